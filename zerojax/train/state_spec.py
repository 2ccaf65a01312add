"""Checkpoints of the train state with orbax, in a logical layout that restores onto any mesh or plan.

A checkpoint holds what a run needs to continue: the fp32 master parameters, the optimizer states, the
step, the count of skipped steps, the data seed and, for models that have them, the run's rng and the
mutable collections (BatchNorm statistics). The step is also the data position: batches are a
pure function of `(seed, step)` (`zerojax.data`). Parameters, and every optimizer-state leaf that has a
parameter's flat shape, are stored in the model's own shapes without padding; scalars (counts) as they
are. Nothing stored depends on the mesh, the process count or the plan, so a checkpoint restores onto
any of them: orbax reads each array straight into the target's shardings (every process reads only
what its devices hold), then the target executor's layout flattens, pads and shards it. State that an
executor derives from the master weights is never stored.

The state of a stateful component (`zerojax.state.stateful`) is stored under the component's name as the
component declares it (`Stateful.stored`: each leaf's stored shape, dtype, sharding and conversions, the
saved shapes it also restores from, its value when a checkpoint lacks it). A checkpoint without a
component's state restores into a run that has the component (it starts fresh); one with a component's
state does not restore into a run without it (`Stateful.refuse_restore` says why).

The conversion to the logical layout is a jitted function whose outputs stay sharded over the devices
(no gather to one host), so every process writes only its own shards. Saving is asynchronous: the
training loop is blocked only while the logical copy is made and handed to host memory; the writes run
in the background and are atomic (a step folder appears only once complete). One checkpoint folder:

  DIR/<step>/state/   the logical arrays: {"params", "opt_state", "step", "skipped"[, "rng", "mutable",
                      one entry per stateful component]}
  DIR/<step>/meta/    JSON: format, step, plan, mesh and process count at save time, seed

References:
  Orbax checkpointing: https://orbax.readthedocs.io/en/latest/guides/checkpoint/checkpoint_manager.html
  ZeRO: Rajbhandari et al. 2020, §5 (partitioned optimizer states, parameters and gradients).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.engine import layout as layout_lib, logical as logical_lib
from zerojax.state.stateful import Stored
from zerojax.state.train_state import STATEFUL

FORMAT = 1
SEP = "/"
STORED = ("step", "params", "opt_state", "skipped", "rng", "mutable", "stateful")  # TrainState fields that are state
DERIVED = ("forward",)  # TrainState fields rebuilt from the stored ones on restore (`Executor.derive`)
COMPONENTS = "stateful"  # the field whose mapping holds each component's state, stored under the component's name


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete, or does not match the run that restores it."""


# -- the logical layout ------------------------------------------------------------------------------

class _Leaf(NamedTuple):
  names: tuple[str, ...]                  # path in the stored tree, e.g. ("opt_state", "1", "0", "mu", ...)
  layout: layout_lib.LeafLayout | None    # the parameter layout of a flat leaf; None for a scalar
  shape: tuple[int, ...]                  # stored (logical) shape
  dtype: Any
  sharding: NamedSharding                 # of the logical array on the executor's mesh
  kind: str = "flat"                      # "flat", "scalar", or "component" (a stateful component's)
  stored: Stored | None = None            # how a component's leaf is stored (`Stateful.stored`)
  replicated: bool = False                # leads with a replica axis (`Placement.fields`, DiLoCo)


class _Spec:
  """How one executor's train state maps to the stored tree and back."""

  def __init__(self, executor):
    shapes = jax.eval_shape(executor.init_from_flat, executor.flat_shapes())
    self.shardings = executor.shardings(shapes)
    self.derive = executor.derive
    by_path = {layout_lib.path_names(p): lay for p, lay in jax.tree_util.tree_flatten_with_path(
        executor.layout.tree(), is_leaf=layout_lib.is_layout)[0]}
    # Optimizer states are named by the user's tree (e.g. flax's params), which the optimizer sees.
    params = [(layout_lib.path_names(p), lay) for p, lay in jax.tree_util.tree_flatten_with_path(
        executor.user_layout(), is_leaf=layout_lib.is_layout)[0]]
    fields = tuple(f.name for f in dataclasses.fields(shapes))
    if sorted(fields) != sorted(STORED + DERIVED):
      raise CheckpointError(f"TrainState has fields {fields} but checkpoints store {STORED}: add a new field to "
                            "zerojax.train.state_spec.STORED if it is state, or rebuild it after `restore` if "
                            "derived")
    leaves, self.treedef = jax.tree_util.tree_flatten_with_path(shapes.replace(**dict.fromkeys(DERIVED)))
    axes, mesh = executor.plan.sharding.opt_order, executor.mesh
    where = executor.placement  # one copy per replica (DiLoCo): its `fields` lead with the replica axis
    self.components = set(executor.stateful)
    stored = {n: iter(c.stored()) for n, c in executor.stateful.items()}  # in the order of the state's leaves
    self.leaves = []
    for path, x in leaves:
      names = layout_lib.path_names(path)
      if names[0] == COMPONENTS:  # a component's state is stored at the top level, under its name
        names = names[1:]
      if names[0] in stored:
        s = next(stored[names[0]])
        self.leaves.append(_Leaf(names, None, s.shape, s.dtype, s.sharding, kind="component", stored=s))
        continue
      replicated = names[0] in where.fields
      base = tuple(x.shape[1:]) if replicated else tuple(x.shape)
      if names[0] == "params":
        lay = by_path[names[1:]]
      elif names[0] != "opt_state" or len(base) == 0:
        lay = None
      else:
        lay = self._owner(names, base, params)
      shape = lay.logical_shape if lay else base
      sharding = layout_lib.logical_sharding(mesh, axes, shape)
      if replicated:  # stored [replicas, *logical shape], each replica on its own node
        shape, sharding = (x.shape[0],) + shape, NamedSharding(mesh, where.spec(*sharding.spec))
      self.leaves.append(_Leaf(names, lay, shape, np.dtype(x.dtype), sharding, kind="flat" if lay else "scalar",
                               replicated=replicated))
    seen = {}
    for leaf in self.leaves:
      key = SEP.join(leaf.names)
      if key in seen:
        raise CheckpointError(f"train-state leaves {seen[key]} and {leaf.names} both store as {key!r}; "
                              "give the optimizer state or the params distinct names")
      seen[key] = leaf.names

  def convert(self, x, leaf: _Leaf, to_logical: bool):
    """One stored leaf to its logical form (`to_logical`) or back into the executor's layout."""
    if leaf.kind == "scalar":
      return x
    if leaf.kind == "component":
      return leaf.stored.to_logical(x) if to_logical else leaf.stored.from_logical(x)
    fn = layout_lib.unflatten_leaf if to_logical else layout_lib.flatten_leaf
    return jax.vmap(lambda y: fn(y, leaf.layout))(x) if leaf.replicated else fn(x, leaf.layout)

  @staticmethod
  def _owner(names, shape, params):
    """The layout of the parameter an optimizer-state leaf belongs to: its path ends with the param's."""
    match = logical_lib.param_owners(names, params, lambda lay: lay.flat_shape() == shape)
    if len(match) != 1:
      raise CheckpointError(
          f"optimizer state leaf {SEP.join(names)} of shape {shape} belongs to no single parameter (no "
          "parameter's path ends its path); it cannot be stored in the logical layout. Use an optax "
          "optimizer whose states mirror the params' tree (adamw, lion, sgd, masked, chain)")
    return match[0]

  def nest(self, values) -> dict:
    return _nested((leaf.names, v) for leaf, v in zip(self.leaves, values))

  def unnest(self, tree: dict) -> list:
    out = []
    for leaf in self.leaves:
      d = tree
      for n in leaf.names:
        d = d[n]
      out.append(d)
    return out

  def expected(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {SEP.join(l.names): (l.shape, l.dtype) for l in self.leaves}

  def abstract(self, saved: dict | None = None) -> dict:
    """The restore target of the stored leaves in `saved` (default all); a component's leaf saved in
    another shape it accepts (e.g. another number of replicas) is read in its saved shape."""
    out = []
    for l in self.leaves:
      key = SEP.join(l.names)
      if saved is not None and key not in saved:
        continue
      if l.kind == "component" and saved is not None and tuple(saved[key][0]) != l.shape:
        shape = tuple(saved[key][0])
        out.append((l.names, jax.ShapeDtypeStruct(shape, l.dtype, sharding=l.stored.read_sharding(shape))))
      elif l.replicated and saved is not None and tuple(saved[key][0]) != l.shape:  # another number of replicas
        shape = tuple(saved[key][0])
        out.append((l.names, jax.ShapeDtypeStruct(shape, l.dtype, sharding=NamedSharding(
            l.sharding.mesh, P(None, *tuple(l.sharding.spec)[1:])))))
      else:
        out.append((l.names, jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=l.sharding)))
    return _nested(out)

  def resize(self, tree: dict) -> dict:
    """`tree` with each replica leaf saved with another number of replicas (DiLoCo on another number of
    nodes) brought to this run's: the first rows kept, the rows of nodes beyond them dropped, a new
    row made by `new_row` (the rule of merging and splitting replicas, `zerojax.train.replica`)."""
    values = self.unnest(tree)
    seeds = seed_params(self)
    changed = [i for i, (l, x) in enumerate(zip(self.leaves, values)) if l.replicated and x.shape[0] != l.shape[0]]
    if not changed:
      return tree

    def fit(xs):
      out = list(xs)
      for i in changed:
        l, x, n = self.leaves[i], xs[i], self.leaves[i].shape[0]
        if x.shape[0] >= n:
          out[i] = x[:n]
        else:
          row = new_row(l, x[0], xs[seeds[i]] if i in seeds else None)
          out[i] = jax.numpy.concatenate([x, jax.numpy.broadcast_to(row, (n - x.shape[0],) + row.shape)])
      return out

    shardings = [l.sharding if i in changed else None for i, l in enumerate(self.leaves)]
    return self.nest(jax.jit(fit, out_shardings=shardings)(values))

  def complete(self, tree: dict) -> dict:
    """`tree` with the component leaves it lacks (a checkpoint saved without the component) made fresh."""
    values = []
    for l in self.leaves:
      d = tree
      for n in l.names:
        d = d.get(n) if isinstance(d, dict) else None
      values.append(l.stored.fresh() if d is None else d)
    return self.nest(values)


def seed_params(spec: _Spec) -> dict[int, int]:
  """Index of each replica leaf `params/...` -> index of the component leaf a joining replica starts it
  from (`Stored.seeds_replicas`: `<component>/<part>/...`, e.g. DiLoCo's global parameters)."""
  seeds = {SEP.join(l.names[2:]): i for i, l in enumerate(spec.leaves)
           if l.kind == "component" and l.stored is not None and l.stored.seeds_replicas}
  return {i: seeds[SEP.join(l.names[1:])] for i, l in enumerate(spec.leaves)
          if l.names[0] == "params" and SEP.join(l.names[1:]) in seeds}


def new_row(leaf: _Leaf, first, seed=None):
  """The row of a per-node leaf for a node that joins (traced): its master weights start from `seed`, the
  component leaf that seeds replicas (DiLoCo's global parameters: every replica restarts from them at a
  sync, Algorithm 1), the skip count
  and a component's state (Radius's residual) from their fresh value, anything else (the inner optimizer
  state) from the first node's row `first`."""
  if leaf.kind == "component" or leaf.names[0] == "skipped":
    return jax.numpy.full(first.shape, leaf.stored.fill if leaf.stored else 0, first.dtype)
  if leaf.names[0] == "params" and seed is not None:
    return seed.astype(first.dtype)
  return first


def _nested(pairs) -> dict:
  """`{a: {b: value}}` from `((a, b), value)` pairs."""
  out = {}
  for names, v in pairs:
    d = out
    for n in names[:-1]:
      d = d.setdefault(n, {})
    d[names[-1]] = v
  return out


_SPECS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def state_spec_of(executor) -> _Spec:
  if executor not in _SPECS:
    spec = _Spec(executor)
    spec.to_logical = jax.jit(
        lambda state: spec.nest([spec.convert(x, l, True) for x, l in zip(
            jax.tree.leaves(state.replace(**dict.fromkeys(DERIVED))), spec.leaves)]),
        out_shardings=spec.nest([l.sharding for l in spec.leaves]))
    spec.from_logical = jax.jit(
        lambda tree: spec.derive(jax.tree.unflatten(spec.treedef, [
            spec.convert(x, l, False) for x, l in zip(spec.unnest(tree), spec.leaves)])),
        out_shardings=spec.shardings)
    _SPECS[executor] = spec
  return _SPECS[executor]


def logical_state(executor, state) -> dict:
  """The train state as stored: `{"params", "opt_state", "step", "skipped"}` in the model's shapes.

  The arrays stay sharded over the executor's mesh (each device keeps a slice); nothing is gathered.
  """
  return state_spec_of(executor).to_logical(state)


def state_from_logical(executor, tree: dict):
  """Inverse of `logical_state` for `executor`: flattens, pads and shards into its `TrainState`."""
  return state_spec_of(executor).from_logical(tree)


def check_compatible(spec: _Spec, saved: dict, where: str) -> None:
  """Raises a `CheckpointError` naming the stored leaves that do not match the target run.

  A stateful component's leaves may be absent (a checkpoint without the component: they start fresh) or
  saved in another shape the component accepts (`Stored.accepts`); the state of a component this run
  does not have is an error (`Stateful.refuse_restore`).
  """
  want = spec.expected()
  for kind in STATEFUL:
    extra = sorted(k for k in set(saved) - set(want) if k.startswith(kind.name + SEP))
    if extra and kind.name not in spec.components:
      raise CheckpointError(kind.refuse_restore(where, extra[0]))
  saved = dict(saved)
  for l in spec.leaves:
    k = SEP.join(l.names)
    if l.kind == "component" and (k not in saved or l.stored.restores(saved[k][0])):
      saved[k] = (want[k][0], saved[k][1] if k in saved else want[k][1])
    elif l.replicated and k in saved and tuple(saved[k][0])[1:] == want[k][0][1:]:  # rows resized (`resize`)
      saved[k] = (want[k][0], saved[k][1])
  fmt = lambda sd: f"shape {tuple(sd[0])} {np.dtype(sd[1])}"
  order = lambda keys: sorted(keys, key=lambda k: (not k.startswith("params"), k))  # params first
  groups = [
      [f"{k}: saved {fmt(saved[k])}, expected {fmt(want[k])}" for k in order(set(want) & set(saved))
       if (tuple(saved[k][0]), np.dtype(saved[k][1])) != want[k]],
      [f"{k}: expected {fmt(want[k])}, but the checkpoint has no such leaf" for k in order(set(want) - set(saved))],
      [f"{k}: saved {fmt(saved[k])}, but this run has no such leaf" for k in order(set(saved) - set(want))]]
  if not any(groups):
    return
  lines = []
  for group in groups:
    lines += group[:6] + ([f"... and {len(group) - 6} more like this"] if len(group) > 6 else [])
  opt_only = all(line.startswith(("opt_state", "...")) for line in lines)
  hint = "the optimizer differs from the one" if opt_only else "the model differs from the one"
  raise CheckpointError(f"checkpoint {where} does not match this run ({hint} it was saved with; restore "
                        "with the same model config and optimizer: only the mesh, the process count and the "
                        "plan may change):\n  " + "\n  ".join(lines))


def saved_leaves(tree, prefix=()) -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(saved_leaves(v, prefix + (str(k),)))
    else:
      out[SEP.join(prefix + (str(k),))] = (tuple(v.shape), np.dtype(v.dtype))
  return out


