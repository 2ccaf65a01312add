"""train.py as a 2-process cluster: a killed process stops the other within a bounded time, and the
same two commands started again resume from the last checkpoint."""
import os
import re
import subprocess
import sys
import time

import pytest

from tests.helpers import free_port
from tests.train_helpers import ROOT, TINY, clean_env, saved_steps as steps_saved, steps_of

STEPS = 30
HEARTBEAT_S = 5


def start(workdir, pid, port):
  args = [sys.executable, os.path.join(ROOT, "train.py"), "--gin_file=configs/zero3.gin", f"--workdir={workdir}",
          f"--coordinator=localhost:{port}", "--num_processes=2", f"--process_id={pid}", "--devices=4",
          f"--heartbeat_timeout={HEARTBEAT_S}"]
  params = TINY + [f"train.steps={STEPS}", "train.checkpoint_every=4", "train.eval_every=0"]
  return subprocess.Popen(args + [f"--gin_param={p}" for p in params], cwd=ROOT, env=clean_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.multiprocess
def test_killed_process_stops_its_peer_and_both_resume(tmp_path):
  workdir = str(tmp_path)
  port = free_port()
  procs = [start(workdir, i, port) for i in range(2)]
  try:
    deadline = time.time() + 300
    while not steps_saved(workdir) and time.time() < deadline and all(p.poll() is None for p in procs):
      time.sleep(0.05)
    assert steps_saved(workdir), "no checkpoint before the kill:\n" + procs[0].communicate(timeout=60)[0][-3000:]
    procs[1].kill()
    killed_at = time.time()
    out = procs[0].communicate(timeout=120)[0]  # bounded: no hang
    waited = time.time() - killed_at
  finally:
    for p in procs:
      p.kill()
  assert procs[0].returncode != 0, out[-3000:]
  assert waited < HEARTBEAT_S + 45, f"the surviving process took {waited:.0f}s to stop"
  last = max(steps_saved(workdir))
  assert last < STEPS, "the run finished before the kill"

  port = free_port()
  procs = [start(workdir, i, port) for i in range(2)]
  try:
    outs = [p.communicate(timeout=400)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert re.search(rf"restored step {last} from", outs[0]), outs[0][-3000:]
  assert steps_of(workdir) == list(range(1, STEPS + 1))
