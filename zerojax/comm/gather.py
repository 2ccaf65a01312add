"""All-gathers of one ZeRO unit's parameters, flat or quantized (qwZ), for `jax.shard_map` bodies.

All leaves of a unit are packed into one buffer, so a unit costs one all-gather per direction (FSDP's
unit; DESIGN.md "Parameter layout"). Shapes are per device; `k` is the number of devices along the
collective's axes and `C` the packed chunk length.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3 (parameter all-gather).
  ZeRO++: Wang et al. 2023, §3.1 (qwZ: block-quantized weight all-gather).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from zerojax import quantization
from zerojax.comm.wire import all_gather_raw, pack_wire, unpack_wire


def _split_kxC(buf_kxC: jax.Array, chunks: list[int]) -> list[jax.Array]:
  """[k, C] packed buffer -> one flat [k * c_i] array per leaf (owner-major, i.e. original order)."""
  out, off = [], 0
  for c in chunks:
    out.append(buf_kxC[:, off:off + c].reshape(-1))
    off += c
  return out


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
