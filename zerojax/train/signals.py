"""Stopping a run cleanly on a signal: finish the step, save, exit with 128 + the signal's number."""
from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np


class StopSignal:
  """Turns SIGINT (Ctrl-C) and SIGTERM into a request to stop after the current step (a context manager).

  The first signal only sets a flag (the loop then saves a checkpoint and stops). A second one, of
  either kind, acts as if no handler were installed: the process ends at once, without saving; orbax
  writes each checkpoint into a temporary folder renamed only when complete, so the latest complete
  checkpoint stays as it was. With several processes, `requested()` is true on all of them as soon as
  one received a signal, so they all save the same step.
  """

  def __init__(self, signals=(signal.SIGINT, signal.SIGTERM)):
    self.signals, self._signum, self._previous = tuple(signals), 0, {}

  def _handle(self, signum, frame):
    self._signum = self._signum or signum
    for s in self.signals:  # the next signal ends the process at once
      signal.signal(s, signal.SIG_DFL)
    again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    os.write(2, f"\nzerojax: {signal.Signals(signum).name} received: finishing the current step and saving a "
                f"checkpoint ({again} again exits at once without saving)\n".encode())

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

  def requested(self) -> int:
    """The number of the signal that asked to stop (on any process), or 0."""
    if jax.process_count() == 1:
      return int(self._signum)
    from jax.experimental import multihost_utils
    return int(np.max(multihost_utils.process_allgather(np.array([self._signum], np.int32))))


def exit_code(signum: int) -> int:
  """The shell's exit status of a process ended by `signum`: 130 for SIGINT, 143 for SIGTERM."""
  return 128 + int(signum)
