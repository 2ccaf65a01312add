"""One run per workdir (`zerojax.train.workdir_lock`): a second run is refused in one line naming the
first's host and pid while the first holds the lock; the lock of a process that died is taken over."""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from zerojax.train import workdir_lock
from tests.train_helpers import ROOT, command, error_line_of, run_main

HOLD = ("import sys; from zerojax.train.workdir_lock import WorkdirLock; lock = WorkdirLock(sys.argv[1]); "
        "lock.acquire(); print('held', flush=True); sys.stdin.read()")


@pytest.fixture
def holder(tmp_path):
  """Another process holding the lock of tmp_path/run until the test ends."""
  p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], cwd=ROOT, stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True)
  try:
    assert p.stdout.readline().strip() == "held"
    yield p
  finally:
    p.kill()
    p.wait()


def test_a_second_run_in_a_workdir_is_refused_while_the_first_holds_it(tmp_path, holder, capsys, monkeypatch):
  with pytest.raises(workdir_lock.WorkdirLocked) as e:
    workdir_lock.WorkdirLock(str(tmp_path / "run")).acquire()
  assert f"host {socket.gethostname()}, pid {holder.pid}" in str(e.value)

  code, out, err = run_main(command(tmp_path / "run", "train.steps=1")[2:], capsys, monkeypatch)
  line = error_line_of(err)
  assert code == 2 and f"--workdir {tmp_path}/run is in use by another run (host {socket.gethostname()}, pid " \
      f"{holder.pid}" in line and "use another --workdir" in line
  assert sorted(os.listdir(tmp_path / "run")) == ["run.lock"]  # nothing else touched


def test_the_lock_of_a_process_that_died_is_taken_over_and_released_at_the_end(tmp_path, holder):
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  said = []
  with workdir_lock.hold(str(tmp_path / "run"), say=said.append) as lock:
    record = json.loads(open(lock.path).read())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(workdir_lock.WorkdirLocked):  # this process holds it: another open is refused too
      workdir_lock.WorkdirLock(str(tmp_path / "run")).acquire()
  assert len(said) == 1 and f"left by host {socket.gethostname()}, pid {holder.pid}" in said[0]
  assert open(tmp_path / "run" / "run.lock").read() == ""  # released: the next start takes it silently
  with workdir_lock.hold(str(tmp_path / "run"), say=said.append):
    pass
  assert len(said) == 1


def test_a_filesystem_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
  import errno
  import fcntl

  def flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(fcntl, "flock", flock)
  said = []
  with workdir_lock.hold(str(tmp_path / "run"), say=said.append) as lock:
    assert lock is None
  assert len(said) == 1 and "No locks available" in said[0] and "nothing stops a second run" in said[0]
