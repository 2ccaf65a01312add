"""A node's own copies (`zerojax.train.replica`) against faults: written durably (files and folder
fsynced, a rewritten step renamed away before it is removed), a copy that does not read completely
falls back to an earlier copy or to the checkpoint, and copies of another run are never restored; the
copy is written on a thread (a failure said in one line), at a cadence turned from seconds into steps."""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import jax
import numpy as np
import pytest

import zerojax
import zerojax.plan as plans
from tests import helpers
from zerojax.train import replica
from zerojax.train.state_spec import CheckpointError


@pytest.fixture(scope="module")
def setup():
  """MiCS on 2 nodes x 2 devices and its initial state (a replica per node: node copies apply)."""
  ex = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(),
                        dataclasses.replace(plans.mics(param_dtype="float32"), pad_multiple=1),
                        zerojax.make_mesh(2, 2, devices=jax.devices()[:4]))
  return ex, ex.init(jax.random.key(0))


def at(state, step):
  return state.replace(step=jax.numpy.int32(step))


def test_a_truncated_node_copy_falls_back_to_an_earlier_copy_then_to_the_checkpoint(setup, tmp_path):
  ex, state = setup
  folder = str(tmp_path / "node0")
  for s in (1, 2):
    replica.save(ex, at(state, s), folder, 0, seed=5)
  latest = os.path.join(folder, "2", replica.STATE)
  os.truncate(latest, os.path.getsize(latest) // 2)  # as a crash of a disk without ordered writes may leave it
  said = []
  assert replica.agree(folder, False, 0, warn=said.append) == (1, [True], 0)
  assert len(said) == 1 and f"node copy {folder}/2 cannot be read (BadZipFile" in said[0]
  assert "earlier copy or the checkpoint" in said[0]
  with pytest.raises(CheckpointError, match=f"the node copy {folder}/2 cannot be read"):
    replica.restore(ex, 2, [True, False], {0: folder})  # a one-line error, not a BadZipFile
  assert int(replica.restore(ex, 1, [True, False], {0: folder}).step) == 1

  open(os.path.join(folder, "1", replica.STATE), "wb").close()  # empty: EOFError
  said.clear()
  assert replica.agree(folder, False, 0, warn=said.append) is None  # the run restores its checkpoint
  assert len(said) == 2 and "EOFError" in said[0]


def test_a_copy_whose_metadata_is_cut_is_not_used(setup, tmp_path):
  ex, state = setup
  folder = str(tmp_path / "node0")
  replica.save(ex, at(state, 3), folder, 0, seed=5)
  (tmp_path / "node0" / "3" / replica.META).write_text('{"step": 3, "no')
  said = []
  assert replica.agree(folder, False, 0, warn=said.append) is None and "JSONDecodeError" in said[0]


def test_copies_of_another_run_are_never_restored(setup, tmp_path):
  ex, state = setup
  folder, first, second = str(tmp_path / "node0"), tmp_path / "run1", tmp_path / "run2"
  run = replica.run_id(str(first))
  assert replica.run_id(str(first)) == run != replica.run_id(str(second))  # the workdir's, kept across starts
  said = []
  replica.claim(folder, run, warn=said.append)
  replica.save(ex, at(state, 4), folder, 0, seed=5)
  assert said == [] and json.loads((tmp_path / "node0" / "4" / replica.META).read_text())["run"] == run
  replica.claim(folder, run, warn=said.append)  # the same run started again: its copies count
  assert said == [] and replica.agree(folder, False, 0, warn=said.append) == (4, [True], 0)

  other = replica.run_id(str(second))  # a new workdir, the node's folder left from the first run
  replica.claim(folder, other, warn=said.append)
  assert len(said) == 1 and f"--replica_dir {folder} holds node copies of another run (run {run}: steps [4]" in said[0]
  assert replica.agree(folder, False, 0, warn=said.append) is None and len(said) == 1
  replica.save(ex, at(state, 2), folder, 0, seed=6)  # this run's first copy replaces the other run's
  assert replica.steps(folder) == [2] and replica.agree(folder, False, 0) == (2, [True], 0)


def test_a_copy_is_fsynced_and_a_rewritten_step_is_renamed_away_before_it_is_removed(setup, tmp_path, monkeypatch):
  ex, state = setup
  folder = str(tmp_path / "node0")
  replica.save(ex, at(state, 2), folder, 0, seed=5)
  synced, renames, real_fsync, real_rename = [], [], os.fsync, os.rename

  def fsync(fd):
    synced.append(os.readlink(f"/proc/self/fd/{fd}"))
    real_fsync(fd)

  def rename(src, dst):
    renames.append((os.path.basename(src), os.path.basename(dst), os.path.exists(os.path.join(folder, "2"))))
    real_rename(src, dst)

  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "rename", rename)
  replica.save(ex, at(state, 2), folder, 0, seed=6)  # step 2 again (a restart trained it again)
  monkeypatch.undo()
  tmp = [s for s in synced if os.path.basename(s).startswith(".tmp-2-")]
  assert {os.path.basename(s) for s in synced if s.startswith(tuple(tmp))} >= {replica.STATE, replica.META}
  assert tmp and synced[-1] == folder  # the files, their folder, then the renames
  (away, _), (new, _) = [(r[0], r[1]) for r in renames]
  assert away == "2" and new.startswith(".tmp-2-") and [r[1] for r in renames] == [f".old-2-{os.getpid()}", "2"]
  assert replica.read_meta(folder, 2)["seed"] == 6 and sorted(os.listdir(folder)) == ["2"]


# -- the copy on a thread, and its cadence ------------------------------------------------------------

def test_a_copy_is_written_on_a_thread_while_the_steps_go_on(setup, tmp_path, monkeypatch):
  """`Writer.save` returns once the arrays are off the devices; the files are written on its thread (here
  held by a slow disk), and the next save waits for the write in flight."""
  ex, state = setup
  folder, real, release, writing = str(tmp_path / "node0"), np.savez, threading.Event(), []

  def slow(path, **arrays):
    writing.append(path)
    assert release.wait(60)
    real(path, **arrays)

  monkeypatch.setattr(np, "savez", slow)
  writer = replica.Writer()
  writer.save(ex, at(state, 3), folder, 0, seed=5)
  deadline = time.monotonic() + 30
  while not writing:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  assert replica.steps(folder) == []  # the save returned before its copy is complete
  second = threading.Thread(target=writer.save, args=(ex, at(state, 4), folder, 0), kwargs={"seed": 5})
  second.start()
  second.join(0.3)
  assert second.is_alive() and len(writing) == 1  # one write in flight: the next save waits for it
  release.set()
  second.join(60)
  writer.wait()
  assert replica.steps(folder) == [3, 4] and int(replica.restore(ex, 4, [True, False], {0: folder}).step) == 4


def test_a_failed_write_surfaces_as_one_line_at_the_next_save_or_at_the_end(setup, tmp_path, monkeypatch):
  ex, state = setup
  folder, failed = str(tmp_path / "node0"), threading.Event()

  def full(path, **arrays):
    failed.set()
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(np, "savez", full)
  writer = replica.Writer()
  writer.save(ex, at(state, 3), folder, 0, seed=5)  # returns: the disk fails on the writer's thread
  assert failed.wait(30)
  monkeypatch.undo()
  with pytest.raises(replica.CopyError) as e:
    writer.save(ex, at(state, 4), folder, 0, seed=5)
  assert str(e.value) == (f"writing the node copy of step 3 to {folder} failed (OSError: [Errno 28] No space left "
                          "on device); the earlier copies are kept: free space on that disk or point --replica_dir "
                          "elsewhere, then run again")
  assert isinstance(e.value, OSError)  # train.py prints it as its one `error:` line and exits 2
  monkeypatch.setattr(np, "savez", full)
  writer.save(ex, at(state, 5), folder, 0, seed=5)
  with pytest.raises(replica.CopyError, match="of step 5 "):
    writer.wait()  # the end of the run
  writer.wait()  # said once
  assert replica.steps(folder) == []


def test_the_cadence_turns_seconds_into_steps_once(monkeypatch):
  """About every 2 s at 0.5 s per step (measured after the first, compiling, step): every 4 steps."""
  clock = iter([0.0, 30.0, 30.5, 31.0, 31.5])
  monkeypatch.setattr(replica.time, "monotonic", lambda: next(clock))
  cadence = replica.Cadence(None, 2.0)
  assert [s for s in range(1, 14) if cadence.due(s)] == [8, 12] and cadence.every == 4
  assert [s for s in range(1, 8) if replica.Cadence(3, 120.0).due(s)] == [3, 6]


def test_the_cadence_lengthens_when_a_copy_blocks_more_than_its_budget(monkeypatch):
  """0.5 s steps, a copy every 4 steps (2 s): a copy that holds the loop 0.51 s (0.01 s beyond the step it
  waits for anyway) is within 1% of 4 steps' 2 s and changes nothing; one that holds it 1.5 s (1 s beyond)
  needs 200 steps between copies to stay within 1%. A fixed interval (the user's) is kept."""
  clock = iter([0.0, 30.0, 30.5, 31.0, 31.5])
  monkeypatch.setattr(replica.time, "monotonic", lambda: next(clock))
  cadence = replica.Cadence(None, 2.0)
  [cadence.due(s) for s in range(1, 6)]
  cadence.copied(0.51)
  assert cadence.every == 4
  cadence.copied(1.5)
  assert cadence.every == 200
  fixed = replica.Cadence(3, 120.0)
  fixed.copied(100.0)
  assert fixed.every == 3
