"""The ZeRO unit: a function transformation `f(params, *args) -> f_sharded(unit_shards, *args)`.

DESIGN.md, "The ZeRO unit". Model code calls `unit(f)(params, *args)`. With plain (unsharded) params it
is just `f(params, *args)`, so the same model code gives the single-device reference. Inside the
executor's `shard_map` the params are a `ShardedUnit`, and the call becomes a `jax.custom_vjp`:

- forward: all-gather the unit's parameters over the plan's param axes A_p (qwZ: int8/int4 values and
  block scales, dequantized on arrival), run `f`; keep as residual only the local shard (hpZ: the
  secondary shard) and the inputs, never the gathered weights;
- backward: re-gather (hpZ: over the secondary axes only, inside the node), recompute `f`'s VJP, reduce
  the full local gradient over the gradient axes A_g (qgZ: 2-hop quantized all-to-all)
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

from zerojax import comm
from zerojax.layout import LeafLayout, pad_flat, trim_flat
from zerojax.mesh import owner_index
from zerojax.plan import Plan


@dataclasses.dataclass(frozen=True)
class UnitMeta:
  """Static description of one unit inside the executor's shard_map (hashable)."""
  plan: Plan
  axis_sizes: tuple[tuple[str, int], ...]
  treedef: Any
  leaves: tuple[LeafLayout, ...]
  # MiCS §3.4 overlapped: in the last micro-step of a window, the backward also all-reduces the reduced
  # gradient plus the window's accumulation (the sink's value) over these replica axes.
  sync_axes: tuple[str, ...] = ()
  calls: list = dataclasses.field(default_factory=list, init=False, compare=False, hash=False, repr=False)

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


def _gather_flats(meta: UnitMeta, shards: list, backward: bool = False) -> list:
  """The unit's full flat leaves `[padded_i]`, gathered over A_p (quantized with qwZ)."""
  plan = meta.plan
  bits = plan.weight_bits if (not backward or plan.quantize_backward_gather) else None
  return comm.all_gather_unit(shards, plan.param_axes, bits=bits, block=plan.weight_block,
                              backend=plan.kernel_backend, hierarchical=plan.hierarchical)


def _tree(meta: UnitMeta, flats: list) -> Any:
  dtype = meta.plan.compute_dtype or meta.plan.param_dtype
  return jax.tree.unflatten(meta.treedef, [trim_flat(f, l).astype(dtype)
                                           for f, l in zip(flats, meta.leaves)])


def _secondary_shards(meta: UnitMeta, flats: list) -> list:
  """hpZ (ZeRO++ §3.2): this device's slice of each gathered leaf along the secondary axes."""
  axes = meta.plan.secondary_axes
  k, idx = meta.size(axes), owner_index(axes)
  return [lax.dynamic_index_in_dim(f.reshape(k, -1), idx, keepdims=False) for f in flats]


def _reduce(meta: UnitMeta, grads: Any) -> list:
  plan = meta.plan
  dtype = jnp.dtype(plan.reduce_dtype)
  flats = [pad_flat(g.astype(dtype), l)
           for g, l in zip(jax.tree.leaves(grads), meta.leaves)]
  sizes = tuple(dict(meta.axis_sizes)[a] for a in plan.grad_order)
  return comm.reduce_scatter_unit(flats, plan.grad_order, sizes, bits=plan.grad_bits,
                                         block=plan.grad_block, stages=plan.qgz_stages,
                                         backend=plan.kernel_backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sharded_call(f, meta, shards, sinks, *args):
  del sinks
  return f(_tree(meta, _gather_flats(meta, shards)), *args)


def _sharded_fwd(f, meta, shards, sinks, *args):
  flats = _gather_flats(meta, shards)
  # Residual: the primary shard, or with hpZ the secondary shard of the (dequantized) gathered weights,
  # so the backward uses exactly the forward's weights. Never the full gathered weights.
  kept = _secondary_shards(meta, flats) if meta.plan.secondary_axes else shards
  return f(_tree(meta, flats), *args), (kept, args, sinks if meta.sync_axes else None)


def _sharded_bwd(f, meta, residuals, g):
  kept, args, window = residuals
  # The barrier ties the re-gather to the arriving cotangent: XLA can neither merge it with the forward
  # gather (keeping full weights alive across the whole step) nor hoist it early.
  kept, g = lax.optimization_barrier((kept, g))
  if meta.plan.secondary_axes:
    flats = comm.all_gather_unit(kept, meta.plan.secondary_axes, hierarchical=meta.plan.hierarchical)
  else:
    flats = _gather_flats(meta, kept, backward=True)
  _, vjp = jax.vjp(f, _tree(meta, flats), *args)
  dparams, *dargs = vjp(g)
  k_p = meta.size(meta.plan.param_axes)
  dshards = [jnp.zeros((l.padded // k_p,), meta.plan.param_dtype) for l in meta.leaves]
  dsinks = _reduce(meta, dparams)
  if meta.sync_axes:  # the replica all-reduce of this layer, while earlier layers' backward runs
    dsinks = [lax.psum(d + w, meta.sync_axes) for d, w in zip(dsinks, window)]
  return (dshards, dsinks, *dargs)


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
      params.meta.calls.append(f)
      return _sharded_call(f, params.meta, params.shards, params.sinks, *args)
    return f(params, *args)
  return apply
