"""`scan_layers(f, params, x)`: `x = f(params[i], x)` over the layers of a scanned unit.

With plain params it is `lax.scan`; with a `ShardedUnit` and `prefetch=False` each layer is a
`zerojax.engine.unit` call (it gathers when it runs); with `Schedule.prefetch` the whole stack is one call of
the unit's engine under the call order `zerojax.engine.prefetch.PREFETCH`, which gathers layer i±1 while layer i
computes.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3 (prefetching the next parameters).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import lax

from zerojax.engine.prefetch import PREFETCH
from zerojax.engine.unit import ShardedUnit, check_collectives, sharded_call, unit


def scan_layers(f: Callable, params: Any, x: Any) -> Any:
  """`x` through every layer of a scanned unit: `x = f(params[i], x)` for i = 0 .. L-1.

  Args:
    f: `f(layer_params, x) -> x`, a pure function; `x` is a pytree of float arrays.
    params: the scanned unit's params (leaves `[L, ...]`), or its `ShardedUnit` inside the executor.
    x: the input of layer 0.

  Returns:
    The output of layer L-1. Inside the executor with `Schedule.prefetch` the layers are prefetched (see
    the module docstring); otherwise each layer is a `zerojax.unit(f)` call.
  """
  if not isinstance(params, ShardedUnit):
    return lax.scan(lambda c, p: (f(p, c), None), x, params)[0]
  meta = params.meta
  if not meta.prefetch:
    layer = unit(f)
    return lax.scan(lambda c, p: (layer(p, c), None), x, params)[0]
  if not meta.scanned:
    raise ValueError(f"scan_layers got an unscanned unit (leaves without a layer axis) for "
                     f"{getattr(f, '__qualname__', f)}; call it as zerojax.unit(f)(params, x)")
  check_collectives(f, meta, [x])
  return sharded_call(PREFETCH, f, meta, params.shards, params.sinks, params.state, x)
