"""The checkpoint folder: orbax saves (asynchronous, atomic) and restores of the logical train state.

See `zerojax.train.state_spec` for what is stored and why it restores onto any mesh or plan.

References:
  Orbax checkpointing: https://orbax.readthedocs.io/en/latest/guides/checkpoint/checkpoint_manager.html
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from zerojax.train.state_spec import CheckpointError, FORMAT, check_compatible, saved_leaves, state_spec_of, logical_state


class Checkpointer:
  """A folder of train-state checkpoints: saves asynchronously, keeps the last `max_to_keep`.

  Every process calls every method (saving is collective); each writes only its own shards.

  Args:
    directory: the checkpoint folder (created unless `read_only`).
    max_to_keep: how many of the latest checkpoints to keep; None keeps all.
    asynchronous: write in the background (the loop is blocked only for the device-to-host copy).
    read_only: open an existing folder to restore from; never writes or deletes.
  """

  def __init__(self, directory: str, *, max_to_keep: int | None = 3, asynchronous: bool = True,
               read_only: bool = False):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep} (train.keep_checkpoints in gin) must be at least 1, or "
                       "None to keep every checkpoint")
    self.directory = os.path.abspath(directory)
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(f"checkpoint folder {self.directory} does not exist; pass the workdir of a run "
                            "that saved checkpoints, or its checkpoints/ folder")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep, save_interval_steps=0 if read_only else 1,
        create=not read_only, read_only=read_only,
        cleanup_tmp_directories=not read_only, enable_async_checkpointing=asynchronous)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, executor, state, **meta) -> bool:
    """Starts saving `state` at its step; returns False if that step is already saved.

    Args:
      executor: the executor whose layout `state` is in.
      state: the `TrainState`.
      **meta: JSON-serialisable fields stored with it (e.g. `seed=0`), returned by `restore`.
    """
    step = int(state.step)
    if step in self._manager.all_steps():
      return False
    info = {"format": FORMAT, "step": step, "plan": executor.plan.name,
            "mesh": {str(k): int(v) for k, v in executor.mesh.shape.items()},
            "process_count": jax.process_count(), **meta}
    tree = logical_state(executor, state)
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                     meta=ocp.args.JsonSave(info)), force=True)
    return True

  def restore(self, executor, step: int | None = None):
    """Restores the checkpoint at `step` (default the latest) into `executor`'s layout and shardings.

    Returns:
      `(state, meta)`: the `TrainState` and the JSON fields saved with it.

    Raises:
      CheckpointError: no checkpoint, an incomplete one, or one of another model or optimizer.
    """
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory} (it has no finished step folder); pass "
                            "the workdir of a run that saved checkpoints, or its checkpoints/ folder")
    step = max(steps) if step is None else step
    if step not in steps:
      raise CheckpointError(f"no checkpoint of step {step} in {self.directory}; it has steps {sorted(steps)}")
    where = os.path.join(self.directory, str(step))
    spec = state_spec_of(executor)
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      saved = self._manager.item_metadata(step).state
      saved = saved_leaves(dict(getattr(saved, "tree", saved)))
    except Exception as e:  # orbax and tensorstore raise many types for missing or broken files
      raise self._broken(where, e) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise CheckpointError(f"checkpoint {where} has metadata {meta!r}, not format {FORMAT} of "
                            "zerojax.checkpoint; it was not written by this version of zerojax")
    check_compatible(spec, saved, where)
    try:
      tree = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(spec.abstract(saved)))).state
    except Exception as e:
      raise self._broken(where, e) from e
    state = spec.from_logical(spec.complete(dict(tree)))
    if int(state.step) != step:
      raise CheckpointError(f"checkpoint {where} holds step {int(state.step)}, not {step}; the folder "
                            "was renamed or mixed up with another")
    return state, meta

  @staticmethod
  def _broken(where: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"checkpoint {where} is incomplete or damaged and cannot be read "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); delete "
                           "that step folder to restore the one before it")

  def wait(self) -> None:
    """Blocks until every started save is written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Finishes pending saves and releases orbax's threads."""
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def find_checkpoints(path: str) -> str:
  """The checkpoint folder of `path`: `path/checkpoints` for a workdir written by train.py, else `path`."""
  sub = os.path.join(path, "checkpoints")
  return sub if os.path.isdir(sub) else path


class Resumed(NamedTuple):
  state: Any
  meta: dict
  directory: str


def resume(executor, checkpointer: Checkpointer, restore_from: str | None = None) -> Resumed | None:
  """The state a run continues from: the latest checkpoint of its own folder, else of `restore_from`.

  Args:
    executor: the target executor (any mesh, process count or plan).
    checkpointer: the run's own checkpoint folder.
    restore_from: another run's workdir or checkpoint folder, used when the run's own folder is empty.

  Returns:
    The restored state, its metadata and folder; None when there is nothing to resume (a fresh run).

  Raises:
    CheckpointError: `restore_from` is given but holds no readable, matching checkpoint.
  """
  if checkpointer.latest_step() is not None:
    state, meta = checkpointer.restore(executor)
    return Resumed(state, meta, checkpointer.directory)
  if restore_from:
    with Checkpointer(find_checkpoints(restore_from), read_only=True) as source:
      state, meta = source.restore(executor)
    return Resumed(state, meta, source.directory)
  return None

