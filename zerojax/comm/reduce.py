"""Gradient reduce-scatter of one ZeRO unit, flat or qgZ, for `jax.shard_map` bodies.

All leaves of a unit are packed into one buffer, so a unit costs one gradient reduction per micro-step.

References:
  ZeRO: Rajbhandari et al. 2020, §5.2-5.3 (gradient reduce-scatter).
  ZeRO++: Wang et al. 2023, §3.3 (qgZ).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from zerojax.comm import qgz


def reduce_scatter_unit(grads: list[jax.Array], axes: tuple[str, ...], sizes: tuple[int, ...], *,
                        bits: int | tuple[int, int] | None = None, block: int = 256, stages: int = 1,
                        backend: str | None = None, **fidelity):
  """Sums each leaf's full flat gradient `[k * c_i]` over `axes` and keeps this device's chunk `[c_i]`.

  With `bits` the sum is qgZ's 2-hop quantized all-to-all (`zerojax.qgz`) instead of `psum_scatter`;
  `fidelity` (`rotate`, `key`, `error`) passes on to it. With `error` (the unit's packed buffers) the
  result is `(chunks, new error)`.
  """
  if not axes:
    return list(grads)
  k = math.prod(sizes)
  chunks = [g.shape[0] // k for g in grads]
  buf_kxC = jnp.concatenate([g.reshape(k, c) for g, c in zip(grads, chunks)], axis=1)
  if bits is None:
    buf_C = lax.psum_scatter(buf_kxC.reshape(-1), axes, scatter_dimension=0, tiled=True)
  else:
    buf_C = qgz.qgz_reduce_scatter(buf_kxC.reshape(-1), axes=axes, sizes=sizes, bits=bits, block=block,
                                   stages=stages, backend=backend, **fidelity)
  error = None
  if fidelity.get("error") is not None:
    buf_C, error = buf_C
  out, off = [], 0
  for c in chunks:
    out.append(buf_C[off:off + c])
    off += c
  return out if error is None else (out, error)

