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
import weakref
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


def _axes(entry) -> tuple[str, ...]:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def per_node(executor, leaf) -> bool:
  """Whether a stored leaf holds one row per node: `[nodes, ...]`, its first dimension sharded over the
  node axis alone (DiLoCo's replicas, Radius's residual)."""
  spec = tuple(leaf.sharding.spec)
  return (len(leaf.shape) > 0 and len(spec) > 0 and _axes(spec[0]) == (NODE,)
          and leaf.shape[0] == executor.mesh.shape[NODE])


def across_nodes(executor, leaf) -> bool:
  """Whether a stored leaf (not a per-node row) is sharded over the node axis: each node holds part of it
  (ZeRO-3, ZeRO++, hpZ's primary shards, MiCS groups spanning nodes), so a node's copy also holds its
  neighbour's part."""
  spec = tuple(leaf.sharding.spec)
  return not per_node(executor, leaf) and any(NODE in _axes(e) for e in spec)


def neighbour(node: int, nodes: int) -> int | None:
  """The node whose part node `node` also keeps: the next one, around the ring (None on one node)."""
  return (node + 1) % nodes if nodes > 1 else None


def sharded_across_nodes(executor) -> str | None:
  """The first leaf of `executor`'s train state that no node holds whole (its copies then keep a
  neighbour's part too), as `'<leaf> is sharded over <spec>'`, or None when every node holds every leaf."""
  for leaf in state_spec_of(executor).leaves:
    if across_nodes(executor, leaf):
      return f"{SEP.join(leaf.names)} is sharded over {tuple(leaf.sharding.spec)}"
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


def _bounds(index, shape) -> tuple[tuple[int, int], ...]:
  """A shard's index (slices) as `(start, stop)` per dimension."""
  return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape))


def _on_node(y, x, mesh, node: int, source: int | None = None) -> dict:
  """The shards of `y` on node `node`'s devices by the part of `x` they hold, one per distinct part: `x`'s
  own (`source` None, `y` is `x`), or node `source`'s, which `_shift` moved to the same devices of `node`."""
  where = x.sharding.devices_indices_map(tuple(x.shape))
  shards = {s.device: s for s in y.addressable_shards}
  devices = list(mesh.devices[node].flat)
  out = {}
  for d, holder in zip(devices, devices if source is None else mesh.devices[source].flat):
    out.setdefault(_bounds(where[holder], x.shape), shards[d])
  return out


def _tiles(parts: list) -> list:
  """A node's parts `[(bounds, array)]` of one leaf, merged into one when they tile their bounding box (the
  distinct shards of a sharding never overlap): a node's part of a leaf sharded over ('node', 'gpu') is
  one block."""
  if len(parts) <= 1:
    return parts
  lo = [min(b[d][0] for b, _ in parts) for d in range(len(parts[0][0]))]
  hi = [max(b[d][1] for b, _ in parts) for d in range(len(parts[0][0]))]
  if sum(a.size for _, a in parts) != int(np.prod([h - l for l, h in zip(lo, hi)])):
    return parts
  out = np.empty([h - l for l, h in zip(lo, hi)], parts[0][1].dtype)
  for b, a in parts:
    out[tuple(slice(s - l, e - l) for (s, e), l in zip(b, lo))] = a
  return [(tuple(zip(lo, hi)), out)]


_SHIFTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _shift(executor, values: list) -> dict:
  """For each leaf sharded across nodes (`across_nodes`), by its index in `values`: the array whose shards
  on node n's devices are node n + 1's (one `ppermute` over the node axis, around the ring). Empty on one
  node or when every node holds every leaf."""
  spec, nodes = state_spec_of(executor), int(executor.mesh.shape[NODE])
  at = [i for i, l in enumerate(spec.leaves) if across_nodes(executor, l)] if nodes > 1 else []
  if not at:
    return {}
  if executor not in _SHIFTS:
    specs = tuple(spec.leaves[i].sharding.spec for i in at)
    ring = [(j, (j - 1) % nodes) for j in range(nodes)]  # node j's part goes to node j - 1
    _SHIFTS[executor] = jax.jit(jax.shard_map(lambda *xs: tuple(jax.lax.ppermute(x, NODE, ring) for x in xs),
                                              mesh=executor.mesh, in_specs=specs, out_specs=specs, check_vma=False))
  return dict(zip(at, _SHIFTS[executor](*[values[i] for i in at])))


def take(executor, state, node: int, **meta) -> tuple[dict[str, np.ndarray], dict]:
  """Node `node`'s copy of `state` on the host: its arrays and its meta. The device-to-host part of a save:
  every process calls it at the same step (the conversion to the logical layout and the neighbour's part
  are programs over the mesh); only `node`'s shards are read, which must be this process's. Every shard's
  transfer starts before the first is waited for.

  The arrays: a per-node row under its leaf's key (`params/...`); the node's part of every other leaf under
  its key (`<key>#<i>` for further parts), and of a leaf sharded across nodes also node `neighbour`'s part
  (`<key>@<node>`). `meta["parts"]` gives each such array's leaf, node and bounds; `meta["covers"]` the
  nodes whose parts the copy holds (every node when every node holds every leaf)."""
  spec, mesh = state_spec_of(executor), executor.mesh
  nodes = int(mesh.shape[NODE])
  values = spec.unnest(logical_state(executor, state))
  shifted = _shift(executor, values)
  nxt = neighbour(node, nodes) if shifted else None
  own = [_on_node(x, x, mesh, node) for x in values]
  theirs = {i: _on_node(y, values[i], mesh, node, source=nxt) for i, y in shifted.items()}
  for s in (s for found in own + list(theirs.values()) for s in found.values()):
    s.data.copy_to_host_async()
  arrays, parts = {}, {}
  for i, (l, x) in enumerate(zip(spec.leaves, values)):
    key = SEP.join(l.names)
    if per_node(executor, l):  # this node's row
      row = np.zeros(x.shape[1:], x.dtype)
      for bounds, s in own[i].items():
        row[tuple(slice(*b) for b in bounds[1:])] = np.asarray(s.data)[0]
      arrays[key] = row
      continue
    for tag, n, found in [(key, node, own[i])] + ([(f"{key}@{nxt}", nxt, theirs[i])] if i in theirs else []):
      for j, (bounds, a) in enumerate(_tiles([(b, np.asarray(s.data)) for b, s in found.items()])):
        name = tag if j == 0 else f"{tag}#{j}"
        arrays[name], parts[name] = a, [key, n, [list(b) for b in bounds]]
  covers = [node] + ([nxt] if nxt is not None else []) if shifted else list(range(nodes))
  info = {"step": int(state.step), "node": node, "nodes": nodes, "plan": executor.plan.name, "covers": covers,
          "parts": parts, **meta}
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


def _drop_node(entry):
  """A sharding entry without the node axis: the axes it keeps within a node."""
  rest = tuple(a for a in _axes(entry) if a != NODE)
  return None if not rest else rest[0] if len(rest) == 1 else rest


def _select(x, covered):
  """Per element of `x`'s rows (one per node), the value of the first node whose copy covers it (exact:
  the others add zeros), and whether every element is covered by some node."""
  first = jnp.argmax(covered, axis=0)
  mine = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1)) == first[None]
  value = jnp.any(x & mine, 0) if x.dtype == jnp.bool_ else jnp.sum(jnp.where(mine, x, jnp.zeros_like(x)), 0)
  return value, jnp.all(jnp.any(covered, 0))


def restore(executor, step: int, held: Sequence[bool], folders: dict[int, str]):
  """The `TrainState` of `step` on `executor`'s mesh from the nodes' copies (the module docstring's rule).

  Every leaf but the per-node rows is assembled from the parts the holders' copies keep (their own, and a
  lost neighbour's): each node of the new mesh stages what its copy holds of the leaf, and each element is
  taken from the first node that holds it, over the interconnect (a masked sum over the nodes: exact).
  A node stages at most the whole leaf, sharded over its own devices, one leaf at a time.

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
  copies = {}

  def copy_of(node) -> tuple[dict, dict]:
    """Node `node`'s arrays, and its parts by leaf: `{key: [(bounds, array)]}`."""
    if node not in copies:
      where = os.path.join(folders[node], str(step))
      try:
        with np.load(os.path.join(where, STATE)) as f:
          arrays = {k: f[k] for k in f.files}
        meta = read_meta(folders[node], step)
      except LOAD_ERRORS as e:
        raise CheckpointError(f"the node copy {where} cannot be read ({type(e).__name__}: {e}); "
                              "remove that folder to restart from an earlier copy or the checkpoint") from e
      parts = {}
      for name, (key, _, bounds) in meta.get("parts", {}).items():
        parts.setdefault(key, []).append((tuple(tuple(b) for b in bounds), arrays[name]))
      copies[node] = arrays, parts
    return copies[node]

  def wrong(node, key, shape, dtype, got) -> CheckpointError:
    return CheckpointError(f"the node copy in {folders[node]} of step {step} has {got} for {key}, expected "
                           f"shape {shape} {np.dtype(dtype)}: it was written by another model or optimizer")

  def parts_of(node, key, shape, dtype) -> list:
    arrays, parts = copy_of(node)
    found = parts.get(key) or ([(tuple((0, n) for n in shape), arrays[key])] if key in arrays else None)
    if found is None:
      raise wrong(node, key, shape, dtype, "no such leaf")
    for bounds, a in found:
      if a.dtype != dtype or len(bounds) != len(shape) or any(e > n for (_, e), n in zip(bounds, shape)):
        raise wrong(node, key, shape, dtype, f"a part {[list(b) for b in bounds]} {a.dtype}")
    return found

  def gather(l, key):
    shape, cache = tuple(l.shape), {}
    sharding = NamedSharding(mesh, P(NODE, *(_drop_node(e) for e in l.sharding.spec)))

    def block(index):
      node, region = index[0].start or 0, _bounds(index[1:], shape)
      if (node, region) not in cache:
        x = np.zeros([e - s for s, e in region], l.dtype)
        covered = np.zeros(x.shape, bool)
        for bounds, a in (parts_of(node, key, shape, l.dtype) if held[node] else []):
          lo = [max(s, b[0]) for (s, _), b in zip(region, bounds)]
          hi = [min(e, b[1]) for (_, e), b in zip(region, bounds)]
          if all(h > o for o, h in zip(lo, hi)):
            to = tuple(slice(o - s, h - s) for o, h, (s, _) in zip(lo, hi, region))
            x[to] = a[tuple(slice(o - b[0], h - b[0]) for o, h, b in zip(lo, hi, bounds))]
            covered[to] = True
        cache[(node, region)] = x[None], covered[None]
      return cache[(node, region)]

    xs = jax.make_array_from_callback((nodes,) + shape, sharding, lambda i: block(i)[0])
    cs = jax.make_array_from_callback((nodes,) + shape, sharding, lambda i: block(i)[1])
    value, whole = jax.jit(_select, out_shardings=(l.sharding, NamedSharding(mesh, P())))(xs, cs)
    if not bool(whole):
      raise CheckpointError(f"the node copies of step {step} do not hold all of {key} (neighbouring nodes were "
                            "lost together); start from the checkpoint: move the node copies aside")
    return value

  def staged_row(l, key):
    shape = tuple(l.shape[1:])

    def fill(index):
      node = index[0].start or 0
      if not held[node]:
        return np.zeros((1,) + shape, l.dtype)[(slice(None),) + tuple(index[1:])]
      x = copy_of(node)[0].get(key)
      if x is None or tuple(x.shape) != shape or x.dtype != l.dtype:
        raise wrong(node, key, shape, l.dtype, "no such leaf" if x is None else f"shape {tuple(x.shape)} {x.dtype}")
      return np.asarray(x)[tuple(index[1:])][None]

    return jax.make_array_from_callback((nodes,) + shape, NamedSharding(mesh, P(NODE, *tuple(l.sharding.spec)[1:])),
                                        fill)

  keys = [SEP.join(l.names) for l in spec.leaves]
  rows = {i for i, l in enumerate(spec.leaves) if per_node(executor, l)}
  values = [None if i in rows else gather(l, k) for i, (l, k) in enumerate(zip(spec.leaves, keys))]
  if rows:
    values = _merge_rows(executor, spec, {i: staged_row(spec.leaves[i], keys[i]) for i in sorted(rows)}, values,
                         held)
  state = spec.from_logical(spec.nest(values))
  if int(state.step) != step:
    raise CheckpointError(f"the node copies of step {step} hold step {int(state.step)}; a folder was renamed")
  return state


def _merge_rows(executor, spec, staged: dict, values: list, held: Sequence[bool]) -> list:
  """`values` with each per-node row leaf (`staged`, one row per node of the new mesh) by the rule of
  merging and splitting replicas: a holder keeps its row, a new node's row is `new_row` of the first
  holder's (seeded from the assembled `values` where the leaf has a seed)."""
  nodes, src, seeds = len(held), list(held).index(True), seed_params(spec)
  keep = np.asarray(held)
  seeded = {j: values[j] for i, j in seeds.items() if i in staged and j not in staged}

  def pick(x):  # the first holder's row on every node: exact (the others add zeros)
    mask = jnp.asarray(np.arange(nodes) == src).reshape((nodes,) + (1,) * (x.ndim - 1))
    return jnp.any(x & mask, 0) if x.dtype == jnp.bool_ else jnp.sum(jnp.where(mask, x, jnp.zeros_like(x)), 0)

  def merge(staged, seeded):
    out = {}
    for i, x in staged.items():
      j = seeds.get(i)
      seed = None if j is None else pick(staged[j]) if j in staged else seeded[j]
      new = new_row(spec.leaves[i], pick(x), seed)
      out[i] = jnp.where(jnp.asarray(keep).reshape((nodes,) + (1,) * (x.ndim - 1)), x, new[None])
    return out

  merged = jax.jit(merge, out_shardings={i: spec.leaves[i].sharding for i in staged})(staged, seeded)
  return [merged.get(i, v) for i, v in enumerate(values)]
