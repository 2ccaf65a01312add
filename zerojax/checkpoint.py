"""Checkpoints of the train state with orbax, in a logical layout that restores onto any mesh or plan.

A checkpoint holds what a run needs to continue: the fp32 master parameters, the optimizer states, the
step, the count of skipped steps and the data seed. The step is also the data position: batches are a
pure function of `(seed, step)` (`zerojax.data`). Parameters, and every optimizer-state leaf that has a
parameter's flat shape, are stored in the model's own shapes without padding; scalars (counts) as they
are. Nothing stored depends on the mesh, the process count or the plan, so a checkpoint restores onto
any of them: orbax reads each array straight into the target's shardings (every process reads only
what its devices hold), then the target executor's layout flattens, pads and shards it. State that an
executor derives from the master weights is never stored.

The conversion to the logical layout is a jitted function whose outputs stay sharded over the devices
(no gather to one host), so every process writes only its own shards. Saving is asynchronous: the
training loop is blocked only while the logical copy is made and handed to host memory; the writes run
in the background and are atomic (a step folder appears only once complete). One checkpoint folder:

  DIR/<step>/state/   the logical arrays: {"params", "opt_state", "step", "skipped"}
  DIR/<step>/meta/    JSON: format, step, plan, mesh and process count at save time, seed

References:
  Orbax checkpointing: https://orbax.readthedocs.io/en/latest/guides/checkpoint/checkpoint_manager.html
  ZeRO: Rajbhandari et al. 2020, §5 (partitioned optimizer states, parameters and gradients).
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import layout as layout_lib

FORMAT = 1
SEP = "/"
STORED = ("step", "params", "opt_state", "skipped")  # the TrainState fields that are state, not derived


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete, or does not match the run that restores it."""


# -- the logical layout ------------------------------------------------------------------------------

def _name(entry) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _names(path) -> tuple[str, ...]:
  return tuple(_name(e) for e in path)


def _flat_shape(lay: layout_lib.LeafLayout) -> tuple[int, ...]:
  return ((lay.layers,) if lay.layers else ()) + (lay.padded,)


def _logical_shape(lay: layout_lib.LeafLayout) -> tuple[int, ...]:
  return ((lay.layers,) if lay.layers else ()) + lay.shape


def _logical_sharding(mesh: Mesh, axes: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
  """Shards a logical array over `axes` (or one of them) on its largest divisible dimension."""
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  groups = ([axes] if axes else []) + ([(a,) for a in axes] if len(axes) > 1 else [])
  for group in groups:
    k = math.prod(sizes[a] for a in group)
    for d in sorted(range(len(shape)), key=lambda i: -shape[i]):
      if shape[d] % k == 0:
        spec = [None] * len(shape)
        spec[d] = group if len(group) > 1 else group[0]
        return NamedSharding(mesh, P(*spec))
  return NamedSharding(mesh, P())


class _Leaf(NamedTuple):
  names: tuple[str, ...]                  # path in the stored tree, e.g. ("opt_state", "1", "0", "mu", ...)
  layout: layout_lib.LeafLayout | None    # the parameter layout of a flat leaf; None for a scalar
  shape: tuple[int, ...]                  # stored (logical) shape
  dtype: Any
  sharding: NamedSharding                 # of the logical array on the executor's mesh


class _Spec:
  """How one executor's train state maps to the stored tree and back."""

  def __init__(self, executor):
    shapes = jax.eval_shape(executor._init_from_flat, executor._flat_shapes())
    self.shardings = executor.shardings(shapes)
    params = [(_names(p), lay) for p, lay in jax.tree_util.tree_flatten_with_path(
        executor.layout.tree(), is_leaf=layout_lib.is_layout)[0]]
    by_path = dict(params)
    fields = tuple(f.name for f in dataclasses.fields(shapes))
    if sorted(fields) != sorted(STORED):
      raise CheckpointError(f"TrainState has fields {fields} but checkpoints store {STORED}: add a new field "
                            "to checkpoint.STORED if it is state, or rebuild it after `restore` if derived")
    leaves, self.treedef = jax.tree_util.tree_flatten_with_path(shapes)
    axes = executor.plan.opt_order
    self.leaves = []
    for path, x in leaves:
      names = _names(path)
      if names[0] == "params":
        lay = by_path[names[1:]]
      elif x.ndim == 0:
        lay = None
      else:
        lay = self._owner(names, tuple(x.shape), params)
      shape = _logical_shape(lay) if lay else tuple(x.shape)
      self.leaves.append(_Leaf(names, lay, shape, np.dtype(x.dtype), _logical_sharding(executor.mesh, axes, shape)))
    seen = {}
    for leaf in self.leaves:
      key = SEP.join(leaf.names)
      if key in seen:
        raise CheckpointError(f"train-state leaves {seen[key]} and {leaf.names} both store as {key!r}; "
                              "give the optimizer state or the params distinct names")
      seen[key] = leaf.names

  @staticmethod
  def _owner(names, shape, params):
    """The layout of the parameter an optimizer-state leaf belongs to: its path ends with the param's."""
    match = [lay for p, lay in params if names[-len(p):] == p and _flat_shape(lay) == shape]
    if len(match) != 1:
      match = [lay for _, lay in params if _flat_shape(lay) == shape]
    if len(match) != 1:
      raise CheckpointError(
          f"optimizer state leaf {SEP.join(names)} of shape {shape} belongs to no single parameter (no "
          "parameter's path ends its path); it cannot be stored in the logical layout. Use an optax "
          "optimizer whose states mirror the params' tree (adamw, lion, sgd, masked, chain)")
    return match[0]

  def nest(self, values) -> dict:
    out = {}
    for leaf, v in zip(self.leaves, values):
      d = out
      for n in leaf.names[:-1]:
        d = d.setdefault(n, {})
      d[leaf.names[-1]] = v
    return out

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

  def abstract(self) -> dict:
    return self.nest([jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=l.sharding) for l in self.leaves])


_SPECS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _spec(executor) -> _Spec:
  if executor not in _SPECS:
    spec = _Spec(executor)
    spec.to_logical = jax.jit(
        lambda state: spec.nest([layout_lib.unflatten_leaf(x, l.layout) if l.layout else x
                                 for x, l in zip(jax.tree.leaves(state), spec.leaves)]),
        out_shardings=spec.nest([l.sharding for l in spec.leaves]))
    spec.from_logical = jax.jit(
        lambda tree: jax.tree.unflatten(spec.treedef, [
            layout_lib.flatten_leaf(x, l.layout) if l.layout else x
            for x, l in zip(spec.unnest(tree), spec.leaves)]),
        out_shardings=spec.shardings)
    _SPECS[executor] = spec
  return _SPECS[executor]


def logical_state(executor, state) -> dict:
  """The train state as stored: `{"params", "opt_state", "step", "skipped"}` in the model's shapes.

  The arrays stay sharded over the executor's mesh (each device keeps a slice); nothing is gathered.
  """
  return _spec(executor).to_logical(state)


def state_from_logical(executor, tree: dict):
  """Inverse of `logical_state` for `executor`: flattens, pads and shards into its `TrainState`."""
  return _spec(executor).from_logical(tree)


def _check_compatible(spec: _Spec, saved: dict, where: str) -> None:
  """Raises a `CheckpointError` naming the stored leaves that do not match the target run."""
  want = spec.expected()
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


def _saved_leaves(tree, prefix=()) -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_saved_leaves(v, prefix + (str(k),)))
    else:
      out[SEP.join(prefix + (str(k),))] = (tuple(v.shape), np.dtype(v.dtype))
  return out


# -- the checkpoint folder ---------------------------------------------------------------------------

class Checkpointer:
  """A folder of train-state checkpoints: saves asynchronously, keeps the last `max_to_keep`.

  Every process calls every method (saving is collective); each writes only its own shards.

  Args:
    directory: the checkpoint folder (created unless `read_only`).
    max_to_keep: how many of the latest checkpoints to keep; None keeps all.
    asynchronous: write in the background (the loop is blocked only for the device-to-host copy).
    read_only: open an existing folder to restore from; never writes or deletes.
  """

  def __init__(self, directory: str, *, max_to_keep: int | None = 3, asynchronous: bool = True,
               read_only: bool = False):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep} (train.keep_checkpoints in gin) must be at least 1, or "
                       "None to keep every checkpoint")
    self.directory = os.path.abspath(directory)
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(f"checkpoint folder {self.directory} does not exist; pass the workdir of a run "
                            "that saved checkpoints, or its checkpoints/ folder")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep, save_interval_steps=0 if read_only else 1,
        create=not read_only, read_only=read_only,
        cleanup_tmp_directories=not read_only, enable_async_checkpointing=asynchronous)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, executor, state, **meta) -> bool:
    """Starts saving `state` at its step; returns False if that step is already saved.

    Args:
      executor: the executor whose layout `state` is in.
      state: the `TrainState`.
      **meta: JSON-serialisable fields stored with it (e.g. `seed=0`), returned by `restore`.
    """
    step = int(state.step)
    if step in self._manager.all_steps():
      return False
    info = {"format": FORMAT, "step": step, "plan": executor.plan.name,
            "mesh": {str(k): int(v) for k, v in executor.mesh.shape.items()},
            "process_count": jax.process_count(), **meta}
    tree = logical_state(executor, state)
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                     meta=ocp.args.JsonSave(info)), force=True)
    return True

  def restore(self, executor, step: int | None = None):
    """Restores the checkpoint at `step` (default the latest) into `executor`'s layout and shardings.

    Returns:
      `(state, meta)`: the `TrainState` and the JSON fields saved with it.

    Raises:
      CheckpointError: no checkpoint, an incomplete one, or one of another model or optimizer.
    """
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory} (it has no finished step folder); pass "
                            "the workdir of a run that saved checkpoints, or its checkpoints/ folder")
    step = max(steps) if step is None else step
    if step not in steps:
      raise CheckpointError(f"no checkpoint of step {step} in {self.directory}; it has steps {sorted(steps)}")
    where = os.path.join(self.directory, str(step))
    spec = _spec(executor)
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      saved = self._manager.item_metadata(step).state
      saved = _saved_leaves(dict(getattr(saved, "tree", saved)))
    except Exception as e:  # orbax and tensorstore raise many types for missing or broken files
      raise self._broken(where, e) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise CheckpointError(f"checkpoint {where} has metadata {meta!r}, not format {FORMAT} of "
                            "zerojax.checkpoint; it was not written by this version of zerojax")
    _check_compatible(spec, saved, where)
    try:
      tree = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(spec.abstract()))).state
    except Exception as e:
      raise self._broken(where, e) from e
    state = spec.from_logical(tree)
    if int(state.step) != step:
      raise CheckpointError(f"checkpoint {where} holds step {int(state.step)}, not {step}; the folder "
                            "was renamed or mixed up with another")
    return state, meta

  @staticmethod
  def _broken(where: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"checkpoint {where} is incomplete or damaged and cannot be read "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); delete "
                           "that step folder to restore the one before it")

  def wait(self) -> None:
    """Blocks until every started save is written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Finishes pending saves and releases orbax's threads."""
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def find_checkpoints(path: str) -> str:
  """The checkpoint folder of `path`: `path/checkpoints` for a workdir written by train.py, else `path`."""
  sub = os.path.join(path, "checkpoints")
  return sub if os.path.isdir(sub) else path


class Resumed(NamedTuple):
  state: Any
  meta: dict
  directory: str


def resume(executor, checkpointer: Checkpointer, restore_from: str | None = None) -> Resumed | None:
  """The state a run continues from: the latest checkpoint of its own folder, else of `restore_from`.

  Args:
    executor: the target executor (any mesh, process count or plan).
    checkpointer: the run's own checkpoint folder.
    restore_from: another run's workdir or checkpoint folder, used when the run's own folder is empty.

  Returns:
    The restored state, its metadata and folder; None when there is nothing to resume (a fresh run).

  Raises:
    CheckpointError: `restore_from` is given but holds no readable, matching checkpoint.
  """
  if checkpointer.latest_step() is not None:
    state, meta = checkpointer.restore(executor)
    return Resumed(state, meta, checkpointer.directory)
  if restore_from:
    with Checkpointer(find_checkpoints(restore_from), read_only=True) as source:
      state, meta = source.restore(executor)
    return Resumed(state, meta, source.directory)
  return None


# -- stopping on SIGTERM -----------------------------------------------------------------------------

class StopSignal:
  """Turns SIGTERM into a request to stop cleanly after the current step (a context manager).

  A second SIGTERM acts as if no handler were installed. With several processes, `requested()` is
  true on all of them as soon as one received the signal, so they all save the same step.
  """

  def __init__(self, signals=(signal.SIGTERM,)):
    self.signals, self._flag, self._previous = tuple(signals), False, {}

  def _handle(self, signum, frame):
    self._flag = True
    signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

  def install(self) -> "StopSignal":
    """Installs the handler (only the main thread can; elsewhere signals keep their handlers)."""
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def uninstall(self) -> None:
    """Puts back the handlers that were installed before."""
    for s, h in self._previous.items():
      signal.signal(s, h)
    self._previous = {}

  def __enter__(self) -> "StopSignal":
    return self.install()

  def __exit__(self, *exc) -> None:
    self.uninstall()

  def requested(self) -> bool:
    if jax.process_count() == 1:
      return self._flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array([self._flag]))))


# -- export ------------------------------------------------------------------------------------------

def export_params(executor, state, path: str | None = None) -> dict:
  """The master weights as plain numpy arrays in the model's shapes; also written to `path` (.npz).

  Every process must call it (the arrays are gathered); only process 0 writes the file, whose keys are
  the leaves' paths joined by "/" (e.g. "blocks/qkv/kernel"; `load_params` rebuilds the tree).
  """
  params = executor.logical_params(state)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    params = multihost_utils.process_allgather(params, tiled=True)
  params = jax.tree.map(np.asarray, params)
  if path is not None and jax.process_index() == 0:
    flat = {SEP.join(_names(p)): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, **flat)
  return params


def load_params(path: str) -> dict:
  """Reads a file written by `export_params` back into a nested dict of numpy arrays."""
  out = {}
  with np.load(path) as f:
    for key in f.files:
      d = out
      *parents, last = key.split(SEP)
      for n in parents:
        d = d.setdefault(n, {})
      d[last] = f[key]
  return out
