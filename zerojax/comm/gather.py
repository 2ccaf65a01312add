"""All-gathers of one ZeRO unit's parameters, flat or quantized (qwZ), for `jax.shard_map` bodies.

All leaves of a unit are packed into one buffer, so a unit costs one all-gather per direction (FSDP's
unit; docs/DESIGN.md, "Parameter layout"). Shapes are per device; `k` is the number of devices along the
collective's axes and `C` the packed chunk length.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3 (parameter all-gather).
  ZeRO++: Wang et al. 2023, §3.1 (qwZ: block-quantized weight all-gather).
  MiCS: Zhang et al. 2022, §3.3 (hierarchical all-gather for groups that span nodes).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax import mesh as mesh_lib
from zerojax.comm.formats import WireFormat
from zerojax.comm.wire import all_gather_raw


def _split_kxC(buf_kxC: jax.Array, chunks: list[int]) -> list[jax.Array]:
  """[k, C] packed buffer -> one flat [k * c_i] array per leaf (owner-major, i.e. original order)."""
  out, off = [], 0
  for c in chunks:
    out.append(buf_kxC[:, off:off + c].reshape(-1))
    off += c
  return out


def hierarchical_all_gather(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """`all_gather(x, axes, tiled=False)` in two stages when `axes` span nodes (MiCS §3.3).

  Stage 1 gathers across nodes among devices of the same local rank (all local ranks in parallel, over
  the node part of `axes`); stage 2 gathers inside the node (the gpu part). The transpose between them
  is the paper's data rearrangement: the result `[k, ...]` is in owner order, identical to the flat
  gather. Each node then receives (p - k) M / p bytes across nodes instead of (p - 1) M / p.
  """
  node_axes = tuple(a for a in axes if mesh_lib.is_node_axis(a))
  gpu_axes = tuple(a for a in axes if not mesh_lib.is_node_axis(a))
  if not node_axes or not gpu_axes or axes != node_axes + gpu_axes:
    return all_gather_raw(x, axes, axis=0, tiled=False)
  across = all_gather_raw(x, node_axes, axis=0, tiled=False)          # [N, ...]: same local rank
  inside = all_gather_raw(across, gpu_axes, axis=0, tiled=False)      # [G, N, ...]
  inside = jnp.swapaxes(inside, 0, 1)                                 # [N, G, ...]: owner n * G + g
  return inside.reshape(-1, *x.shape)


def all_gather_unit(shards: list[jax.Array], axes: tuple[str, ...], *, fmt: WireFormat | None = None,
                    backend: str | None = None, hierarchical: bool = False, rotate: bool = False) -> list[jax.Array]:
  """Gathers each leaf's local chunk `[c_i]` over `axes` into its full flat array `[k * c_i]`.

  With a wire format `fmt` (qwZ's int8/int4, ZeRO++ §3.1; the float8 gather, FP8-LM §2.1) the packed
  chunk is block-quantized, values and scales travel in one buffer (`WireFormat.pack`), and the result
  is dequantized on arrival into the chunk's dtype. With `hierarchical` a group that spans nodes gathers
  in two stages (MiCS §3.3, `hierarchical_all_gather`); the result is identical. With `rotate` each
  block is Hadamard-rotated before quantization and back after (SDP4Bit §3.2). Without `axes` (a group
  of one device) the shards are the leaves: nothing moves, nothing is quantized.
  """
  if not axes:
    return list(shards)
  gather = hierarchical_all_gather if hierarchical else (lambda x, ax: all_gather_raw(x, ax, axis=0, tiled=False))
  buf_C = jnp.concatenate(shards)
  if fmt is None:
    buf_kxC = gather(buf_C, axes)
  else:
    fmt = fmt.for_length(buf_C.shape[0])  # block 0: one scale for the whole shard (non-blocked)
    v, s = fmt.quantize(buf_C, rotate=rotate, backend=backend)
    v_kxV, s_kxS = fmt.unpack(gather(fmt.pack(v, s), axes), v.shape[0])
    buf_kxC = fmt.dequantize(v_kxV, s_kxS, dtype=buf_C.dtype, rotate=rotate,
                             backend=backend).reshape(v_kxV.shape[0], -1)
  return _split_kxC(buf_kxC, [s.shape[0] for s in shards])
