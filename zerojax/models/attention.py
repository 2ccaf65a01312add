"""Causal self-attention that never writes the `[batch, heads, seq, seq]` scores to HBM on GPUs.

`attention(q, k, v)` (layout `[batch, seq, heads, head_dim]`, as `jax.nn.dot_product_attention` takes
it) is the one call the built-in GPT, the Llama family (`zerojax.models.llama`) and the recipes for
users' models (docs/flax.md) make. Keys and values may have fewer heads than the queries (grouped-query
attention; one head: multi-query attention): query head j attends with key/value head
`j // (heads / kv_heads)`, as Hugging Face's `repeat_kv` lays them out.

- `implementation="auto"` (the default): cuDNN's fused flash attention on GPUs, the einsum form
  elsewhere. The choice is made where the program is lowered (`jax.lax.platform_dependent`), so a step
  traced once lowers to cuDNN's kernel for a GPU (real or compile-only) and to the einsum form for a
  CPU (bit for bit what it computed before). Where cuDNN cannot trace these shapes and dtypes (fp32, a
  head dimension cuDNN refuses, or no cuDNN installed) the einsum form serves everywhere, said once in
  the log with the reason.
- `"cudnn"`, `"xla"`: that implementation of `jax.nn.dot_product_attention`, always. XLA's writes the
  scores in fp32 and took 2.98 ms against the einsum form's 1.88 ms (forward and backward, b 8, s 1,024,
  h 16, d 128, bf16, one H100; cuDNN's 0.71 ms), so it is nobody's fallback.
- `"einsum"`: the scores written out (two einsums, a masked fp32 softmax), the reference the other
  forms are tested against (tests/test_attention.py).

The output is named `zerojax.engine.remat.ATTENTION` (`checkpoint_name`), so a remat policy keeps it instead
of recomputing the attention in the backward (`zerojax.engine.remat`, "dots"; `jax.checkpoint_policies.
save_only_these_names(ATTENTION)` for a user's own `jax.checkpoint`).

References:
  Vaswani et al. 2017, §3.2.1 (scaled dot-product attention).
  Dao et al. 2022, "FlashAttention" (the scores tiled in on-chip memory, never in HBM); cuDNN's fused
  attention is an implementation of it.
  Ainslie et al. 2023, "GQA" (grouped-query attention); Shazeer 2019 (multi-query attention).
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zerojax.engine.remat import ATTENTION

IMPLEMENTATIONS = ("auto", "cudnn", "xla", "einsum")

log = logging.getLogger("zerojax")
_said: set[str] = set()


def repeat_kv(x, heads: int):
  """Keys or values `[b, s, kv_heads, d]` with each head repeated for the `heads / kv_heads` query heads
  it serves; `x` itself where the heads are equal."""
  rep = heads // x.shape[2]
  return x if rep == 1 else jnp.repeat(x, rep, axis=2)


def einsum_attention(q, k, v):
  """Causal attention with the scores written out: the reference form (fewer key/value heads repeated)."""
  k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
  t, d = q.shape[1], q.shape[-1]
  att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(d, q.dtype))
  mask = jnp.tril(jnp.ones((t, t), bool))
  att = jax.nn.softmax(jnp.where(mask, att.astype(jnp.float32), -1e30), axis=-1).astype(q.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", att, v)


def _fused(implementation: str):
  return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation)


@functools.lru_cache(maxsize=None)
def cudnn_refusal(shape: tuple, dtype: str, kv_heads: int | None = None) -> str | None:
  """Why cuDNN's fused attention cannot trace forward and backward for `[b, s, h, d]` queries and
  `[b, s, kv_heads, d]` keys and values (default: h) of `dtype` here (None: it can)."""
  x = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
  kv = x if kv_heads in (None, shape[2]) else jax.ShapeDtypeStruct((*shape[:2], kv_heads, shape[3]), x.dtype)
  loss = lambda q, k, v: jnp.sum(_fused("cudnn")(q, k, v).astype(jnp.float32))
  try:
    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), x, kv, kv)
  except Exception as e:  # noqa: BLE001 - cuDNN's checks raise RuntimeError, NotImplementedError, ValueError
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return None


def resolve(q, implementation: str = "auto", kv_heads: int | None = None) -> str:
  """The implementation `attention` runs for `q` (and keys and values of `kv_heads` heads, default q's):
  "auto" becomes "platform" (cuDNN on GPUs, einsum elsewhere) where cuDNN can trace, else "einsum" (said
  once)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation={implementation!r}; use one of {IMPLEMENTATIONS}")
  if implementation != "auto":
    return implementation
  kv_heads = q.shape[2] if kv_heads is None else kv_heads
  why = cudnn_refusal(tuple(q.shape), str(q.dtype), kv_heads)
  if why is None:
    return "platform"
  key = f"{tuple(q.shape)} {q.dtype}" + ("" if kv_heads == q.shape[2] else f" kv_heads={kv_heads}")
  if key not in _said:
    _said.add(key)
    log.info("attention %s: the einsum form on every platform (cuDNN's fused attention cannot trace "
             "these inputs here: %s)", key, why)
  return "einsum"


def attention(q, k, v, implementation: str = "auto"):
  """Causal self-attention of `[batch, seq, heads, head_dim]` queries and `[batch, seq, kv_heads,
  head_dim]` keys and values, kv_heads dividing heads (scaled by 1/sqrt(head_dim)); the output,
  `[batch, seq, heads, head_dim]`, is named `ATTENTION`."""
  if v.shape[2] != k.shape[2] or not k.shape[2] or q.shape[2] % k.shape[2]:
    raise ValueError(f"attention: {q.shape[2]} query heads, {k.shape[2]} key and {v.shape[2]} value heads; "
                     "keys and values need one head count, dividing the queries'")
  how = resolve(q, implementation, k.shape[2])
  if how == "einsum":
    out = einsum_attention(q, k, v)
  elif how == "platform":
    out = jax.lax.platform_dependent(q, k, v, cuda=_fused("cudnn"), default=einsum_attention)
  else:
    out = _fused(how)(q, k, v)
  return checkpoint_name(out, ATTENTION)
