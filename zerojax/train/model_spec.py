"""Which model `train.py` builds: the GPT (`model_config`), a Llama (`llama_config`), or the Llama-family
checkpoint of a Hugging Face folder (`train.init_from`), with the vocabulary the data says.

`ModelSpec` is the one description the trainer, the checkpoints' settings, `cli.export` and `cli.evaluate`
share: the architecture, its config, and for the Llama family the Hugging Face `model_type` it is written
back as. A gin setting of `llama_config` that contradicts a folder's `config.json` is refused in one line.
"""
from __future__ import annotations

import dataclasses
import json
import os

import gin

from zerojax.engine.model import Model
from zerojax.models.gpt import GPTConfig, gpt
from zerojax.models.llama import LlamaConfig, llama
from zerojax.models import llama_hf
from zerojax.train.token_file import DataError

ARCHITECTURES = ("gpt", "llama")
SPEC_FILE = "model.json"  # in the workdir: what `cli.export` and `cli.evaluate` rebuild


@gin.configurable
def model_config(vocab_size: int | None = None, seq_len: int = 128, d_model: int = 128, num_heads: int = 4,
                 num_layers: int = 4, mlp_ratio: int = 4) -> GPTConfig:
  """The GPT `train` builds (a resume never changes it).

  Args:
    vocab_size: the vocabulary; None takes the data's (256 for bytes, the token file's sidecar or
      `train.tokenizer`'s). A larger value pads it (e.g. to a multiple of 128); a smaller one is refused.
    seq_len: tokens per training sequence (the context).
    d_model: width of the residual stream.
    num_heads: attention heads per layer.
    num_layers: transformer blocks.
    mlp_ratio: MLP hidden width over d_model.
  """
  return GPTConfig(vocab_size or 256, seq_len, d_model, num_heads, num_layers, mlp_ratio)


@gin.configurable
def llama_config(vocab_size: int | None = None, seq_len: int = 128, d_model: int = 128, num_layers: int = 4,
                 num_heads: int = 4, num_kv_heads: int = 2, d_ff: int = 352, rope_theta: float = 500000.0,
                 rope_scaling: dict | None = None, rms_norm_eps: float = 1e-5, tie_embeddings: bool = False,
                 qkv_bias: bool = False, head_dim: int | None = None) -> LlamaConfig:
  """The Llama `train` builds with `train.architecture = 'llama'` (`zerojax.models.llama`; with
  `train.init_from` the folder's `config.json` gives every field but `seq_len`).

  Args:
    vocab_size: the vocabulary; None takes the data's (as `model_config.vocab_size`).
    seq_len: tokens per training sequence.
    d_model: width of the residual stream.
    num_layers: decoder layers.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention; 1: multi-query).
    d_ff: the SwiGLU MLP's inner width.
    rope_theta: RoPE's base wavelength (Llama 3: 500000).
    rope_scaling: Llama 3.1's scaling, a dict of factor, low_freq_factor, high_freq_factor,
      original_max_position_embeddings, rope_type='llama3'; None: none.
    rms_norm_eps: RMSNorm's epsilon.
    tie_embeddings: the output projection is the embedding's transpose.
    qkv_bias: biases on the query, key and value projections (Qwen2).
    head_dim: the heads' width (None: d_model // num_heads).
  """
  return LlamaConfig(vocab_size or 256, seq_len, d_model, num_layers, num_heads, num_kv_heads, d_ff, rope_theta,
                     rope_scaling, rms_norm_eps, tie_embeddings, qkv_bias, head_dim=head_dim)


def bound(name: str) -> dict:
  """The parameters of configurable `name` bound in gin (none: {})."""
  try:
    return dict(gin.get_bindings(name))
  except (ValueError, KeyError):
    return {}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The model of a run.

  Attributes:
    architecture: "gpt" or "llama".
    config: its `GPTConfig` or `LlamaConfig`.
    model_type: the Hugging Face `model_type` a Llama-family model is exported as ("llama", "mistral",
      "qwen2"); None for the GPT.
    init_from: the Hugging Face folder its weights start from, or None.
    asked_vocab: the vocabulary gin set explicitly (None: the data's).
  """
  architecture: str
  config: GPTConfig | LlamaConfig
  model_type: str | None = None
  init_from: str | None = None
  asked_vocab: int | None = None

  @property
  def seq_len(self) -> int:
    return self.config.seq_len

  @property
  def prefix(self) -> str:
    return "model_config" if self.architecture == "gpt" else "llama_config"

  def build(self) -> Model:
    return gpt(self.config) if self.architecture == "gpt" else llama(self.config)

  def describe(self) -> str:
    c = self.config
    if self.architecture == "gpt":
      return f"GPT, {c.num_layers} layers, d_model {c.d_model}, vocabulary {c.vocab_size}"
    return (f"{c.num_layers} layers, d_model {c.d_model}, {c.num_heads} heads / {c.num_kv_heads} kv, d_ff {c.d_ff}, "
            f"vocabulary {c.vocab_size}" + (", tied embeddings" if c.tie_embeddings else ""))

  def with_vocab(self, data_vocab: int | None) -> "ModelSpec":
    """This spec with its vocabulary: the folder's, gin's explicit one, else the data's."""
    if self.init_from is not None:
      return self
    vocab = self.asked_vocab if self.asked_vocab is not None else data_vocab
    if vocab is None:
      raise DataError("the token files have no sidecar and train.tokenizer is unset, so nothing says the "
                      f"vocabulary: set {self.prefix}.vocab_size (or train.tokenizer)")
    return dataclasses.replace(self, config=dataclasses.replace(self.config, vocab_size=vocab))

  def settings(self) -> dict:
    """The model's settings as a checkpoint records them (gin names to JSON values)."""
    out = {f"{self.prefix}.{k}": v for k, v in dataclasses.asdict(self.config).items()}
    if self.architecture != "gpt":
      out["train.architecture"] = self.architecture
    return out

  def to_json(self) -> dict:
    return {"architecture": self.architecture, "config": dataclasses.asdict(self.config),
            "model_type": self.model_type, "init_from": self.init_from}

  @classmethod
  def from_json(cls, fields: dict) -> "ModelSpec":
    kind = GPTConfig if fields["architecture"] == "gpt" else LlamaConfig
    config = dict(fields["config"])
    if config.get("rope_scaling") is not None:
      config["rope_scaling"] = tuple(tuple(p) for p in config["rope_scaling"])
    return cls(fields["architecture"], kind(**config), fields.get("model_type"), fields.get("init_from"))


def model_spec(architecture: str = "gpt", init_from: str | None = None) -> ModelSpec:
  """The run's model from gin (`model_config` or `llama_config`) or from a Hugging Face folder.

  Raises:
    ValueError: an unknown architecture; a folder that is not a Llama-family checkpoint; a gin setting of
      `llama_config` that contradicts the folder's `config.json` (one line naming both).
  """
  if architecture not in ARCHITECTURES:
    raise ValueError(f"train.architecture={architecture!r}; use one of {ARCHITECTURES}")
  if init_from is None:
    if architecture == "gpt":
      return ModelSpec("gpt", model_config(), asked_vocab=bound("model_config").get("vocab_size"))
    return ModelSpec("llama", llama_config(), asked_vocab=bound("llama_config").get("vocab_size"))
  if architecture != "llama" and "architecture" in bound("train"):
    raise ValueError(f"train.init_from={init_from!r} is a Llama-family checkpoint but train.architecture="
                     f"{architecture!r}; drop train.architecture (the folder's config.json says it)")
  config = read_config(init_from)
  cfg = llama_hf.config_from_hf(config, llama_config().seq_len)
  given = {k: v for k, v in bound("llama_config").items() if k != "seq_len"}
  for key, value in sorted(given.items()):
    own = getattr(cfg, key)
    if key == "rope_scaling" and value is not None:
      value = tuple(sorted(value.items()))
    if own != value:
      raise ValueError(f"llama_config.{key}={value!r} contradicts {os.path.join(init_from, 'config.json')} "
                       f"({key} {own!r}); drop the setting: the checkpoint's config.json gives the model's shape")
  return ModelSpec("llama", cfg, config["model_type"], os.path.abspath(init_from))


def read_config(folder: str) -> dict:
  path = os.path.join(folder, "config.json")
  if not os.path.isdir(folder):
    raise ValueError(f"train.init_from={folder!r} is not a folder; pass a Hugging Face checkpoint folder (config.json "
                     "and *.safetensors, as save_pretrained writes them)")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"train.init_from={folder!r}: cannot read {path} ({e}); pass a Hugging Face checkpoint folder "
                     "(config.json and *.safetensors)") from None


def initial_params(spec: ModelSpec) -> dict | None:
  """The Hugging Face folder's weights as the model's params (numpy, the checkpoint's dtype); None without
  `init_from`."""
  if spec.init_from is None:
    return None
  _, _, params = llama_hf.read_hf_dir(spec.init_from, spec.seq_len)
  return params


def write(workdir: str, spec: ModelSpec, tokenizer: str | None) -> None:
  """`workdir/model.json`: the spec and the run's tokenizer, for `cli.export` and `cli.evaluate`."""
  path = os.path.join(workdir, SPEC_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump({**spec.to_json(), "tokenizer": tokenizer and os.path.abspath(tokenizer)}, f, indent=1)
  os.replace(path + ".tmp", path)


def read(workdir: str) -> tuple[ModelSpec, str | None]:
  """The spec and tokenizer `write` recorded in `workdir`."""
  path = os.path.join(workdir, SPEC_FILE)
  try:
    with open(path) as f:
      fields = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"--workdir {workdir}: cannot read {path} ({e}); pass the workdir of a train.py run") from None
  return ModelSpec.from_json(fields), fields.get("tokenizer")
