"""train.py stopped and started again as people do: Ctrl-C once and twice, a finished run rerun, a resume
with other settings. Each test runs train.py as a subprocess on the TINY model."""
import glob
import json
import os
import re
import signal
import struct
import subprocess
import time

import pytest

from tests.train_helpers import ROOT, clean_env, command, error_line, saved_steps, steps_of, train

STEPS = 60
pytestmark = pytest.mark.e2e  # each test runs train.py and stops it with a signal


def start(workdir, *params, out_dir):
  """Starts train.py with stdout and stderr going to files in `out_dir` (read while it runs)."""
  out, err = open(os.path.join(out_dir, "out.txt"), "w"), open(os.path.join(out_dir, "err.txt"), "w")
  return subprocess.Popen(command(workdir, *params), cwd=ROOT, env=clean_env(), stdout=out, stderr=err, text=True)


def wait_for(predicate, proc, timeout=240):
  deadline = time.time() + timeout
  while not predicate():
    assert proc.poll() is None, f"train.py ended early with {proc.returncode}"
    assert time.time() < deadline, "timed out"
    time.sleep(0.005)


def logged(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  return len(open(path).readlines()) if os.path.exists(path) else 0


def tensorboard_steps(workdir, tag="train/loss") -> list[int]:
  """The steps of `tag` in the TensorBoard event files (TFRecord framing around Event protos)."""
  from tensorboardX.proto import event_pb2
  steps = []
  for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))):
    data, i = open(path, "rb").read(), 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      steps += [event.step for v in event.summary.value if v.tag == tag]
      i += 12 + n + 4
  return steps


def test_ctrl_c_saves_exits_130_and_the_same_command_resumes(tmp_path):
  workdir, params = tmp_path / "run", [f"train.steps={STEPS}", "train.checkpoint_every=0", "train.eval_every=0"]
  proc = start(workdir, *params, out_dir=tmp_path)
  wait_for(lambda: logged(workdir) >= 5, proc)
  proc.send_signal(signal.SIGINT)
  assert proc.wait(timeout=120) == 130
  out = open(tmp_path / "out.txt").read()
  (stopped,) = [int(s) for s in re.findall(r"stopped by SIGINT after step (\d+)", out)]
  assert 5 <= stopped < STEPS and saved_steps(workdir) == [stopped], out[-2000:]
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "stopped by SIGINT" and summary["step"] == stopped
  first_loss = json.loads(open(workdir / "metrics.jsonl").readline())["loss"]

  r = train(workdir, *params, f"train.steps={STEPS + 10}")  # would change the schedule mid-run
  line = error_line(r)
  assert r.returncode == 2 and f"train.steps {STEPS} -> {STEPS + 10}" in line and "learning-rate schedule" in line
  assert "--allow_changed=train.steps" in line

  r = train(workdir, *params, "train.progress=True")
  assert r.returncode == 0 and f"restored step {stopped} from" in r.stdout, r.stderr[-3000:]
  assert re.search(rf"\| {stopped}/{STEPS} \[", r.stderr), "the progress bar starts at the restored step"
  assert steps_of(workdir) == list(range(1, STEPS + 1))  # each step once
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "finished" and summary["first_loss"] == first_loss
  assert sorted(tensorboard_steps(workdir)) == list(range(1, STEPS + 1))
  assert open(workdir / "loss.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_second_ctrl_c_exits_at_once_and_the_checkpoints_stay_readable(tmp_path):
  workdir = tmp_path / "run"
  params = [f"train.steps={STEPS}", "train.checkpoint_every=5", "train.keep_checkpoints=2", "train.eval_every=0"]
  proc = start(workdir, *params, out_dir=tmp_path)
  wait_for(lambda: logged(workdir) >= 9 and saved_steps(workdir), proc)
  proc.send_signal(signal.SIGINT)
  wait_for(lambda: "SIGINT received" in open(tmp_path / "err.txt").read(), proc)
  proc.send_signal(signal.SIGINT)  # while it finishes the step and saves
  assert proc.wait(timeout=120) == -signal.SIGINT  # ended by the signal itself: status 130 in a shell
  assert "stopped by SIGINT" not in open(tmp_path / "out.txt").read()

  r = train(workdir, *params)
  assert r.returncode == 0, r.stderr[-3000:]
  (restored,) = [int(s) for s in re.findall(r"restored step (\d+) from", r.stdout)]
  assert restored >= 5 and "warning" not in r.stdout
  assert steps_of(workdir) == list(range(1, STEPS + 1))
  assert not glob.glob(str(workdir / "checkpoints" / "*tmp*"))  # the interrupted save's leftovers are gone


def files_of(folder) -> dict:
  """Each file's modification time; not the workdir's lock, which every start takes (its holder record)."""
  return {os.path.relpath(os.path.join(d, f), folder): os.stat(os.path.join(d, f)).st_mtime_ns
          for d, _, fs in os.walk(folder) for f in fs if f != "run.lock"}


def test_finished_run_is_left_as_it_is_more_steps_continue_other_settings_are_refused(tmp_path):
  r = train(tmp_path, "train.steps=6")
  assert r.returncode == 0, r.stderr[-3000:]
  before = files_of(tmp_path)
  assert "config.gin" in before and "summary.json" in before

  # The config.gin the run wrote is all it takes to run it again: it has finished, so nothing changes.
  r = train(tmp_path, gin_file=str(tmp_path / "config.gin"), tiny=False)
  assert r.returncode == 0 and "the run already finished" in r.stdout, r.stderr[-3000:]
  assert files_of(tmp_path) == before

  r = train(tmp_path, "train.steps=10")
  assert r.returncode == 0 and "the run finished at step 6; continuing to train.steps=10" in r.stdout, r.stderr
  assert steps_of(tmp_path) == list(range(1, 11)) and "train.steps = 10" in open(tmp_path / "config.gin").read()

  r = train(tmp_path, "train.steps=12", "train.batch_size=16")
  line = error_line(r)
  assert r.returncode == 2 and "train.batch_size 8 -> 16" in line and "--allow_changed=train.batch_size" in line

  r = train(tmp_path, "train.steps=12", "model_config.d_model=64", extra=["--allow_changed=train.batch_size"])
  line = error_line(r)
  assert r.returncode == 2 and "is of another model or optimizer (model_config.d_model 32 -> 64" in line

  r = train(tmp_path, "train.steps=12", "train.batch_size=16", extra=["--allow_changed=train.batch_size"])
  assert r.returncode == 0 and "continuing with changed settings train.batch_size 8 -> 16" in r.stdout, r.stderr
  assert steps_of(tmp_path) == list(range(1, 13))
