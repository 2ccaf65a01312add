"""Stopping a run cleanly on a signal: finish the step, save, exit."""
from __future__ import annotations

import signal
import threading

import jax
import numpy as np


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

