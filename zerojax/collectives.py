"""Collectives of one ZeRO unit, written for `jax.shard_map` bodies.

All leaves of a unit are packed into one buffer, so a unit costs one all-gather per direction and one
gradient reduction (FSDP's unit; DESIGN.md "Parameter layout"). Shapes are per device; `k` is the number
of devices along the collective's axes and `C` the packed chunk length.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3 (parameter all-gather, gradient reduce-scatter).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _split_kxC(buf_kxC: jax.Array, chunks: list[int]) -> list[jax.Array]:
  """[k, C] packed buffer -> one flat [k * c_i] array per leaf (owner-major, i.e. original order)."""
  out, off = [], 0
  for c in chunks:
    out.append(buf_kxC[:, off:off + c].reshape(-1))
    off += c
  return out


def all_gather_unit(shards: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
  """Gathers each leaf's local chunk `[c_i]` over `axes` into its full flat array `[k * c_i]`."""
  if not axes:
    return list(shards)
  buf_C = jnp.concatenate(shards)
  buf_kxC = lax.all_gather(buf_C, axes, axis=0, tiled=False)
  return _split_kxC(buf_kxC, [s.shape[0] for s in shards])


def reduce_scatter_unit(grads: list[jax.Array], axes: tuple[str, ...], k: int) -> list[jax.Array]:
  """Sums each leaf's full flat gradient `[k * c_i]` over `axes` and keeps this device's chunk `[c_i]`."""
  if not axes:
    return list(grads)
  chunks = [g.shape[0] // k for g in grads]
  buf_kxC = jnp.concatenate([g.reshape(k, c) for g, c in zip(grads, chunks)], axis=1)
  buf_C = lax.psum_scatter(buf_kxC.reshape(-1), axes, scatter_dimension=0, tiled=True)
  out, off = [], 0
  for c in chunks:
    out.append(buf_C[off:off + c])
    off += c
  return out
