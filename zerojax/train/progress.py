"""A trainer's heartbeat for the supervisor's watchdog (`zerojax.train.supervisor`).

A supervised `train.py` (`--progress_file`) rewrites one small JSON file every `BEAT_S` seconds from a
thread of its own: a count that grows with every write (`beat`), the last step the loop completed
(`step`, None until the first), the run's length (`steps`) and the median time between completed steps
(`median_step_s`). The thread beats while the main thread waits in a collective, so a process whose
file stops changing is stopped (SIGSTOP), frozen or gone, while a process whose file changes but whose
step does not is alive and waiting (for a peer, or hung in the runtime). The supervisor compares what it
reads with its own clock, never with the writer's: the nodes' clocks need not agree.
"""
from __future__ import annotations

import collections
import json
import os
import threading
import time

BEAT_S = 1.0  # seconds between writes


class Progress:
  """Writes `path` every `every_s` seconds until `close()`; `completed(step, steps)` after each step."""

  def __init__(self, path: str, every_s: float = BEAT_S):
    self.path, self.every_s = path, every_s
    self.step: int | None = None
    self.steps: int | None = None
    self._beat, self._last, self._gaps = 0, None, collections.deque(maxlen=50)
    self._stop = threading.Event()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self._write()
    self._thread = threading.Thread(target=self._run, name="zerojax-progress", daemon=True)
    self._thread.start()

  def completed(self, step: int, steps: int) -> None:
    """Step `step` of `steps` is done (its metrics were read): called by the training loop."""
    now = time.monotonic()
    if self._last is not None:
      self._gaps.append(now - self._last)
    self._last, self.step, self.steps = now, step, steps

  def median_step_s(self) -> float | None:
    gaps = sorted(self._gaps)
    return gaps[len(gaps) // 2] if gaps else None

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=5)

  def _run(self) -> None:
    while not self._stop.wait(self.every_s):
      self._write()

  def _write(self) -> None:
    self._beat += 1
    record = {"pid": os.getpid(), "beat": self._beat, "step": self.step, "steps": self.steps,
              "median_step_s": self.median_step_s()}
    tmp = f"{self.path}.{os.getpid()}.tmp"
    try:
      with open(tmp, "w") as f:
        json.dump(record, f)
      os.replace(tmp, self.path)
    except OSError:
      pass  # a heartbeat that cannot be written stops changing: the watchdog judges it so


def read(path: str) -> dict | None:
  """The last record written to `path`, or None (not written yet, or unreadable)."""
  try:
    with open(path) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) else None
