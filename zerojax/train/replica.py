"""A node's own copy of the train state, written to its local disk every few minutes, and the restore of
a run onto another number of nodes from the copies its nodes hold.

Every plan survives the loss of a node. Each process writes its node's part of the logical train state
(`zerojax.train.state_spec`): the leaves every node holds whole (all of them for MiCS with a group inside
a node, DiLoCo over it, data parallelism), its own row of each leaf held one row per node (DiLoCo's
replicas, Radius's residuals), and its part of each leaf sharded across nodes (ZeRO-3, ZeRO++, hpZ's
primary shards, MiCS groups spanning nodes). For those it also keeps the part of the next node around the
ring (`neighbour`), moved over the interconnect by one `ppermute` when the copy is taken: a lost node's
part survives on its predecessor, as Gemini (Wang et al., SOSP '23, §4) places checkpoint replicas in
peers' memory. Two neighbouring nodes lost together leave a part no survivor keeps: the run then resumes
from its checkpoint (`agree`).

A write goes to a temporary folder whose files and folder are fsynced, then renamed to `<step>` (an
earlier copy of that step is renamed away first and removed after), so a failure while writing leaves
the previous copies as they were; the last `keep` are kept.

The training loop copies the arrays off the devices at the save point and writes the files on a thread
of its own (`Writer`) while the next steps run; `Cadence` says at which steps (every process copies at
the same step: the conversion to the logical layout is one program over the mesh).

Copies are data, never code (`np.load` without pickles). Each records the run it belongs to (`run_id`:
the workdir's, written there by the run's first start; `claim` stamps the node's folder with it): a start
uses only its own run's copies that read completely, falling back to an older copy, then to the
checkpoint (`agree`).

A restart with another number of nodes (`restore`) assembles each leaf from the parts the holders keep
(the newcomers receive theirs over the interconnect: a masked sum over the nodes, exact), and builds the
per-node rows by the rule of merging and splitting replicas:

  - a surviving node keeps its own row (its DiLoCo replica and inner optimizer state, its residual);
  - a dropped node's row is discarded;
  - a new node's DiLoCo replica starts from the outer parameters (DiLoCo, Douillard et al. 2023,
    Algorithm 1: every replica restarts from them at a sync), its inner optimizer state is the first
    holder's (as a recovering replica group takes a healthy peer's in torchft), its skip count 0, and a
    component's row (Radius's residual: nothing unsent) starts at its fresh value.

  DIR/<step>/state.npz   this node's arrays: a leaf's part under its key ("params/..."), further parts
                         "<key>#<i>", the neighbour's part "<key>@<node>"
  DIR/<step>/meta.json   step, node, nodes, plan, run id, the nodes whose parts it covers, each array's
                         leaf, node and bounds, and the run's meta (seed, first loss, settings)
  DIR/run_id             the run whose copies the folder holds (`claim`)
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import threading
import time
import uuid
import zipfile
import zlib
from typing import Callable, Sequence

import jax
import numpy as np

from zerojax.planner.agree import from_process0
from zerojax.train import node_parts
from zerojax.train.state_spec import CheckpointError

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
  """`directory/run.json`: the plan and whether its node copies survive a lost node (read by the supervisor)."""
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


def steps(directory: str | None) -> list[int]:
  """The complete copies in a node's folder, oldest first."""
  if not directory or not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory)
                if d.isdigit() and os.path.exists(os.path.join(directory, d, META)))


def read_meta(directory: str, step: int) -> dict:
  with open(os.path.join(directory, str(step), META)) as f:
    return json.load(f)


def save(executor, state, directory: str, node: int, keep: int = 2, **meta) -> str:
  """Writes node `node`'s copy of `state` to `directory/<step>` (atomically); keeps the last `keep`
  and removes copies of later steps (left from before a restart). Every process calls it at the same
  step (`take`). Returns the folder."""
  arrays, info = node_parts.take(executor, state, node, **meta)
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
    arrays, info = node_parts.take(executor, state, node, **meta)
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
  seconds, lengthened so that taking the copies blocks the loop at most `BUDGET` of the time.

  Every process must copy at the same step (`take`), and their clocks differ: the seconds are turned into
  steps once per start, from the median time between the steps after the first (which compiles) that
  process 0 measured over `WARMUP` steps. After each copy, `copied` lengthens the interval when the copy
  blocked the loop for more than `BUDGET` of it (a large state on a slow disk or link: a plan sharded
  across nodes also moves the next node's part), again as process 0 measured it. A fixed `every` (the
  user's) is kept as it is.
  """
  WARMUP = 5
  BUDGET = 0.01

  def __init__(self, every: int | None, every_s: float):
    self.every, self.every_s, self._times, self.step_s = every, every_s, [], None

  def due(self, step: int) -> bool:
    """Whether step `step` (just dispatched) is copied; called by every process after every step."""
    if self.every is None:
      self._times.append(time.monotonic())
      if len(self._times) < self.WARMUP:
        return False
      self.step_s = max(float(np.median(np.diff(self._times[1:]))), 1e-6)
      self.every = int(from_process0(max(1, round(self.every_s / self.step_s))))
    return step % self.every == 0

  def copied(self, blocked_s: float) -> None:
    """After a copy that held the loop `blocked_s` seconds (one step's compute included, which the loop
    waits for anyway): every process calls it at the same step."""
    if self.step_s is None:
      return
    extra = max(blocked_s - self.step_s, 0.0)
    self.every = int(from_process0(max(self.every, math.ceil(extra / (self.BUDGET * self.step_s)))))


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
  copies that is not `joining`) whose copies together hold every node's part (`take`'s `covers`: two
  neighbouring nodes lost leave a part no survivor keeps), which processes hold it, and the data seed of
  the first holder. A copy counts only when it is of the folder's run (`claim`) and reads completely
  (`unusable`); one that does not is said in one line, and an older copy, or the checkpoint, is used instead.

  Returns:
    `(step, held, seed)` (`held[p]` for process p), or None when no process holds a copy or the holders
    share no step whose parts are all held (then the run starts from its checkpoint).
  """
  mine, run = [], owner(directory)
  for s in ([] if joining else steps(directory)[-slots:]):
    why = unusable(directory, s, run)
    if why is None:
      mine.append(s)
    elif not why.startswith("it belongs to run"):  # another run's copies were said by `claim`
      warn(f"zerojax: warning: the node copy {os.path.join(directory, str(s))} cannot be read ({why}); using an "
           "earlier copy or the checkpoint")
  vec = np.full((2 + 4 * slots,), -1, np.int64)
  vec[0], vec[1] = int(bool(mine)), seed
  for k, s in enumerate(mine):  # per step: the step, its copy's node, nodes, and neighbour (-2: every node)
    meta = read_meta(directory, s)
    covers = meta.get("covers")  # absent: a copy of every leaf whole
    whole = covers is None or len(covers) == meta.get("nodes")
    nxt = -2 if whole else (covers[1] if len(covers) > 1 else -1)
    vec[2 + 4 * k:6 + 4 * k] = s, meta.get("node", -1), meta.get("nodes", -1), nxt
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    rows = np.asarray(multihost_utils.process_allgather(vec)).reshape(jax.process_count(), -1)
  else:
    rows = vec[None]
  held = [bool(r[0] == 1) for r in rows]
  if not any(held):
    return None
  copies = [{int(c[0]): c[1:] for c in r[2:].reshape(slots, 4) if c[0] >= 0} for r, h in zip(rows, held) if h]
  for step in sorted(set.intersection(*(set(c) for c in copies)), reverse=True):
    held_by = [c[step] for c in copies]
    if any(c[2] == -2 for c in held_by):
      return step, held, int(rows[held.index(True)][1])
    covered = {int(n) for c in held_by for n in (c[0], c[2]) if n >= 0}
    missing = sorted(set(range(int(held_by[0][1]))) - covered)
    if not missing:
      return step, held, int(rows[held.index(True)][1])
    warn(f"zerojax: warning: no surviving node keeps the part of node {missing} in its copy of step {step} "
         "(neighbouring nodes were lost together); using an earlier copy or the checkpoint")
  return None


def restore(executor, step: int, held: Sequence[bool], folders: dict[int, str]):
  """The `TrainState` of `step` on `executor`'s mesh from the nodes' copies (`node_parts.assemble`).

  Args:
    executor: the run restored into; its mesh has `len(held)` nodes.
    step: the step every holder's folder has.
    held: per node of the new mesh, whether it holds a copy of `step` (others are new).
    folders: for the nodes whose devices are this process's and that hold a copy, their folder.
  """
  def load(node):
    where = os.path.join(folders[node], str(step))
    try:
      with np.load(os.path.join(where, STATE)) as f:
        return {k: f[k] for k in f.files}, read_meta(folders[node], step)
    except LOAD_ERRORS as e:
      raise CheckpointError(f"the node copy {where} cannot be read ({type(e).__name__}: {e}); "
                            "remove that folder to restart from an earlier copy or the checkpoint") from e

  return node_parts.assemble(executor, step, held, load)
