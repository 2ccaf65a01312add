"""The ZeRO unit: a function transformation `f(params, *args) -> f_sharded(unit_shards, *args)`.

docs/DESIGN.md, "The ZeRO unit". Model code calls `unit(f)(params, *args)`. With plain (unsharded) params it
is just `f(params, *args)`, so the same model code gives the single-device reference. Inside the
executor's `shard_map` the params are a `ShardedUnit`, and the call becomes a `jax.custom_vjp`:

- forward: all-gather the unit's parameters over A_p (qwZ: int8/int4 values and
  block scales, dequantized on arrival), run `f`; keep as residual only the local shard (hpZ: the
  secondary shard) and the inputs, never the gathered weights;
- backward: re-gather (hpZ: over the secondary axes only, inside the node), recompute `f`'s VJP (or,
  with `Schedule.remat` "dots"/"none", reuse the activations the forward saved: `zerojax.engine.remat`), reduce
  the full local gradient over the gradient axes A_g (qgZ: 2-hop quantized all-to-all)
  and return it as the cotangent of the unit's *gradient sink*, a zero placeholder shaped like the G
  shard. The executor differentiates with respect to the sinks, so A_g may shard more finely than A_p
  (ZeRO-2, AMSP) while the gradient is still reduced layer by layer inside the backward pass.

The collectives are the plan's components (`zerojax.engine.components`: `ParamGather`, `GradReduction`), bound
to the unit's leaves in its `UnitMeta`; the unit never reads the plan. That `custom_vjp`,
`sharded_call`, is the one engine of every unit: a `CallOrder` orders the components above (gather,
`call_forward`, re-gather, `call_backward`, `reduce_and_sync`); `ONE_CALL` runs one call,
`zerojax.engine.prefetch.PREFETCH` a scanned unit's layers with the next layer's gather in flight.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3. ZeRO++: Wang et al. 2023, §3 (the unit's collectives).
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerojax.engine import remat
from zerojax.engine.components import GradReduction, ParamGather
from zerojax.engine.jaxpr_walk import sub_jaxprs
from zerojax.engine.layout import LeafLayout


@dataclasses.dataclass(frozen=True)
class UnitMeta:
  """Static description of one unit inside the executor's shard_map (hashable): the plan's components
  (`zerojax.engine.components`) bound to the unit's leaves.

  Attributes:
    gather, reduction: the unit's `ParamGather` and `GradReduction`.
    remat: the remat mode (`Schedule.remat` resolved); `prefetch` whether `scan_layers` prefetches.
    prefetch_optional: prefetch is the platform's default, not the user's setting: a scanned unit whose
      layers are called one by one (flax `nn.scan`, a user's `lax.scan`) runs per layer instead of
      raising (the step's probe lists it: `zerojax.executor.step.Probe`).
    axis_sizes: the mesh's `(axis, size)` pairs.
    treedef, leaves: the unit's parameter tree and its leaves' layouts.
    sync_axes: MiCS §3.4 overlapped: in the last micro-step of a window, the backward also all-reduces
      the reduced gradient plus the window's accumulation (the sink's value) over these replica axes.
    scanned: leaves lead with a layer axis (a scanned unit).
  """
  gather: ParamGather
  reduction: GradReduction
  remat: str
  prefetch: bool
  axis_sizes: tuple[tuple[str, int], ...]
  treedef: Any
  leaves: tuple[LeafLayout, ...]
  sync_axes: tuple[str, ...] = ()
  scanned: bool = False
  prefetch_optional: bool = False


class StateKey(abc.ABC):
  """A component that carries per-unit state through the units' backward, and the typed key of that state
  (equinox's `StateIndex`: the component owns its key; the engine names no state). The step puts the
  component's value for each unit in `UnitState.keyed` under the component itself; the unit's backward
  gives the value back to it (`backward`) and returns the new value, under the same key, as the old
  value's cotangent: the state the next micro-step gets (so values are inexact arrays: an integer's
  cotangent is float0). Keys sort by their class's name, so a unit's state flattens alike in every trace,
  and hash by identity (a dataclass key keeps `eq=False`)."""

  def error(self, value):
    """What `value` gives the unit's gradient reduction as the errors it adds back (qgZ's error feedback,
    LoCo §3), or None; at most one key of a unit gives them."""
    return None

  @abc.abstractmethod
  def backward(self, value, grads, reduced, dropped):
    """After one call's gradient reduction: the new value, shaped as `value`, from `grads` (the unit's
    local gradient tree), `reduced` (its chunks reduced over A_g) and `dropped` (what the reduction's
    quantizations dropped given `error`'s errors; None without them)."""

  def __lt__(self, other):
    name = lambda k: f"{type(k).__module__}.{type(k).__qualname__}"
    return name(self) < name(other)


class UnitState(NamedTuple):
  """A unit's per-call state (`ShardedUnit.state`).

  Attributes:
    keyed: `{StateKey: value}`, the per-unit state of each component carried through the backward (a
      scanned unit's values lead with the layer axis).
    seed: the gradient reduction's stochastic-rounding key data (`GradReduction.seeds`), or None.
  """
  keyed: dict
  seed: Any = None


def state_cotangent(state: UnitState | None, new: dict) -> UnitState | None:
  """The cotangent of a unit's `state`: each key's new value, zero (float0) for the rounding key."""
  if state is None:
    return None
  seed = None if state.seed is None else np.zeros(state.seed.shape, jax.dtypes.float0)
  return UnitState(new, seed)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class ShardedUnit:
  """A unit's parameters as the model code sees them inside the executor.

  Attributes:
    shards: list of local parameter shards `[padded / |A_p|]` (param dtype), one per leaf.
    sinks: list of zero gradient sinks `[padded / |A_g|]` (reduce dtype), one per leaf.
    meta: static `UnitMeta`.
    state: the unit's per-call `UnitState`; the backward returns `state_cotangent` as its cotangent.
      None when the step carries none.
  For a scanned unit every array has a leading layer axis; `lax.scan` over a `ShardedUnit` slices it.
  """
  shards: list
  sinks: list
  meta: UnitMeta
  state: UnitState | None = None

  def tree_flatten(self):
    return (self.shards, self.sinks, self.state), self.meta

  @classmethod
  def tree_unflatten(cls, meta, children):
    shards, sinks, state = children
    return cls(shards, sinks, meta, state)


def params_tree(meta: UnitMeta, flats: list) -> Any:
  return meta.gather.params(meta.treedef, meta.leaves, flats)


def reduce_and_sync(meta: UnitMeta, dparams: Any, window: list | None, state: UnitState | None = None):
  """`(reduced chunks, {StateKey: new value})`: the gradient reduced over A_g (with the errors a key of
  `state` gives and its rounding seed), each key's new value; with `window` (the accumulated sinks of the
  window's last micro-step) also all-reduced over the replica axes, the sync of MiCS §3.4 overlapped with
  the rest of the backward (`sync_replicas`). `PREFETCH` calls the two halves apart (window None, then
  `sync_replicas`), to let layer i's backward wait between them."""
  keyed, seed = state if state is not None else ({}, None)
  errors = [e for e in (k.error(v) for k, v in keyed.items()) if e is not None]
  if len(errors) > 1:
    raise ValueError(f"{sorted(type(k).__name__ for k in keyed)}: more than one gives the unit's gradient "
                     "reduction errors to add back; it adds back one")
  dsinks, dropped = meta.reduction(dparams, meta.leaves, errors[0] if errors else None, seed)
  new = {k: k.backward(v, dparams, dsinks, dropped) for k, v in keyed.items()}
  return sync_replicas(meta, dsinks, window), new


def sync_replicas(meta: UnitMeta, dsinks: list, window: list | None) -> list:
  """The second half of `reduce_and_sync`: the reduced chunks plus the window's accumulation, all-reduced
  over the replica axes (`meta.sync_axes`); the chunks as they are without `window`."""
  if window is None:
    return dsinks
  return [lax.psum(d + w, meta.sync_axes) for d, w in zip(dsinks, window)]


def shard_cotangents(meta: UnitMeta, layers: int | None = None) -> list:
  """Zero cotangents of the parameter shards: the gradient leaves through the sinks."""
  return meta.gather.cotangents(meta.leaves, layers)


def call_forward(f, meta: UnitMeta, flats: list, args: tuple, differentiated: bool = True):
  """One call of `f` on the gathered weights `flats`: `(out, saved)`, `saved` being what its backward needs
  under `Schedule.remat`: the inputs ("full"; in host memory under "offloaded") or the forward's
  activations without the weights (`remat.forward`, "dots" / "none"); None when the call is not
  differentiated."""
  mode = meta.remat
  if not differentiated or remat.recomputes(mode):
    return f(params_tree(meta, flats), *args), (remat.keep_inputs(mode, args) if differentiated else None)
  return remat.forward(f, mode, params_tree(meta, flats), *args)


def call_backward(f, meta: UnitMeta, flats: list, saved, g):
  """`(parameter gradient, input cotangents)` of one call, on the re-gathered weights `flats`:
  recomputing the forward ("full", "offloaded") or reusing its saved activations."""
  if isinstance(saved, remat.Saved):  # remat "dots" / "none": the forward's vjp, re-gathered weights in
    vjp = saved.vjp_with(params_tree(meta, flats))
  else:
    _, vjp = jax.vjp(f, params_tree(meta, flats), *remat.inputs_back(meta.remat, saved))
  dparams, *dargs = vjp(g)
  return dparams, dargs


def ordered_after(tree, dep):
  """`tree` plus a zero computed from `dep`: a data dependency XLA keeps (the CPU pipeline drops
  optimization barriers before CSE and loop-invariant code motion). A unit's gathers then run only once
  its input (forward) or its cotangent (backward) exists, so an unscanned unit's full weights are neither
  shared by its forward and backward nor hoisted out of the micro-batch loop: they live while it runs.
  The zero comes from the bits of one element of `dep`, so it is +0.0 even where `dep` is inf or NaN."""
  for x in jax.tree.leaves(dep):
    if x.size and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) and x.dtype != jax.dtypes.float0:
      v = x.reshape(-1)[0]
      if jnp.issubdtype(v.dtype, jnp.inexact):
        v = lax.bitcast_convert_type(v.real, jnp.dtype(f"uint{8 * v.real.dtype.itemsize}"))
      z = v.astype(jnp.float32) * 0.0
      return jax.tree.map(lambda y: y + z.astype(y.dtype), tree)
  return tree


class CallOrder(NamedTuple):
  """The order in which `sharded_call` runs a unit's components (gather, `call_forward`, re-gather,
  `call_backward`, `reduce_and_sync`).

  forward(f, meta, shards, args, differentiated) -> (out, residual)
  backward(f, meta, residual, window, state, g) -> (shard cotangents, reduced chunks, new state, dargs)
  """
  forward: Callable
  backward: Callable


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def sharded_call(order: CallOrder, f, meta, shards, sinks, state, *args):
  """The one engine of a unit: `order`'s forward and backward as a `jax.custom_vjp` whose
  differentiated inputs are the shards, the gradient sinks, the unit's state and `args`. The shards'
  cotangent is zero, the sinks' is the reduced gradient, the state's each key's new value
  (`state_cotangent`)."""
  del sinks, state
  return order.forward(f, meta, shards, args, False)[0]


def _engine_fwd(order, f, meta, shards, sinks, state, *args):
  out, residual = order.forward(f, meta, shards, args, True)
  return out, (residual, sinks if meta.sync_axes else None, state)


def _engine_bwd(order, f, meta, residuals, g):
  residual, window, state = residuals
  dshards, dsinks, new, dargs = order.backward(f, meta, residual, window, state, g)
  return (dshards, dsinks, state_cotangent(state, new), *dargs)


sharded_call.defvjp(_engine_fwd, _engine_bwd)


def _one_forward(f, meta, shards, args, differentiated):
  """The unit's call order, forward: gather (once its inputs exist), compute, keep the residual: the
  primary shard or with hpZ the secondary shard, and `call_forward`'s saved values; never the gathered
  weights."""
  if not differentiated:
    return call_forward(f, meta, meta.gather.forward(shards), args, False)
  # A gather that moves nothing returns the shards themselves: there is nothing to order.
  flats = meta.gather.forward(ordered_after(shards, args) if meta.gather.moves else shards)
  kept = meta.gather.keep(shards, flats)
  out, saved = call_forward(f, meta, flats, args)
  return out, (kept, saved, _scalars(out))


def _scalars(out):
  """A unit's output when it is scalars only (the loss and its metrics), else None: the backward waits
  for it on GPUs, so XLA computes the loss where the forward ends instead of at the end of the step,
  and the unit's forward-gathered weights are not kept alive through the backward's layer loop."""
  leaves = jax.tree.leaves(out)
  return out if leaves and all(getattr(x, "size", 2) == 1 for x in leaves) else None


def _one_backward(f, meta, residual, window, state, g):
  """The unit's call order, backward: re-gather once the cotangent exists, VJP, reduce (and sync)."""
  kept, saved, out = residual
  if not meta.gather.moves:  # nothing is gathered (dp, zero1, zero2, any plan on one device): no order to keep
    dparams, dargs = call_backward(f, meta, meta.gather.backward(kept), saved, g)
    dsinks, new = reduce_and_sync(meta, dparams, window, state)
    return shard_cotangents(meta), dsinks, new, dargs
  if out is not None:  # on GPUs only; XLA:CPU's program is left as it was
    g = lax.platform_dependent(g, out, cpu=lambda c, o: c, default=ordered_after)
  # The barrier ties the re-gather to the arriving cotangent: XLA can neither merge it with the forward
  # gather (keeping full weights alive across the whole step) nor hoist it early.
  kept, g = lax.optimization_barrier((kept, g))
  kept = ordered_after(kept, g)
  # On GPUs also to the unit's inputs: the head's cotangent is the loss seed, a constant that alone lets
  # XLA:GPU gather the head's weights at the step's start (merged with the embedding's forward gather).
  # XLA:CPU merges the head's two gathers into one instead; its program is left as it was.
  kept = lax.platform_dependent(kept, saved, cpu=lambda k, a: k, default=ordered_after)
  dparams, dargs = call_backward(f, meta, meta.gather.backward(kept), saved, g)
  dsinks, new = reduce_and_sync(meta, dparams, window, state)
  return shard_cotangents(meta), dsinks, new, dargs


ONE_CALL = CallOrder(_one_forward, _one_backward)


class _Bound:
  """`f(params, *args, **kwargs)` with the non-array arguments of one call bound, called as
  `g(params, *arrays)`: Python values (`train=True`, `None`, strings) stay static for the custom VJP."""

  def __init__(self, f, treedef, static):
    self.f, self.treedef, self.static = f, treedef, static

  def __call__(self, params, *arrays):
    it = iter(arrays)
    args, kwargs = jax.tree.unflatten(self.treedef, [next(it) if s is _ARRAY else s for s in self.static])
    return self.f(params, *args, **kwargs)


_ARRAY = object()
_COLLECTIVE_PARAMS = ("axes", "axis_name")


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _collective_axes(jaxpr) -> set:
  found = set()
  for eqn in jaxpr.eqns:
    for k in _COLLECTIVE_PARAMS:
      v = eqn.params.get(k)
      found |= {a for a in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(a, str)}
    for sub, _ in sub_jaxprs(eqn):
      found |= _collective_axes(sub)
  return found


def check_collectives(f, meta: UnitMeta, arrays) -> None:
  """Raises if `f` calls a collective over an axis of the mesh (zerojax's own) or an unbound one."""
  dtype = meta.gather.compute_dtype
  tree = jax.tree.unflatten(meta.treedef, [jax.ShapeDtypeStruct(l.shape, dtype) for l in meta.leaves])
  name = getattr(f.f if isinstance(f, _Bound) else f, "__qualname__", repr(f))
  fix = ("zerojax owns the mesh axes for sharding and averages mutable collections (batch_stats) over the "
         "data-parallel devices after each step: drop the unit's collective (e.g. BatchNorm's axis_name)")
  try:
    jaxpr = jax.make_jaxpr(f)(tree, *arrays)
  except NameError as e:
    raise ValueError(f"unit {name} calls a collective over an axis that is not bound inside zerojax's step "
                     f"({e}); {fix}") from None
  owned = _collective_axes(jaxpr.jaxpr) & {a for a, _ in meta.axis_sizes}
  if owned:
    raise ValueError(f"unit {name} calls a collective over the mesh axes {sorted(owned)}; {fix}")


def unit(f: Callable) -> Callable:
  """Turns `f(params, *args, **kwargs)` into a ZeRO unit (see the module docstring).

  Args:
    f: a pure function of a params pytree and further arguments. Array arguments (positional or
      keyword) are differentiated; any other argument (`train=True`, `None`, a string) is static.

  Returns:
    `g(params, *args, **kwargs)`: `f(params, *args, **kwargs)` for plain params; for a `ShardedUnit`, the
    sharded call whose parameters are gathered in forward and backward and whose gradient is reduced in
    backward.

  Raises:
    ValueError: `f` calls a collective over a mesh axis (zerojax's) or over an axis that is not bound.
  """
  @functools.wraps(f)
  def apply(params, *args, **kwargs):
    if isinstance(params, ShardedUnit):
      meta = params.meta  # a scanned unit's layers one by one under the default prefetch: per layer
      if meta.prefetch and meta.scanned and not meta.prefetch_optional:
        raise ValueError(f"prefetch=True: a scanned unit's layers are called one by one (lax.scan or "
                         f"flax nn.scan) by {getattr(f, '__qualname__', f)}; run the stack with "
                         "zerojax.scan_layers(f, params, x), or set prefetch=False")
      leaves, treedef = jax.tree.flatten((args, kwargs))
      g = _Bound(f, treedef, tuple(_ARRAY if _is_array(x) else x for x in leaves))
      arrays = [x for x in leaves if _is_array(x)]
      check_collectives(g, params.meta, arrays)
      return sharded_call(ONE_CALL, g, params.meta, params.shards, params.sinks, params.state, *arrays)
    return f(params, *args, **kwargs)
  return apply
