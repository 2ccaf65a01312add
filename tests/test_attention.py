"""The GPT's attention (`zerojax.models.attention`) against the einsum form it replaced: per layer, and
over a train step; on CPU "auto" is the einsum form bit for bit, and a bad implementation is refused."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.models import attention as attn
from zerojax.models.gpt import GPTConfig, gpt

# The bound between two attention implementations: fp32 is exact to reassociation; bf16 rounds the
# scores and probabilities at different points (XLA's form keeps the scores in fp32).
BOUND = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def qkv(dtype, b=2, s=64, h=4, d=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(k, (b, s, h, d), jnp.float32).astype(dtype) for k in ks]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_attention_matches_the_einsum_form_forward_and_backward(dtype):
  q, k, v = qkv(dtype)
  loss = lambda how: lambda q, k, v: jnp.sum(jnp.sin(attn.attention(q, k, v, how).astype(jnp.float32)))
  # each form's output and gradients in one program (eagerly, every op would compile alone)
  run = lambda how: jax.jit(lambda q, k, v: (attn.attention(q, k, v, how),
                                             jax.grad(loss(how), argnums=(0, 1, 2))(q, k, v)))(q, k, v)
  f32 = lambda x: np.asarray(x, np.float32)
  (ref_out, g_ref), (out, g) = run("einsum"), run("xla")
  scale = np.max(np.abs(f32(ref_out)))
  assert np.max(np.abs(f32(out) - f32(ref_out))) <= BOUND[dtype] * scale
  for a, r in zip(g, g_ref):
    assert np.max(np.abs(f32(a) - f32(r))) <= BOUND[dtype] * np.max(np.abs(f32(r)))


def test_attention_is_causal():
  q, k, v = qkv(jnp.float32)
  v2 = v.at[:, 40:].set(0.0)  # later keys and values cannot change earlier outputs
  for how in ("einsum", "xla", "auto"):
    a, b = attn.attention(q, k, v, how), attn.attention(q, k, v2, how)
    np.testing.assert_array_equal(np.asarray(a[:, :40]), np.asarray(b[:, :40]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_auto_is_the_einsum_form_bitwise_on_cpu(dtype):
  q, k, v = qkv(dtype)
  f = lambda how: jax.jit(jax.grad(lambda q: jnp.sum(attn.attention(q, k, v, how).astype(jnp.float32))))
  np.testing.assert_array_equal(np.asarray(f("auto")(q)), np.asarray(f("einsum")(q)))
  # fp32 is never cuDNN's: auto resolves it to the einsum form on every platform, with the reason logged.
  assert attn.resolve(q.astype(jnp.float32)) == "einsum"
  assert attn.cudnn_refusal(tuple(q.shape), "float32") is not None


def test_a_bad_implementation_is_refused_in_one_line():
  q, k, v = qkv(jnp.float32)
  with pytest.raises(ValueError, match=r"implementation='flash'; use one of") as e:
    attn.attention(q, k, v, "flash")
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype,bound", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_one_train_step_with_xla_attention_matches_the_einsum_gpt(dtype, bound):
  """The whole GPT under ZeRO-3 on the 8 CPU devices, parameters in `dtype`: loss and the parameters'
  moves of one step with XLA's attention against the einsum form's (SGD: the moves are the gradients)."""
  mesh = zerojax.make_mesh(2)
  batch = np.random.default_rng(0).integers(0, 256, (1, 8, 33)).astype(np.int32)
  out = {}
  for how in ("einsum", "xla"):
    model = gpt(GPTConfig(seq_len=32, d_model=32, num_heads=4, num_layers=2, attention=how))
    ex = zerojax.Executor(model, optax.sgd(0.5), zerojax.zero3(param_dtype=dtype), mesh)
    state = ex.init(jax.random.key(0))
    init = jax.tree.map(np.asarray, ex.logical_params(state))
    state, m = ex.step_fn()(state, batch)
    out[how] = (float(m.loss), jax.tree.map(np.asarray, ex.logical_params(state)))
  assert out["xla"][0] == pytest.approx(out["einsum"][0], rel=bound / 10)
  # The parameters' moves (0.5 x the gradient) over the whole model: the gradient of the key bias is zero
  # in exact arithmetic (softmax ignores a score added to every key), so its leaf is rounding noise of both
  # forms and is compared only as part of the whole.
  move = lambda how: np.concatenate([(a - b).ravel() for a, b in zip(jax.tree.leaves(out[how][1]),
                                                                      jax.tree.leaves(init))])
  assert np.linalg.norm(move("xla") - move("einsum")) <= bound * np.linalg.norm(move("einsum"))


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("nodes,gpus", [(1, 1), (2, 4)])
def test_the_default_gpt_calls_cudnn_and_keeps_no_score_matrix_on_compile_only_h100s(nodes, gpus):
  """The built-in GPT's train step (bf16, the default attention) compiled for H100s: cuDNN's fused
  attention forward and backward are in the program, and no `[batch, heads, seq, seq]` buffer is."""
  from zerojax import gpu_aot
  from zerojax.executor import aot
  gpu_aot.compile_only_host()
  cfg = GPTConfig(seq_len=256, d_model=256, num_heads=4, num_layers=2)
  mesh = zerojax.make_mesh(nodes, devices=gpu_aot.devices("h100", nodes, gpus))
  ex = zerojax.Executor(gpt(cfg), optax.adam(1e-3), zerojax.zero3(), mesh)
  batch = 2 * mesh.size
  compiled, _ = aot.compile_step(ex, (1, batch, cfg.seq_len + 1))
  text = compiled.as_text()
  assert 'custom_call_target="__cudnn$fmhaSoftmax"' in text
  assert 'custom_call_target="__cudnn$fmhaSoftmaxBackward"' in text
  local = batch // mesh.size
  assert f"{local},{cfg.num_heads},{cfg.seq_len},{cfg.seq_len}]" not in text
  einsum = zerojax.Executor(gpt(dataclasses.replace(cfg, attention="einsum")), optax.adam(1e-3), zerojax.zero3(), mesh)
  assert f"{local},{cfg.num_heads},{cfg.seq_len},{cfg.seq_len}]" in aot.compile_step(
      einsum, (1, batch, cfg.seq_len + 1))[0].as_text()  # the check sees a score matrix where there is one
