"""qgZ: 2-hop quantized all-to-all gradient reduction (ZeRO++ §3.3, §4.1.2).

For a mesh of N nodes x G gpus (W = N·G) and an owner chunk of c elements (docs/DESIGN.md, "qgZ step by
step"): the local full gradient `[W*c]`, viewed `[N, G, c]` with owner (n', g') at [n', g'], is reordered
to `[G, N, c]` (the paper's tensor-slice reordering, eq. 1 -> 2) and quantized; an all-to-all over `gpu`
gives each GPU the G slabs `[N, c]` its node-mates hold for the owners (*, g); it dequantizes them, sums
in fp32 and requantizes (the fused intra-node step); an all-to-all over `node` then gives each device the
N partial sums of its own chunk, which it dequantizes and sums: `[c]`. Nothing is divided here: the
result is the plain sum, like `psum_scatter`, and the executor divides by W once.

The chunk is split into `stages` pipeline stages (Algorithm 2): each stage is an independent chain of
collectives, so stage s+1's quantization can overlap stage s's communication. Blocks never cross a stage,
so the result is identical for every number of stages.

Fidelity options (each off by default): per-hop bits, Hadamard rotation, stochastic rounding and error
feedback; see `qgz_reduce_scatter`.

References:
  ZeRO++: Wang et al. 2023, §3.3.2 (hierarchical all-to-all), §3.3.3 (tensor slice reordering),
  §4.1.2 (Algorithm 2, pipelining), §4.2 (fused kernels).
  SDP4Bit: Jia et al. 2024, §3.2 (8-bit intra-node / 4-bit inter-node hops, Hadamard smoothing).
  LoCo: Xie et al. 2024, §3 (error feedback for low-bit gradient communication).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import hadamard
from zerojax import mesh as mesh_lib
from zerojax.comm.formats import WireFormat


def _all_to_all(values, scales, axes: tuple[str, ...], fmt: WireFormat):
  """One all-to-all (split and concat on axis 0) of values and scales packed as raw bytes."""
  wire = lax.all_to_all(fmt.pack(values, scales), axes, 0, 0, tiled=True)
  return fmt.unpack(wire, values.shape[-1])


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


def _hop_error(x: jax.Array, v, s, fmt: WireFormat, rotate: bool, backend) -> jax.Array:
  """What a quantization of `x` dropped: x - dequantize(quantize(x)), in x's shape (LoCo §3)."""
  return x - fmt.dequantize(v, s, rotate=rotate, backend=backend).reshape(x.shape)


def qgz_reduce_scatter(grad_W_c: jax.Array, *, axes: tuple[str, ...], sizes: tuple[int, ...],
                       formats: WireFormat | tuple[WireFormat, WireFormat], stages: int = 1,
                       backend: str | None = None, rotate: bool = False, key: jax.Array | None = None, error=None):
  """Sums the flat gradient `[W*c]` over `axes` and returns this device's chunk `[c]` (fp32).

  The axes may be any group of the (factored) mesh: its node part (`node` or its factors, e.g. a MiCS
  group of 2 nodes `node.2`) makes the inter-node hop, its gpu part the intra-node one. A group inside
  one node has only the intra-node hop; a group of whole nodes with one device each only the other.

  Args:
    grad_W_c: the local full gradient, owner-major over `axes`.
    axes: the mesh axes of the reduction group, e.g. ("node", "gpu"), ("node.2", "gpu") or ("gpu",).
    sizes: sizes of `axes`.
    formats: the wire format of both hops, or a pair (intra-node, inter-node), e.g. int8 inside the node
      and int4 across (SDP4Bit §3.2), or float8 blocks (`comm.formats`); one block size for both.
    stages: pipeline stages.
    backend: quantization kernel backend.
    rotate: Hadamard-rotate each block before the first quantization; the sums stay rotated and the
      last dequantization rotates back (rotation is linear).
    key: a PRNG key: stochastic rounding in both hops (noise from `fold_in(key, hop)`); None rounds
      to nearest.
    error: error feedback (LoCo §3): `(e_send [W*c], e_node [N*c])`, what the last call's first hop
      dropped of this device's gradient (node-major order) and its second hop of the node-local sums
      (in the rotated domain with `rotate`). Each is added before its hop's quantization.

  Returns:
    The chunk `[c]` (the gradient itself for a group of one device: nothing is quantized); with `error`,
    `(chunk, (e_send, e_node))` with this call's errors. Everything the
    quantizations drop is in the errors: over the group, the chunks plus the change of the errors'
    sums equal the inputs' sum (to fp32 rounding).
  """
  if math.prod(sizes) == 1:  # a group of one device: nothing leaves it, so nothing is quantized or dropped
    out = grad_W_c.astype(jnp.float32)
    return out if error is None else (out, jax.tree.map(jnp.zeros_like, error))
  intra, inter = (formats, formats) if isinstance(formats, WireFormat) else formats
  noise = lambda i, shape: None if key is None else hadamard.uniform(jax.random.fold_in(key, i), shape)
  slab = grad_W_c.shape[0] // (math.prod(sizes) * stages)  # block 0: one scale per slab (non-blocked)
  intra, inter = intra.for_length(slab), inter.for_length(slab)
  node_axes, gpu_axes, nodes, gpus, grad_W_c = node_major(grad_W_c, axes, sizes)
  e_send, e_node = error if error is not None else (None, None)
  if e_send is not None:
    grad_W_c = grad_W_c + e_send
  if nodes == 1 or gpus == 1:  # the group lies in one node, or has one device per node: one hop
    k, hop, f = (gpus, gpu_axes, intra) if nodes == 1 else (nodes, node_axes, inter)
    v, s = f.quantize(grad_W_c, rotate=rotate, noise=noise(0, grad_W_c.shape), backend=backend)
    if error is not None:
      e_send = _hop_error(grad_W_c, v, s, f, rotate, backend)
    v, s = _all_to_all(v.reshape(k, -1), s.reshape(k, -1), hop, f)  # [k(from), c]
    out = f.dequant_sum(v, s, rotate=rotate, backend=backend)
    return out if error is None else (out, (e_send, e_node))
  v_SxGxNxc, s_SxGxNxb = intra.reorder_quantize(grad_W_c, nodes, gpus, stages=stages, rotate=rotate,
                                                noise=noise(0, grad_W_c.shape), backend=backend)
  if error is not None:  # the first hop's error, back in the gradient's order [N, G, S, c/S]
    d = intra.dequantize(v_SxGxNxc, s_SxGxNxb, rotate=rotate, backend=backend)
    d = jnp.transpose(d.reshape(stages, gpus, nodes, -1), (2, 1, 0, 3)).reshape(-1)
    e_send, e_node = grad_W_c - d, e_node.reshape(stages, nodes, -1)
  out, e_nodes = [], []
  for st in range(stages):
    v, s = _all_to_all(v_SxGxNxc[st], s_SxGxNxb[st], gpu_axes, intra)  # [G(from), N, c/S]
    if error is None:  # the fused intra-node step: node-local sums, requantized
      v, s = intra.dequant_sum_quantize(v, s, inter, noise=noise(1 + st, v.shape[1:-1] + (
          v.shape[-1] // intra.value_len(intra.block) * intra.block,)), backend=backend)
    else:
      acc = intra.dequant_sum(v, s, backend=backend) + e_node[st]  # [N, c/S], rotated domain
      v, s = inter.quantize(acc, noise=noise(1 + st, acc.shape), backend=backend)
      e_nodes.append(_hop_error(acc, v, s, inter, False, backend))
      v, s = v.reshape(nodes, -1), s.reshape(nodes, -1)
    v, s = _all_to_all(v, s, node_axes, inter)                          # [N(from), c/S]
    out.append(inter.dequant_sum(v, s, rotate=rotate, backend=backend))  # [c/S]
  out = jnp.concatenate(out) if stages > 1 else out[0]
  return out if error is None else (out, (e_send, jnp.stack(e_nodes).reshape(-1)))
