"""train.py against faults: a damaged latest checkpoint, writes that fail during a save (a file-size limit,
an immutable checkpoint folder), a workdir that cannot exist, a start from another directory."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.train_helpers import command, error_line, error_line_of, run_main, saved_steps, steps_of, train


def losses(workdir) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.mark.e2e
def test_damaged_latest_checkpoint_is_skipped_with_a_warning(tmp_path):
  params = ["train.steps=8", "train.checkpoint_every=4", "train.eval_every=0"]
  r = train(tmp_path, *params)
  assert r.returncode == 0 and saved_steps(tmp_path) == [4, 8], r.stderr[-3000:]
  before = losses(tmp_path)
  files = glob.glob(str(tmp_path / "checkpoints" / "8" / "state" / "**" / "d" / "*"), recursive=True)
  assert files
  for f in files:  # as a crash of a filesystem without atomic renames might leave them
    os.truncate(f, os.path.getsize(f) // 2)

  r = train(tmp_path, *params)
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"warning: checkpoint {tmp_path}/checkpoints/8 is incomplete or damaged" in r.stdout
  assert "restoring step 4 instead" in r.stdout and "restored step 4 from" in r.stdout
  assert saved_steps(tmp_path) == [4, 8] and glob.glob(str(tmp_path / "checkpoints" / "8.damaged-*"))
  assert steps_of(tmp_path) == list(range(1, 9)) and losses(tmp_path) == before  # steps 5-8 again, bitwise


# Runs a command under a file-size limit: every write past 64 kB fails (EFBIG) as on a full disk; the
# checkpoint's arrays do not fit, the metrics and event files do.
LIMIT_FILE_SIZE = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
                   "(64_000, 64_000)); os.execv(sys.argv[1], sys.argv[1:])"]


@pytest.mark.e2e
def test_failed_save_keeps_the_previous_checkpoint_and_says_so_in_one_line(tmp_path):
  r = train(tmp_path, "train.steps=4")
  assert r.returncode == 0 and saved_steps(tmp_path) == [4], r.stderr[-3000:]

  r = train(tmp_path, "train.steps=8", prefix=LIMIT_FILE_SIZE)
  line = error_line(r)
  assert r.returncode == 2 and f"saving the checkpoint of step 8 in {tmp_path}/checkpoints failed" in line
  assert "File too large" in line and "the checkpoint of step 4 is intact" in line
  assert saved_steps(tmp_path) == [4]

  r = train(tmp_path, "train.steps=8")
  assert r.returncode == 0 and "restored step 4 from" in r.stdout, r.stderr[-3000:]
  assert saved_steps(tmp_path) == [4, 8] and not glob.glob(str(tmp_path / "checkpoints" / "*tmp*"))


def _chattr(flag, path) -> bool:
  return shutil.which("chattr") is not None and subprocess.run(
      ["chattr", flag, str(path)], capture_output=True).returncode == 0


@pytest.mark.e2e
def test_read_only_checkpoint_folder_during_a_save(tmp_path):
  """`chmod` does not stop root; an immutable folder (`chattr +i`) stops every user from writing in it."""
  r = train(tmp_path, "train.steps=4")
  assert r.returncode == 0 and saved_steps(tmp_path) == [4], r.stderr[-3000:]
  folder = tmp_path / "checkpoints"
  if not _chattr("+i", folder):
    pytest.skip("chattr +i is not available on this filesystem")
  try:
    r = train(tmp_path, "train.steps=8")
  finally:
    _chattr("-i", folder)
  line = error_line(r)
  assert r.returncode == 2 and "saving the checkpoint of step 8" in line and "step 4 is intact" in line
  assert saved_steps(tmp_path) == [4] and steps_of(tmp_path) == list(range(1, 9))  # the rerun resumes from 4


def test_workdir_under_a_file_is_a_one_line_error(tmp_path, capsys, monkeypatch):
  (tmp_path / "file").write_text("not a folder")
  code, _, err = run_main(command(tmp_path / "file" / "run", "train.steps=1")[2:], capsys, monkeypatch)
  line = error_line_of(err)
  assert code == 2 and f"{tmp_path}/file/run" in line and "use a --workdir you can write to" in line


@pytest.mark.e2e
def test_runs_from_another_directory_with_includes_next_to_the_config(tmp_path):
  """The repository's config (which includes 'configs/base.gin') named relative to the repository, and a
  user's config elsewhere whose include is relative to its own folder, from a third directory."""
  mine, elsewhere = tmp_path / "mine", tmp_path / "elsewhere"
  mine.mkdir()
  elsewhere.mkdir()
  (mine / "short.gin").write_text("include 'steps.gin'\ntrain.eval_every = 0\n")
  (mine / "steps.gin").write_text("train.steps = 3\n")
  r = train(tmp_path / "run", gin_file=None, extra=["--gin_file=configs/zero3.gin", "--gin_file=../mine/short.gin"],
            cwd=elsewhere)
  assert r.returncode == 0, r.stderr[-3000:]
  assert steps_of(tmp_path / "run") == [1, 2, 3]
  assert "train.steps = 3" in open(tmp_path / "run" / "config.gin").read()
