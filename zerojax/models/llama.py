"""The Llama family (Llama 2 and 3, Mistral, Qwen2) written as ZeRO units: embed, scanned decoder layers, head.

One `LlamaConfig` describes the family: pre-norm decoder layers with RMSNorm, rotary positions (RoPE, with
Llama 3's scaling of the long wavelengths), grouped-query attention (one key/value head: multi-query) and a
SwiGLU MLP; Qwen2 adds biases to the query, key and value projections. The parameters are plain dicts of
arrays, kernels `[in, out]`, named as `zerojax.train.optim.decay_mask` reads them ("kernel" and "wte" decayed,
norms' "scale" and biases not); `zerojax.models.llama_hf` converts Hugging Face checkpoints to and from them.

`llama(cfg)` is a `zerojax.Model` with the units `embed` (`{"wte": [vocab, d]}`), `blocks` (one decoder layer
per call, scanned over the layers by `scan_layers`) and `head` (the final RMSNorm, the output projection and the
mean cross-entropy in fp32). With tied embeddings the head holds the final norm only and the output projection
is a second call of the `embed` unit (`h @ wte.T` and the loss): every use of the matrix is the embed unit's, so
it is gathered for each call and its two gradients are summed in its sink. A plan that needs one call per unit
(`sync_in_backward=True`, qgZ's `grad_error_feedback=True`) refuses a tied model in one line.

`logits(cfg, params, tokens)` is the unsharded forward, `[b, t]` tokens to `[b, t, vocab]` fp32 logits.

References:
  Touvron et al. 2023, "LLaMA" and "Llama 2" (the architecture); Dubey et al. 2024, "The Llama 3 Herd of
    Models" (RoPE scaling of the long wavelengths, `rope_scaling`).
  Zhang & Sennrich 2019, "Root Mean Square Layer Normalization" (RMSNorm).
  Su et al. 2021, "RoFormer" (rotary position embedding; here in Hugging Face's rotate-half layout).
  Shazeer 2020, "GLU Variants Improve Transformer" (SwiGLU).
  Ainslie et al. 2023, "GQA" (grouped-query attention; `zerojax.models.attention`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.engine.model import Model
from zerojax.engine.scan_layers import scan_layers
from zerojax.engine.unit import unit
from zerojax.models.attention import attention

LLAMA3_KEYS = ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings", "rope_type")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """One member of the Llama family.

  Attributes:
    vocab_size, seq_len, d_model, num_layers: sizes; `seq_len` is the input length (a batch row holds
      `seq_len + 1` tokens: inputs and next-token targets).
    num_heads, num_kv_heads: query heads and key/value heads (dividing them; 1: multi-query attention).
    d_ff: the SwiGLU MLP's inner width.
    rope_theta: RoPE's base wavelength.
    rope_scaling: None, or Llama 3's scaling as sorted `(key, value)` pairs of `LLAMA3_KEYS` (a dict is
      accepted and stored in that form).
    rms_norm_eps: RMSNorm's epsilon.
    tie_embeddings: the output projection is the token embedding's transpose.
    qkv_bias: biases on the query, key and value projections (Qwen2).
    attention: `zerojax.models.attention.IMPLEMENTATIONS`.
    head_dim: the heads' width; None: `d_model // num_heads` (Mistral's configs may set another).
  """
  vocab_size: int = 256
  seq_len: int = 128
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 4
  d_ff: int = 352
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  attention: str = "auto"
  head_dim: int | None = None

  def __post_init__(self):
    if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
      raise ValueError(f"LlamaConfig: num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(f"LlamaConfig: d_model={self.d_model} is not a multiple of num_heads={self.num_heads}; "
                       "set head_dim")
    if self.head_size % 2:
      raise ValueError(f"LlamaConfig: head_dim={self.head_size} must be even (RoPE rotates pairs)")
    scaling = self.rope_scaling
    if isinstance(scaling, dict):
      scaling = tuple(sorted(scaling.items()))
      object.__setattr__(self, "rope_scaling", scaling)
    if scaling is not None and (tuple(k for k, _ in scaling) != LLAMA3_KEYS or dict(scaling)["rope_type"] != "llama3"):
      raise ValueError(f"LlamaConfig: rope_scaling={scaling!r}; use None or Llama 3's {{{', '.join(LLAMA3_KEYS)}}} "
                       "with rope_type 'llama3'")

  @property
  def head_size(self) -> int:
    return self.head_dim or self.d_model // self.num_heads


def shapes(cfg: LlamaConfig) -> dict:
  """The parameters' shapes, `{unit: {...: shape}}`; the scanned `blocks` lead with the layer axis."""
  d, f, hd, L = cfg.d_model, cfg.d_ff, cfg.head_size, cfg.num_layers
  dense = lambda i, o, bias=False: {"kernel": (L, i, o), **({"bias": (L, o)} if bias else {})}
  blocks = {"attn_norm": {"scale": (L, d)}, "q": dense(d, cfg.num_heads * hd, cfg.qkv_bias),
            "k": dense(d, cfg.num_kv_heads * hd, cfg.qkv_bias), "v": dense(d, cfg.num_kv_heads * hd, cfg.qkv_bias),
            "o": dense(cfg.num_heads * hd, d), "mlp_norm": {"scale": (L, d)},
            "gate": dense(d, f), "up": dense(d, f), "down": dense(f, d)}
  head = {"norm": {"scale": (d,)}, **({} if cfg.tie_embeddings else {"lm_head": {"kernel": (d, cfg.vocab_size)}})}
  return {"embed": {"wte": (cfg.vocab_size, d)}, "blocks": blocks, "head": head}


def init_params(cfg: LlamaConfig, rng) -> dict:
  """Matrices N(0, 0.02) (Hugging Face's `initializer_range`), norms' scales one, biases zero."""
  tree = shapes(cfg)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(rng, len(leaves))
  def fill(path, shape, key):
    name = path[-1].key
    if name == "scale":
      return jnp.ones(shape, jnp.float32)
    if name == "bias":
      return jnp.zeros(shape, jnp.float32)
    return 0.02 * jax.random.normal(key, shape, jnp.float32)
  return jax.tree.unflatten(treedef, [fill(p, s, k) for (p, s), k in zip(leaves, keys)])


def rms_norm(p, x, eps: float):
  """RMSNorm in fp32, cast back, then scaled (Hugging Face's `LlamaRMSNorm`)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype) * p["scale"].reshape((1,) * (x.ndim - 1) + (-1,))


def dense(p, x):
  y = x @ p["kernel"]
  return y + p["bias"].reshape((1,) * (y.ndim - 1) + (-1,)) if "bias" in p else y


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
  """RoPE's inverse wavelengths `[head_dim / 2]`, in fp32 as Hugging Face computes them; with Llama 3's
  scaling, wavelengths beyond `original / low_freq_factor` divided by `factor`, those below
  `original / high_freq_factor` kept, and those between interpolated."""
  hd, f32 = cfg.head_size, np.float32
  inv = (f32(1.0) / (f32(cfg.rope_theta) ** (np.arange(0, hd, 2).astype(f32) / f32(hd)))).astype(f32)
  if cfg.rope_scaling is None:
    return inv
  s = dict(cfg.rope_scaling)
  factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
  old = s["original_max_position_embeddings"]
  wavelen = (2 * np.pi / inv).astype(f32)
  scaled = np.where(wavelen > old / low, inv / factor, inv).astype(f32)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(f32)
  medium = (wavelen >= old / high) & (wavelen <= old / low)
  return np.where(medium, smoothed, scaled).astype(f32)


def rope_tables(cfg: LlamaConfig, t: int) -> tuple[np.ndarray, np.ndarray]:
  """`(cos, sin)`, each `[t, head_dim]` fp32, of positions 0 .. t-1 (the angles repeated for the two halves)."""
  angles = np.arange(t, dtype=np.float32)[:, None] * rope_frequencies(cfg)[None]
  angles = np.concatenate([angles, angles], axis=-1)
  return np.cos(angles), np.sin(angles)


def rope(x, cos, sin):
  """Rotates `[b, t, heads, head_dim]` in the rotate-half layout: the pairs are (i, i + head_dim / 2)."""
  cos, sin = (jnp.asarray(c, x.dtype)[None, :, None, :] for c in (cos, sin))
  x1, x2 = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def decoder_layer(cfg: LlamaConfig, p, x):
  """One pre-norm decoder layer: `x + attention(norm(x))`, then `x + SwiGLU(norm(x))`."""
  b, t, _ = x.shape
  hd = cfg.head_size
  h = rms_norm(p["attn_norm"], x, cfg.rms_norm_eps)
  q = dense(p["q"], h).reshape(b, t, cfg.num_heads, hd)
  k = dense(p["k"], h).reshape(b, t, cfg.num_kv_heads, hd)
  v = dense(p["v"], h).reshape(b, t, cfg.num_kv_heads, hd)
  cos, sin = rope_tables(cfg, t)
  y = attention(rope(q, cos, sin), rope(k, cos, sin), v, cfg.attention).reshape(b, t, cfg.num_heads * hd)
  x = x + dense(p["o"], y)
  h = rms_norm(p["mlp_norm"], x, cfg.rms_norm_eps)
  return x + dense(p["down"], jax.nn.silu(dense(p["gate"], h)) * dense(p["up"], h))


def embed_tokens(p, tokens):
  return p["wte"][tokens]


def cross_entropy(logits, targets):
  """Mean next-token cross-entropy of fp32 logits."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def tied_logits(p, h):
  return (h @ p["wte"].T).astype(jnp.float32)


def llama(cfg: LlamaConfig = LlamaConfig()) -> Model:
  """The model as a `zerojax.Model` with units `embed`, `blocks` (scanned) and `head`; the loss takes
  `[b, seq_len + 1]` tokens (see the module docstring for tied embeddings)."""

  def block(p, x):
    return decoder_layer(cfg, p, x)

  def final_norm(p, x):
    return rms_norm(p["norm"], x, cfg.rms_norm_eps)

  def head_loss(p, x, targets):
    """Final RMSNorm, output projection and mean cross-entropy (fp32 logits)."""
    return cross_entropy(dense(p["lm_head"], final_norm(p, x)), targets)

  def tied_loss(p, h, targets):
    """The embed unit's second call: the output projection `h @ wte.T` and the mean cross-entropy."""
    return cross_entropy(tied_logits(p, h), targets)

  embed_fn, head_fn, norm_fn, tied_fn = unit(embed_tokens), unit(head_loss), unit(final_norm), unit(tied_loss)

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = embed_fn(params["embed"], inputs)
    x = scan_layers(block, params["blocks"], x)
    if cfg.tie_embeddings:
      return tied_fn(params["embed"], norm_fn(params["head"], x), targets)
    return head_fn(params["head"], x, targets)

  return Model(init=lambda rng: init_params(cfg, rng), loss=loss, scanned=frozenset({"blocks"}))


def logits(cfg: LlamaConfig, params: dict, tokens) -> jax.Array:
  """The unsharded forward: `[b, t]` int tokens to `[b, t, vocab]` fp32 logits."""
  x = embed_tokens(params["embed"], tokens)
  x = scan_layers(lambda p, x: decoder_layer(cfg, p, x), params["blocks"], x)
  h = rms_norm(params["head"]["norm"], x, cfg.rms_norm_eps)
  if cfg.tie_embeddings:
    return tied_logits(params["embed"], h)
  return dense(params["head"]["lm_head"], h).astype(jnp.float32)
