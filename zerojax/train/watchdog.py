"""The supervisor's watchdog (`zerojax.train.supervisor`): which nodes of a start completed no step for
too long, and which of them are not running at all.

Each trainer rewrites a heartbeat file every second from a thread of its own (`zerojax.train.progress`):
the last step it completed and the median time between its steps. A node is late when it completed no
step for max(`k` x that median, `floor_s`) seconds, or `first_s` until its first step of a start (which
starts JAX, restores and compiles) and after its last one (the final save). A node whose heartbeat
stopped changing for `STALE_S` is not running (SIGSTOP, a frozen host, a link to the shared folder
lost); one whose heartbeat goes on while it is late waits in a collective, for a peer or in a hang.
Every time is the supervisor's own clock, at which it saw a file change: the nodes' clocks need not agree.

References:
  torchelastic (torch.distributed.elastic): a worker group restarted as a whole when one worker fails.
"""
from __future__ import annotations

from typing import Callable

from zerojax.train import progress as progress_lib

STALE_S = 5 * progress_lib.BEAT_S  # a heartbeat unchanged this long: the process is not running
WATCH_S = 0.5  # seconds between two reads of the heartbeats


class Watchdog:
  """What the heartbeats of one start's nodes say (module docstring); `reset` at each start.

  Args:
    path: node -> its heartbeat file.
    k, floor_s, first_s: the limits (module docstring); `k` 0 turns the watchdog off (`late` is empty).
  """

  def __init__(self, path: Callable[[int], str], k: float = 10, floor_s: float = 120, first_s: float = 1800):
    self.path, self.k, self.floor_s, self.first_s = path, k, floor_s, first_s
    self.seen: dict[int, dict] = {}
    self.started_at = self.read_at = 0.0

  def reset(self, started_at: float) -> None:
    self.seen, self.started_at, self.read_at = {}, started_at, 0.0

  def observe(self, nodes, now: float) -> None:
    """Reads the nodes' heartbeats; notes when each one's beat and step last changed."""
    self.read_at = now
    for n in nodes:
      rec = progress_lib.read(self.path(n)) or {}
      s = self.seen.setdefault(n, {"beat": None, "beat_at": self.started_at, "step": None,
                                   "step_at": self.started_at, "record": {}})
      if rec.get("beat") != s["beat"]:
        s["beat"], s["beat_at"], s["record"] = rec.get("beat"), now, rec
      if rec.get("step") != s["step"]:
        s["step"], s["step_at"] = rec.get("step"), now

  def stopped(self, nodes, now: float) -> list[int]:
    """Those of `nodes` whose heartbeat began but has not changed for `STALE_S`. A process that has not
    written its first yet (still importing) is not taken for stopped."""
    return [n for n in nodes if self.seen.get(n, {}).get("beat") is not None
            and now - self.seen[n]["beat_at"] > STALE_S]

  def last_beat(self, node: int) -> float:
    """When node `node`'s heartbeat last changed (the start's time if it never did)."""
    return self.seen.get(node, {}).get("beat_at", self.started_at)

  def limit(self, record: dict) -> tuple[float, str]:
    """Seconds a node may go without completing a step, and why, from its heartbeat's record."""
    step, steps, median = record.get("step"), record.get("steps"), record.get("median_step_s")
    if step is None or (steps is not None and step >= steps):
      where = "until the first" if step is None else "after the last"
      return self.first_s, f"{self.first_s:g} s {where} step"
    if median is None:
      return self.floor_s, "the floor, no median step time yet"
    why = f"{self.k:g} x the median step {median:.3g} s, at least {self.floor_s:g} s"
    return max(self.k * median, self.floor_s), why

  def late(self, nodes, now: float) -> dict[int, tuple[float, float, str]]:
    """The nodes late at `now` (reading the heartbeats at most every `WATCH_S`, also with `k` 0, for
    `stopped`): node -> (seconds since its last step, its limit, why that limit)."""
    if now - self.read_at < WATCH_S:
      return {}
    self.observe(nodes, now)
    if self.k <= 0:
      return {}
    out = {}
    for n in nodes:
      s = self.seen[n]
      limit, why = self.limit(s["record"])
      if now - s["step_at"] > limit:
        out[n] = (now - s["step_at"], limit, why)
    return out
