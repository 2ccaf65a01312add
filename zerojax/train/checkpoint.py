"""The checkpoint folder: orbax saves (asynchronous, atomic) and restores of the logical train state.

See `zerojax.train.state_spec` for what is stored and why it restores onto any mesh or plan.

References:
  Orbax checkpointing: https://orbax.readthedocs.io/en/latest/guides/checkpoint/checkpoint_manager.html
"""
from __future__ import annotations

import os
import re
import time
from typing import Any, Callable, NamedTuple

import jax
import orbax.checkpoint as ocp

from zerojax.train.state_spec import CheckpointError, FORMAT, check_compatible, saved_leaves, state_spec_of, logical_state


class DamagedCheckpoint(CheckpointError):
  """A checkpoint folder whose files are missing, truncated or unreadable."""

  def __init__(self, where: str, reason: str):
    super().__init__(f"checkpoint {where} is incomplete or damaged and cannot be read ({reason}); delete "
                     "that step folder to restore the one before it")
    self.where, self.reason = where, reason


class SaveError(CheckpointError):
  """Writing a checkpoint failed (a full disk, a read-only folder); the previous ones are intact."""


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
    self._pending = None
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(f"checkpoint folder {self.directory} does not exist; pass the workdir of a run "
                            "that saved checkpoints, or its checkpoints/ folder")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep, save_interval_steps=0 if read_only else 1,
        create=not read_only, read_only=read_only,
        cleanup_tmp_directories=not read_only, enable_async_checkpointing=asynchronous)
    try:
      self._manager = ocp.CheckpointManager(
          self.directory, options=options,
          item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
    except OSError as e:
      raise CheckpointError(f"cannot open the checkpoint folder {self.directory} ({_first_line(e)}); use a "
                            "--workdir you can write to") from e

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
    self._check_pending()
    if step in self._manager.all_steps():
      return False
    info = {"format": FORMAT, "step": step, "plan": executor.plan.name,
            "mesh": {str(k): int(v) for k, v in executor.mesh.shape.items()},
            "process_count": jax.process_count(), **meta}
    tree = logical_state(executor, state)
    self._pending = step
    try:
      self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                       meta=ocp.args.JsonSave(info)), force=True)
    except Exception as e:  # noqa: BLE001  (orbax and tensorstore raise many types for failed writes)
      raise self._save_failed(e) from e
    return True

  def _check_pending(self) -> None:
    """Waits for the save in flight; raises a `SaveError` if it failed."""
    if self._pending is None:
      return
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise self._save_failed(e) from e
    self._pending = None

  def _save_failed(self, e: Exception) -> SaveError:
    step, self._pending = self._pending, None
    done = [s for s in self.all_steps() if s != step]
    kept = f"the checkpoint of step {max(done)} is intact" if done else "no earlier checkpoint exists"
    return SaveError(f"saving the checkpoint of step {step} in {self.directory} failed ({_os_error(e)}); "
                     f"{kept}: free disk space or make the folder writable, then run the same command to "
                     "resume from there")

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
    meta = self.read_meta(step)
    try:
      saved = self._manager.item_metadata(step).state
      saved = saved_leaves(dict(getattr(saved, "tree", saved)))
    except Exception as e:  # orbax and tensorstore raise many types for missing or broken files
      raise self._broken(where, e) from e
    check_compatible(spec, saved, where)
    try:
      tree = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(spec.abstract(saved)))).state
    except Exception as e:
      raise self._broken(where, e) from e
    state = spec.from_logical(spec.resize(spec.complete(dict(tree))))
    if int(state.step) != step:
      raise CheckpointError(f"checkpoint {where} holds step {int(state.step)}, not {step}; the folder "
                            "was renamed or mixed up with another")
    return state, meta

  def read_meta(self, step: int) -> dict:
    """The JSON fields saved with the checkpoint of `step` (cheap: no array is read)."""
    where = os.path.join(self.directory, str(step))
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001
      raise self._broken(where, e) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise CheckpointError(f"checkpoint {where} has metadata {meta!r}, not format {FORMAT} of "
                            "zerojax.checkpoint; it was not written by this version of zerojax")
    return meta

  def set_aside(self, step: int) -> str:
    """Renames the folder of `step` to `<step>.damaged-<time>` (ignored as a step; kept for inspection)."""
    src = os.path.join(self.directory, str(step))
    dst = f"{src}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_index() == 0:
      os.rename(src, dst)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"zerojax set aside {step}")
    self._manager.reload()
    return dst

  @staticmethod
  def _broken(where: str, e: Exception) -> DamagedCheckpoint:
    return DamagedCheckpoint(where, _first_line(e))

  def wait(self) -> None:
    """Blocks until every started save is written; raises a `SaveError` if one failed."""
    self._check_pending()

  def close(self) -> None:
    """Finishes pending saves and releases orbax's threads; raises a `SaveError` if a save failed."""
    try:
      self._check_pending()
    finally:
      try:
        self._manager.close()
      except Exception:  # noqa: BLE001  (the failure of a save was raised above)
        pass

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def find_checkpoints(path: str) -> str:
  """The checkpoint folder of `path`: `path/checkpoints` for a workdir written by train.py, else `path`."""
  sub = os.path.join(path, "checkpoints")
  return sub if os.path.isdir(sub) else path


def _first_line(e: Exception, limit: int = 200) -> str:
  """`Type: first line of the message`, cut to `limit` characters."""
  text = str(e).strip()
  line = f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
  return line if len(line) <= limit else line[:limit - 3] + "..."


def _os_error(e: Exception) -> str:
  """The operating system's reason of a failed write ("File too large", "No space left on device"), else
  the error's first line. Tensorstore reports it as `[os_error_code='27']` inside its message."""
  if isinstance(e, OSError) and e.errno:
    return f"{os.strerror(e.errno)}: {e.filename}" if e.filename else os.strerror(e.errno)
  code = re.search(r"os_error_code='?(\d+)", str(e))
  return os.strerror(int(code.group(1))) if code else _first_line(e)


class Resumed(NamedTuple):
  state: Any
  meta: dict
  directory: str
  note: str | None = None  # what `check` said about the settings


def _latest_readable(executor, source: Checkpointer, check, warn, own: bool) -> Resumed:
  """Restores the newest checkpoint of `source` that reads; damaged ones are skipped with a warning
  (and, in the run's own folder, renamed so that they are never taken as the latest again)."""
  steps = sorted(source.all_steps(), reverse=True)
  if not steps:
    raise CheckpointError(f"no checkpoint in {source.directory} (it has no finished step folder); pass "
                          "the workdir of a run that saved checkpoints, or its checkpoints/ folder")
  for i, step in enumerate(steps):
    try:
      meta = source.read_meta(step)
      note = check(meta, os.path.join(source.directory, str(step))) if check else None
      state, meta = source.restore(executor, step)
      return Resumed(state, meta, source.directory, note)
    except DamagedCheckpoint as e:
      nxt = f"restoring step {steps[i + 1]} instead" if i + 1 < len(steps) else "no earlier checkpoint is left"
      moved = f"; renamed it to {os.path.basename(source.set_aside(step))}" if own else ""
      warn(f"warning: checkpoint {e.where} is incomplete or damaged ({e.reason}){moved}; {nxt}")
  raise CheckpointError(f"every checkpoint in {source.directory} is damaged (steps {sorted(steps)}); "
                        "delete that folder to start again, or restore another run's with --restore_from")


def resume(executor, checkpointer: Checkpointer, restore_from: str | None = None,
           check: Callable[[dict, str], str | None] | None = None, warn: Callable[[str], None] = print
           ) -> Resumed | None:
  """The state a run continues from: the latest checkpoint of its own folder, else of `restore_from`.

  A damaged or incomplete checkpoint is skipped with a warning and the one before it restored.

  Args:
    executor: the target executor (any mesh, process count or plan).
    checkpointer: the run's own checkpoint folder.
    restore_from: another run's workdir or checkpoint folder, used when the run's own folder is empty.
    check: called with a checkpoint's metadata and folder before it is restored; raises to refuse it,
      returns a note (or None).
    warn: prints a warning.

  Returns:
    The restored state, its metadata, folder and note; None when there is nothing to resume (a fresh run).

  Raises:
    CheckpointError: `restore_from` is given but holds no readable, matching checkpoint; or `check`
      refused the checkpoint.
  """
  if checkpointer.latest_step() is not None:
    return _latest_readable(executor, checkpointer, check, warn, own=True)
  if restore_from:
    with Checkpointer(find_checkpoints(restore_from), read_only=True) as source:
      return _latest_readable(executor, source, check, warn, own=False)
  return None

