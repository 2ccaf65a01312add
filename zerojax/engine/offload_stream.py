"""The streamed update's loop over the layers of a scanned unit (`Sharding.offload`, `offload_update="streamed"`):
each layer's master weights and optimizer states come from host memory, are updated on the device and go back,
three layers in flight at once (docs/offload.md, "The update, streamed").

ZeRO-Offload (Ren et al. 2021, §4) moves the states between host and device every step; Megatron-Core's chunked
offloader overlaps the copy of chunk N + 1 to the device, the update of chunk N and the copy of chunk N - 1 back,
which `stream_layers` does per layer, writing the donated host buffers in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerojax.engine.offload import HostOffload


def in_host_memory(tree) -> bool:
  """Inside a trace: whether every array of `tree` is typed as host memory. The step's offloaded inputs are,
  on every backend with memory kinds (GPUs, CPUs); compile-only GPUs of jax 0.10.2 list no memories, so their
  shardings drop the memory kind and the trace types those inputs as device memory (docs/offload.md)."""
  return all(jax.typeof(x).memory_space == jax.memory.Space.Host for x in jax.tree.leaves(tree) if np.ndim(x))


def stream_layers(offload: HostOffload, chunk, grads, hp, hs, forward=None):
  """`chunk(grads, params, states)` over the layers of a scanned unit, each layer's master weights `hp` and
  states `hs` fetched to the device and stored back to host memory, and with `forward` (the unit's kept
  rounding, `HostOffload.forward`) each layer's new rounding written into it on the device. -> (new master,
  new states, the scalar states of the first layer's update, the new rounding or None).

  Layer 0 is updated before a `lax.scan` over the layers between the first and the last, whose step i fetches
  layer i + 1, updates layer i (fetched by the step before) and stores layer i - 1 (updated by the step
  before); the last layer is updated and stored after the scan. The three depend on nothing of each
  other, so the two directions of the host link and the device's update can run at once (Megatron-Core's
  chunked offloader; docs/offload.md, "The two directions of the host link at once"), with three layers'
  states on the device.

  The stored layer is written into the host arrays themselves (`dynamic_update_slice` into the scan's carry),
  so the donated host buffers are updated in place and the states are in host memory once. Each array's read
  of layer i + 1 comes before its write of layer i - 1 (a `lax.optimization_barrier` per array: without it
  XLA copies the whole host array to keep the read correct; one barrier over all the arrays would make every
  fetch wait for every store). Where the trace types the host arrays as device memory (`in_host_memory`:
  compile-only GPUs of jax 0.10.2), the stored layers stack in a new host array instead (`stack_layers`)."""
  in_place = all(in_host_memory(t) for f, t in (("params", hp), ("opt_state", hs)) if offload.host(f))
  if not in_place:
    return stack_layers(offload, chunk, grads, hp, hs, forward is not None)
  n = jax.tree.leaves(grads)[0].shape[0]
  get = lambda host, i: _fetch_layer(offload, host, i)
  at = lambda i: jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=True), grads)
  put = lambda tree, new, i: jax.tree.map(lambda h, x: lax.dynamic_update_index_in_dim(h, x, i, 0), tree, new)

  def write(host, fwd, new, i):
    """`new` (a layer's master and states, on the device) into the host arrays `host` at layer i, and its
    rounding into `fwd`."""
    stored = (offload.store("params", new[0]), offload.store("opt_state", new[1]))
    return put(host, stored, i), (None if fwd is None else put(fwd, offload.forward_copy(new[0]), i))

  def body(carry, i):
    host, fwd, cur, prev = carry
    nxt = get(host, i + 1)
    pairs = jax.tree.map(lambda a, b: lax.optimization_barrier((a, b)), nxt, host)
    nxt, host = (jax.tree.map(lambda _, ab, k=k: ab[k], nxt, pairs) for k in (0, 1))
    p_new, s_new, _ = chunk(at(i), *cur)
    return (*write(host, fwd, prev, i - 1), nxt, (p_new, s_new)), None
  p0, s0, scalars = chunk(at(0), *get((hp, hs), 0))
  if n == 1:
    host, fwd = write((hp, hs), forward, (p0, s0), 0)
    return (*host, scalars, fwd)
  carry = ((hp, hs), forward, get((hp, hs), 1), (p0, s0))
  (host, fwd, cur, prev), _ = lax.scan(body, carry, jnp.arange(1, n - 1))
  p_last, s_last, _ = chunk(at(n - 1), *cur)
  host, fwd = write(*write(host, fwd, prev, n - 2), (p_last, s_last), n - 1)
  return (*host, scalars, fwd)


def _fetch_layer(offload: HostOffload, host, i):
  """Layer i of the host arrays `host` (master weights, states), on the device."""
  take = lambda tree: jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=True), tree)
  return offload.fetch("params", take(host[0])), offload.fetch("opt_state", take(host[1]))


def stack_layers(offload: HostOffload, chunk, grads, hp, hs, forward: bool):
  """`stream_layers` where the host arrays are typed as device memory: a `lax.scan` whose step i fetches layer
  i + 1, updates layer i and stores it; the stored layers stack in a new host array (the states are in host
  memory twice during the step), and with `forward` their roundings in a new device array."""
  n = jax.tree.leaves(grads)[0].shape[0]
  one = lambda t: jax.tree.map(lambda x: x[0], t)

  def body(cur, xs):
    i, g = xs
    nxt = _fetch_layer(offload, (hp, hs), jnp.minimum(i + 1, n - 1))
    p_new, s_new, sc = chunk(jax.tree.map(lambda x: x[None], g), *cur)
    fwd = one(offload.forward_copy(p_new)) if forward else None
    return nxt, (one(offload.store("params", p_new)), one(offload.store("opt_state", s_new)), sc, fwd)
  _, (p_new, s_new, sc, fwd) = lax.scan(body, _fetch_layer(offload, (hp, hs), 0), (jnp.arange(n), grads))
  return p_new, s_new, [x[0] for x in sc], fwd
