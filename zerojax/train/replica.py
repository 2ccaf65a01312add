"""A node's own copy of the train state, written to its local disk every few minutes, and the restore of
a run onto another number of nodes from the copies its nodes hold.

Plans that hold a full replica of the model states on every node (MiCS with a group inside a node, with
or without Radius; DiLoCo over it; data parallelism) lose nothing the survivors do not hold when a node
dies. Each process writes its node's part of the logical train state (`zerojax.train.state_spec`): every
leaf that is the same on every node, and its own row of each leaf held one row per node (DiLoCo's
replicas, Radius's residuals). A write goes to a temporary folder whose files and folder are fsynced, then
renamed to `<step>` (an earlier copy of that step is renamed away first and removed after), so a failure
while writing leaves the previous copies as they were; the last `keep` are kept.

The training loop copies the arrays off the devices at the save point and writes the files on a thread
of its own (`Writer`) while the next steps run; `Cadence` says at which steps (every process copies at
the same step: the conversion to the logical layout is one program over the mesh).

Copies are data, never code (`np.load` without pickles). Each records the run it belongs to (`run_id`:
the workdir's, written there by the run's first start; `claim` stamps the node's folder with it): a start
uses only its own run's copies that read completely, falling back to an older copy, then to the
checkpoint (`agree`).

A restart with another number of nodes (`restore`) takes each leaf that is the same on every node from
one holder (the newcomers receive it over the interconnect: a masked sum over the nodes, exact), and
builds the per-node rows by the rule of merging and splitting replicas:

  - a surviving node keeps its own row (its DiLoCo replica and inner optimizer state, its residual);
  - a dropped node's row is discarded;
  - a new node's DiLoCo replica starts from the outer parameters (DiLoCo, Douillard et al. 2023,
    Algorithm 1: every replica restarts from them at a sync), its inner optimizer state is the first
    holder's (as a recovering replica group takes a healthy peer's in torchft), its skip count 0, and a
    component's row (Radius's residual: nothing unsent) starts at its fresh value.

Plans that shard a model state across nodes (ZeRO-3, ZeRO++, MiCS groups spanning nodes) hold no
replica per node; `unsupported` says why.

  DIR/<step>/state.npz   this node's logical arrays, keyed like the checkpoint's leaves ("params/...")
  DIR/<step>/meta.json   step, node, nodes, plan, run id and the run's meta (seed, first loss, settings)
  DIR/run_id             the run whose copies the folder holds (`claim`)
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import threading
import time
import uuid
import zipfile
import zlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.mesh import AXES
from zerojax.planner.agree import from_process0
from zerojax.train.state_spec import SEP, CheckpointError, logical_state, new_row, seed_params, state_spec_of

NODE = AXES[0]
STATE, META, RUN, RUN_ID = "state.npz", "meta.json", "run.json", "run_id"
# What reading a truncated, cut or garbled copy raises (np.load never unpickles: a copy is data)
LOAD_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error)


@dataclasses.dataclass(frozen=True)
class NodeCopy:
  """What a process of a supervised run is told about its node's copy (`train.py --replica_dir`).

  Attributes:
    directory: the node's own folder (its local disk).
    joining: the node has no current copy (restarted or replaced): it takes the copy from a holder.
    event: the membership change this start follows (`zerojax.train.supervisor`), or None.
  """
  directory: str
  joining: bool = False
  event: dict | None = None


def write_run(directory: str, **fields) -> None:
  """`directory/run.json`: the plan and whether it holds a replica per node (read by the supervisor)."""
  os.makedirs(directory, exist_ok=True)
  _write(os.path.join(directory, RUN), json.dumps(fields))


def _write(path: str, text: str) -> None:
  """`text` to `path` atomically and durably: a temporary file, fsynced, renamed, the folder fsynced."""
  tmp = f"{os.path.join(os.path.dirname(path), '.' + os.path.basename(path))}.{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  _fsync(os.path.dirname(path))


def _fsync(path: str) -> None:
  """Flushes a file, or a folder's entries (its renames), to the disk."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def run_id(workdir: str) -> str:
  """The run's id, the same on every process and at every start in `workdir`: `WORKDIR/run_id`, written by
  process 0 at the first start (a fresh workdir is a new run, whatever folders its nodes had)."""
  value = None
  if jax.process_index() == 0:
    path = os.path.join(workdir, RUN_ID)
    with contextlib.suppress(FileNotFoundError):
      with open(path) as f:
        value = f.read().strip()
    if not value:
      value = uuid.uuid4().hex[:16]
      os.makedirs(workdir, exist_ok=True)
      _write(path, value)
  return from_process0(value)


def owner(directory: str | None) -> str | None:
  """The run whose copies `directory` holds (`claim`), or None."""
  try:
    with open(os.path.join(directory, RUN_ID)) as f:
      return f.read().strip() or None
  except (OSError, TypeError):
    return None


def claim(directory: str, run: str, warn: Callable[[str], None] = print) -> None:
  """Makes `directory` the folder of run `run`'s copies; copies of another run there (an earlier run's,
  left on the node's disk) are said in one line, never restored, and replaced as this run writes."""
  os.makedirs(directory, exist_ok=True)
  theirs = {}
  for s in steps(directory):
    try:
      other = read_meta(directory, s).get("run")
    except (OSError, ValueError):
      continue  # unreadable: `agree` says so
    if other != run:
      theirs.setdefault(str(other), []).append(s)
  if theirs:
    warn(f"zerojax: warning: --replica_dir {directory} holds node copies of another run (run "
         f"{', '.join(f'{r}: steps {v}' for r, v in theirs.items())}; this run is {run}): they are not used, "
         "and are replaced as this run writes its own")
  if owner(directory) != run:
    _write(os.path.join(directory, RUN_ID), run)


def _axes(entry) -> tuple[str, ...]:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def per_node(executor, leaf) -> bool:
  """Whether a stored leaf holds one row per node: `[nodes, ...]`, its first dimension sharded over the
  node axis alone (DiLoCo's replicas, Radius's residual)."""
  spec = tuple(leaf.sharding.spec)
  return (len(leaf.shape) > 0 and len(spec) > 0 and _axes(spec[0]) == (NODE,)
          and leaf.shape[0] == executor.mesh.shape[NODE])


def unsupported(executor) -> str | None:
  """Why the nodes of `executor`'s run do not each hold a full replica of the train state (a leaf sharded
  over the node axis, other than a per-node row), or None when they do."""
  for leaf in state_spec_of(executor).leaves:
    spec = tuple(leaf.sharding.spec)
    rest = spec[1:] if per_node(executor, leaf) else spec
    if any(NODE in _axes(e) for e in rest):
      return f"{SEP.join(leaf.names)} is sharded over {rest}, across nodes"
  return None


def steps(directory: str | None) -> list[int]:
  """The complete copies in a node's folder, oldest first."""
  if not directory or not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory)
                if d.isdigit() and os.path.exists(os.path.join(directory, d, META)))


def read_meta(directory: str, step: int) -> dict:
  with open(os.path.join(directory, str(step), META)) as f:
    return json.load(f)


def _node_shards(x, mesh, node: int) -> list:
  """The shards of `x` on node `node`'s devices, one per distinct part (a part several devices hold is
  read once)."""
  devices, seen, out = set(mesh.devices[node].flat), set(), []
  for s in x.addressable_shards:
    key = tuple((i.start, i.stop) for i in s.index)
    if s.device in devices and key not in seen:
      seen.add(key)
      out.append(s)
  return out


def _node_part(shards, shape, dtype, row: bool) -> np.ndarray:
  """Node `node`'s part of a global array from its shards (`_node_shards`): the whole array (every
  node's devices hold all of it), or with `row` its row of a per-node leaf."""
  out = np.zeros(shape[1:] if row else shape, dtype)
  for s in shards:
    data, index = np.asarray(s.data), tuple(s.index)
    if row:
      data, index = data[0], index[1:]
    out[index] = data
  return out


def take(executor, state, node: int, **meta) -> tuple[dict[str, np.ndarray], dict]:
  """Node `node`'s copy of `state` on the host: its arrays (keyed like the checkpoint's leaves) and its
  meta. The device-to-host part of a save: every process calls it at the same step (the conversion to
  the logical layout is one program over the mesh); only `node`'s shards are read, which must be this
  process's. Every shard's transfer starts before the first is waited for."""
  spec = state_spec_of(executor)
  values = spec.unnest(logical_state(executor, state))
  shards = [_node_shards(x, executor.mesh, node) for x in values]
  for s in (s for part in shards for s in part):
    s.data.copy_to_host_async()
  arrays = {SEP.join(l.names): _node_part(part, x.shape, x.dtype, per_node(executor, l))
            for l, x, part in zip(spec.leaves, values, shards)}
  info = {"step": int(state.step), "node": node, "nodes": int(executor.mesh.shape[NODE]),
          "plan": executor.plan.name, **meta}
  return arrays, info


def save(executor, state, directory: str, node: int, keep: int = 2, **meta) -> str:
  """Writes node `node`'s copy of `state` to `directory/<step>` (atomically); keeps the last `keep`
  and removes copies of later steps (left from before a restart). Every process calls it at the same
  step (`take`). Returns the folder."""
  arrays, info = take(executor, state, node, **meta)
  return write(directory, arrays, info, keep)


def write(directory: str, arrays: dict[str, np.ndarray], info: dict, keep: int = 2) -> str:
  """Writes a copy taken by `take` to `directory/<step>` (the module docstring's steps); returns the
  folder. Reads no device: `Writer` runs it on its thread."""
  step = info["step"]
  os.makedirs(directory, exist_ok=True)
  tmp = os.path.join(directory, f".tmp-{step}-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  np.savez(os.path.join(tmp, STATE), **arrays)
  with open(os.path.join(tmp, META), "w") as f:
    json.dump({**info, "run": owner(directory)}, f)
  for name in (STATE, META, ""):  # the files, then the folder's entries
    _fsync(os.path.join(tmp, name))
  final = os.path.join(directory, str(step))
  old = os.path.join(directory, f".old-{step}-{os.getpid()}")
  if os.path.exists(final):  # this step written before (a restart): renamed away, removed once replaced
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
  os.rename(tmp, final)
  _fsync(directory)
  done = steps(directory)
  for s in [s for s in done if s > step] + [s for s in done if s <= step][:-keep]:
    shutil.rmtree(os.path.join(directory, str(s)), ignore_errors=True)
  for d in os.listdir(directory):  # the replaced copy; temporaries of earlier processes that died while writing
    if d.startswith((".tmp-", ".old-")) and d != os.path.basename(tmp):
      shutil.rmtree(os.path.join(directory, d), ignore_errors=True)
  return final


class CopyError(OSError):
  """Writing a node's copy failed (raised at the save after, or at the end of the run)."""


class Writer:
  """Writes a node's copies on a thread of its own, so that the step does not wait for the disk.

  `save` takes the copy off the devices at the save point (`take`: the next step reuses the state's
  buffers) and returns; the files are written (`write`) while the next steps run. One write is in flight:
  a save first waits for the previous one. A write that failed raises `CopyError`, one line naming the
  step, the folder and the fix, at the next `save` or at `wait`.
  """

  def __init__(self):
    self._thread: threading.Thread | None = None
    self._error: CopyError | None = None

  def save(self, executor, state, directory: str, node: int, keep: int = 2, **meta) -> None:
    self.wait()
    arrays, info = take(executor, state, node, **meta)
    self._thread = threading.Thread(target=self._write, args=(directory, arrays, info, keep),
                                    name="zerojax-node-copy", daemon=True)
    self._thread.start()

  def wait(self, quiet: bool = False) -> None:
    """Waits for the write in flight; raises its error (`quiet`: drops it, e.g. while another is raised)."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    error, self._error = self._error, None
    if error is not None and not quiet:
      raise error

  def _write(self, directory, arrays, info, keep) -> None:
    try:
      write(directory, arrays, info, keep)
    except Exception as e:  # noqa: BLE001 - raised in the loop's thread, as one line
      why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
      self._error = CopyError(f"writing the node copy of step {info['step']} to {directory} failed ({why}); the "
                              "earlier copies are kept: free space on that disk or point --replica_dir elsewhere, "
                              "then run again")


class Cadence:
  """At which steps a node writes its copy: every `every` steps, or (`every` None) about every `every_s`
  seconds.

  Every process must copy at the same step (`take`), and their clocks differ: the seconds are turned into
  steps once per start, from the median time between the steps after the first (which compiles) that
  process 0 measured over `WARMUP` steps, then kept for the start.
  """
  WARMUP = 5

  def __init__(self, every: int | None, every_s: float):
    self.every, self.every_s, self._times = every, every_s, []

  def due(self, step: int) -> bool:
    """Whether step `step` (just dispatched) is copied; called by every process after every step."""
    if self.every is None:
      self._times.append(time.monotonic())
      if len(self._times) < self.WARMUP:
        return False
      step_s = max(float(np.median(np.diff(self._times[1:]))), 1e-6)
      self.every = int(from_process0(max(1, round(self.every_s / step_s))))
    return step % self.every == 0


def unusable(directory: str, step: int, run: str | None) -> str | None:
  """Why the copy of `step` in `directory` cannot be restored (None: it can): it is of another run than
  `run`, or a file of it is missing, truncated or fails to decode. Reads the whole copy (each array's
  CRC is checked), one array at a time."""
  try:
    meta = read_meta(directory, step)
    if meta.get("run") != run:
      return f"it belongs to run {meta.get('run')}, not to this run ({run})"
    with np.load(os.path.join(directory, str(step), STATE)) as f:
      for key in f.files:
        f[key]
  except LOAD_ERRORS as e:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
  return None


def agree(directory: str | None, joining: bool, seed: int, slots: int = 8, warn: Callable[[str], None] = print):
  """On every process at start: the latest step every holder's folder has (a holder: a process with
  copies that is not `joining`), which processes hold it, and the data seed of the first holder. A copy
  counts only when it is of the folder's run (`claim`) and reads completely (`unusable`); one that does
  not is said in one line, and an older copy, or the checkpoint, is used instead.

  Returns:
    `(step, held, seed)` (`held[p]` for process p), or None when no process holds a copy or the holders
    share no step (then the run starts from its checkpoint).
  """
  mine, run = [], owner(directory)
  for s in ([] if joining else steps(directory)[-slots:]):
    why = unusable(directory, s, run)
    if why is None:
      mine.append(s)
    elif not why.startswith("it belongs to run"):  # another run's copies were said by `claim`
      warn(f"zerojax: warning: the node copy {os.path.join(directory, str(s))} cannot be read ({why}); using an "
           "earlier copy or the checkpoint")
  vec = np.full((slots + 2,), -1, np.int64)
  vec[0], vec[1] = int(bool(mine)), seed
  vec[2:2 + len(mine)] = mine
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    rows = np.asarray(multihost_utils.process_allgather(vec)).reshape(jax.process_count(), -1)
  else:
    rows = vec[None]
  held = [bool(r[0] == 1) for r in rows]
  if not any(held):
    return None
  common = set.intersection(*(set(int(s) for s in r[2:] if s >= 0) for r, h in zip(rows, held) if h))
  if not common:
    return None
  first = held.index(True)
  return max(common), held, int(rows[first][1])


def restore(executor, step: int, held: Sequence[bool], folders: dict[int, str]):
  """The `TrainState` of `step` on `executor`'s mesh from the nodes' copies (the module docstring's rule).

  Args:
    executor: the run restored into; its mesh has `len(held)` nodes.
    step: the step every holder's folder has.
    held: per node of the new mesh, whether it holds a copy of `step` (others are new).
    folders: for the nodes whose devices are this process's and that hold a copy, their folder.
  """
  mesh, spec = executor.mesh, state_spec_of(executor)
  nodes = int(mesh.shape[NODE])
  if len(held) != nodes or not any(held):
    raise CheckpointError(f"restoring step {step} onto {nodes} nodes needs a holder flag per node and at least "
                          f"one holder; got {list(held)}")
  src = list(held).index(True)
  loaded = {}

  def node_arrays(node):
    if node not in loaded:
      where = os.path.join(folders[node], str(step))
      try:
        with np.load(os.path.join(where, STATE)) as f:
          loaded[node] = {k: f[k] for k in f.files}
      except LOAD_ERRORS as e:
        raise CheckpointError(f"the node copy {where} cannot be read ({type(e).__name__}: {e}); "
                              "remove that folder to restart from an earlier copy or the checkpoint") from e
    return loaded[node]

  keys = [SEP.join(l.names) for l in spec.leaves]
  rows = [per_node(executor, l) for l in spec.leaves]
  staged = []
  for l, key, row in zip(spec.leaves, keys, rows):
    shape = tuple(l.shape[1:] if row else l.shape)
    inner = tuple(l.sharding.spec)[1:] if row else tuple(l.sharding.spec)
    sharding = NamedSharding(mesh, P(NODE, *inner))

    def fill(index, l=l, key=key, shape=shape):
      node = index[0].start or 0
      if not held[node]:
        return np.zeros((1,) + shape, l.dtype)[(slice(None),) + tuple(index[1:])]
      x = node_arrays(node).get(key)
      if x is None or tuple(x.shape) != shape or x.dtype != l.dtype:
        got = "no such leaf" if x is None else f"shape {tuple(x.shape)} {x.dtype}"
        raise CheckpointError(f"the node copy in {folders[node]} of step {step} has {got} for {key}, expected "
                              f"shape {shape} {np.dtype(l.dtype)}: it was written by another model or optimizer")
      return np.asarray(x)[tuple(index[1:])][None]

    staged.append(jax.make_array_from_callback((nodes,) + shape, sharding, fill))
  seeds = seed_params(spec)
  where_held = np.asarray(held)

  def assemble(xs):
    def pick(x):  # the first holder's copy on every node: exact (the others add zeros)
      mask = jnp.asarray(np.arange(nodes) == src).reshape((nodes,) + (1,) * (x.ndim - 1))
      return jnp.any(x & mask, 0) if x.dtype == jnp.bool_ else jnp.sum(jnp.where(mask, x, jnp.zeros_like(x)), 0)

    out = []
    for l, x, row in zip(spec.leaves, xs, rows):
      if not row:
        out.append(pick(x))
        continue
      i = len(out)
      new = new_row(l, pick(x), pick(xs[seeds[i]]) if i in seeds else None)
      keep = jnp.asarray(where_held).reshape((nodes,) + (1,) * (x.ndim - 1))
      out.append(jnp.where(keep, x, new[None]))
    return out

  values = jax.jit(assemble, out_shardings=[l.sharding for l in spec.leaves])(staged)
  state = spec.from_logical(spec.nest(values))
  if int(state.step) != step:
    raise CheckpointError(f"the node copies of step {step} hold step {int(state.step)}; a folder was renamed")
  return state
