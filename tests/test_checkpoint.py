"""Checkpoints: bitwise resume after SIGKILL or SIGTERM, restore onto other meshes, plans and process
counts, clear errors for missing, damaged or mismatched checkpoints, export of plain parameters."""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import gin
import jax
import numpy as np
import pytest

import zerojax
from zerojax.engine import layout
from zerojax import plan as plans
from zerojax.train import checkpoint, export, signals, state_spec
from zerojax.models.gpt import gpt
from tests import helpers
from tests.helpers import free_port
from tests.train_helpers import STEPS, TRAIN_STEPS, make_executor, records, run_train

# A failed read leaves orbax reader tasks whose event loop is closed when they are collected, later.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def flat_numpy(tree) -> dict:
  """`{"params/blocks/qkv/kernel": array, ...}` of a stored-layout tree."""
  return {state_spec.SEP.join(layout.path_names(p)): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A ZeRO-3 state on 2 nodes x 4 devices after 2 adamw steps, its logical arrays and checkpoint folder."""
  ex = make_executor(plans.zero3(), zerojax.make_mesh(2, 4))
  state, step = ex.init(jax.random.key(0)), ex.step_fn()
  for b in helpers.batches(STEPS, 1):
    state, _ = step(state, jax.device_put(b, ex.batch_sharding))
  path = str(tmp_path_factory.mktemp("ckpt") / "single")
  with checkpoint.Checkpointer(path) as c:
    assert c.save(ex, state, seed=7)
  return ex, state, flat_numpy(state_spec.logical_state(ex, state)), path


def restore(ex, path):
  with checkpoint.Checkpointer(path, read_only=True) as c:
    return c.restore(ex)


@pytest.mark.parametrize("target", ["zero3_2x4", "mics_1x4", "dp_8x1"])
def test_restore_onto_other_mesh_and_plan(saved, target):
  _, _, want, path = saved
  plan, mesh = {"zero3_2x4": (plans.zero3(), zerojax.make_mesh(2, 4)),
                "mics_1x4": (plans.mics(), zerojax.make_mesh(1, 4, devices=jax.devices()[:4])),
                "dp_8x1": (plans.dp(), zerojax.make_mesh(8, 1))}[target]
  ex = make_executor(plan, mesh)
  state, meta = restore(ex, path)
  assert meta["seed"] == 7 and meta["step"] == STEPS and meta["plan"] == "zero3"
  assert int(state.step) == STEPS and int(state.skipped) == 0
  helpers.assert_trees_identical(flat_numpy(state_spec.logical_state(ex, state)), want)
  assert jax.tree.map(lambda x: x.sharding, state) == ex.shardings()


def test_restore_is_exact_in_the_flat_layout(saved):
  """Same executor: the flat padded state comes back bit for bit, padding included."""
  ex, state, _, path = saved
  got, _ = restore(ex, path)
  helpers.assert_trees_identical(got, state)


def test_stored_layout_is_logical(saved):
  ex, _, want, _ = saved
  params = ex.logical_params(saved[1])
  for p, x in jax.tree_util.tree_leaves_with_path(params):
    key = state_spec.SEP.join(("params",) + layout.path_names(p))
    assert want[key].shape == x.shape
    mu = [k for k in want if k.startswith("opt_state") and k.endswith("/mu/" + key[len("params/"):])]
    assert len(mu) == 1 and want[mu[0]].shape == x.shape


def test_export_params(saved, tmp_path):
  ex, state, want, _ = saved
  params = export.export_params(ex, state, str(tmp_path / "params.npz"))
  back = export.load_params(str(tmp_path / "params.npz"))
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for key, x in flat_numpy(back).items():
    np.testing.assert_array_equal(x, want["params/" + key], strict=True)
  assert params["blocks"]["qkv"]["kernel"].shape == (2, 32, 96)


def test_keeps_the_last_k(saved, tmp_path):
  ex, state, _, _ = saved
  with checkpoint.Checkpointer(str(tmp_path), max_to_keep=2) as c:
    for k in range(3, 6):
      assert c.save(ex, state.replace(step=jax.numpy.int32(k)))
    assert not c.save(ex, state.replace(step=jax.numpy.int32(5)))  # that step is already saved
    c.wait()
    assert c.all_steps() == [4, 5]


# -- errors ------------------------------------------------------------------------------------------

def test_missing_checkpoint(saved, tmp_path):
  ex = saved[0]
  with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
    checkpoint.Checkpointer(str(tmp_path / "nowhere"), read_only=True)
  (tmp_path / "empty").mkdir()
  with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint in .*empty"):
    restore(ex, str(tmp_path / "empty"))
  with checkpoint.Checkpointer(str(tmp_path / "own")) as own:
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in"):
      checkpoint.resume(ex, own, restore_from=str(tmp_path / "empty"))
    assert checkpoint.resume(ex, own) is None  # nothing requested: a fresh run


def test_train_never_starts_from_scratch_when_a_restore_is_requested(tmp_path):
  from zerojax.train import trainer
  (tmp_path / "empty").mkdir()
  gin.parse_config(["train.plan = @zero3()", "model_config.d_model = 32", "model_config.num_layers = 1",
                    "model_config.seq_len = 16", "train.batch_size = 8"])
  try:
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in"):
      trainer.train(str(tmp_path / "run"), restore_from=str(tmp_path / "empty"))
  finally:
    gin.clear_config()
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("victim", ["state/d/*", "state/manifest.ocdbt", "state/_METADATA", "meta/metadata",
                                    "truncate state/d/*"])
def test_damaged_checkpoint(saved, tmp_path, victim):
  ex, _, _, path = saved
  copy = str(tmp_path / "copy")
  shutil.copytree(path, copy)
  files = glob.glob(os.path.join(copy, str(STEPS), victim.split()[-1]))
  assert files, victim
  for f in files:
    if victim.startswith("truncate"):
      os.truncate(f, os.path.getsize(f) // 2)
    else:
      os.remove(f)
  with pytest.raises(checkpoint.CheckpointError, match=rf"checkpoint .*/{STEPS} is incomplete or damaged"):
    restore(ex, copy)


def test_other_model_shape(saved):
  cfg = helpers.TINY.__class__(**{**vars(helpers.TINY), "d_model": 64})
  ex = make_executor(plans.zero3(), zerojax.make_mesh(2, 4), model=gpt(cfg))
  with pytest.raises(checkpoint.CheckpointError) as e:
    restore(ex, saved[3])
  msg = str(e.value)
  assert "the model differs" in msg
  assert "params/blocks/fc/kernel: saved shape (2, 32, 128) float32, expected shape (2, 64, 256) float32" in msg


def test_other_optimizer(saved):
  ex = make_executor(plans.zero3(), zerojax.make_mesh(2, 4), optimizer="sgd")
  with pytest.raises(checkpoint.CheckpointError) as e:
    restore(ex, saved[3])
  msg = str(e.value)
  assert "the optimizer differs" in msg
  assert re.search(r"opt_state/\S+/mu/blocks/fc/bias: saved shape \(2, 128\) float32, but this run has no", msg)
  assert re.search(r"opt_state/\S+/trace/blocks/fc/bias: expected shape \(2, 128\) float32, but the "
                   "checkpoint has no such leaf", msg)


def test_stop_signal():
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  with signals.StopSignal() as stop:
    assert stop.requested() == 0
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)
    assert stop.requested() == signal.SIGTERM and signals.exit_code(stop.requested()) == 143
    # a second signal of either kind ends the process at once
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
  assert {s: signal.getsignal(s) for s in before} == before


# -- a real 2-process cluster -----------------------------------------------------------------------

@pytest.mark.multiprocess
def test_two_processes_save_and_restore(saved, tmp_path):
  """A 1-process checkpoint restores onto 2 processes x 4 devices (ZeRO-3), which save it again; one
  process restores that onto 1 x 4 (MiCS) and 8 x 1 (DP): every logical array is bitwise the original."""
  _, _, want, path = saved
  shutil.copytree(path, tmp_path / "single")
  port, env = free_port(), {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  worker = os.path.join(ROOT, "tests", "ckpt_worker.py")
  procs = [subprocess.Popen([sys.executable, worker, str(i), str(port), str(tmp_path)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  for plan, mesh in [(plans.mics(), zerojax.make_mesh(1, 4, devices=jax.devices()[:4])),
                     (plans.dp(), zerojax.make_mesh(8, 1))]:
    target = make_executor(plan, mesh)
    state, meta = restore(target, str(tmp_path / "multi"))
    assert meta["process_count"] == 2 and meta["mesh"] == {"node": 2, "gpu": 4}
    helpers.assert_trees_identical(flat_numpy(state_spec.logical_state(target, state)), want)


# -- train.py: kill, restart, compare ---------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  rc, out, recs, restored = run_train(str(tmp_path_factory.mktemp("uninterrupted")))
  assert rc == 0 and restored is None, out[-3000:]
  assert [r[0] for r in recs] == list(range(1, TRAIN_STEPS + 1))
  return recs


@pytest.mark.e2e
def test_sigkill_and_sigterm_then_restart_are_bitwise_identical(uninterrupted, tmp_path):
  """SIGKILL between checkpoints loses only the steps since the last one; SIGTERM saves the current step
  and exits with 143. Every restart continues with exactly the losses of a run never interrupted."""
  workdir = str(tmp_path)
  has = lambda step: os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))
  rc, out, first, restored = run_train(workdir, signal.SIGKILL, lambda s: s >= 6 and has(4))
  assert rc == -signal.SIGKILL and restored is None, out[-3000:]
  assert first == uninterrupted[:len(first)] and first[-1][0] < TRAIN_STEPS, "finished before the kill"

  rc, out, second, restored = run_train(workdir, signal.SIGTERM, lambda s: s >= first[-1][0] + 2)
  assert rc == 143, out[-3000:]
  assert restored % 4 == 0 and 4 <= restored <= first[-1][0]
  assert second == uninterrupted[restored:restored + len(second)]  # exact floats: bitwise
  (stopped,) = [int(s) for s in re.findall(r"stopped by SIGTERM after step (\d+)", out)]
  assert second[-1][0] == stopped < TRAIN_STEPS, "finished before SIGTERM"
  assert has(stopped)

  rc, out, third, restored = run_train(workdir)
  assert rc == 0 and restored == stopped, out[-3000:]
  assert third == uninterrupted[stopped:]
  assert records(workdir) == uninterrupted  # metrics.jsonl: each step once, as if never interrupted
