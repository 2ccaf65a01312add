"""Prefetch inside the layer scan: the next layer's gather and the previous layer's gradient reduction
run beside the current layer's compute (`Plan.prefetch`).

`scan_layers(f, params, x)` runs `x = f(params[i], x)` over the layers of a scanned unit. With plain
params it is `lax.scan`; with a `ShardedUnit` and `prefetch=False` each layer is a `zerojax.unit` call
(it gathers when it runs). With `prefetch=True` the whole stack is one `jax.custom_vjp`:

- forward: layer 0 is gathered before the loop; iteration i gathers layer i+1 into the loop carry while
  layer i computes on the carried weights, so the gather has no data dependence on layer i's compute and
  at most two gathered layers are alive. Residuals as in `zerojax.unit`: each layer's input and the
  primary shard (hpZ: the secondary shard of the gathered weights), never the gathered weights.
- backward: layer L-1 is gathered before the loop; iteration i gathers layer i-1 ahead (hpZ: inside the
  node), reduces layer i+1's gradient (carried unreduced from the previous iteration; qgZ: both hops,
  the cross-node one included) and runs layer i's VJP, recomputing its forward. The last two
  reductions follow the loop. The MiCS in-backward replica all-reduce rides with each reduction.

The first and last layers are peeled out of the loops, so every layer is gathered exactly once per
direction and reduced exactly once: the same collectives as without prefetch, in a different order.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3 and §7 (prefetching the next parameters, overlap).
  ZeRO++: Wang et al. 2023, §3 (the unit's collectives: qwZ, hpZ, qgZ). MiCS: Zhang et al. 2022, §3.4.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zerojax.unit import (ShardedUnit, UnitMeta, check_collectives, gather_flats, ordered_after, params_tree,
                          reduce_and_sync, regather, secondary_shards, shard_cotangents, unit)


def scan_layers(f: Callable, params: Any, x: Any) -> Any:
  """`x` through every layer of a scanned unit: `x = f(params[i], x)` for i = 0 .. L-1.

  Args:
    f: `f(layer_params, x) -> x`, a pure function; `x` is a pytree of float arrays.
    params: the scanned unit's params (leaves `[L, ...]`), or its `ShardedUnit` inside the executor.
    x: the input of layer 0.

  Returns:
    The output of layer L-1. Inside the executor with `Plan.prefetch` the layers are prefetched (see
    the module docstring); otherwise each layer is a `zerojax.unit(f)` call.
  """
  if not isinstance(params, ShardedUnit):
    return lax.scan(lambda c, p: (f(p, c), None), x, params)[0]
  meta = params.meta
  if not meta.plan.prefetch:
    layer = unit(f)
    return lax.scan(lambda c, p: (layer(p, c), None), x, params)[0]
  if not meta.scanned:
    raise ValueError(f"scan_layers got an unscanned unit (leaves without a layer axis) for "
                     f"{getattr(f, '__qualname__', f)}; call it as zerojax.unit(f)(params, x)")
  meta.calls.append(f)
  check_collectives(f, meta, [x])
  return _prefetched(f, meta, params.shards, params.sinks, x)


def _layer(stack: list, i) -> list:
  return [s[i] for s in stack]


def _forward(f, meta: UnitMeta, shards: list, x):
  """(output, each layer's input `[L, ...]`, each layer's kept shard `[L, ...]`)."""
  hpz = bool(meta.plan.secondary_axes)
  w = gather_flats(meta, ordered_after(_layer(shards, 0), x))  # not before the stack's input exists

  def body(carry, next_shards):
    x, w = carry
    w_next = gather_flats(meta, next_shards)  # layer i+1, beside layer i's compute
    kept = secondary_shards(meta, w) if hpz else ()
    return (f(params_tree(meta, w), x), w_next), (x, kept)

  (x_last, w), (xs, kept) = lax.scan(body, (x, w), [s[1:] for s in shards])
  out = f(params_tree(meta, w), x_last)
  append = lambda stack, last: jnp.concatenate([stack, last[None]])
  xs = jax.tree.map(append, xs, x_last)
  kept = [append(k, s) for k, s in zip(kept, secondary_shards(meta, w))] if hpz else shards
  return out, xs, kept


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _prefetched(f, meta, shards, sinks, x):
  del sinks
  return _forward(f, meta, shards, x)[0]


def _prefetched_fwd(f, meta, shards, sinks, x):
  out, xs, kept = _forward(f, meta, shards, x)
  return out, (kept, xs, sinks if meta.sync_axes else None)


def _prefetched_bwd(f, meta, residuals, g):
  kept, xs, window = residuals
  n = kept[0].shape[0]
  gather = lambda k: regather(meta, k)  # hpZ: the secondary shard, inside the node

  def vjp(w, x, g):
    _, pull = jax.vjp(f, params_tree(meta, w), x)
    return pull(g)  # (layer gradient, input cotangent)

  def reduce(dp, win):  # MiCS §3.4: with `win`, this layer's replica all-reduce beside the next backward
    return reduce_and_sync(meta, dp, win)[0]

  x_at = lambda i: jax.tree.map(lambda a: a[i], xs)
  win = lambda i: None if window is None else _layer(window, i)
  # The first gathers wait for the cotangent: not merged with the forward's, nor hoisted.
  w = gather(ordered_after(_layer(kept, n - 1), g))
  if n > 1:
    w_prev = gather(ordered_after(_layer(kept, n - 2), g))
  dp, g = vjp(w, x_at(n - 1), g)
  if n == 1:
    dsinks = [d[None] for d in reduce(dp, win(0))]
  else:
    def body(carry, layer):  # layer i = n-2 .. 1
      g, w, dp_next = carry
      k_prev, x, win_next = layer
      w_prev = gather(k_prev)               # layer i-1, ahead
      ds_next = reduce(dp_next, win_next)   # layer i+1's gradient
      dp, g = vjp(w, x, g)                  # layer i
      return (g, w_prev, dp), ds_next

    rest = ([k[:n - 2] for k in kept], jax.tree.map(lambda a: a[1:n - 1], xs),
            None if window is None else [a[2:] for a in window])
    (g, w, dp1), ds_top = lax.scan(body, (g, w_prev, dp), rest, reverse=True)
    ds1 = reduce(dp1, win(1))
    dp0, g = vjp(w, x_at(0), g)
    ds0 = reduce(dp0, win(0))
    dsinks = [jnp.concatenate([a[None], b[None], c]) for a, b, c in zip(ds0, ds1, ds_top)]
  return shard_cotangents(meta, n), dsinks, g


_prefetched.defvjp(_prefetched_fwd, _prefetched_bwd)
