"""The ZeRO unit: a function transformation `f(params, *args) -> f_sharded(unit_shards, *args)`.

DESIGN.md, "The ZeRO unit". Model code calls `unit(f)(params, *args)`. With plain (unsharded) params it
is just `f(params, *args)`, so the same model code gives the single-device reference. Inside the
executor's `shard_map` the params are a `ShardedUnit`, and the call becomes a `jax.custom_vjp`:

- forward: all-gather the unit's parameters over the plan's param axes A_p, run `f`; keep as residual
  only the local shard and the inputs, never the gathered weights;
- backward: re-gather, recompute `f`'s VJP, reduce the full local gradient over the gradient axes A_g
  and return it as the cotangent of the unit's *gradient sink*, a zero placeholder shaped like the G
  shard. The executor differentiates with respect to the sinks, so A_g may shard more finely than A_p
  (ZeRO-2, AMSP) while the gradient is still reduced layer by layer inside the backward pass.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3. ZeRO++: Wang et al. 2023, §3 (the unit's collectives).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from zerojax import collectives
from zerojax.layout import LeafLayout
from zerojax.plan import Plan


@dataclasses.dataclass(frozen=True)
class UnitMeta:
  """Static description of one unit inside the executor's shard_map (hashable)."""
  plan: Plan
  axis_sizes: tuple[tuple[str, int], ...]
  treedef: Any
  leaves: tuple[LeafLayout, ...]

  def size(self, axes: tuple[str, ...]) -> int:
    sizes = dict(self.axis_sizes)
    return math.prod(sizes[a] for a in axes)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class ShardedUnit:
  """A unit's parameters as the model code sees them inside the executor.

  Attributes:
    shards: list of local parameter shards `[padded / |A_p|]` (param dtype), one per leaf.
    sinks: list of zero gradient sinks `[padded / |A_g|]` (reduce dtype), one per leaf.
    meta: static `UnitMeta`.
  For a scanned unit every array has a leading layer axis; `lax.scan` over a `ShardedUnit` slices it.
  """
  shards: list
  sinks: list
  meta: UnitMeta

  def tree_flatten(self):
    return (self.shards, self.sinks), self.meta

  @classmethod
  def tree_unflatten(cls, meta, children):
    return cls(*children, meta)


def _gather(meta: UnitMeta, shards: list) -> Any:
  flats = collectives.all_gather_unit(shards, meta.plan.param_axes)
  leaves = [f[:l.size].reshape(l.shape) for f, l in zip(flats, meta.leaves)]
  return jax.tree.unflatten(meta.treedef, leaves)


def _reduce(meta: UnitMeta, grads: Any) -> list:
  dtype = jnp.dtype(meta.plan.reduce_dtype)
  flats = [jnp.pad(g.astype(dtype).reshape(-1), (0, l.padded - l.size))
           for g, l in zip(jax.tree.leaves(grads), meta.leaves)]
  axes = meta.plan.grad_order
  return collectives.reduce_scatter_unit(flats, axes, meta.size(axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sharded_call(f, meta, shards, sinks, *args):
  del sinks
  return f(_gather(meta, shards), *args)


def _sharded_fwd(f, meta, shards, sinks, *args):
  del sinks
  return f(_gather(meta, shards), *args), (shards, args)


def _sharded_bwd(f, meta, residuals, g):
  shards, args = residuals
  # The barrier ties the re-gather to the arriving cotangent: XLA can neither merge it with the forward
  # gather (keeping full weights alive across the whole step) nor hoist it early.
  shards, g = lax.optimization_barrier((shards, g))
  _, vjp = jax.vjp(f, _gather(meta, shards), *args)
  dparams, *dargs = vjp(g)
  dshards = [jnp.zeros_like(s) for s in shards]
  return (dshards, _reduce(meta, dparams), *dargs)


_sharded_call.defvjp(_sharded_fwd, _sharded_bwd)


def unit(f: Callable) -> Callable:
  """Turns `f(params, *args)` into a ZeRO unit (see the module docstring).

  Args:
    f: a pure function of a params pytree and further arguments.

  Returns:
    `g(params, *args)`: `f(params, *args)` for plain params; for a `ShardedUnit`, the sharded call whose
    parameters are gathered in forward and backward and whose gradient is reduced in backward.
  """
  @functools.wraps(f)
  def apply(params, *args):
    if isinstance(params, ShardedUnit):
      return _sharded_call(f, params.meta, params.shards, params.sinks, *args)
    return f(params, *args)
  return apply
