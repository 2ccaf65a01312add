"""One train step on the GPU with the GPU's default engine, against the unsharded single-device reference.

On a GPU mesh `Plan.resolve` turns prefetch on (`zerojax.engine.prefetch`'s call order `PREFETCH`) for every plan
whose parameters are sharded; a flax `nn.scan` stack, whose layers flax calls one by one, falls back to
per-layer calls (`Executor.prefetch_fallbacks`). `check_one_step` runs one step of ZeRO-3, ZeRO++, MiCS
and a flax `nn.scan` model (under ZeRO-3) on the devices it is given, from the plan's defaults, and
compares the gradient the optimizer gets and the loss with `jax.grad` of the same loss on one device:

  * unquantized (zero3, mics, flax-scan): exact up to float32 reassociation. The sharded step sums the
    same per-token terms as `jax.grad` in another order (per-device partial sums, then the reduce-scatter)
    and the matmuls run on other shapes; fp32's unit roundoff is 6e-8, and a sum of n terms reassociated
    moves by about sqrt(n) * 6e-8 relative (1.4e-6 for the 512 token terms of the batch here), a little
    more through the layers' VJPs. Bound: the whole gradient's relative L2 error < 1e-5 and the loss
    within rtol 1e-6 (as `tests/test_prefetch.py`); flax's per-leaf bound is `tests/test_flax.py`'s.
    Measured on CPU: 7e-7 (GPT) and 8e-8 (flax) on 2 x 4, 3.5e-7 and 5e-8 on 1 x 2, 3e-7 and 0 on one.
  * zeropp (qwZ int8 weights, hpZ, qgZ int4 gradients): the gradient's relative L2 error < 0.25 per int4
    quantization of the gradient (one on one node: its intra-node hop; two across nodes), so < 0.25 on
    1 x n and < 0.5 on 2 x 4 (`tests/test_prefetch.py`'s bound for this plan and model against
    `jax.grad`). An int4 hop rounds each element to a step of 1/7 of its block's absmax, and these
    gradients are heavy-tailed (embedding rows, biases) in 256-element blocks, so the noise is large;
    `tests/test_zeropp.py` bounds each hop per element. Measured on CPU: 0.18 on one device, 0.19 on
    1 x 2, 0.35 on 2 x 4. The loss within rtol 1e-3 (`tests/test_zeropp.py`'s bound for the int8
    weights; measured 4e-7: the loss at initialisation is close to log(vocab) whatever the weights).

Both sides run their matmuls in true float32 (`jax.default_matmul_precision("float32")`): by default JAX
computes float32 dots in TF32 on recent NVIDIA GPUs (inputs rounded to a 10-bit mantissa, 2^-11
relative), where activations that differ by reassociation can round to different TF32 inputs and move
the two sides apart by far more than fp32 reassociation does, which says nothing about the sharding.
The plan, mesh and schedule stay the GPU's defaults.

The `gpu` tests (`pytest -m gpu` on a GPU machine: `tests/platforms.py`) run it on the GPUs present,
mesh 1 x n; the CPU test runs the same function on the 8 CPU devices (2 x 4) with the prefetch call order
forced (`prefetch=True`), and for the flax model, which refuses an explicit `prefetch=True`, with the GPU
default emulated, so this code runs in the fast suite too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from tests import flax_models as fm
from tests import helpers
from zerojax.engine import layout as layout_lib
from zerojax.models.gpt import GPTConfig, gpt

CASES = ("zero3", "zeropp", "mics", "flax-scan")
QUANTIZED = {"zeropp"}
EXACT_GRAD, EXACT_LOSS = 1e-5, 1e-6             # float32 reassociation (module docstring)
ZEROPP_GRAD_PER_HOP, ZEROPP_LOSS = 0.25, 1e-3   # int8 weights, int4 gradient hops (module docstring)
LAYERS = 4  # four layers keep both of PREFETCH's layer loops in the program (XLA drops or unrolls shorter)


@functools.cache
def gpt_model():
  return gpt(GPTConfig(seq_len=16, d_model=32, num_heads=2, num_layers=LAYERS))


def linen_model():
  net = fm.Net()  # nn.scan-ed blocks: one scanned unit whose layers flax calls one by one
  model = zerojax.from_linen(net, jax.tree.map(lambda x: x[:2], fm.batch()), fm.loss_fn, units=(fm.Block,),
                             mutable=("batch_stats",), rngs=("dropout",))
  return model, fm.linen_apply(net)


def check_one_step(name: str, devices, nodes: int = 1, prefetch: bool | None = None) -> dict:
  """One step of `name` (one of `CASES`) on `devices` (mesh `nodes` x rest) against single-device
  `jax.grad` on `devices[0]`; `prefetch=None` keeps the plan's default. Asserts the bounds of the module
  docstring and that the step ran the prefetch call order (or, for the flax scan, its per-layer fallback);
  returns the measured errors."""
  devices = list(devices)
  mesh = zerojax.make_mesh(nodes, len(devices) // nodes, devices=devices)
  plan_name = "zero3" if name == "flax-scan" else name
  kw = {"param_dtype": "float32"} | ({} if prefetch is None else {"prefetch": prefetch})
  plan = zerojax.PLANS[plan_name](**kw)
  with jax.default_matmul_precision("float32"):
    if name == "flax-scan":
      got, loss, want, want_loss, ex, extra = _flax_step(plan, mesh, devices[0])
    else:
      got, loss, want, want_loss, ex, extra = _gpt_step(plan, mesh, devices[0])
  assert ex.plan.schedule.prefetch, f"{name}: the prefetch call order was not resolved on {mesh.devices}"
  fallbacks = list(ex.prefetch_fallbacks())  # a mesh whose gather moves nothing (1 x 1) prefetches nothing
  assert fallbacks == (list(ex.model.scanned) if name == "flax-scan" and ex.components.prefetch else []), fallbacks
  got, want = jax.device_get((got, want))  # compared on the host
  assert jax.tree.structure(got) == jax.tree.structure(want)
  err = {"grad_rel_l2": helpers.rel_l2(got, want), "loss_rel": abs(loss - want_loss) / abs(want_loss), **extra}
  hops = 1 if nodes == 1 else 2  # int4 quantizations of a gradient element in qgZ
  grad_bound, loss_bound = ((ZEROPP_GRAD_PER_HOP * hops, ZEROPP_LOSS) if name in QUANTIZED
                            else (EXACT_GRAD, EXACT_LOSS))
  assert np.isfinite(loss) and err["grad_rel_l2"] < grad_bound, (name, err)
  np.testing.assert_allclose(loss, want_loss, rtol=loss_bound)
  return err


def _gpt_step(plan, mesh, ref_device):
  model = gpt_model()
  params = jax.device_get(jax.jit(model.init)(jax.random.key(0)))  # on the host: each side places them
  batch = helpers.batches(1, 2)[0]  # 2 micro-batches of 16 sequences
  p_ref, b_ref = jax.device_put((params, batch), ref_device)
  want = helpers.reference_grads(model, p_ref, b_ref)
  want_loss = float(jax.jit(lambda p, b: jnp.mean(jax.vmap(lambda t: model.loss(p, t))(b)))(p_ref, b_ref))
  ex = zerojax.Executor(model, helpers.capture_grads(), plan, mesh, accum_steps=batch.shape[0])
  state, m = ex.step_fn()(ex.init_from_params(params), ex.shard_batch(batch))
  return layout_lib.to_logical(state.opt_state, ex.layout), float(m.loss), want, want_loss, ex, {}


def _flax_step(plan, mesh, ref_device):
  """The flax reference is `tests/flax_models.reference`: flax's own `apply` on each device's slice of
  each micro-batch with that device's rng (dropout, per-device BatchNorm statistics), averaged."""
  model, apply_fn = linen_model()
  batch = fm.batch(64, accum=2)
  ex = zerojax.Executor(model, helpers.capture_grads(), plan, mesh, accum_steps=2)
  state = ex.init(jax.random.key(0))
  v0 = jax.device_put(jax.device_get(ex.logical_variables(state)), ref_device)  # the step donates the state
  key = jax.random.wrap_key_data(jax.device_put(np.asarray(state.rng), ref_device))
  stats = {k: v for k, v in v0.items() if k != "params"}
  want, want_loss, want_aux, want_stats = fm.reference(apply_fn, v0["params"], stats,
                                                       jax.device_put(batch, ref_device), key, mesh.size)
  got, metrics, state = fm.step_grads(ex, state, ex.shard_batch(batch))
  got, metrics, new_stats, want, want_aux, want_stats = jax.device_get(  # compared on the host
      (got, metrics, ex.logical_variables(state)["batch_stats"], want, want_aux, want_stats["batch_stats"]))
  # Per leaf (`tests/test_flax.py`): biases before BatchNorm have gradients that are zero up to rounding,
  # so each leaf's worst error is bounded relative to the largest gradient element.
  scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want))
  worst = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  assert worst < 1e-5 * scale, (worst, scale)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), metrics.aux, want_aux)
  stats_err = helpers.max_rel_diff(new_stats, want_stats)
  assert stats_err < 1e-5, stats_err
  return got, float(metrics.loss), want, float(want_loss), ex, {"worst_over_scale": worst / scale,
                                                                "stats": stats_err}


# ------------------------------------------------------------------------------------------------ tests

@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_gpu_step_matches_single_device_grad(name):
  """The GPUs present (`pytest -m gpu` on a GPU machine; skipped where there is none), mesh 1 x n, the
  plan's defaults: prefetch resolved on by `Plan.resolve` for the GPU mesh."""
  devices = jax.devices()
  assert devices[0].platform == "gpu", f"the default backend is {devices[0].platform}, not the GPU"
  print(name, jax.devices()[0].device_kind, len(devices), check_one_step(name, devices))


@pytest.mark.parametrize("name", helpers.sweep(list(CASES), ["zero3", "flax-scan"]))  # ~20-40 s each
def test_cpu_step_with_the_gpu_call_order_matches_single_device_grad(name, monkeypatch):
  """`check_one_step` on the 8 CPU devices (2 x 4) in the GPU's call order: prefetch forced for the GPT
  plans; the flax scan refuses an explicit prefetch=True, so the GPU default is emulated for it (resolved
  on, then its per-layer fallback), as `tests/test_prefetch.py` does."""
  if name == "flax-scan":
    from zerojax import gpu_aot
    monkeypatch.setattr(gpu_aot, "is_gpu", lambda mesh: True)
  devices = jax.devices()
  assert len(devices) == 8 and devices[0].platform == "cpu"
  check_one_step(name, devices, nodes=2, prefetch=None if name == "flax-scan" else True)


def test_cpu_step_on_one_device_in_the_gpu_call_order(monkeypatch):
  """The flax scan on one CPU device as on one GPU (`test_gpu_step_matches_single_device_grad` on a 1 x 1
  mesh): prefetch resolves on, the gather moves nothing, so nothing prefetches and nothing falls back."""
  from zerojax import gpu_aot
  monkeypatch.setattr(gpu_aot, "is_gpu", lambda mesh: True)
  check_one_step("flax-scan", jax.devices()[:1])
