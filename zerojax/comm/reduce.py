"""Gradient reduce-scatter of one ZeRO unit, flat, 16-bit all-to-all or qgZ, for `jax.shard_map` bodies.

All leaves of a unit are packed into one buffer, so a unit costs one gradient reduction per micro-step.

References:
  ZeRO: Rajbhandari et al. 2020, §5.2-5.3 (gradient reduce-scatter).
  ZeRO++: Wang et al. 2023, §3.3 (qgZ; its hierarchical all-to-all, here also for unquantized words).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from zerojax.comm import qgz
from zerojax.comm.formats import WireFormat


def _all_to_all_words(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """All-to-all (split and concat on axis 0) of the raw bit patterns: no float collective to widen."""
  words = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
  return lax.bitcast_convert_type(lax.all_to_all(lax.bitcast_convert_type(x, words), axes, 0, 0, tiled=True),
                                  x.dtype)


def all_to_all_reduce_scatter(grad_W_c: jax.Array, axes: tuple[str, ...], sizes: tuple[int, ...]) -> jax.Array:
  """Sums the flat gradient `[W*c]` over `axes` and returns this device's chunk `[c]`, in its own dtype
  on the wire (16-bit gradients stay 16 bits) with every sum in fp32.

  qgZ's hierarchy without its quantization (ZeRO++ §3.3.2-3.3.3): the gradient viewed `[N, G, c]` is
  reordered to `[G, N, c]`; an all-to-all of the raw words over the gpu part of `axes` gives each device
  its node-mates' slabs `[G, N, c]`, summed in fp32 and rounded once to the wire dtype (`[N, c]`); an
  all-to-all over the node part gives it the N node sums of its own chunk, summed in fp32. A group in one
  node (or of one device per node) has one hop. XLA's CPU backend widens a 16-bit `psum_scatter` to fp32
  on the wire; raw words cannot be widened. Each node sends (N-1)/N of its gradient bytes across nodes,
  a flat ring reduce-scatter (W-1)/W.
  """
  node_axes, gpu_axes, nodes, gpus, grad = qgz.node_major(grad_W_c, axes, sizes)
  x = jnp.swapaxes(grad.reshape(nodes, gpus, -1), 0, 1)  # [G, N, c]: the tensor-slice reordering
  dtype = x.dtype
  for hop, k in ((gpu_axes, gpus), (node_axes, nodes)):
    if k == 1:
      x = x[0]
      continue
    x = jnp.sum(_all_to_all_words(x, hop).astype(jnp.float32), axis=0)  # [k(from), ...] -> [...]
    x = x.astype(dtype)
  return x


def reduce_scatter_unit(grads: list[jax.Array], axes: tuple[str, ...], sizes: tuple[int, ...], *,
                        formats: WireFormat | tuple[WireFormat, WireFormat] | None = None, stages: int = 1,
                        backend: str | None = None, all_to_all: bool = False, **fidelity):
  """Sums each leaf's full flat gradient `[k * c_i]` over `axes` and keeps this device's chunk `[c_i]`.

  With wire `formats` the sum is qgZ's 2-hop quantized all-to-all (`zerojax.comm.qgz.qgz_reduce_scatter`); with `all_to_all` the same
  hops move the gradient's own words (`all_to_all_reduce_scatter`); else `psum_scatter`. `fidelity`
  (`rotate`, `key`, `error`) passes on to qgZ. With `error` (the unit's packed buffers) the result is
  `(chunks, new error)`. Without `axes` (a group of one device) nothing moves and nothing is quantized:
  the gradients are the chunks (and the new error is zero).
  """
  if not axes:
    error = fidelity.get("error")
    return list(grads) if error is None else (list(grads), jax.tree.map(jnp.zeros_like, error))
  k = math.prod(sizes)
  chunks = [g.shape[0] // k for g in grads]
  buf_kxC = jnp.concatenate([g.reshape(k, c) for g, c in zip(grads, chunks)], axis=1)
  if formats is None and all_to_all:
    buf_C = all_to_all_reduce_scatter(buf_kxC.reshape(-1), axes, sizes)
  elif formats is None:
    buf_C = lax.psum_scatter(buf_kxC.reshape(-1), axes, scatter_dimension=0, tiled=True)
  else:
    buf_C = qgz.qgz_reduce_scatter(buf_kxC.reshape(-1), axes=axes, sizes=sizes, formats=formats, stages=stages,
                                   backend=backend, **fidelity)
  error = None
  if fidelity.get("error") is not None:
    buf_C, error = buf_C
  out, off = [], 0
  for c in chunks:
    out.append(buf_C[off:off + c])
    off += c
  return out if error is None else (out, error)

