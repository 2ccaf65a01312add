"""Hugging Face checkpoints of the Llama family (model_type "llama", "mistral", "qwen2") to and from
`zerojax.models.llama`'s parameters, with numpy and safetensors only (no torch, no transformers).

- `config_from_hf(config, seq_len)` / `config_to_hf(cfg, model_type)`: `config.json` (transformers 4's
  `rope_theta` / `rope_scaling` or 5's `rope_parameters`) to a `LlamaConfig` and back; what the model does not
  implement (sliding windows shorter than the sequence, RoPE scalings other than Llama 3's, biases other than
  Qwen2's, another activation) is refused in one line.
- `params_from_hf(get_tensor, names, cfg)` / `params_to_hf(params, cfg)`: the tensors, `[out, in]` weights per
  layer, to the model's `[in, out]` kernels stacked over the layers, and back, bit for bit in any dtype.
- `read_hf_dir(path, seq_len)` / `write_hf_dir(path, params, cfg, model_type)`: a checkpoint folder
  (`config.json`, one `*.safetensors` file or shards with `model.safetensors.index.json`).

bf16 tensors are numpy arrays of `ml_dtypes.bfloat16` (jax's own bf16).
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from zerojax.models.llama import LLAMA3_KEYS, LlamaConfig, shapes

SUPPORTED = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
LAYER = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
         "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm", "gate": "mlp.gate_proj",
         "up": "mlp.up_proj", "down": "mlp.down_proj"}
TOP = {("embed", "wte"): "model.embed_tokens.weight", ("head", "norm", "scale"): "model.norm.weight",
       ("head", "lm_head", "kernel"): "lm_head.weight"}
DERIVED = ("rotary_emb.inv_freq",)  # buffers older checkpoints hold; recomputed from the config


def check_model_type(model_type) -> None:
  if model_type not in SUPPORTED:
    raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")


def config_from_hf(config: dict, seq_len: int) -> LlamaConfig:
  """The `LlamaConfig` of a Hugging Face `config.json` (a dict) trained on `seq_len` tokens per row."""
  mt = config.get("model_type")
  check_model_type(mt)

  def refuse(what):
    raise ValueError(f"{mt} config: {what}; zerojax.models.llama does not implement it")
  if config.get("hidden_act", "silu") != "silu":
    refuse(f"hidden_act={config['hidden_act']!r} (only 'silu')")
  if config.get("mlp_bias") or (mt != "qwen2" and config.get("attention_bias")):
    refuse("mlp_bias / attention_bias (biases other than Qwen2's on q, k, v)")
  uses_window = mt == "mistral" or config.get("use_sliding_window")
  window = config.get("sliding_window") if uses_window else None
  if window is not None and window < seq_len:
    refuse(f"sliding_window={window} < seq_len={seq_len} (attention over a window)")
  rope = config.get("rope_parameters") or {}
  if any(isinstance(v, dict) for v in rope.values()):
    refuse("rope_parameters per layer type")
  scaling = config.get("rope_scaling") or rope
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind not in ("default", "llama3"):
    refuse(f"rope_type={kind!r} (only 'default' and 'llama3')")
  if scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
    refuse("partial_rotary_factor != 1")
  rope_scaling = None
  if kind == "llama3":
    full = {"original_max_position_embeddings": config.get("max_position_embeddings"), **scaling, "rope_type": "llama3"}
    rope_scaling = {k: full[k] for k in LLAMA3_KEYS if k in full}  # LlamaConfig names a missing key
  heads = config["num_attention_heads"]
  head_dim = config.get("head_dim")
  return LlamaConfig(
      vocab_size=config["vocab_size"], seq_len=seq_len, d_model=config["hidden_size"],
      num_layers=config["num_hidden_layers"], num_heads=heads,
      num_kv_heads=config.get("num_key_value_heads") or heads, d_ff=config["intermediate_size"],
      rope_theta=float(scaling.get("rope_theta", config.get("rope_theta", 10000.0))), rope_scaling=rope_scaling,
      rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(config.get("tie_word_embeddings")),
      qkv_bias=mt == "qwen2", head_dim=None if head_dim in (None, config["hidden_size"] // heads) else head_dim)


def max_positions(cfg: LlamaConfig) -> int:
  """`seq_len`, or with Llama 3's scaling the length it scales to (`factor` x the original), if longer."""
  s = dict(cfg.rope_scaling or {})
  return max(cfg.seq_len, int(s.get("factor", 0) * s.get("original_max_position_embeddings", 0)))


def config_to_hf(cfg: LlamaConfig, model_type: str, dtype: str = "bfloat16") -> dict:
  """A `config.json` (a dict) for `cfg` as `model_type` that transformers' `AutoModelForCausalLM` loads."""
  check_model_type(model_type)
  if cfg.qkv_bias != (model_type == "qwen2"):
    raise ValueError(f"qkv_bias={cfg.qkv_bias} cannot be written as {model_type}: only qwen2 has q, k, v biases "
                     "(and it always has them)")
  out = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "hidden_size": cfg.d_model,
         "intermediate_size": cfg.d_ff, "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
         "num_hidden_layers": cfg.num_layers, "head_dim": cfg.head_size, "vocab_size": cfg.vocab_size,
         "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
         "rope_scaling": None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
         "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": max_positions(cfg), "torch_dtype": dtype}
  extra = {"llama": {"attention_bias": False, "mlp_bias": False}, "mistral": {"sliding_window": None},
           "qwen2": {"use_sliding_window": False, "sliding_window": None}}
  return out | extra[model_type]


def layout(cfg: LlamaConfig) -> dict:
  """`{hf name: (path of our leaf, layer or None, hf shape, transposed)}`."""
  out = {}
  for unit_name, tree in shapes(cfg).items():
    for name, leaf in tree.items():
      for field, shape in (leaf.items() if isinstance(leaf, dict) else [(None, leaf)]):
        path = (unit_name, name) + ((field,) if field else ())
        kernel = field == "kernel"
        if unit_name == "blocks":
          for i in range(cfg.num_layers):
            hf = f"model.layers.{i}.{LAYER[name]}.{'bias' if field == 'bias' else 'weight'}"
            out[hf] = (path, i, shape[1:][::-1] if kernel else shape[1:], kernel)
        else:
          out[TOP[path]] = (path, None, shape[::-1] if kernel else shape, kernel)
  return out


def listed(names) -> str:
  names = sorted(names)
  return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def params_from_hf(get_tensor, names, cfg: LlamaConfig) -> dict:
  """The model's parameters (numpy, the checkpoint's dtype) from a checkpoint's tensors.

  Args:
    get_tensor: `name -> np.ndarray`.
    names: the names of the checkpoint's tensors.
    cfg: the checkpoint's config (`config_from_hf`).

  Raises:
    ValueError (one line): tensors the config needs are missing, tensors it does not know are there, or one has
      the wrong shape.
  """
  spec = layout(cfg)
  names = {n for n in names if not n.endswith(DERIVED)}
  tied_copy = cfg.tie_embeddings and "lm_head.weight" in names  # some tied checkpoints keep the copy
  missing, extra = set(spec) - names, names - set(spec) - ({"lm_head.weight"} if tied_copy else set())
  if missing:
    raise ValueError(f"checkpoint lacks {len(missing)} tensors the config needs: {listed(missing)}")
  if extra:
    raise ValueError(f"checkpoint has {len(extra)} tensors the config does not know: {listed(extra)}")
  leaves: dict = {}
  for name, (path, layer, shape, kernel) in spec.items():
    t = np.asarray(get_tensor(name))
    if t.shape != tuple(shape):
      raise ValueError(f"tensor {name} has shape {tuple(t.shape)}; the config needs {tuple(shape)}")
    leaves.setdefault(path, {})[layer] = t.T if kernel else t
  if tied_copy and not np.array_equal(get_tensor("lm_head.weight"), leaves[("embed", "wte")][None]):
    raise ValueError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
  params: dict = {}
  for path, by_layer in leaves.items():
    value = by_layer[None] if None in by_layer else np.stack([by_layer[i] for i in range(cfg.num_layers)])
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.ascontiguousarray(value)
  return params


def params_to_hf(params: dict, cfg: LlamaConfig) -> dict:
  """`{hf name: np.ndarray}` of the model's parameters (any arrays), in their dtype: `params_from_hf`'s inverse."""
  out, leaves = {}, {}
  for name, (path, layer, _, kernel) in layout(cfg).items():
    if path not in leaves:
      value = params
      for key in path:
        value = value[key]
      leaves[path] = np.asarray(value)  # once per leaf: a device array comes to the host once
    value = leaves[path] if layer is None else leaves[path][layer]
    out[name] = np.ascontiguousarray(value.T if kernel else value)
  return out


def read_hf_dir(path, seq_len: int) -> tuple[LlamaConfig, str, dict]:
  """`(cfg, model_type, params)` of a Hugging Face checkpoint folder: `config.json` and its safetensors (one
  file, or the shards `model.safetensors.index.json` lists)."""
  path = pathlib.Path(path)
  config = json.loads((path / "config.json").read_text())
  cfg = config_from_hf(config, seq_len)
  index = path / "model.safetensors.index.json"
  files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
           else sorted(p.name for p in path.glob("*.safetensors")))
  if not files:
    raise FileNotFoundError(f"{path}: no *.safetensors files")
  with contextlib.ExitStack() as stack:
    where = {}
    for file in files:
      f = stack.enter_context(safe_open(str(path / file), framework="numpy"))
      for name in f.keys():
        if name in where:
          raise ValueError(f"{path}: tensor {name} is in two files")
        where[name] = f
    params = params_from_hf(lambda n: where[n].get_tensor(n), set(where), cfg)
  return cfg, config["model_type"], params


def write_hf_dir(path, params: dict, cfg: LlamaConfig, model_type: str, dtype: str = "bfloat16",
                 max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes a Hugging Face checkpoint folder: `config.json`, `model-0000i-of-0000n.safetensors` (tensors in
  `dtype`, at most `max_shard_bytes` per file unless one tensor is larger) and `model.safetensors.index.json`.
  The folder is written beside `path` and renamed into place; `path` must not exist or be empty."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}; use one of {tuple(DTYPES)}")
  path = pathlib.Path(path)
  if path.exists() and any(path.iterdir()):
    raise FileExistsError(f"{path} exists and is not empty")
  config = config_to_hf(cfg, model_type, dtype)
  tensors = {n: t.astype(DTYPES[dtype]) for n, t in params_to_hf(params, cfg).items()}
  shards, size = [[]], 0
  for name, t in tensors.items():
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += t.nbytes
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
  tmp.chmod(0o755)  # mkdtemp's is 0o700
  try:
    weight_map = {}
    for i, names in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file({n: tensors[n] for n in names}, str(tmp / file), metadata={"format": "pt"})
      weight_map |= {n: file for n in names}
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
