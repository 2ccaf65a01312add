"""Radius's sparse replica all-reduce: periodic top-k indices, a compact all-reduce, a residual.

Pure functions for `jax.shard_map` bodies (the sync) and for jitted functions of global arrays (the
checkpoint conversions). Each device holds, per leaf, its chunk `[..., c]` of the flat padded leaf
(`...` is a scanned unit's layer axis); a Radius window fixes `k` positions per chunk, the same on every
replica, so the selected values travel as one dense vector of k elements with no indices (Radius §4.1).

Gradients arrive as sums over the devices and micro-batches of a replica (`psum(...) / denom` is the
mean gradient, as in the dense sync); the residual is kept in mean-gradient units, so it does not depend
on the number of devices.

References:
  Radius: Zheng & Zhang, §4.1 and Algorithm 1 lines 7–17 (dense step with residual, compact all-reduce),
  §4.2 and Algorithm 1 line 23 (top-k selection), §4.3 (residual, error feedback), §5 (binary mask).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def select(score: jax.Array, k: int, start, size: int) -> jax.Array:
  """Algorithm 1 line 23 on one chunk: positions of the k largest |score|, ascending, int32.

  Args:
    score: this device's chunk `[..., c]` of a leaf's score (the corrected update, Radius §4.2).
    k: elements to select per chunk (per layer).
    start: flat position of the chunk's first element in the leaf (owner index x c).
    size: the leaf's elements without padding; padding positions rank below every real one and are
      picked, lowest first, only when the chunk has fewer than k real elements.
  """
  real = jnp.broadcast_to(start + jnp.arange(score.shape[-1]) < size, score.shape)
  ranked = jnp.where(real, jnp.abs(score).astype(jnp.float32), -1.0)
  _, idx = lax.top_k(ranked, k)  # ties: the lower position first, so every replica picks the same
  return jnp.sort(idx, axis=-1).astype(jnp.int32)


def _scatter(values: jax.Array, idx: jax.Array, c: int) -> jax.Array:
  """`[..., k]` values at positions `idx [..., k]` of zeros `[..., c]`."""
  if idx.ndim == 1:
    return jnp.zeros((c,), values.dtype).at[idx].set(values, unique_indices=True)
  return jax.vmap(lambda v, i: _scatter(v, i, c))(values, idx)


def selected_mask(idx: jax.Array, c: int) -> jax.Array:
  """Bool `[..., c]`: True at the selected positions `idx [..., k]`."""
  return _scatter(jnp.ones(idx.shape, bool), idx, c)


def dense_all_reduce(grads: list[jax.Array], residuals: list[jax.Array], axes, denom) -> tuple[list, list]:
  """Algorithm 1 lines 8–11: all-reduce gradient + residual over `axes`, reset the residual.

  Args:
    grads: per leaf this replica's gradient sum `[..., c]`.
    residuals: per leaf this replica's residual `[..., c]` (mean-gradient units).
    axes: the replica axes.
    denom: devices x micro-batches: `sum / denom` is the mean gradient.

  Returns:
    (mean gradients, zero residuals). With a zero residual the result is bitwise the dense sync's.
  """
  out = [lax.psum(g + r * denom, axes) / denom for g, r in zip(grads, residuals)]
  return out, [jnp.zeros_like(r) for r in residuals]


def sparse_all_reduce(grads: list[jax.Array], residuals: list[jax.Array], indices: list[jax.Array], axes,
                      denom) -> tuple[list, list]:
  """Algorithm 1 lines 13–17: one all-reduce of the k selected values of every leaf; the rest of the
  local gradient goes to the residual, and the mean gradient is zero there.

  Args:
    grads, residuals, axes, denom: as for `dense_all_reduce`.
    indices: per leaf the window's selected positions `[..., k]` (the same on every replica).

  Returns:
    (mean gradients, zero off the selection; residuals + the unselected local gradient / denom).
  """
  compact = jnp.concatenate([jnp.take_along_axis(g, i, axis=-1).reshape(-1) for g, i in zip(grads, indices)])
  compact = lax.psum(compact, axes) / denom  # the only collective: k elements per leaf chunk
  out, new_res, off = [], [], 0
  for g, r, i in zip(grads, residuals, indices):
    n = i.size
    out.append(_scatter(compact[off:off + n].reshape(i.shape), i, g.shape[-1]))
    new_res.append(r + jnp.where(selected_mask(i, g.shape[-1]), 0.0, g / denom).astype(r.dtype))
    off += n
  return out, new_res


# -- checkpoints: the indices as a mask over the leaf, which does not depend on the mesh -----------

def indices_to_mask(idx: jax.Array, c: int, shards: int) -> jax.Array:
  """Global `[..., shards * k]` per-chunk positions -> bool `[..., shards * c]` mask over the flat leaf."""
  k = idx.shape[-1] // shards
  chunks = idx.reshape(*idx.shape[:-1], shards, k)
  mask = selected_mask(chunks.reshape(-1, k), c)
  return mask.reshape(*idx.shape[:-1], shards * c)


def mask_to_indices(mask: jax.Array, k: int, shards: int, size: int) -> jax.Array:
  """Inverse of `indices_to_mask` for a mask that holds k positions per chunk; any other mask (saved
  on another mesh or plan) is re-tiled: per chunk its masked positions first, then padding, then the
  lowest unmasked ones, k in all. The residual keeps whatever is not sent, so any k positions conserve
  the gradient; those of the saved window are kept where the chunks allow.
  """
  c = mask.shape[-1] // shards
  chunks = mask.reshape(*mask.shape[:-1], shards, c)
  padding = jnp.broadcast_to(jnp.arange(shards * c).reshape(shards, c) >= size, chunks.shape)
  rank = jnp.where(chunks, 0, jnp.where(padding, 1, 2))
  idx = jnp.sort(jnp.argsort(rank, axis=-1, stable=True)[..., :k], axis=-1)
  return idx.reshape(*mask.shape[:-1], shards * k).astype(jnp.int32)


def fold_residual(saved: jax.Array, replicas: int) -> jax.Array:
  """A residual saved with `saved.shape[0]` replicas onto `replicas`: unchanged when they agree, else
  the sum on the first replica and zeros on the others (only the sum enters the next select step)."""
  if saved.shape[0] == replicas:
    return saved
  return jnp.zeros((replicas,) + saved.shape[1:], saved.dtype).at[0].set(jnp.sum(saved, axis=0))
