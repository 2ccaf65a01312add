"""A flax NNX module as a zerojax `Model`: `zerojax.from_nnx(module_or_constructor, batch, loss_fn)`.

As `zerojax.from_linen`: the user names the ZeRO units by module type or path, keeps their module and
parameter tree (`nnx.to_pure_dict` of the `nnx.Param` state), and writes `loss_fn(apply, batch, rng) ->
loss or (loss, aux)`. Parameters outside the units form the root unit (FSDP's root wrap). Inside the
executor the model is rebuilt (`nnx.merge`) each micro-batch with every unit's parameters left as shards;
a call of a unit instance (`__call__`) becomes a `zerojax.engine.unit` call that rebuilds the unit from its
gathered parameters, runs it, and writes its other state (BatchNorm statistics, rng counts) back into the
model (ZeRO, Rajbhandari et al. 2020, §5.3).

Each micro-batch the model's rng streams named in `rngs` are reseeded with `linen_rngs(rng, rngs)`
(`nnx.reseed`), so the unsharded reference is `nnx.reseed(model, **linen_rngs(rng, rngs)); model(...)`.
The `mutable` collections ("batch_stats" is `nnx.BatchStat`; or `nnx.Variable` types) are carried in the
train state and averaged over the data-parallel devices after each step; other non-parameter state (the
rng streams) is rebuilt each micro-batch. Units must be called through `__call__`, and NNX stacks made
with `nnx.scan`/`nnx.vmap` are not split into scanned units (list the stack's parent, or use linen's
`nn.scan`). Passing a constructor `rngs -> module` creates the parameters already sharded, one unit at
a time; a built module's current parameters are used as they are.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.engine.model import Model
from zerojax.models.checks import check_nnx_module, loss_form
from zerojax.models.linen import (ShardLeaf, check_unit_state, linen_rngs, merge_user, shape_struct, split_user,
                                  to_dict, user_tree)
from zerojax.engine.unit import ShardedUnit, unit

_COLLECTIONS = {"batch_stats": nnx.BatchStat, "params": nnx.Param}


def _collections(mutable: Sequence) -> dict:
  """`{name: nnx.Variable type}` of the mutable collections ("batch_stats" or types, named by class)."""
  cols = {m if isinstance(m, str) else m.__name__: _COLLECTIONS.get(m, m) for m in mutable}
  if not all(isinstance(t, type) and issubclass(t, nnx.Variable) for t in cols.values()):
    raise ValueError(f"mutable={tuple(mutable)}: name nnx.Variable types or 'batch_stats'")
  return cols


def _matches(node, path, units) -> bool:
  for u in units:
    if isinstance(u, type) and isinstance(node, u):
      return True
    if isinstance(u, str) and "/".join(map(str, path)) == u.strip("/"):
      return True
    if isinstance(u, tuple) and tuple(path) == u:
      return True
  return False


def _fill(state):
  """Values for abstract non-parameter, non-mutable state (rng streams): zeros and key(0)."""
  def value(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.key(0) if x.shape == () else jax.random.split(jax.random.key(0), x.shape)
    return jnp.zeros(x.shape, x.dtype)
  return jax.tree.map(value, state)


def _with_values(template, pure: dict):
  state = jax.tree.map(lambda x: x, template)
  nnx.replace_by_pure_dict(state, pure)
  return state


@contextlib.contextmanager
def _intercept(instances: dict):
  """Makes calls of the given unit instances (`id -> meta`) ZeRO unit calls, for the duration."""
  classes = {type(node) for node, _ in instances.values()}
  saved = {c: c.__dict__.get("__call__") for c in classes}

  def wrap(cls):
    orig = cls.__call__

    def call(self, *args, **kwargs):
      entry = instances.get(id(self))
      if entry is None or entry[0] is not self:
        return orig(self, *args, **kwargs)
      return _unit_call(self, entry[1], orig, args, kwargs)
    return call

  try:
    for c in classes:
      c.__call__ = wrap(c)
    yield
  finally:
    for c, f in saved.items():
      if f is None:
        del c.__call__
      else:
        c.__call__ = f


def _unit_call(module, entry, orig, args, kwargs):
  """One call of a unit module inside the executor, with its `(meta, per-call state)` from `user_tree`."""
  meta, state = entry
  check_unit_state(meta, state, type(module).__name__)
  gdef, params, rest = nnx.split(module, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  leaves = jax.tree.leaves(pure, is_leaf=lambda x: isinstance(x, ShardLeaf))

  def run(p, rest, *a, **k):
    # Values may arrive as numpy constants (e.g. residuals), which NNX would update in place.
    rest = jax.tree.map(jnp.asarray, rest)
    mod = nnx.merge(gdef, _with_values(params, p), rest)
    out = orig(mod, *a, **k)
    return out, nnx.state(mod, nnx.Not(nnx.Param))

  su = ShardedUnit([l.shard for l in leaves], [l.sink for l in leaves], meta, state)
  out, new_rest = unit(run)(su, rest, *args, **kwargs)
  nnx.update(module, new_rest)
  return out


def from_nnx(module: nnx.Module | Callable[[nnx.Rngs], nnx.Module], example_batch: Any, loss_fn: Callable,
             *, units: Sequence = (), mutable: Sequence = (), rngs: Sequence[str] = ()) -> Model:
  """Wraps an NNX module (or a constructor `rngs -> module`) as a zerojax `Model`.

  Args:
    module: the NNX module, or a function of an `nnx.Rngs` building it (sharded initialisation).
    example_batch: one micro-batch (arrays or `ShapeDtypeStruct`s, leaves `[batch, ...]`).
    loss_fn: `loss_fn(apply, batch, rng) -> loss` or `(loss, aux)`; `apply(*args, **kwargs)` calls the
      module (kwargs such as `deterministic=False` reach it).
    units: the ZeRO units, as module types and/or paths (`"blocks/0"`, `("blocks", 0)`); the outermost
      match wins.
    mutable: state the module updates in training, as collection names ("batch_stats") or `nnx.Variable`
      types, carried in the train state and averaged over the data-parallel devices after each step.
    rngs: rng streams reseeded for every micro-batch (e.g. `("dropout",)`).

  Returns:
    The `Model`; `Executor.logical_params` returns `nnx.to_pure_dict` of the module's `nnx.Param` state.

  Raises:
    TypeError: `module` is neither (e.g. a linen Module, or an object holding the module at `.module` or
      `.model`: pass that module).
    ValueError: at wrap time, from a training step traced with `jax.eval_shape`: `loss_fn` returns no
      scalar loss or `(loss, aux)`.
  """
  check_nnx_module(module)
  units, rngs = tuple(units), tuple(rngs)
  cols = _collections(mutable)
  example = jax.tree.map(shape_struct, example_batch)
  build = module if not isinstance(module, nnx.Module) else None

  def split(m):  # graphdef, params, {collection: state}, the rest
    graphdef, params, *states, rest = nnx.split(m, nnx.Param, *cols.values(), ...)
    return graphdef, params, dict(zip(cols, states)), rest

  pure = lambda states: {c: to_dict(nnx.to_pure_dict(v)) for c, v in states.items()}

  def make(rng):
    keys = jax.random.split(rng, len(rngs) + 1)
    return build(nnx.Rngs(keys[0], **{n: k for n, k in zip(rngs, keys[1:])}))

  abstract = nnx.eval_shape(lambda: make(jax.random.key(0))) if build else module
  graphdef, p_abs, m_abs, o_abs = split(abstract)
  paths = {}
  for path, node in nnx.iter_graph(abstract):
    if path and isinstance(node, nnx.Module) and _matches(node, path, units):
      paths[tuple(path)] = ".".join(map(str, path))
  outer = {p: n for p, n in paths.items() if not any(p[:len(q)] == q and p != q for q in paths)}
  paths = {n: p for p, n in outer.items()}
  if not paths and units:
    raise ValueError(f"no submodule matches units={units}; name module types or paths of the module")
  if not build:
    _, p_val, m_val, _ = split(module)
    p_val, m_val = to_dict(nnx.to_pure_dict(p_val)), pure(m_val)

  def init(rng):
    if build:
      return split_user(to_dict(nnx.to_pure_dict(split(make(rng))[1])), paths)
    return split_user(p_val, paths)

  def init_state(rng):
    return pure(split(make(rng))[2]) if build else m_val

  def loss(params, batch, rng, state):
    box = {"state": state}
    tree, metas, sharded = user_tree(params, paths)

    def apply(*args, **kwargs):
      states = [_with_values(m_abs[c], box["state"][c]) for c in cols]
      m = nnx.merge(graphdef, _with_values(p_abs, tree), *states, _fill(o_abs))
      if rng is not None and rngs:
        nnx.reseed(m, **linen_rngs(rng, rngs))
      instances = {}
      for path, node in nnx.iter_graph(m):
        if tuple(path) in metas:
          instances[id(node)] = (node, metas[tuple(path)])
      with _intercept(instances) if instances else contextlib.nullcontext():
        out = m(*args, **kwargs)
      box["state"] = {c: to_dict(nnx.to_pure_dict(nnx.state(m, t))) for c, t in cols.items()}
      return out

    return loss_fn(apply, batch, rng), box["state"]

  has_aux = loss_form(lambda p, s, b, r: loss(p, b, r, s)[0], init(jax.random.key(0)) if not build else
                      jax.eval_shape(init, jax.random.key(0)), init_state(jax.random.key(0)) if not build
                      else jax.eval_shape(init_state, jax.random.key(0)), example, jax.random.key(0))
  return Model(init=init, loss=loss, scanned=frozenset(), has_aux=has_aux, rng=True, init_state=init_state,
               to_user=lambda t: merge_user(t, paths), from_user=lambda t: split_user(t, paths),
               example_batch=example)
