"""Prefetch inside the layer scan: the next layer's gather and the previous layer's gradient reduction
run beside the current layer's compute (`Schedule.prefetch`).

`zerojax.engine.scan_layers` runs a scanned unit's whole stack, with `prefetch=True`, as one call of the unit's
engine (`zerojax.engine.unit.sharded_call`) under the call order `PREFETCH` defined here, which orders the same components
(`ParamGather.forward`, `call_forward`, `ParamGather.backward`, `call_backward`, `reduce_and_sync`) across layers:

- forward: layer 0 is gathered before the loop; iteration i gathers layer i+1 into the loop carry while
  layer i computes on the carried weights, so the gather has no data dependence on layer i's compute and
  at most two gathered layers are alive. Residuals as in `zerojax.engine.unit`, per layer: the primary shard
  (hpZ: the secondary shard of the gathered weights) and what `Schedule.remat` keeps (the layer's input, or
  its activations), never the gathered weights.
- backward: layer L-1 is gathered before the loop; iteration i gathers layer i-1 ahead (hpZ: inside the
  node), reduces layer i+1's gradient (carried unreduced from the previous iteration; qgZ: both hops,
  the cross-node one included, with that layer's slice of the reduction's state) and runs
  layer i's VJP. The last two reductions follow the loop. The MiCS in-backward replica all-reduce rides
  with each reduction; it needs the reduction's result, so under remat "full" layer i's cotangent waits
  for layer i+1's reduced gradient (an optimization barrier): the reduction runs beside layer i's
  recomputed forward and the all-reduce over the replicas beside its backward (`_reduce_beside`).

The first and last layers are peeled out of the loops, so every layer is gathered exactly once per
direction and reduced exactly once: the same collectives as without prefetch, in a different order.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3 and §7 (prefetching the next parameters, overlap).
  ZeRO++: Wang et al. 2023, §3 (the unit's collectives: qwZ, hpZ, qgZ). MiCS: Zhang et al. 2022, §3.4.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from zerojax.engine import remat
from zerojax.engine.unit import (CallOrder, UnitMeta, call_backward, call_forward, ordered_after, reduce_and_sync,
                          shard_cotangents, sync_replicas)


def _at(tree, i):
  """Layer (or layers) `i` of a stacked pytree; None stays None."""
  return jax.tree.map(lambda a: a[i], tree)


def _forward(f, meta: UnitMeta, shards: list, args: tuple, differentiated: bool):
  """The forward over the layers; residual: each layer's kept shard `[L, ...]` and `call_forward`'s
  saved values, stacked for layers 0 .. L-2 and separate for layer L-1."""
  (x,) = args
  gather = meta.gather
  hpz = bool(gather.secondary)
  w = gather.forward(ordered_after(_at(shards, 0), x))  # not before the stack's input exists

  def body(carry, next_shards):
    x, w = carry
    w_next = gather.forward(next_shards)  # layer i+1, beside layer i's compute
    kept = gather.secondary_shards(w) if hpz else ()
    x, saved = call_forward(f, meta, w, (x,), differentiated)
    return (x, w_next), (kept, saved)

  (x, w), (kept, saved) = lax.scan(body, (x, w), _at(shards, slice(1, None)))
  out, last = call_forward(f, meta, w, (x,), differentiated)
  if hpz:
    kept = [jnp.concatenate([k, s[None]]) for k, s in zip(kept, gather.secondary_shards(w))]
  return out, ((kept if hpz else shards), saved, last)


def _reduce_beside(meta: UnitMeta, dp, window, state, g):
  """Layer i+1's gradient reduction (and replica sync), to run beside layer i's VJP, whose cotangent is
  `g`: `((chunks, the reduction's new state), g)`.

  With the in-backward sync (`window`) the all-reduce over the replicas needs the reduction's result:
  left alone, XLA:GPU schedules the reduction beside all of layer i's compute and the all-reduce after
  it, beside nothing. Under remat "full" layer i's VJP first recomputes its forward, which does not need
  `g`; so `g` and the reduced chunks pass one optimization barrier: the reduction runs beside the
  recomputed forward, the all-reduce (the slow, cross-node link) beside the backward. Values are
  untouched (XLA:CPU drops the barrier; its numbers stay bitwise). Under "dots" / "none" the whole VJP
  needs `g`, and the barrier would leave the reduction and the gather without compute: the all-reduce
  follows the reduction as before. (Issuing the all-reduce an iteration later instead peels one more
  layer out of the loop: a 4-layer stack keeps a loop of one trip, which XLA inlines, and its combiners
  then merge every layer's collectives into one each, overlapping nothing.)"""
  chunks, new = reduce_and_sync(meta, dp, None, state)
  if window is not None and remat.recomputes(meta.remat):
    g, chunks = lax.optimization_barrier((g, chunks))
  return (sync_replicas(meta, chunks, window), new), g


def _backward(f, meta: UnitMeta, residual, window, state, g):
  """The backward over the layers, each layer's gradient reduced while the next layer's VJP runs."""
  kept, saved, last = residual
  n = kept[0].shape[0]
  layer = lambda dp, i: reduce_and_sync(meta, dp, _at(window, i), _at(state, i))  # (chunks, new state)
  # The first gathers wait for the cotangent: not merged with the forward's, nor hoisted.
  w = meta.gather.backward(ordered_after(_at(kept, n - 1), g))
  if n > 1:
    w_prev = meta.gather.backward(ordered_after(_at(kept, n - 2), g))
  dp, (g,) = call_backward(f, meta, w, last, g)
  if n == 1:
    reduced = _at(layer(dp, 0), None)
  else:
    def body(carry, xs):  # layer i = n-2 .. 1
      g, w, dp_next = carry
      k_prev, saved_i, win_next, state_next = xs
      w_prev = meta.gather.backward(k_prev)                                      # layer i-1, ahead
      reduced_next, g = _reduce_beside(meta, dp_next, win_next, state_next, g)  # layer i+1's gradient
      dp, (g,) = call_backward(f, meta, w, saved_i, g)                           # layer i
      return (g, w_prev, dp), reduced_next

    rest = (_at(kept, slice(0, n - 2)), _at(saved, slice(1, n - 1)), _at(window, slice(2, None)),
            _at(state, slice(2, None)))
    (g, w, dp1), top = lax.scan(body, (g, w_prev, dp), rest, reverse=True)
    one, g = _reduce_beside(meta, dp1, _at(window, 1), _at(state, 1), g)
    dp0, (g,) = call_backward(f, meta, w, _at(saved, 0), g)
    reduced = jax.tree.map(lambda a, b, c: jnp.concatenate([a[None], b[None], c]), layer(dp0, 0), one, top)
  dsinks, new = reduced
  return shard_cotangents(meta, n), dsinks, new, [g]


PREFETCH = CallOrder(_forward, _backward)
