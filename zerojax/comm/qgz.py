"""qgZ: 2-hop quantized all-to-all gradient reduction (ZeRO++ §3.3, §4.1.2).

For a mesh of N nodes x G gpus (W = N·G) and an owner chunk of c elements (DESIGN.md, "qgZ step by
step"): the local full gradient `[W*c]`, viewed `[N, G, c]` with owner (n', g') at [n', g'], is reordered
to `[G, N, c]` (the paper's tensor-slice reordering, eq. 1 -> 2) and quantized; an all-to-all over `gpu`
gives each GPU the G slabs `[N, c]` its node-mates hold for the owners (*, g); it dequantizes them, sums
in fp32 and requantizes (the fused intra-node step); an all-to-all over `node` then gives each device the
N partial sums of its own chunk, which it dequantizes and sums: `[c]`. Nothing is divided here: the
result is the plain sum, like `psum_scatter`, and the executor divides by W once.

The chunk is split into `stages` pipeline stages (Algorithm 2): each stage is an independent chain of
collectives, so stage s+1's quantization can overlap stage s's communication. Blocks never cross a stage,
so the result is identical for every number of stages.

References:
  ZeRO++: Wang et al. 2023, §3.3.2 (hierarchical all-to-all), §3.3.3 (tensor slice reordering),
  §4.1.2 (Algorithm 2, pipelining), §4.2 (fused kernels).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from zerojax import mesh as mesh_lib, quantization as q
from zerojax.comm.wire import pack_wire, unpack_wire


def _all_to_all(values, scales, axes: tuple[str, ...], bits: int):
  """One all-to-all (split and concat on axis 0) of values and scales packed as raw bytes."""
  wire = lax.all_to_all(pack_wire(values, scales), axes, 0, 0, tiled=True)
  return unpack_wire(wire, values.shape[-1], bits)


def node_major(grad_W_c: jax.Array, axes: tuple[str, ...], sizes: tuple[int, ...]):
  """Splits `axes` into the node part and the gpu part and views the gradient node-major.

  Returns `(node_axes, gpu_axes, N, G, grad)` with `grad[n * G + g]` the chunk of the owner at node-part
  index n and gpu-part index g (each part in the order of `axes`, as a collective over it numbers them).
  """
  node_ix = [i for i, a in enumerate(axes) if mesh_lib.is_node_axis(a)]
  gpu_ix = [i for i, a in enumerate(axes) if not mesh_lib.is_node_axis(a)]
  nodes, gpus = math.prod(sizes[i] for i in node_ix), math.prod(sizes[i] for i in gpu_ix)
  if node_ix + gpu_ix != list(range(len(axes))):  # owners are not node-major: transpose them to be
    x = grad_W_c.reshape(*sizes, -1)
    grad_W_c = jnp.transpose(x, node_ix + gpu_ix + [len(axes)]).reshape(-1)
  return tuple(axes[i] for i in node_ix), tuple(axes[i] for i in gpu_ix), nodes, gpus, grad_W_c


def qgz_reduce_scatter(grad_W_c: jax.Array, *, axes: tuple[str, ...], sizes: tuple[int, ...], bits: int,
                       block: int, stages: int = 1, backend: str | None = None) -> jax.Array:
  """Sums the flat gradient `[W*c]` over `axes` and returns this device's chunk `[c]` (fp32).

  The axes may be any group of the (factored) mesh: its node part (`node` or its factors, e.g. a MiCS
  group of 2 nodes `node.2`) makes the inter-node hop, its gpu part the intra-node one. A group inside
  one node has only the intra-node hop; a group of whole nodes with one device each only the other.

  Args:
    grad_W_c: the local full gradient, owner-major over `axes`.
    axes: the mesh axes of the reduction group, e.g. ("node", "gpu"), ("node.2", "gpu") or ("gpu",).
    sizes: sizes of `axes`.
    bits, block: quantization of both hops.
    stages: pipeline stages.
    backend: quantization kernel backend.
  """
  if not block:  # 0: one scale per slab (non-blocked)
    block = grad_W_c.shape[0] // (math.prod(sizes) * stages)
  node_axes, gpu_axes, nodes, gpus, grad_W_c = node_major(grad_W_c, axes, sizes)
  if nodes == 1 or gpus == 1:  # the group lies in one node, or has one device per node: one hop
    k, hop = (gpus, gpu_axes) if nodes == 1 else (nodes, node_axes)
    v, s = q.quantize(grad_W_c, bits, block, backend=backend)
    v, s = _all_to_all(v.reshape(k, -1), s.reshape(k, -1), hop, bits)  # [k(from), c]
    return q.dequant_sum(v, s, bits, block, backend=backend)
  v_SxGxNxc, s_SxGxNxb = q.reorder_quantize(grad_W_c, nodes, gpus, bits, block, stages=stages,
                                            backend=backend)
  out = []
  for st in range(stages):
    v, s = _all_to_all(v_SxGxNxc[st], s_SxGxNxb[st], gpu_axes, bits)   # [G(from), N, c/S]
    v, s = q.dequant_sum_quantize(v, s, bits, block, backend=backend)  # [N, c/S]: node-local sums
    v, s = _all_to_all(v, s, node_axes, bits)                          # [N(from), c/S]
    out.append(q.dequant_sum(v, s, bits, block, backend=backend))       # [c/S]
  return jnp.concatenate(out) if stages > 1 else out[0]
