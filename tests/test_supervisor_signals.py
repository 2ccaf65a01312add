"""The supervisor (`zerojax.train.supervisor`) on stand-in processes: a signal to it reaches the trainers,
which save before they exit (SIGKILL only after the grace period); a usage error on every node is reported
with the node's own error line, not as a lost node."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from zerojax.cli.supervise import error_line
from zerojax.train import supervisor

STAND_IN = r"""
import os, signal, sys, time
work, node, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "usage":
  print("zerojax: train.py starting", flush=True)
  print(f"zerojax: error: config configs/mine.gin:3: Configurable 'train' doesn't have a parameter named 'stesp' "
        "(did you mean train.steps?) (--verbose shows the traceback)", flush=True)
  sys.exit(2)

def stop(signum, frame):
  with open(os.path.join(work, f"saved{node}"), "w") as f:
    f.write(signal.Signals(signum).name)
  sys.exit(128 + signum)

if mode != "stubborn":
  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
else:
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(work, f"ready{node}"), "w").close()
for _ in range(200):
  time.sleep(0.05)
"""


def make(tmp_path, modes, **kw):
  script = tmp_path / "node.py"
  script.write_text(STAND_IN)
  starts, lines = [], []

  def launch(s):
    starts.append(s)
    with open(tmp_path / f"node{s.node}.log", "a") as out:
      out.write(f"--- generation {s.generation}: process {s.process_id} of {s.num_processes}\n")
      out.flush()
      return subprocess.Popen([sys.executable, str(script), str(tmp_path), str(s.node), modes[s.node], *s.args],
                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

  sup = supervisor.Supervisor(len(modes), launch, str(tmp_path), lambda n: str(tmp_path / f"r{n}"), log=lines.append,
                              error_line=lambda n: error_line(str(tmp_path / f"node{n}.log")), **kw)
  return sup, starts, lines


def signal_when_ready(tmp_path, nodes, sig):
  """Sends `sig` to this process once every stand-in is up (from a thread: the supervisor runs here)."""
  def go():
    end = time.monotonic() + 60
    while not all((tmp_path / f"ready{n}").exists() for n in range(nodes)) and time.monotonic() < end:
      time.sleep(0.02)
    os.kill(os.getpid(), sig)

  thread = threading.Thread(target=go, daemon=True)
  thread.start()
  return thread


@pytest.fixture
def fallback_handlers():
  """Handlers that only note a signal, in case the supervisor installs none (the test then fails, rather
  than the signal ending the test process)."""
  got = []
  before = {s: signal.signal(s, lambda signum, frame: got.append(signum))
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
  yield got
  for s, h in before.items():
    signal.signal(s, h)


@pytest.mark.parametrize("sig,forwarded", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM"),
                                           (signal.SIGHUP, "SIGTERM")])
def test_a_signal_to_the_supervisor_reaches_the_trainers_which_save(tmp_path, fallback_handlers, sig, forwarded):
  sup, starts, lines = make(tmp_path, ["plain"] * 3, stop_grace_s=30)
  signal_when_ready(tmp_path, 3, sig)
  t0 = time.monotonic()
  status = sup.run()
  assert status == 128 + sig and time.monotonic() - t0 < 9, lines  # not the stand-ins' own end
  assert [(tmp_path / f"saved{n}").read_text() for n in range(3)] == [forwarded] * 3  # each saved: no SIGKILL
  assert len(lines) == 1 and f"{signal.Signals(sig).name} received; sending {forwarded} to nodes [0, 1, 2]" in lines[0]
  assert len(starts) == 3 and not fallback_handlers


def test_a_trainer_that_does_not_stop_is_killed_after_the_grace_period(tmp_path, fallback_handlers):
  sup, _, lines = make(tmp_path, ["plain", "stubborn"], stop_grace_s=0.5)
  signal_when_ready(tmp_path, 2, signal.SIGTERM)
  assert sup.run() == 128 + signal.SIGTERM
  assert (tmp_path / "saved0").read_text() == "SIGTERM" and not (tmp_path / "saved1").exists()
  assert "nodes [1] did not stop in time and were SIGKILLed" in lines[-1]


def test_a_usage_error_on_every_node_is_reported_with_its_own_line(tmp_path):
  sup, starts, lines = make(tmp_path, ["usage"] * 3, restart_after=0.1)
  sup.start([0, 1, 2])
  try:
    end = time.monotonic() + 60
    while sup.poll() is None:
      assert time.monotonic() < end
      time.sleep(0.02)
  finally:
    sup.stop_all()
  assert sup.status == 2 and len(starts) == 3  # nothing restarted
  assert len(lines) == 1 and "lost" not in lines[0]
  assert lines[0].startswith("zerojax: supervisor: train.py stopped with a usage error (exit status 2) on every "
                             "node [0, 1, 2]: zerojax: error: config configs/mine.gin:3: Configurable 'train'")
