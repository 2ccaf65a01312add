"""A GPT-style decoder written as ZeRO units: embed, scanned blocks, head.

The flax modules are used as pure functions of their parameters; each is wrapped in `zerojax.engine.unit`, so
the same `loss` runs unsharded (reference) and under any plan of the executor.

References:
  Radford et al. 2019 (GPT-2): pre-norm decoder blocks; the attention is `zerojax.models.attention`.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from zerojax.engine.model import Model
from zerojax.models.attention import attention
from zerojax.engine.scan_layers import scan_layers
from zerojax.engine.unit import unit


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 256
  seq_len: int = 128
  d_model: int = 128
  num_heads: int = 4
  num_layers: int = 4
  mlp_ratio: int = 4
  attention: str = "auto"  # `zerojax.models.attention.IMPLEMENTATIONS`: cuDNN's fused attention on GPUs


class Block(nn.Module):
  """Pre-norm transformer block: causal self-attention and an MLP."""
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    b, t, d = x.shape
    h = nn.LayerNorm(name="ln1")(x)
    qkv = nn.Dense(3 * d, name="qkv")(h).reshape(b, t, 3, cfg.num_heads, d // cfg.num_heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    y = attention(q, k, v, cfg.attention).reshape(b, t, d)
    x = x + nn.Dense(d, name="proj")(y)
    h = nn.LayerNorm(name="ln2")(x)
    h = nn.Dense(cfg.mlp_ratio * d, name="fc")(h)
    return x + nn.Dense(d, name="out")(jax.nn.gelu(h))


def embed_tokens(p, tokens):
  t = tokens.shape[1]
  return p["wte"][tokens] + p["wpe"][:t][None]


def head_loss(p, x, targets):
  """Final LayerNorm, output projection and mean cross-entropy (fp32 logits)."""
  h = nn.LayerNorm().apply({"params": p["ln_f"]}, x)
  logits = (h @ p["w_out"]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def gpt(cfg: GPTConfig = GPTConfig()) -> Model:
  """The GPT model as a `zerojax.Model` with units `embed`, `blocks` (scanned) and `head`."""
  block = Block(cfg)

  def init(rng):
    k_emb, k_pos, k_blocks, k_out = jax.random.split(rng, 4)
    x = jnp.zeros((1, cfg.seq_len, cfg.d_model))
    blocks = jax.vmap(lambda k: block.init(k, x)["params"])(jax.random.split(k_blocks, cfg.num_layers))
    return {
        "embed": {"wte": 0.02 * jax.random.normal(k_emb, (cfg.vocab_size, cfg.d_model)),
                  "wpe": 0.01 * jax.random.normal(k_pos, (cfg.seq_len, cfg.d_model))},
        "blocks": blocks,
        "head": {"ln_f": nn.LayerNorm().init(k_out, x)["params"],
                 "w_out": 0.02 * jax.random.normal(k_out, (cfg.d_model, cfg.vocab_size))},
    }

  block_fn = lambda p, x: block.apply({"params": p}, x)
  embed_fn, head_fn = unit(embed_tokens), unit(head_loss)

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = embed_fn(params["embed"], inputs)
    x = scan_layers(block_fn, params["blocks"], x)
    return head_fn(params["head"], x, targets)

  return Model(init=init, loss=loss, scanned=frozenset({"blocks"}))
