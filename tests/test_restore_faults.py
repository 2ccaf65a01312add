"""A restore tells damage from trouble: a missing, truncated or undecodable checkpoint is set aside and the
one before it restored; an I/O error or a lack of memory is retried, then stops the start with every
checkpoint in place; a folder whose checkpoints were all set aside is never taken for a fresh run."""
import errno
import glob
import json
import os
import shutil
import subprocess
import sys

import jax
import orbax.checkpoint as ocp
import pytest

import zerojax
from zerojax import plan as plans
from zerojax.train import checkpoint
from tests.helpers import free_port
from tests.train_helpers import ROOT, clean_env, error_line, make_executor, saved_steps, train

# A failed read leaves orbax reader tasks whose event loop is closed when they are collected, later.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
STEPS = (2, 4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A ZeRO-3 executor on 2 x 4 devices and a folder with its checkpoints of steps 2 and 4."""
  ex = make_executor(plans.zero3(), zerojax.make_mesh(2, 4))
  state = ex.init(jax.random.key(0))
  path = str(tmp_path_factory.mktemp("ckpt") / "checkpoints")
  with checkpoint.Checkpointer(path) as c:
    for s in STEPS:
      assert c.save(ex, state.replace(step=jax.numpy.int32(s)), seed=3)
  return ex, path


def copy_of(saved, tmp_path) -> str:
  shutil.copytree(saved[1], tmp_path / "checkpoints")
  return str(tmp_path / "checkpoints")


def folders(path) -> list[str]:
  return sorted(os.listdir(path))


def fail_reads(monkeypatch, error, times):
  """orbax's restore of the state raises `error` the first `times` calls (None: every call)."""
  real, calls = ocp.StandardCheckpointHandler.restore, []

  def restore(self, *args, **kwargs):
    calls.append(1)
    if times is None or len(calls) <= times:
      raise error
    return real(self, *args, **kwargs)

  monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore", restore)
  return calls


def test_a_transient_read_error_is_retried_and_sets_nothing_aside(saved, tmp_path, monkeypatch):
  ex, path = saved[0], copy_of(saved, tmp_path)
  before = folders(path)
  calls = fail_reads(monkeypatch, OSError(errno.EIO, "Input/output error"), times=1)
  monkeypatch.setattr(checkpoint, "READ_BACKOFF_S", 0, raising=False)
  said = []
  with checkpoint.Checkpointer(path) as c:
    resumed = checkpoint.resume(ex, c, warn=said.append)
  assert int(resumed.state.step) == 4 and resumed.meta["seed"] == 3 and len(calls) == 2
  assert folders(path) == before and not glob.glob(os.path.join(path, "*.damaged-*"))
  assert len(said) == 1 and "reading checkpoint" in said[0] and "Input/output error" in said[0]
  assert "trying again" in said[0] and "damaged" not in said[0]


@pytest.mark.parametrize("error", [OSError(errno.EIO, "Input/output error"), OSError(errno.ESTALE, "Stale file handle"),
                                   MemoryError(), ValueError("UNKNOWN: Error reading local file [os_error_code=5]")],
                         ids=["eio", "estale", "memory", "tensorstore-eio"])
def test_a_lasting_read_error_stops_the_start_and_renames_nothing(saved, tmp_path, monkeypatch, error):
  ex, path = saved[0], copy_of(saved, tmp_path)
  before = folders(path)
  fail_reads(monkeypatch, error, times=None)
  said = []
  with checkpoint.Checkpointer(path) as c:
    with pytest.raises(checkpoint.UnreadableCheckpoint) as e:
      checkpoint.resume(ex, c, warn=said.append, tries=3, backoff_s=0)
  msg = str(e.value)
  assert f"reading checkpoint {path}/4 failed 3 times" in msg and "left in place" in msg and "\n" not in msg
  assert folders(path) == before and len(said) == 2  # two retries said, the third failure raised


def damage_all(path):
  for f in glob.glob(os.path.join(path, "*", "state", "**", "d", "*"), recursive=True):
    os.truncate(f, os.path.getsize(f) // 2)


def test_when_every_checkpoint_is_damaged_the_next_start_refuses_unless_start_over(saved, tmp_path):
  ex, path = saved[0], copy_of(saved, tmp_path)
  damage_all(path)
  said = []
  with checkpoint.Checkpointer(path) as c:
    with pytest.raises(checkpoint.CheckpointError, match=r"every checkpoint in .* is damaged.*--start_over"):
      checkpoint.resume(ex, c, warn=said.append)
  assert saved_steps(tmp_path) == [] and len(glob.glob(os.path.join(path, "*.damaged-*"))) == 2
  assert "restoring step 2 instead" in said[0] and "no earlier checkpoint is left" in said[1]

  with checkpoint.Checkpointer(path) as c:  # the same command again: no silent start at step 0
    with pytest.raises(checkpoint.CheckpointError) as e:
      checkpoint.resume(ex, c, warn=said.append)
  msg = str(e.value)
  assert "holds no usable checkpoint, only ones set aside as damaged (2.damaged-" in msg
  assert "a start at step 0 would drop that run's progress" in msg and "--start_over" in msg

  said.clear()
  with checkpoint.Checkpointer(path) as c:
    assert checkpoint.resume(ex, c, warn=said.append, start_over=True) is None
    (other := tmp_path / "other").mkdir()
    shutil.copytree(saved[1], other / "checkpoints")
    with pytest.raises(checkpoint.CheckpointError, match=r"a start from .*other \(--restore_from\) would drop"):
      checkpoint.resume(ex, c, str(other))
    resumed = checkpoint.resume(ex, c, str(other), warn=said.append, start_over=True)
  assert int(resumed.state.step) == 4 and resumed.directory == str(other / "checkpoints")
  assert "--start_over" in said[0] and "starting at step 0" in said[0]
  assert len(glob.glob(os.path.join(path, "*.damaged-*"))) == 2  # kept for inspection


def test_start_over_also_starts_over_when_this_start_finds_every_checkpoint_damaged(saved, tmp_path):
  ex, path = saved[0], copy_of(saved, tmp_path)
  damage_all(path)
  with checkpoint.Checkpointer(path) as c:
    assert checkpoint.resume(ex, c, warn=lambda m: None, start_over=True) is None


def chained(outer, inner):
  try:
    try:
      raise inner
    except Exception as e:
      raise outer from e
  except Exception as e:
    return e


@pytest.mark.parametrize("error,damage", [
    (FileNotFoundError(errno.ENOENT, "gone"), True),
    (json.JSONDecodeError("Expecting value", "", 0), True),
    (EOFError(), True),
    (ValueError('NOT_FOUND: Error opening "zarr" driver [os_error_code=2]'), True),
    (ValueError("OUT_OF_RANGE: Requested byte range [0, 11586) is not valid"), True),
    (ValueError("DATA_LOSS: Error decoding b-tree node: CRC-32C checksum mismatch"), True),
    (ValueError("FAILED_PRECONDITION: Truncated Zstd-compressed stream"), True),
    (KeyError('Item "meta" was not found in the checkpoint'), True),
    (chained(Exception("Encountered error while reading array index"), ValueError("OUT_OF_RANGE: x")), True),
    (OSError(errno.EIO, "Input/output error"), False),
    (OSError(errno.ESTALE, "Stale file handle"), False),
    (PermissionError(errno.EACCES, "Permission denied"), False),
    (MemoryError(), False),
    (chained(Exception("Encountered error while reading array index"), MemoryError()), False),
    (ValueError("UNKNOWN: Error reading local file [os_error_code=5]"), False),
    (ValueError("ABORTED: Error reading local file [os_error_code=116]"), False),
    (ValueError("RESOURCE_EXHAUSTED: Out of memory while reading"), False),
    (RuntimeError("something else"), False),
])
def test_is_damage_tells_damage_from_trouble(error, damage):
  assert checkpoint.is_damage(error) is damage


@pytest.mark.e2e
def test_train_py_refuses_a_second_start_at_step_0_after_every_checkpoint_was_set_aside(tmp_path):
  params = ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=0"]
  r = train(tmp_path, *params)
  assert r.returncode == 0 and saved_steps(tmp_path) == [2, 4], r.stderr[-3000:]
  damage_all(str(tmp_path / "checkpoints"))

  r = train(tmp_path, *params)
  assert r.returncode == 2 and "every checkpoint in" in error_line(r) and "--start_over" in error_line(r)
  r = train(tmp_path, *params)  # a scheduler's retry of the same command
  line = error_line(r)
  assert r.returncode == 2 and "holds no usable checkpoint" in line and "--start_over" in line
  assert saved_steps(tmp_path) == [] and "restored" not in r.stdout

  r = train(tmp_path, *params, extra=["--start_over"])
  assert r.returncode == 0 and "--start_over" in r.stdout and "starting at step 0" in r.stdout, r.stderr[-3000:]
  assert saved_steps(tmp_path) == [2, 4] and len(glob.glob(str(tmp_path / "checkpoints" / "*.damaged-*"))) == 2


@pytest.mark.multiprocess
def test_two_processes_agree_before_anything_is_set_aside(saved, tmp_path):
  """Only process 1 fails to read: an I/O error makes both stop with the checkpoints in place (no process
  waits in a collective the other left); a missing file makes both set the step aside and restore the
  one before it."""
  path = copy_of(saved, tmp_path)
  before = folders(path)
  port, worker = free_port(), os.path.join(ROOT, "tests", "restore_worker.py")
  procs = [subprocess.Popen([sys.executable, worker, str(i), str(port), path], env=clean_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  results = [[json.loads(l) for l in out.splitlines() if l.startswith("{")] for out in outs]
  assert all(p.returncode == 0 for p in procs), [out[-3000:] for out in outs]
  assert results[0] == results[1] == [{"case": "trouble", "error": "UnreadableCheckpoint"},
                                      {"case": "damage", "step": 2}]
  assert [f for f in folders(path) if ".damaged-" not in f] == [f for f in before if f != "4"]
  assert len(glob.glob(os.path.join(path, "4.damaged-*"))) == 1
