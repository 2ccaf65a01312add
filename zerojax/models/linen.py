"""A flax linen module as a zerojax `Model`, in one statement: `zerojax.from_linen(module, batch, loss_fn)`.

The user keeps their module and their parameter tree and names which submodules are ZeRO units, by type
(`units=(Block,)`) or by path (`"encoder/layers_0"`); an `nn.scan`-ed stack of them becomes one scanned
unit. Parameters outside the named units form one root unit (FSDP's root wrap): they are gathered at the
start of each micro-batch and kept until its backward ends. Inside the executor every call of a unit
module is intercepted (`nn.intercept_methods`) and becomes a `zerojax.engine.unit` call that gathers the
unit's shards, runs the module's own method on them, and reduces its gradient in backward (ZeRO,
Rajbhandari et al. 2020, §5.3). With plain parameters nothing is intercepted: the same loss is the
module's ordinary `apply`, the single-device reference.

The loss is `loss_fn(apply, batch, rng) -> loss` or `(loss, aux)`: `apply(*args, **kwargs)` runs the
module with zerojax supplying its variables, the rngs `linen_rngs(rng, rngs)` and collecting the
`mutable` collections; `rng` is None in `Executor.eval_fn`. Dropout inside a unit draws exactly the
masks the plain `apply` draws (the unit's scope keeps its rng path).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.scope import LazyRng

from zerojax.engine.model import Model
from zerojax.models.checks import bound_axes, check_linen_module, loss_form, rng_streams
from zerojax.engine.unit import ShardedUnit, unit

ROOT = "_root"


@jax.tree_util.register_pytree_node_class
class ShardLeaf:
  """A unit parameter inside the executor: its local shard and gradient sink, where flax expects the
  parameter. Flax's own transforms (`nn.scan`, `nn.remat`) slice and carry it like any pytree; using it as
  an array outside the unit's call is an error."""

  def __init__(self, shard, sink):
    self.shard, self.sink = shard, sink

  def tree_flatten(self):
    return (self.shard, self.sink), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(*children)

  def __jax_array__(self):
    raise TypeError("a parameter of a ZeRO unit is used outside the unit's call (e.g. weight tying with a "
                    "module outside the unit); make the module that reads it part of the same unit, or "
                    "leave both in the root unit (do not list them in `units`)")


def linen_rngs(rng, names: Sequence[str]) -> dict:
  """The rngs `apply` passes to the module for a micro-batch's `rng`: `{name: fold_in(rng, i)}`."""
  return {} if rng is None else {n: jax.random.fold_in(rng, i) for i, n in enumerate(names)}


def to_dict(tree):
  return {k: to_dict(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def split_user(tree, paths: dict) -> dict:
  """The user's params tree -> `{ROOT: the rest, unit name: subtree}` (any leaves)."""
  tree = to_dict(tree)
  units = {name: _get(tree, p) for name, p in paths.items()}

  def rest(t, prefix):
    out = {}
    for k, v in t.items():
      p = prefix + (k,)
      if p in paths.values():
        continue
      v = rest(v, p) if isinstance(v, dict) else v
      if not (isinstance(v, dict) and not v):
        out[k] = v
    return out

  root = rest(tree, ())
  return ({ROOT: root} if jax.tree.leaves(root) else {}) | units


def merge_user(units: dict, paths: dict) -> dict:
  """Inverse of `split_user`."""
  tree = to_dict(units.get(ROOT, {}))
  for name, p in paths.items():
    node = tree
    for k in p[:-1]:
      node = node.setdefault(k, {})
    node[p[-1]] = units[name]
  return tree


def _apply(module, variables, args, kwargs, rngs, mutable, method=None):
  kwargs = dict(kwargs)
  method = kwargs.pop("method", method)
  if mutable:
    return module.apply(variables, *args, rngs=rngs, mutable=list(mutable), method=method, **kwargs)
  return module.apply(variables, *args, rngs=rngs, method=method, **kwargs), {}


def _copy_counters(counters: dict) -> dict:
  """A copy of a flax scope's rng counters (nested dicts keyed by names and child tokens)."""
  return {k: _copy_counters(v) if isinstance(v, dict) else v for k, v in counters.items()}


def _matches(module, path, units) -> bool:
  for u in units:
    if isinstance(u, type) and isinstance(module, u):
      return True
    if isinstance(u, str) and "/".join(path) == u.strip("/"):
      return True
    if isinstance(u, tuple) and tuple(path) == u:
      return True
  return False


def check_unit_state(meta, state, where: str) -> None:
  """A scanned unit whose layers flax calls one by one (nn.scan) cannot get its layer's slice of the
  unit's per-call state (`ShardedUnit.state`: the in-backward components' values, e.g. qgZ's error
  feedback, and stochastic rounding's key)."""
  if state is not None and meta.scanned:
    raise ValueError(f"{where}: grad_error_feedback / stochastic_rounding need each layer's qgZ state, but "
                     "flax calls this scanned unit's layers one by one; make each layer its own unit (units=...) "
                     "or drop them")


def _unit_call(ctx, meta, state, leaves, mutable, args, kwargs):
  """One call of a unit module inside the executor: its own method on the gathered parameters, with the
  unit's per-call state (`ShardedUnit.state`) passed through."""
  check_unit_state(meta, state, "/".join(ctx.module.path))
  m = ctx.module
  method = getattr(type(m), ctx.method_name)
  bare = m.unbind()[0]
  lazy = dict(m.scope.rngs)
  keys = {n: r.rng for n, r in lazy.items()}
  suffixes = {n: r.suffix for n, r in lazy.items()}
  others = {c: v for c, v in m.variables.items() if c != "params"}
  cols = [c for c in mutable if c in others]

  counters, after = _copy_counters(m.scope.rng_counters), {}

  def run(params, others, keys, *a, **k):
    def call(mod, *a2, **k2):
      # The unit's scope as in the plain apply: its rng path and its rng counters, so dropout draws the
      # same masks.
      for n, sfx in suffixes.items():
        mod.scope.rngs[n] = LazyRng(mod.scope.rngs[n].rng, sfx)
      mod.scope.rng_counters = _copy_counters(counters)
      out = method(mod, *a2, **k2)
      after["counters"] = mod.scope.rng_counters
      return out
    return _apply(bare, {"params": params, **others}, a, k, keys, cols, method=call)

  su = ShardedUnit([l.shard for l in leaves], [l.sink for l in leaves], meta, state)
  out, updates = unit(run)(su, others, keys, *args, **kwargs)
  if "counters" in after:  # shared with flax's transforms (nn.scan): update in place
    m.scope.rng_counters.clear()
    m.scope.rng_counters.update(after["counters"])
  for col, values in updates.items():
    for name, v in values.items():
      m.put_variable(col, name, v)
  return out


def _interceptor(metas: dict, mutable):
  def intercept(next_fun, args, kwargs, ctx):
    m = ctx.module
    entry = metas.get(tuple(m.path)) if m.scope is not None and ctx.method_name != "setup" else None
    if entry is None or not callable(getattr(type(m), ctx.method_name, None)):
      return next_fun(*args, **kwargs)
    leaves = jax.tree.leaves(m.variables.get("params", {}), is_leaf=lambda x: isinstance(x, ShardLeaf))
    # Only a call with one layer's shards: an nn.scan-ed unit is intercepted inside flax's scan.
    if not leaves or not all(isinstance(l, ShardLeaf) and l.shard.ndim == 1 for l in leaves):
      return next_fun(*args, **kwargs)
    return _unit_call(ctx, *entry, leaves, mutable, args, kwargs)
  return intercept


def shape_struct(x):
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def from_linen(module: nn.Module, example_batch: Any, loss_fn: Callable, *, units: Sequence = (),
               mutable: Sequence[str] = (), rngs: Sequence[str] = ()) -> Model:
  """Wraps a linen module as a zerojax `Model`.

  Args:
    module: the flax linen module (unbound).
    example_batch: one micro-batch (arrays or `ShapeDtypeStruct`s, leaves `[batch, ...]`); only its
      shapes and dtypes are used, to trace initialisation.
    loss_fn: `loss_fn(apply, batch, rng) -> loss` or `(loss, aux)`, the mean loss of a micro-batch;
      `apply(*args, **kwargs)` runs the module (kwargs such as `train=True` reach it).
    units: the ZeRO units, as module types and/or paths (`"blocks"`, `("encoder", "layers_0")`); the
      outermost match wins. An `nn.scan`-ed module of a listed type is one scanned unit.
    mutable: collections the module updates in training (e.g. `("batch_stats",)`), carried in the train
      state and averaged over the data-parallel devices after each step.
    rngs: rng streams the module draws from in training (e.g. `("dropout",)`).

  Returns:
    The `Model`; `Executor.logical_params` returns the module's `params` tree, and
    `Executor.logical_variables` adds the other collections.

  Raises:
    TypeError: `module` is no linen Module (e.g. a Hugging Face wrapper or another object holding the
      module at `.module` or `.model`: pass that module).
    ValueError: at wrap time, from a trial initialisation and training step traced with `jax.eval_shape`
      (`zerojax.models.checks`): the module draws an rng stream not in `rngs`, `loss_fn` returns no
      scalar loss or `(loss, aux)`, or the module calls a collective over an axis zerojax does not bind.
  """
  check_linen_module(module)
  units, mutable, rngs = tuple(units), tuple(mutable), tuple(rngs)
  example = jax.tree.map(shape_struct, example_batch)

  def init_variables(rng):
    k_init, k_loss = jax.random.split(rng)
    keys = jax.random.split(k_init, len(rngs) + 1)
    init_rngs = {"params": keys[0], **{n: k for n, k in zip(rngs, keys[1:])}}
    box = {}

    def apply(*args, **kwargs):
      if "v" not in box:
        out, box["v"] = module.init_with_output(init_rngs, *args, **kwargs)
        return out
      return _apply(module, box["v"], args, kwargs, linen_rngs(k_loss, rngs), mutable)[0]

    loss_fn(apply, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), example), k_loss)
    if "v" not in box:
      raise ValueError("loss_fn never called `apply`; it must run the module through it")
    return to_dict(box["v"])

  calls = {}

  def record(next_fun, args, kwargs, ctx):
    out = next_fun(*args, **kwargs)
    m = ctx.module
    path = tuple(m.path) if m.scope is not None else ()
    if path and ctx.method_name != "setup" and _matches(m, path, units):
      calls.setdefault(path, jax.tree.map(np.shape, to_dict(m.variables.get("params", {}))))
    return out

  with nn.intercept_methods(record), rng_streams(rngs), bound_axes():
    variables = jax.eval_shape(init_variables, jax.random.key(0))
  params = variables.get("params", {})
  paths, scanned = {}, set()
  for path in sorted(calls, key=len):
    if any(path[:len(p)] == p for p in paths.values()):
      continue  # inside an outer unit
    name = ".".join(path)
    stored = jax.tree.map(np.shape, _get(params, path))
    per_call = calls[path]
    if jax.tree.structure(stored, is_leaf=_is_shape) != jax.tree.structure(per_call, is_leaf=_is_shape):
      raise ValueError(f"unit {name}: its parameters differ between calls; name another module as the unit")
    if stored != per_call:
      lead = {s[0] for s, c in zip(jax.tree.leaves(stored, is_leaf=_is_shape), jax.tree.leaves(
          per_call, is_leaf=_is_shape)) if len(s) == len(c) + 1 and s[1:] == c}
      if len(lead) != 1:
        raise ValueError(f"unit {name}: stored parameter shapes {stored} are neither one call's {per_call} "
                         "nor a stack of them (nn.scan)")
      scanned.add(name)
    paths[name] = path
  if not paths and units:
    raise ValueError(f"no submodule matches units={units}; name module types or paths of `module`")

  def init(rng):
    return split_user(init_variables(rng).get("params", {}), paths)

  def init_state(rng):
    return {c: v for c, v in init_variables(rng).items() if c != "params"}

  def loss(params, batch, rng, state):
    state = dict(state or {})
    tree, metas, sharded = user_tree(params, paths)

    def apply(*args, **kwargs):
      ctx = nn.intercept_methods(_interceptor(metas, mutable)) if sharded else contextlib.nullcontext()
      with ctx:
        out, updates = _apply(module, {"params": tree, **state}, args, kwargs, linen_rngs(rng, rngs), mutable)
      state.update(to_dict(updates))
      return out

    return loss_fn(apply, batch, rng), state

  # A trial training step on the plain parameters: the rng streams the module draws and the loss's form.
  state = {c: v for c, v in variables.items() if c != "params"}
  with rng_streams(rngs), bound_axes():
    has_aux = loss_form(lambda p, b, r, s: loss(p, b, r, s)[0], split_user(params, paths), example,
                        jax.random.key(0), state)
  return Model(init=init, loss=loss, scanned=frozenset(scanned), has_aux=has_aux, rng=True,
               init_state=init_state, to_user=lambda t: merge_user(t, paths),
               from_user=lambda t: split_user(t, paths), example_batch=example)


def _is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def user_tree(params: dict, paths: dict):
  """The user's tree from the executor's `{unit: params}`, each unit's `(meta, state)` by module path (its
  `UnitMeta` and its opaque per-call state, `ShardedUnit.state`), and whether the params are sharded
  (inside the executor: each named unit's leaves become `ShardLeaf`s, the root unit is gathered whole)."""
  sharded = any(isinstance(v, ShardedUnit) for v in params.values())
  if not sharded:
    return merge_user(params, paths), {}, False
  metas, tree = {}, {ROOT: unit(_identity)(params[ROOT])} if ROOT in params else {}
  for name, su in params.items():
    if name != ROOT:
      metas[paths[name]] = (su.meta, su.state)
      tree[name] = jax.tree.unflatten(su.meta.treedef, [ShardLeaf(a, b) for a, b in zip(su.shards, su.sinks)])
  return merge_user(tree, paths), metas, True


def _identity(tree):
  return tree
