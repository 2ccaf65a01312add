"""One run per workdir: a lock file that process 0 holds for the run's life.

Two runs in one workdir destroy each other's work: orbax's start-up removes the temporary folders of
saves in flight (the other run's), both write `metrics.jsonl` and both rotate the same checkpoints. So
`train.py` takes `WORKDIR/run.lock` before it touches anything there: an exclusive `fcntl.flock` held by
process 0 until the run ends, the file recording the holder's host and process id. A second run stops
with one line naming them. The kernel releases the lock when its process dies, however it dies, so the
lock of a killed run is taken over by the next start (which says whose it was); on NFS the server's lock
lease does the same once the dead host's lease runs out. With several processes, process 0 decides and
every process stops or goes on alike.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from typing import Callable

from zerojax.planner.agree import from_process0
from zerojax.train.config import ConfigError

NAME = "run.lock"


class WorkdirLocked(ConfigError):
  """Another run holds the workdir."""


class LocksUnsupported(OSError):
  """The workdir's filesystem refuses locks (some FUSE mounts, NFS without its lock service)."""


class WorkdirLock:
  """The lock of `workdir` (`acquire`, `release`); a context manager."""

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, NAME)
    self._file = None

  def acquire(self) -> dict | None:
    """Takes the lock, or raises `WorkdirLocked` naming its holder. Returns the record of a holder that
    ended without releasing it (taken over), else None.

    Raises:
      WorkdirLocked: another live process holds it.
      ConfigError: the workdir cannot be created or the lock file written.
      LocksUnsupported: the filesystem refuses locks.
    """
    try:
      os.makedirs(self.workdir, exist_ok=True)
      f = open(self.path, "a+")
    except OSError as e:
      raise ConfigError(f"cannot create the lock file {self.path} ({e.strerror or e}); use a --workdir you can "
                        "write to") from e
    try:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _read(f)
      f.close()
      if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise WorkdirLocked(f"--workdir {self.workdir} is in use by another run ({_who(holder)}; {self.path}): two "
                            "runs in one workdir delete each other's checkpoints; wait for that run to end or "
                            "stop it, or use another --workdir") from e
      raise LocksUnsupported(e.errno, f"cannot lock {self.path} ({e.strerror or e})") from e
    stale = _read(f)
    f.seek(0)
    f.truncate()
    json.dump({"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
    f.flush()
    os.fsync(f.fileno())
    self._file = f
    return stale or None

  def release(self) -> None:
    """Empties the record and releases the lock (the file stays: removing it would let two later runs
    lock two different files)."""
    if self._file is None:
      return
    try:
      self._file.seek(0)
      self._file.truncate()
      self._file.flush()
    finally:
      fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
      self._file.close()
      self._file = None

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


@contextlib.contextmanager
def hold(workdir: str, say: Callable[[str], None] = print):
  """Process 0 holds `workdir`'s lock while the block runs; every process raises `WorkdirLocked` (or the
  `ConfigError` of a workdir that cannot be written) when process 0 could not take it. On a filesystem
  that refuses locks the run goes on unlocked, with a warning."""
  import jax
  lock = WorkdirLock(workdir) if jax.process_index() == 0 else None
  error, stale = None, None
  if lock is not None:
    try:
      stale = lock.acquire()
    except ConfigError as e:
      error = [type(e).__name__, str(e)]
    except LocksUnsupported as e:
      say(f"zerojax: warning: {e.strerror}; nothing stops a second run from using {workdir} (two runs in one "
          "workdir delete each other's checkpoints)")
      lock = None
  error = from_process0(error)
  if error is not None:
    raise (WorkdirLocked if error[0] == WorkdirLocked.__name__ else ConfigError)(error[1])
  if stale:
    say(f"zerojax: took over the lock of {workdir}, left by {_who(stale)}, which ended without releasing it")
  try:
    yield lock
  finally:
    if lock is not None:
      lock.release()


def _read(f) -> dict:
  try:
    f.seek(0)
    record = json.loads(f.read() or "{}")
    return record if isinstance(record, dict) else {}
  except (OSError, ValueError):
    return {}


def _who(holder: dict) -> str:
  if not holder.get("pid"):
    return "a process that has not written its host and pid yet"
  return f"host {holder.get('host', '?')}, pid {holder['pid']}, since {holder.get('since', '?')}"
