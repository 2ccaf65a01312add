"""The optimizer's update of offloaded states on the device, chunk by chunk (`Sharding.offload`,
`offload_update="streamed"`; docs/offload.md, "The update, streamed"), one of the update strategies of
`zerojax.executor.update`.

After the backward, each chunk (a unit, or one layer of a scanned unit: `offload_stream.stream_layers`) has its
master weights and optimizer states fetched from host memory, updated with the whole gradient's global
statistics (`chunked_update.global_scalars`: the clipping's norm) and stored back; with 16-bit weights the new
master weights' rounding stays on the device for the next step's forward (`TrainState.forward`).

References:
  ZeRO-Offload: Ren et al. 2021, §4. Megatron-Core's chunked optimizer-state offloader (per-chunk fetch,
  update and store with two staging slots).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from zerojax.engine import chunked_update
from zerojax.engine.model import user_views
from zerojax.engine.offload_stream import stream_layers
from zerojax.executor.update import Update, Updated
from zerojax.state.stateful import keep
from zerojax.state.train_state import TrainState


class Streamed(Update):
  """The "streamed" update of an `Executor`'s step (`zerojax.executor.update`): offloaded states, updated
  on the device chunk by chunk."""
  widens_per_chunk = True  # each chunk widens its own gradient (`wide`), not all at once

  def __init__(self, *args):
    super().__init__(*args)
    self._chunk_opts = {}

  def __call__(self, host: TrainState, state: TrainState, grads, finite) -> Updated:
    """The optimizer's update with offloaded states, one chunk at a time (docs/offload.md, "The streamed
    update"): a unit, or one layer of a scanned unit (a `lax.scan` over its layers). Each chunk's states
    come to the device, are updated and go back to host memory; a scanned unit fetches layer i + 1 while
    it updates layer i and stores layer i - 1 (`offload_stream.stream_layers`). A unit's fetch waits on the store
    of the unit two before it (and the first two on the gradients), so at most three units' states are on
    the device at once, whatever XLA's scheduler would do. The update's global statistics (the clipping's
    norm) come from the whole gradient before the first chunk (`chunked_update.global_scalars`). -> (new master
    weights, new optimizer states, each in the memory its field lives in; the new master weights' rounding
    the train state keeps on the device, `TrainState.forward`, or None)."""
    off, lay = self.placement.offload, self.layout.tree()
    scalars = chunked_update.global_scalars(self.optimizer.update, self.wide(grads), host.opt_state, host.params)
    # Each chunk widens its own gradient after the norm: XLA would otherwise widen all of them once, for both,
    # and hold that copy through the update (4 bytes per parameter on the device)
    scalars, grads = lax.optimization_barrier((scalars, grads))
    leaves, treedef = jax.tree.flatten(host.opt_state)
    new_leaves, new_params, stored = list(leaves), {}, []
    forward = None if host.forward is None else {}
    for k, u in enumerate(lay):
      scanned = u in self.model.scanned
      cache = self._chunk_opts
      if u not in cache:
        cache[u] = chunked_update.chunk_optimizer(self.user_optimizer, self.layout, u, scanned, *user_views(self.model))
      opt, mine, empty = cache[u]
      hp, hs = host.params[u], [leaves[i] for i in mine]
      _, (hp, hs) = lax.optimization_barrier((stored[k - 2] if k >= 2 else grads, (hp, hs)))

      def chunk(g, p, s, u=u, opt=opt, mine=mine, empty=empty):
        """The update of unit u's chunk (device arrays): -> (master, its states, the scalar states)."""
        fill = lambda tree, x: {v: (x if v == u else jax.tree.map(lambda e: jnp.zeros(e.shape, e.dtype), tree[v]))
                                for v in tree}
        g_t, p_t = fill(empty[0], self.wide(g)), fill(empty[0], p)
        it = iter(s)
        s_t = jax.tree.unflatten(treedef, [next(it) if i in mine else (leaves[i] if not np.ndim(leaves[i])
                                           else jnp.zeros(e.shape, e.dtype)) for i, e in enumerate(empty[1])])
        updates, s_new = chunked_update.run_chunk(opt.update, scalars, g_t, s_t, p_t)
        p_new = optax.apply_updates(p_t[u], updates[u])
        s_new = jax.tree.leaves(s_new)
        old_scalars = [leaves[i] for i in range(len(leaves)) if not np.ndim(leaves[i])]
        return (keep(finite, p_new, p), keep(finite, [s_new[i] for i in mine], list(s)),
                keep(finite, [s_new[i] for i in range(len(leaves)) if not np.ndim(leaves[i])], old_scalars))

      if not scanned:
        p_new, s_new, sc = chunk(grads[u], off.fetch("params", hp), off.fetch("opt_state", hs))
        fwd = off.forward_copy(p_new)  # None where no rounding is kept
        p_new, s_new = off.store("params", p_new), off.store("opt_state", s_new)
      else:
        p_new, s_new, sc, fwd = stream_layers(off, chunk, grads[u], hp, hs,
                                              None if forward is None else host.forward[u])
      if forward is not None:
        forward[u] = fwd
      new_params[u] = p_new
      for i, x in zip(mine, s_new):
        new_leaves[i] = x
      if k == 0:
        for i, x in zip([i for i in range(len(leaves)) if not np.ndim(leaves[i])], sc):
          new_leaves[i] = x
      stored.append((p_new, s_new))
    return Updated(new_params, jax.tree.unflatten(treedef, new_leaves), forward, None)
