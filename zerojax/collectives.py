"""Collectives of one ZeRO unit, written for `jax.shard_map` bodies.

All leaves of a unit are packed into one buffer, so a unit costs one all-gather per direction and one
gradient reduction (FSDP's unit; DESIGN.md "Parameter layout"). Shapes are per device; `k` is the number
of devices along the collective's axes and `C` the packed chunk length.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3 (parameter all-gather, gradient reduce-scatter).
  ZeRO++: Wang et al. 2023, §3.1 (qwZ), §3.3 (qgZ).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from zerojax import qgz, quantization


def _split_kxC(buf_kxC: jax.Array, chunks: list[int]) -> list[jax.Array]:
  """[k, C] packed buffer -> one flat [k * c_i] array per leaf (owner-major, i.e. original order)."""
  out, off = [], 0
  for c in chunks:
    out.append(buf_kxC[:, off:off + c].reshape(-1))
    off += c
  return out


def all_gather_raw(x: jax.Array, axes, **kw) -> jax.Array:
  """`lax.all_gather` that moves 16-bit floats as raw 16-bit words.

  A gather only moves data, so bf16/fp16 travel as uint16 bit patterns: XLA's CPU backend would otherwise
  widen 16-bit float collectives to fp32 and send twice the bytes.
  """
  if x.dtype.itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    return lax.all_gather(x, axes, **kw)
  return lax.bitcast_convert_type(lax.all_gather(lax.bitcast_convert_type(x, jnp.uint16), axes, **kw), x.dtype)


def pack_wire(values: jax.Array, scales: jax.Array) -> jax.Array:
  """Quantized values and their fp32 scales as one uint8 buffer `[..., V + 4 * S]`.

  One collective then moves both (fewer, larger messages), and no floating-point data is on the wire:
  the scales travel as raw bytes (bitcast, never converted or reduced).
  """
  v = lax.bitcast_convert_type(values, jnp.uint8) if values.dtype == jnp.int8 else values
  s = lax.bitcast_convert_type(scales, jnp.uint8)  # [..., S, 4]
  return jnp.concatenate([v, s.reshape(*scales.shape[:-1], -1)], axis=-1)


def unpack_wire(buf: jax.Array, num_values: int, bits: int) -> tuple[jax.Array, jax.Array]:
  """Inverse of `pack_wire`: `(values, scales)` from `[..., V + 4 * S]` uint8."""
  v, s = buf[..., :num_values], buf[..., num_values:]
  if bits == 8:
    v = lax.bitcast_convert_type(v, jnp.int8)
  s = lax.bitcast_convert_type(s.reshape(*s.shape[:-1], -1, 4), jnp.float32)
  return v, s


def all_gather_unit(shards: list[jax.Array], axes: tuple[str, ...], *, bits: int | None = None,
                    block: int = 256, backend: str | None = None) -> list[jax.Array]:
  """Gathers each leaf's local chunk `[c_i]` over `axes` into its full flat array `[k * c_i]`.

  With `bits` (qwZ, ZeRO++ §3.1) the packed chunk is block-quantized, values and scales are gathered,
  and the result is dequantized on arrival into the chunk's dtype.
  """
  if not axes:
    return list(shards)
  buf_C = jnp.concatenate(shards)
  if bits is None:
    buf_kxC = all_gather_raw(buf_C, axes, axis=0, tiled=False)
  else:
    block = block or buf_C.shape[0]  # 0: one scale for the whole shard (non-blocked)
    v, s = quantization.quantize(buf_C, bits, block, backend=backend)
    wire_kxW = lax.all_gather(pack_wire(v, s), axes, axis=0, tiled=False)
    v_kxV, s_kxS = unpack_wire(wire_kxW, v.shape[0], bits)
    buf_kxC = quantization.dequantize(v_kxV, s_kxS, bits, block, dtype=buf_C.dtype,
                                      backend=backend).reshape(v_kxV.shape[0], -1)
  return _split_kxC(buf_kxC, [s.shape[0] for s in shards])


def reduce_scatter_unit(grads: list[jax.Array], axes: tuple[str, ...], sizes: tuple[int, ...], *,
                        bits: int | None = None, block: int = 256, stages: int = 1,
                        backend: str | None = None) -> list[jax.Array]:
  """Sums each leaf's full flat gradient `[k * c_i]` over `axes` and keeps this device's chunk `[c_i]`.

  With `bits` the sum is qgZ's 2-hop quantized all-to-all (`zerojax.qgz`) instead of `psum_scatter`.
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
                                   stages=stages, backend=backend)
  out, off = [], 0
  for c in chunks:
    out.append(buf_C[off:off + c])
    off += c
  return out
