"""An lm1b-style decoder-only Transformer (flax's examples/lm1b) trained with zerojax in two statements.

The model is the user's own linen module; its decoder blocks are the ZeRO units (one unit per block, as
in the flax example's unscanned stack), everything else (embedding tied with the output, final norm) is
the root unit. The batch is a dict with a padding mask, dropout draws from the step's rng, and the loss
returns the token accuracy as aux. The data are synthetic byte sequences of random length (a noisy
counting task), padded with 0, so the loss falls within a few hundred CPU steps.

  python examples/lm1b_transformer.py --steps 300

References:
  Vaswani et al. 2017 (Transformer); flax examples/lm1b (the model); ZeRO++: Wang et al. 2023 (the plan).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 64
  max_len: int = 32
  emb_dim: int = 64
  num_heads: int = 4
  num_layers: int = 4
  mlp_dim: int = 128
  dropout_rate: float = 0.1


class DecoderBlock(nn.Module):
  """Pre-norm causal self-attention and MLP, with dropout (flax lm1b's EncoderDecoder1DBlock)."""
  cfg: Config

  @nn.compact
  def __call__(self, x, mask, *, deterministic: bool):
    cfg = self.cfg
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads, dropout_rate=cfg.dropout_rate,
                                        deterministic=deterministic)(y, y, mask=mask)
    x = x + nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(y)
    y = nn.Dense(cfg.mlp_dim)(nn.LayerNorm()(x))
    y = nn.Dense(cfg.emb_dim)(nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(nn.gelu(y)))
    return x + nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(y)


class TransformerLM(nn.Module):
  """Token and learned position embeddings, decoder blocks, final norm, logits tied to the embedding."""
  cfg: Config

  @nn.compact
  def __call__(self, inputs, padding, *, train: bool):
    cfg = self.cfg
    embed = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.initializers.normal(1.0))
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, cfg.max_len, cfg.emb_dim))
    x = embed(inputs) + pos[:, :inputs.shape[1]]
    x = nn.Dropout(cfg.dropout_rate, deterministic=not train)(x)
    mask = nn.combine_masks(nn.make_causal_mask(inputs), nn.make_attention_mask(padding, padding))
    for i in range(cfg.num_layers):
      x = DecoderBlock(cfg, name=f"block{i}")(x, mask, deterministic=not train)
    return embed.attend(nn.LayerNorm()(x)) / np.sqrt(cfg.emb_dim)


def loss_fn(apply, batch, rng):
  """Next-token cross-entropy over the non-padding positions; aux: token accuracy and padding share."""
  tokens, padding = batch["inputs"], batch["padding"]
  logits = apply(tokens[:, :-1], padding[:, :-1], train=rng is not None)
  weights = padding[:, 1:].astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  denom = jnp.maximum(weights.sum(), 1.0)
  accuracy = jnp.sum((jnp.argmax(logits, -1) == tokens[:, 1:]) * weights) / denom
  return jnp.sum(ce * weights) / denom, {"accuracy": accuracy, "tokens": weights.mean()}


def synthetic_batch(cfg: Config, rng: np.random.Generator, batch: int, accum: int | None = None) -> dict:
  """Sequences `s, s+1, s+2, ...` (mod vocab, token 0 reserved for padding) with 10% random tokens, of
  random length, padded with 0; `padding` is 1 on real tokens."""
  lead = (accum, batch) if accum else (batch,)
  start = rng.integers(1, cfg.vocab_size, lead + (1,))
  seq = (start + np.arange(cfg.max_len + 1)) % (cfg.vocab_size - 1) + 1
  noise = rng.random(seq.shape) < 0.1
  seq = np.where(noise, rng.integers(1, cfg.vocab_size, seq.shape), seq)
  length = rng.integers(cfg.max_len // 2, cfg.max_len + 2, lead + (1,))
  padding = (np.arange(cfg.max_len + 1) < length).astype(np.int32)
  return {"inputs": (seq * padding).astype(np.int32), "padding": padding}


def build(cfg: Config = Config(), plan: zerojax.Plan | None = None, mesh=None, optimizer=None, accum_steps=1):
  """The two statements: the model from the user's module, and the executor."""
  example = synthetic_batch(cfg, np.random.default_rng(0), 2)
  model = zerojax.from_linen(TransformerLM(cfg), example, loss_fn, units=(DecoderBlock,), rngs=("dropout",))
  optimizer = optimizer or optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      3e-3, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
  plan = plan or zerojax.zeropp(compute_dtype="float32")  # configs/zeropp.gin: qwZ, hpZ, qgZ
  return zerojax.Executor(model, optimizer, plan, mesh or zerojax.make_mesh(2, 4), accum_steps=accum_steps)


def train(steps: int = 300, cfg: Config = Config(), batch: int = 32, plan=None, log_every: int = 50) -> list:
  ex = build(cfg, plan)
  state, step = ex.init(jax.random.key(0)), ex.step_fn()
  rng, losses, t0 = np.random.default_rng(1), [], time.time()
  for i in range(steps):
    state, metrics = step(state, synthetic_batch(cfg, rng, batch))
    losses.append(float(metrics.loss))
    if log_every and (i + 1) % log_every == 0:
      print(f"step {i + 1}: loss {losses[-1]:.3f} token accuracy {float(metrics.aux['accuracy']):.3f} "
            f"({time.time() - t0:.0f}s)", flush=True)
  return losses


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--plan", default="zeropp", choices=sorted(zerojax.PLANS))
  args = parser.parse_args()
  train(args.steps, plan=zerojax.PLANS[args.plan](compute_dtype="float32"))
