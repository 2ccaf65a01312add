"""A small supervisor of a multi-node run: when a node's process dies, it stops the others and starts
the survivors again with one node fewer; when the node comes back, it starts the run at full size.

Every plan loses nothing the survivors do not hold (`zerojax.train.replica`): every process writes its
node's copy every few minutes (with the next node's part of what is sharded across nodes), and a start
resumes from the latest step the surviving nodes hold between them, on any number of nodes; a node that
rejoins takes its state from the survivors (`train.py --join`). JAX's distributed runtime cannot shrink a
running job on CPUs (gloo), so the survivors are restarted: the route that works on every jax this
project supports. A run whose processes are not one per node keeps no copies and stops with one line
naming the step it resumes from (its last checkpoint), as without the supervisor.

The supervisor launches one process per node through `launch(Start)` (`zerojax.train.launchers`): a
local process, an `srun` step on the node's host inside a Slurm allocation, a Kubernetes pod, or one in a
network namespace (`benchmarks/cluster.py`). What `launch` returns answers `poll`, `wait`,
`send_signal` and `returncode` as a `subprocess.Popen` does. Each membership change is passed to the next
start (`train.py --event`), whose first logged step records it in metrics.jsonl (time to detect, time to
resume, steps lost; `zerojax.train.report.membership`).

A watchdog (`zerojax.train.watchdog`) reads each trainer's heartbeat (`train.py --progress_file`, in
WORKDIR/progress). When a node completed no step for max(`watchdog_k` x the median step time,
`watchdog_floor_s`) seconds, the nodes whose heartbeat stopped (SIGSTOP, a frozen host) are ended and
taken as lost, as a dead one is; when every heartbeat goes on but no step completes (a hang in a
collective or the runtime), every node is started again. When JAX's own heartbeat ends the others first
(they abort while the stopped node is still there), the node whose heartbeat stopped is the one taken
as lost.

Restarts after a loss or a hang are capped (`max_restarts`, as torchelastic's); a start that trained no
step is retried after `restart_backoff_s`, doubled for each one in a row (at most `MAX_BACKOFF_S`); a run
left with fewer than `min_nodes` nodes stops, with one line. Restarted processes wait at most
`init_timeout_s` for each other in `jax.distributed.initialize` (`train.py --initialization_timeout`;
the first start keeps train.py's default, 300 s).

SIGINT, SIGTERM and SIGHUP to the supervisor (`run`) are passed on to the trainers (SIGHUP as SIGTERM),
which finish their step and save a checkpoint; those still running after `stop_grace_s` are SIGKILLed,
as they are at once on a second signal. When every process of a generation exits with status 2 (a
usage error: a bad config or flag, a refused checkpoint, a workdir in use), the run stops with that
process's own `error:` line, not as a node loss (`error_line`).

References:
  torchft (replica groups that leave and rejoin, a recovering group taking a healthy peer's weights).
  torchelastic (torch.distributed.elastic): max_restarts.
  DiLoCo, Douillard et al. 2023, §3 (workers leaving and joining).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import threading
import time
from typing import Callable

from zerojax.train import replica as replica_lib, report, watchdog as watchdog_lib

USAGE = 2  # train.py's exit status for what the user can fix (config, data, checkpoint, disk)
MAX_BACKOFF_S = 300.0
FORWARD = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}


@dataclasses.dataclass(frozen=True)
class Start:
  """One node's process of one generation of the run.

  Attributes:
    node: the node (a fixed index, also after others left).
    process_id, num_processes: its place in this generation (the holders first, in node order).
    coordinator: the node of process 0, which hosts JAX's coordinator.
    generation: 0 for the first start, one more for each restart (e.g. a fresh coordinator port).
    args: the train.py flags the supervisor adds (--num_processes, --process_id, --replica_dir,
      --progress_file, --join, --event, --initialization_timeout); the launcher adds --coordinator and the
      run's own flags.
    members: the nodes of this generation, in process order (a launcher places them all at its first start).
  """
  node: int
  process_id: int
  num_processes: int
  coordinator: int
  generation: int
  args: tuple[str, ...]
  members: tuple[int, ...] = ()


def parse_kill(text: str, flag: str = "--kill") -> tuple[int, int]:
  """`NODE@STEP` (cluster.py's and supervise's --kill and --hang) -> (node, step)."""
  try:
    node, step = (int(x) for x in text.split("@"))
  except ValueError:
    raise ValueError(f"{flag} {text!r} is not NODE@STEP, e.g. 2@20 (node 2 when step 20 is logged)")
  return node, step


class Supervisor:
  """Runs `nodes` processes through `launch` and restarts them on a loss or a rejoin (module docstring).

  Args:
    nodes: the nodes of the full-size run.
    launch: starts one node's process (`Start`) and returns it.
    workdir: the run's workdir (metrics.jsonl, checkpoints/, progress/: the heartbeats).
    replica_dir: node -> its own folder for its copy.
    restart_after: seconds after a loss at which the lost node is started again (None: only `ready`).
    kill_at: node -> step: SIGKILL that node's process once the lead logged the step (fault injection).
    log: prints one line.
    stop_grace_s: seconds the processes get to stop on SIGTERM (before a rejoin, or when the supervisor
      is stopped by a signal) before they are SIGKILLed.
    finish_s: seconds the survivors get after a loss to finish writing their copies before the SIGKILL.
    error_line: node -> the `error:` line its process printed last (e.g. from its log), or None.
    usage_wait_s: after a process exits with status 2, seconds the others get to exit alike (a usage
      error every process meets) before the exit is taken for a node loss.
    hang_at: node -> step: SIGSTOP that node's process once the lead logged the step (fault injection).
    watchdog_k, watchdog_floor_s, watchdog_first_s: the watchdog's limits (`watchdog.Watchdog`: k x the
      median step time, at least the floor; `first_s` until a start's first step and after the last);
      k 0 turns the watchdog off.
    max_restarts: restarts after a loss or a hang before the run stops (a rejoin does not count).
    restart_backoff_s: the wait before a restart that follows a start which trained no step; doubled for
      each such restart in a row.
    min_nodes: the run stops when fewer nodes than this are left.
    init_timeout_s: `train.py --initialization_timeout` for the starts after the first.
  """

  def __init__(self, nodes: int, launch: Callable[[Start], subprocess.Popen], workdir: str,
               replica_dir: Callable[[int], str], restart_after: float | None = None,
               kill_at: dict[int, int] | None = None, log: Callable[[str], None] = print, stop_grace_s: float = 120,
               finish_s: float = 1.0, error_line: Callable[[int], str | None] | None = None,
               usage_wait_s: float = 20.0, hang_at: dict[int, int] | None = None, watchdog_k: float = 10,
               watchdog_floor_s: float = 120, watchdog_first_s: float = 1800, max_restarts: int = 10,
               restart_backoff_s: float = 1.0, min_nodes: int = 1, init_timeout_s: int = 60):
    self.nodes, self.launch, self.workdir, self.replica_dir = nodes, launch, workdir, replica_dir
    self.restart_after, self.kill_at, self.log, self.stop_grace_s = restart_after, dict(kill_at or {}), log, stop_grace_s
    self.finish_s, self.error_line, self.usage_wait_s = finish_s, error_line, usage_wait_s
    self.hang_at, self.max_restarts, self.restart_backoff_s = dict(hang_at or {}), max_restarts, restart_backoff_s
    self.min_nodes, self.init_timeout_s = min_nodes, init_timeout_s
    self.watchdog = watchdog_lib.Watchdog(self.progress_file, watchdog_k, watchdog_floor_s, watchdog_first_s)
    self.interrupted = 0                  # the signal that stops the run (`interrupt`), or 0
    self.procs: dict[int, subprocess.Popen] = {}
    self.members: list[int] = []
    self.generation = -1
    self.killed: dict[int, float] = {}    # node -> when it failed (SIGKILLed here, or last seen beating)
    self.back: dict[int, float] = {}      # lost node -> when it is ready again
    self.events: list[dict] = []
    self.status: int | None = None
    self.started_at = 0.0
    self.restarts = 0                     # restarts after a loss or a hang
    self.failed_in_a_row = 0              # of those, in a row, after a start that trained no step
    self.pending: tuple[float, list[int], dict] | None = None  # a restart waiting for its backoff
    self.frozen: dict[int, float] = {}    # node -> when it was SIGSTOPped here

  # -- the run's state, read from its files ---------------------------------------------------------

  def last_step(self) -> int | None:
    rows = report.read_metrics(os.path.join(self.workdir, "metrics.jsonl"))
    return max((r["step"] for r in rows if "step" in r), default=None)

  def trained(self) -> bool:
    """Whether the current generation has logged a step."""
    rows = report.read_metrics(os.path.join(self.workdir, "metrics.jsonl"))
    return bool(rows) and rows[-1].get("time", 0) > self.started_at

  def last_checkpoint(self) -> int | None:
    folder = os.path.join(self.workdir, "checkpoints")
    done = [int(d) for d in os.listdir(folder) if d.isdigit()] if os.path.isdir(folder) else []
    return max(done, default=None)

  def run_info(self) -> dict | None:
    """What a process wrote about its plan (`replica.write_run`), from any member's folder."""
    for node in self.members:
      try:
        with open(os.path.join(self.replica_dir(node), replica_lib.RUN)) as f:
          return json.load(f)
      except (OSError, ValueError):
        continue
    return None

  def progress_file(self, node: int) -> str:
    """Node `node`'s heartbeat (`train.py --progress_file`), in the shared workdir."""
    return os.path.join(self.workdir, "progress", f"node{node}.json")

  # -- starting and stopping ------------------------------------------------------------------------

  def start(self, members: list[int], joining: tuple[int, ...] = (), event: dict | None = None) -> None:
    self.generation += 1
    self.started_at = time.time()
    order = [n for n in members if n not in joining] + [n for n in members if n in joining]
    self.members, self.procs, self.frozen = order, {}, {}
    self.watchdog.reset(self.started_at)
    for pid, node in enumerate(order):
      with contextlib.suppress(FileNotFoundError):
        os.remove(self.progress_file(node))  # an earlier start's heartbeat is not this one's
      args = [f"--num_processes={len(order)}", f"--process_id={pid}", f"--replica_dir={self.replica_dir(node)}",
              f"--progress_file={self.progress_file(node)}"]
      args += [f"--initialization_timeout={self.init_timeout_s}"] if self.generation else []
      args += ["--join"] if node in joining else []
      args += [f"--event={json.dumps(event)}"] if event else []
      self.procs[node] = self.launch(Start(node, pid, len(order), order[0], self.generation, tuple(args),
                                           tuple(order)))
    if event:
      self.events.append(event)

  def kill(self, node: int, failed: float | None = None) -> None:
    """SIGKILLs node `node`'s process (a node that dies) and notes when it failed (default now)."""
    p = self.procs.get(node)
    if p is not None and p.poll() is None:
      self.killed[node] = time.time() if failed is None else failed
      _signal(p, signal.SIGKILL)

  def ready(self, node: int) -> None:
    """Node `node` is back (a cluster manager restarted or replaced it): it rejoins at the next poll."""
    self.back[node] = min(self.back.get(node, time.time()), time.time())

  def stop_all(self, sig=signal.SIGKILL, grace_s: float = 10) -> dict[int, int]:
    """Sends `sig` to every running process and waits (SIGKILL after `grace_s`); their exit codes."""
    for p in self.procs.values():
      if p.poll() is None:
        _signal(p, sig)
    deadline = time.time() + grace_s
    for p in self.procs.values():
      try:
        p.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        _signal(p, signal.SIGKILL)
        p.wait()
    return {n: p.returncode for n, p in self.procs.items()}

  # -- one round of watching ------------------------------------------------------------------------

  def poll(self) -> int | None:
    """Checks the processes once: starts a restart whose backoff is over, injects a due fault, handles a
    loss, a hang or a due rejoin. Returns the run's exit status when it is over (0: finished), else None."""
    if self.status is not None:
      return self.status
    if self.interrupted:
      return self._stop_on_signal()
    if self.pending is not None:
      at, members, event = self.pending
      if time.time() >= at:
        self.pending = None
        self.start(members, event=event)
      return None
    codes = {n: p.poll() for n, p in self.procs.items()}
    if all(c == 0 for c in codes.values()):
      self.status = 0
      return 0
    dead = [n for n, c in codes.items() if c not in (None, 0)]
    if dead and USAGE in (codes[n] for n in dead) and self._usage_error():
      return self.status
    if dead:
      codes = {n: p.poll() for n, p in self.procs.items()}
      return self._lost([n for n, c in codes.items() if c not in (None, 0)], codes)
    self._inject()
    self._watch()
    if self.status is not None or self.pending is not None:
      return self.status
    now = time.time()
    due = sorted(n for n, t in self.back.items() if t <= now)
    if due and self.trained():  # a generation that has not trained a step yet is left to start
      self._rejoin(due)
    return self.status

  def run(self, poll_s: float = 0.05) -> int:
    """Starts the full-size run and watches it until it is over; returns its exit status (128 + the
    signal's number when a signal stopped it). In the main thread, SIGINT, SIGTERM and SIGHUP stop the
    run through `interrupt`."""
    handled = {}
    if threading.current_thread() is threading.main_thread():
      handled = {s: signal.signal(s, lambda signum, frame: self.interrupt(signum)) for s in FORWARD}
    try:
      self.start(list(range(self.nodes)))
      while self.poll() is None:
        time.sleep(poll_s)
    finally:
      self.stop_all()
      for s, h in handled.items():
        signal.signal(s, h)
    return self.status

  def interrupt(self, signum: int) -> None:
    """A signal to the supervisor (its handler): the first stops the run at the next poll, passing the
    signal on to the trainers so that they save; the next SIGKILLs them at once."""
    if self.interrupted:
      for p in self.procs.values():
        if p.poll() is None:
          _signal(p, signal.SIGKILL)
      return
    self.interrupted = signum

  def _stop_on_signal(self) -> int:
    sig, name = FORWARD.get(self.interrupted, signal.SIGTERM), signal.Signals(self.interrupted).name
    running = [n for n, p in self.procs.items() if p.poll() is None]
    self.log(f"zerojax: supervisor: {name} received; sending {sig.name} to nodes {running} (they finish the "
             f"step and save a checkpoint), SIGKILL after {self.stop_grace_s:g} s or on a second signal")
    codes = self.stop_all(sig, self.stop_grace_s)
    killed = [n for n, c in codes.items() if c == -signal.SIGKILL]
    if killed:
      self.log(f"zerojax: supervisor: nodes {killed} did not stop in time and were SIGKILLed (no checkpoint "
               "of their last step)")
    self.status = 128 + int(self.interrupted)
    return self.status

  def _usage_error(self) -> bool:
    """After a process exited with status 2: waits up to `usage_wait_s` for the others; when every one
    exited with status 2, logs the first one's `error:` line, sets status 2 and returns True."""
    deadline = time.time() + self.usage_wait_s
    while time.time() < deadline and any(p.poll() is None for p in self.procs.values()):
      if any(p.poll() not in (None, USAGE) for p in self.procs.values()):
        return False
      time.sleep(0.05)
    if any(p.poll() != USAGE for p in self.procs.values()):
      return False
    node = self.members[0] if self.members else min(self.procs)
    line = self.error_line(node) if self.error_line else None
    self.log(f"zerojax: supervisor: train.py stopped with a usage error (exit status 2) on every node "
             f"{sorted(self.procs)}: " + (line or "see the nodes' output for its error line"))
    self.status = USAGE
    return True

  def _inject(self) -> None:
    """The due faults of `kill_at` (SIGKILL) and `hang_at` (SIGSTOP)."""
    if not (self.kill_at or self.hang_at):
      return
    last = self.last_step()
    for faults, sig in ((self.kill_at, signal.SIGKILL), (self.hang_at, signal.SIGSTOP)):
      for node, step in list(faults.items()):
        if last is not None and last >= step and node in self.procs:
          del faults[node]
          self.log(f"zerojax: supervisor: {'killing' if sig == signal.SIGKILL else 'stopping'} node {node} "
                   f"({sig.name}) at step {last}")
          if sig == signal.SIGKILL:
            self.kill(node)
          elif self.procs[node].poll() is None:
            self.frozen[node] = time.time()
            _signal(self.procs[node], sig)

  # -- the watchdog ---------------------------------------------------------------------------------

  def _watch(self) -> None:
    """Ends the nodes whose heartbeat stopped once a node completed no step within its limit (they are then
    lost, at the next poll); restarts every node when all heartbeats beat but none completes a step."""
    now, dog = time.time(), self.watchdog
    late = dog.late(self.members, now)
    if not late:
      return
    idle, limit, why = max(late.values())
    stopped = dog.stopped(self.members, now)
    for n in stopped:
      self.log(f"zerojax: supervisor: node {n} completed no step for {idle:.0f} s (limit {limit:g} s: {why}) and "
               f"its heartbeat stopped {now - dog.last_beat(n):.0f} s ago (stopped, frozen or cut off): ending it "
               "as a lost node")
      self.kill(n, self.frozen.get(n, dog.last_beat(n)))
      with contextlib.suppress(subprocess.TimeoutExpired):
        self.procs[n].wait(timeout=10)  # seen dead at the next poll, not ended twice
    if stopped or min(i - l for i, l, _ in late.values()) <= watchdog_lib.STALE_S:
      return  # a stopped heartbeat may still show: wait that long before taking the whole run for hung
    last = self.last_step()
    what = (f"no step completed for {idle:.0f} s (limit {limit:g} s: {why}) while every node's heartbeat "
            f"goes on (a hang in a collective or the runtime)")
    event = {"kind": "hang", "node": list(self.members), "nodes_before": len(self.members),
             "nodes": len(self.members), "failed": now - idle, "detected": now, "last_step": last}
    if self._capped(what):
      return
    self.stop_all(signal.SIGKILL)
    delay = self._backoff()
    self.log(f"zerojax: supervisor: {what}; restarting nodes {self.members}" + (f" in {delay:g} s" if delay else ""))
    self.pending = (time.time() + delay, list(self.members), event)

  # -- restarts ---------------------------------------------------------------------------------------

  def _capped(self, what: str) -> bool:
    """When the run was restarted `max_restarts` times: logs `what` and why the run stops, sets status 1."""
    if self.restarts < self.max_restarts:
      return False
    self.log(f"zerojax: supervisor: {what}; the run was restarted {self.restarts} times already "
             f"(--max_restarts={self.max_restarts}), so it stops; start it again to resume from the nodes' own "
             "copies, or raise --max_restarts")
    self.status = 1
    return True

  def _backoff(self) -> float:
    """Counts a restart; the seconds to wait before it: 0 after a start that trained a step, else
    `restart_backoff_s`, doubled for each such restart in a row (at most `MAX_BACKOFF_S`)."""
    self.restarts += 1
    self.failed_in_a_row = 0 if self.trained() else self.failed_in_a_row + 1
    if not self.failed_in_a_row:
      return 0.0
    return min(self.restart_backoff_s * 2 ** (self.failed_in_a_row - 1), MAX_BACKOFF_S)

  def _lost(self, dead: list[int], codes: dict[int, int | None]) -> int | None:
    detected = time.time()
    by_signal = [n for n in dead if codes[n] < 0 and codes[n] != -signal.SIGTERM]
    # peers that fail because a node died exit with an error, not a signal; when JAX's heartbeat ended
    # them (SIGABRT) while a stopped node is still there, that node is the one lost
    self.watchdog.observe(self.members, detected)
    stopped = self.watchdog.stopped([n for n, c in codes.items() if c is None], detected)
    for n in stopped:
      self.killed[n] = self.frozen.get(n, self.watchdog.last_beat(n))
    lost = stopped or by_signal or dead
    last = self.last_step()
    time.sleep(self.finish_s)  # let the survivors finish writing the copy of their last step
    self.stop_all(signal.SIGKILL)  # they wait in a collective for the dead node: nothing else to save
    survivors = [n for n in self.members if n not in lost]
    info = self.run_info() or {}
    plan = info.get("plan", "the plan")
    what = f"node {', '.join(map(str, lost))} lost after step {last}"
    if not info.get("survives"):
      resume = self.last_checkpoint()
      why = f" ({info['why']})" if info.get("why") else ""
      self.log(f"zerojax: {what}; {plan} keeps no node copies{why}, so the run stops; start all {self.nodes} "
               "nodes again to " + (f"resume from step {resume}, its last checkpoint" if resume is not None else
                                    "start over (no checkpoint was saved)"))
      self.status = 1
      return 1
    if not survivors:
      self.log(f"zerojax: every node was lost after step {last}; start them again to resume")
      self.status = 1
      return 1
    if len(survivors) < self.min_nodes:
      self.log(f"zerojax: supervisor: {what}; {len(survivors)} of {self.nodes} nodes left, fewer than "
               f"--min_nodes={self.min_nodes}, so the run stops; start the nodes again to resume from their own copies")
      self.status = 1
      return 1
    if self._capped(what):
      return 1
    for n in lost:
      if self.restart_after is not None:
        self.back[n] = detected + self.restart_after
    event = {"kind": "node_lost", "node": lost, "nodes_before": len(self.members), "nodes": len(survivors),
             "failed": min((self.killed[n] for n in lost if n in self.killed), default=None),
             "detected": detected, "last_step": last, "plan": plan}
    delay = self._backoff()
    self.log(f"zerojax: supervisor: {what}; restarting {len(survivors)} nodes {survivors} from their own copies"
             + (f" in {delay:g} s" if delay else ""))
    self.pending = (time.time() + delay, survivors, event)
    return self.poll()

  def _rejoin(self, due: list[int]) -> None:
    since, acted = min(self.back[n] for n in due), time.time()  # back since; the restart starts now
    for n in due:
      del self.back[n]
    codes = self.stop_all(signal.SIGTERM, self.stop_grace_s)  # finish the step, write the copies
    stopped = [n for n, c in codes.items() if c in (0, -signal.SIGTERM, 128 + signal.SIGTERM)]
    if all(c == 0 for c in codes.values()):
      self.status = 0
      return
    members = sorted(set(stopped) | set(due))
    event = {"kind": "node_rejoined", "node": due, "nodes_before": len(stopped), "nodes": len(members),
             "failed": None, "ready": since, "detected": acted, "last_step": self.last_step()}
    self.log(f"zerojax: supervisor: node {', '.join(map(str, due))} back; restarting {len(members)} nodes "
             f"{members}, node {', '.join(map(str, due))} taking the copy from node {stopped[0] if stopped else '?'}")
    self.start(members, joining=tuple(due), event=event)


def _signal(p: subprocess.Popen, sig) -> None:
  """`sig` to the process's group when it leads one (a launcher that starts a shell), else to it; a handle
  that is no local process (an srun step, a pod: `zerojax.train.launchers`) passes it on its own way."""
  if not isinstance(p, subprocess.Popen):
    p.send_signal(sig)
    return
  try:
    if os.getpgid(p.pid) == p.pid:
      os.killpg(p.pid, sig)
    else:
      p.send_signal(sig)
  except ProcessLookupError:
    pass
