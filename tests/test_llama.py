"""The Llama family (`zerojax.models.llama`, `llama_hf`) against Hugging Face transformers' PyTorch models on
CPU in fp32: tiny random checkpoints written by `save_pretrained` and read by `read_hf_dir` give the same
logits and the same gradient of the mean next-token loss (max|diff| <= 1e-4 max|ref|, per tensor); a checkpoint
read and written back is the same bits (fp32 and bf16) and loads in transformers with the same logits; under
ZeRO-3 on 2 x 4 devices the gradient is single-device `jax.grad`'s, tied embeddings included; grouped-query
attention matches its repeated-heads form; what the converter cannot do is refused in one line."""
import copy
import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

import zerojax
from tests import helpers
from tests.llama_reference import CONFIGS, SEQ, TOKENS, rel, torch_logits, torch_model
from zerojax.models import attention as attn
from zerojax.models import llama as L
from zerojax.models import llama_hf as H

BOUND = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """`checkpoint(name, dtype)`: the folder `save_pretrained` wrote for `torch_model(name)` in `dtype`."""
  saved = {}

  def get(name, dtype="float32"):
    if (name, dtype) not in saved:
      saved[name, dtype] = tmp_path_factory.mktemp(f"{name}-{dtype}")
      copy.deepcopy(torch_model(name)).to(getattr(torch, dtype)).save_pretrained(saved[name, dtype])
    return saved[name, dtype]
  return get


@functools.cache
def loaded(path):
  cfg, model_type, params = H.read_hf_dir(path, SEQ)
  return cfg, model_type, jax.tree.map(jnp.asarray, params)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(name, checkpoint):
  cfg, model_type, params = loaded(checkpoint(name))
  assert model_type == CONFIGS[name]().model_type
  want = torch_logits(torch_model(name), TOKENS[:, :-1])
  got = jax.jit(L.logits, static_argnums=0)(cfg, params, TOKENS[:, :-1])
  assert got.dtype == jnp.float32 and got.shape == want.shape
  assert rel(got, want) <= BOUND, rel(got, want)


@pytest.mark.parametrize("name", CONFIGS)
def test_gradients_match_torch_autograd(name, checkpoint):
  """Every weight's gradient of the mean next-token loss (the tied matrix: both uses summed)."""
  cfg, _, params = loaded(checkpoint(name))
  model = torch_model(name)
  named = dict(model.named_parameters())  # a tied matrix once
  logits = model(torch.tensor(TOKENS[:, :-1])).logits
  loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), torch.tensor(TOKENS[:, 1:]).reshape(-1))
  grads = dict(zip(named, (g.numpy() for g in torch.autograd.grad(loss, list(named.values())))))
  want = H.params_from_hf(grads.__getitem__, grads, cfg)
  got_loss, got = jax.jit(jax.value_and_grad(L.llama(cfg).loss))(params, TOKENS)
  assert float(got_loss) == pytest.approx(loss.item(), rel=1e-5)
  worst = max(jax.tree.leaves(jax.tree.map(rel, got, want)))
  assert worst <= BOUND, worst


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", CONFIGS)
def test_checkpoint_round_trip_is_bitwise_and_loads_in_transformers(name, dtype, checkpoint, tmp_path):
  """read -> write (in shards, with an index) -> the same tensors, bit for bit; the written folder loads in
  transformers as the same model (its config.json included) and reads back to the same config."""
  src = checkpoint(name, dtype)
  cfg, model_type, params = H.read_hf_dir(src, SEQ)
  H.write_hf_dir(tmp_path / "out", params, cfg, model_type, dtype=dtype, max_shard_bytes=20_000)
  files = sorted((tmp_path / "out").glob("*.safetensors"))
  assert len(files) > 1 and (tmp_path / "out/model.safetensors.index.json").exists()
  want = safetensors.torch.load_file(src / "model.safetensors")
  got = {k: v for f in files for k, v in safetensors.torch.load_file(f).items()}
  assert sorted(got) == sorted(want)
  assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
  assert H.read_hf_dir(tmp_path / "out", SEQ)[0] == cfg
  if dtype == "float32":
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    want_logits = torch_logits(torch_model(name), TOKENS[:, :-1])
    assert rel(torch_logits(back, TOKENS[:, :-1]), want_logits) <= BOUND


@pytest.fixture(scope="module")
def mesh():
  return zerojax.make_mesh(2, 4)


@pytest.mark.parametrize("name", ["llama_gqa", "tied_mqa"])
def test_zero3_gradient_matches_single_device_grad(name, checkpoint, mesh):
  """ZeRO-3 on 2 nodes x 4 devices, 2 micro-batches: the loss and every parameter's gradient are single-device
  `jax.grad`'s; with tied embeddings the embed unit is called twice and its sink sums both gradients."""
  cfg, _, params = loaded(checkpoint(name))
  model = L.llama(cfg)
  batch = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 8, SEQ + 1)).astype(np.int32)
  want = helpers.reference_grads(model, params, batch)
  got, metrics = helpers.sharded_grads(zerojax.zero3(param_dtype="float32"), mesh, model, params, batch)
  want_loss = float(jnp.mean(jax.vmap(lambda t: model.loss(params, t))(batch)))
  assert float(metrics.loss) == pytest.approx(want_loss, rel=1e-5)
  assert helpers.max_rel_diff(got, want) < 1e-5


def test_init_has_the_converters_shapes():
  cfg = L.LlamaConfig(vocab_size=64, seq_len=SEQ, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64,
                      qkv_bias=True, tie_embeddings=True)
  model = L.llama(cfg)
  params = jax.jit(model.init)(jax.random.key(0))
  tensors = H.params_to_hf(params, cfg)
  back = H.params_from_hf(tensors.__getitem__, tensors, cfg)
  chex.assert_trees_all_equal_shapes(back, params)
  assert float(jax.jit(model.loss)(params, TOKENS)) == pytest.approx(np.log(64), rel=0.05)  # near uniform


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_query_attention_is_attention_over_repeated_heads(kv_heads):
  q, k, v = (jax.random.normal(key, (2, 16, 4 if i == 0 else kv_heads, 8)) for i, key in
             enumerate(jax.random.split(jax.random.key(0), 3)))
  want = jax.jit(attn.einsum_attention)(q, jnp.repeat(k, 4 // kv_heads, 2), jnp.repeat(v, 4 // kv_heads, 2))
  for how in ("einsum", "xla", "auto"):
    got = jax.jit(functools.partial(attn.attention, implementation=how))(q, k, v)
    assert float(jnp.max(jnp.abs(got - want))) <= 2e-5 * float(jnp.max(jnp.abs(want)))
  with pytest.raises(ValueError, match="4 query heads, 3 key and 3 value heads") as e:
    attn.attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
  assert "\n" not in str(e.value)


def one_line_error(match, f, *args):
  with pytest.raises(ValueError, match=match) as e:
    f(*args)
  assert "\n" not in str(e.value)


def test_what_the_converter_cannot_do_is_refused_in_one_line(checkpoint):
  config = json.loads((checkpoint("llama_gqa") / "config.json").read_text())
  one_line_error(r"model_type 'gpt2' is not supported; supported: llama, mistral, qwen2", H.config_from_hf,
                 config | {"model_type": "gpt2"}, SEQ)
  one_line_error(r"sliding_window=8 < seq_len=16", H.config_from_hf,
                 config | {"model_type": "mistral", "sliding_window": 8}, SEQ)
  one_line_error(r"rope_type='yarn'", H.config_from_hf,
                 config | {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, SEQ)
  one_line_error(r"cannot be written as llama", H.config_to_hf, H.config_from_hf(config | {"model_type": "qwen2"}, SEQ),
                 "llama")
  cfg, _, params = loaded(checkpoint("llama_gqa"))
  tensors = H.params_to_hf(params, cfg)
  names = set(tensors)
  one_line_error(r"lacks 1 tensors the config needs: model.layers.1.mlp.up_proj.weight", H.params_from_hf,
                 tensors.__getitem__, names - {"model.layers.1.mlp.up_proj.weight"}, cfg)
  one_line_error(r"has 1 tensors the config does not know: model.layers.2.mlp.up_proj.weight", H.params_from_hf,
                 tensors.__getitem__, names | {"model.layers.2.mlp.up_proj.weight"}, cfg)
  wrong = lambda n: tensors[n][:, :-1] if n == "lm_head.weight" else tensors[n]
  one_line_error(r"tensor lm_head.weight has shape \(64, 31\); the config needs \(64, 32\)", H.params_from_hf,
                 wrong, names, cfg)
  cfg, _, params = loaded(checkpoint("tied_mqa"))  # a tied checkpoint may keep lm_head.weight: the same matrix
  tensors = H.params_to_hf(params, cfg) | {"lm_head.weight": np.asarray(params["embed"]["wte"])}
  chex.assert_trees_all_equal(H.params_from_hf(tensors.__getitem__, tensors, cfg), params)
  tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
  one_line_error(r"lm_head.weight differs from model.embed_tokens.weight", H.params_from_hf, tensors.__getitem__,
                 tensors, cfg)
