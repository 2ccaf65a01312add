"""The checkpoint folder: orbax saves (asynchronous, atomic) and restores of the logical train state.

See `zerojax.train.state_spec` for what is stored and why it restores onto any mesh or plan.

References:
  Orbax checkpointing: https://orbax.readthedocs.io/en/latest/guides/checkpoint/checkpoint_manager.html
"""
from __future__ import annotations

import errno
import json
import os
import re
import time
import zipfile
from typing import Any, Callable, NamedTuple

import jax
import orbax.checkpoint as ocp

from zerojax.planner.agree import every_process, from_process0
from zerojax.train.state_spec import CheckpointError, FORMAT, check_compatible, saved_leaves, state_spec_of, logical_state

DAMAGED = ".damaged-"  # a step folder set aside: `<step>.damaged-<time>`
READ_TRIES = 3         # reads of a checkpoint that fails for a reason other than damage
READ_BACKOFF_S = 2.0   # seconds before the second read; doubled before each next one


class DamagedCheckpoint(CheckpointError):
  """A checkpoint folder whose files are missing, truncated or fail to decode (`is_damage`)."""

  def __init__(self, where: str, reason: str):
    super().__init__(f"checkpoint {where} is incomplete or damaged and cannot be read ({reason}); delete "
                     "that step folder to restore the one before it")
    self.where, self.reason = where, reason


class UnreadableCheckpoint(CheckpointError):
  """Reading a checkpoint failed for a reason other than damage (an I/O error, a stale network file handle,
  memory): the checkpoint is not known to be bad, so it is never set aside."""

  def __init__(self, where: str, reason: str, tries: int = 1):
    super().__init__(f"reading checkpoint {where} failed{f' {tries} times' if tries > 1 else ''} ({reason}); "
                     "it is left in place, not known to be damaged: check the filesystem and the memory, then run "
                     "the same command again (if that checkpoint itself is bad, move its folder away to restore "
                     "the one before it)")
    self.where, self.reason = where, reason


# Tensorstore's status codes (the prefix of its errors' messages) that say a file is missing or shorter than
# its index says, and words of its messages that say a file fails to decode or to match its checksum (a
# missing OCDBT data file reads as a "Truncated Zstd-compressed stream"). Other codes (UNKNOWN for EIO,
# ABORTED for a stale NFS handle, RESOURCE_EXHAUSTED, UNAVAILABLE, PERMISSION_DENIED, ...) are trouble.
DAMAGE_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS")
DAMAGE_WORDS = ("truncated", "error decoding", "error parsing", "checksum", "corrupt")
DAMAGE_TYPES = (FileNotFoundError, EOFError, json.JSONDecodeError, UnicodeDecodeError, zipfile.BadZipFile)
MISSING_ITEM = ("was not found in the checkpoint", "Unknown key")  # orbax's KeyErrors for a missing item folder


def is_damage(e: BaseException) -> bool:
  """Whether a failed read says the checkpoint itself is bad: a missing or truncated file, a decoding
  error, a checksum mismatch. Anything else (an OSError other than a missing file, a MemoryError, an
  unknown error) is not: the same read may succeed again."""
  chain, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    chain.append(e)
    e = e.__cause__ or e.__context__
  if any(isinstance(x, MemoryError) for x in chain):
    return False
  for x in chain:
    text = str(x)
    code = re.search(r"os_error_code='?(\d+)", text)
    if isinstance(x, DAMAGE_TYPES):
      return True
    if isinstance(x, OSError) or (code and int(code.group(1)) != errno.ENOENT):
      return isinstance(x, OSError) and x.errno == errno.ENOENT
    if isinstance(x, ValueError) and (text.startswith(DAMAGE_CODES) or any(w in text.lower() for w in DAMAGE_WORDS)):
      return True
    if isinstance(x, KeyError) and any(m in text for m in MISSING_ITEM):
      return True
  return False


class Deferred(NamedTuple):
  """An error raised while a handler read, returned instead of raised: orbax's restore then reaches the
  barrier that ends it on every process, and the processes agree on the outcome (`Checkpointer._agreed`)."""
  error: BaseException


class _StateHandler(ocp.StandardCheckpointHandler):
  @classmethod
  def typestr(cls) -> str:  # written in the checkpoint's metadata: the same as orbax's own handler
    return ocp.StandardCheckpointHandler.typestr()

  def restore(self, *args, **kwargs):
    try:
      return super().restore(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (judged by `is_damage` once every process has read)
      return Deferred(e)


class _MetaHandler(ocp.JsonCheckpointHandler):
  @classmethod
  def typestr(cls) -> str:
    return ocp.JsonCheckpointHandler.typestr()

  def restore(self, *args, **kwargs):
    try:
      return super().restore(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
      return Deferred(e)


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
    handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state, meta = _StateHandler(), _MetaHandler()
    for args, handler in ((ocp.args.StandardSave, state), (ocp.args.StandardRestore, state),
                          (ocp.args.JsonSave, meta), (ocp.args.JsonRestore, meta)):
      handlers.add("state" if handler is state else "meta", args, handler)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=handlers)
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

    With several processes, every process reads, then they agree on the outcome before any raises, so
    all raise the same error (no process waits in a collective that another left).

    Returns:
      `(state, meta)`: the `TrainState` and the JSON fields saved with it.

    Raises:
      DamagedCheckpoint: a file is missing, truncated or fails to decode (on any process).
      UnreadableCheckpoint: the read failed otherwise (I/O, memory): the same read may succeed again.
      CheckpointError: no checkpoint, or one of another model or optimizer.
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
    saved = self._agreed(where, lambda: self._saved_leaves(step))
    check_compatible(spec, saved, where)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(spec.abstract(saved)))
    tree = self._agreed(where, lambda: self._manager.restore(step, args=args).state)
    state = self._agreed(where, lambda: spec.from_logical(spec.resize(spec.complete(dict(tree)))))
    if int(state.step) != step:
      raise CheckpointError(f"checkpoint {where} holds step {int(state.step)}, not {step}; the folder "
                            "was renamed or mixed up with another")
    return state, meta

  def _saved_leaves(self, step: int):
    saved = self._manager.item_metadata(step).state
    if saved is None:  # orbax's answer when state/_METADATA is missing
      raise FileNotFoundError(errno.ENOENT, "the state's metadata (state/_METADATA) is missing")
    return saved_leaves(dict(getattr(saved, "tree", saved)))

  @staticmethod
  def _agreed(where: str, read: Callable[[], Any]):
    """`read()`'s value once every process read without error; else raises on every process the same
    `DamagedCheckpoint` (damage on some process, trouble on none) or `UnreadableCheckpoint`."""
    try:
      value = read()
      if isinstance(value, Deferred):
        raise value.error
      failure = None
    except CheckpointError:
      raise  # a refusal (another model, a renamed folder): the same on every process
    except Exception as e:  # noqa: BLE001  (orbax and tensorstore raise many types)
      value, failure = e, ["damage" if is_damage(e) else "trouble", _first_line(_root(e))]
    failures = [f for f in every_process(failure) if f is not None]
    if not failures:
      return value
    kind, reason = next((f for f in failures if f[0] == "trouble"), failures[0])
    error = (DamagedCheckpoint if kind == "damage" else UnreadableCheckpoint)(where, reason)
    raise error from (value if failure is not None else None)

  def read_meta(self, step: int) -> dict:
    """The JSON fields saved with the checkpoint of `step` (cheap: no array is read)."""
    where = os.path.join(self.directory, str(step))
    args = ocp.args.Composite(meta=ocp.args.JsonRestore())
    meta = self._agreed(where, lambda: self._manager.restore(step, args=args).meta)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise CheckpointError(f"checkpoint {where} has metadata {meta!r}, not format {FORMAT} of "
                            "zerojax.checkpoint; it was not written by this version of zerojax")
    return meta

  def set_aside_folders(self) -> list[str]:
    """The step folders set aside as damaged (`<step>.damaged-<time>`), oldest first."""
    try:
      names = os.listdir(self.directory)
    except OSError:
      return []
    return sorted((d for d in names if DAMAGED in d and d.split(DAMAGED)[0].isdigit()),
                  key=lambda d: int(d.split(DAMAGED)[0]))

  def set_aside(self, step: int) -> str:
    """Renames the folder of `step` to `<step>.damaged-<time>` (ignored as a step; kept for inspection)."""
    src = os.path.join(self.directory, str(step))
    dst = f"{src}{DAMAGED}{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_index() == 0:
      os.rename(src, dst)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"zerojax set aside {step}")
    self._manager.reload()
    return dst

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


def _root(e: BaseException) -> BaseException:
  """The innermost error `e` was raised from (tensorstore's own, under orbax's generic `Exception`)."""
  seen = {id(e)}
  while (e.__cause__ or e.__context__) is not None and id(e.__cause__ or e.__context__) not in seen:
    e = e.__cause__ or e.__context__
    seen.add(id(e))
  return e


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


class NoUsableCheckpoint(CheckpointError):
  """Every checkpoint of a folder is damaged."""


def _latest_readable(executor, source: Checkpointer, check, warn, own: bool, tries: int, backoff_s: float) -> Resumed:
  """Restores the newest checkpoint of `source` that reads; damaged ones are skipped with a warning
  (and, in the run's own folder, renamed so that they are never taken as the latest again). A read that
  fails for another reason is tried `tries` times, then stops the start with the checkpoint in place."""
  steps = sorted(source.all_steps(), reverse=True)
  if not steps:
    raise CheckpointError(f"no checkpoint in {source.directory} (it has no finished step folder); pass "
                          "the workdir of a run that saved checkpoints, or its checkpoints/ folder")
  for i, step in enumerate(steps):
    for attempt in range(1, tries + 1):
      try:
        meta = source.read_meta(step)
        note = check(meta, os.path.join(source.directory, str(step))) if check else None
        state, meta = source.restore(executor, step)
        return Resumed(state, meta, source.directory, note)
      except DamagedCheckpoint as e:
        nxt = f"restoring step {steps[i + 1]} instead" if i + 1 < len(steps) else "no earlier checkpoint is left"
        moved = f"; renamed it to {os.path.basename(source.set_aside(step))}" if own else ""
        warn(f"warning: checkpoint {e.where} is incomplete or damaged ({e.reason}){moved}; {nxt}")
        break
      except UnreadableCheckpoint as e:
        if attempt == tries:
          raise UnreadableCheckpoint(e.where, e.reason, tries) from e
        delay = backoff_s * 2 ** (attempt - 1)
        warn(f"warning: reading checkpoint {e.where} failed ({e.reason}); trying again in {delay:g} s "
             f"(try {attempt} of {tries})")
        time.sleep(delay)
  if own:
    raise NoUsableCheckpoint(
        f"every checkpoint in {source.directory} is damaged (steps {sorted(steps)}, each set aside as "
        f"<step>{DAMAGED}<time>); run again with --start_over to start over (the damaged folders stay for "
        "inspection), or restore another run's with --start_over --restore_from")
  raise NoUsableCheckpoint(f"every checkpoint in {source.directory} is damaged (steps {sorted(steps)}); "
                           "restore another run's with --restore_from")


def resume(executor, checkpointer: Checkpointer, restore_from: str | None = None,
           check: Callable[[dict, str], str | None] | None = None, warn: Callable[[str], None] = print, *,
           start_over: bool = False, tries: int | None = None, backoff_s: float | None = None) -> Resumed | None:
  """The state a run continues from: the latest checkpoint of its own folder, else of `restore_from`.

  A damaged or incomplete checkpoint (`is_damage`) is skipped with a warning and the one before it
  restored; in the run's own folder it is set aside as `<step>.damaged-<time>`. A read that fails for
  another reason (an I/O error, memory) is tried again, then stops the start, renaming nothing. A folder
  whose checkpoints were all set aside is never taken for a fresh run: the start stops unless
  `start_over`.

  Args:
    executor: the target executor (any mesh, process count or plan).
    checkpointer: the run's own checkpoint folder.
    restore_from: another run's workdir or checkpoint folder, used when the run's own folder is empty.
    check: called with a checkpoint's metadata and folder before it is restored; raises to refuse it,
      returns a note (or None).
    warn: prints a warning.
    start_over: when the run's own folder holds only damaged checkpoints, start from `restore_from` or
      from scratch (train.py --start_over) instead of stopping.
    tries: reads of a checkpoint that fails for a reason other than damage (default `READ_TRIES`).
    backoff_s: seconds before the second read, doubled before each next one (default `READ_BACKOFF_S`).

  Returns:
    The restored state, its metadata, folder and note; None when there is nothing to resume (a fresh run).

  Raises:
    CheckpointError: `restore_from` is given but holds no readable, matching checkpoint; `check` refused
      the checkpoint; the run's own checkpoints are all damaged (without `start_over`).
    UnreadableCheckpoint: a checkpoint could not be read `tries` times for a reason other than damage.
  """
  tries = READ_TRIES if tries is None else tries
  backoff_s = READ_BACKOFF_S if backoff_s is None else backoff_s
  if checkpointer.latest_step() is not None:
    try:
      return _latest_readable(executor, checkpointer, check, warn, True, tries, backoff_s)
    except NoUsableCheckpoint:
      if not start_over:
        raise
  aside = from_process0(checkpointer.set_aside_folders())
  start = f"from {restore_from} (--restore_from)" if restore_from else "at step 0"
  if aside and not start_over:
    raise NoUsableCheckpoint(
        f"{checkpointer.directory} holds no usable checkpoint, only ones set aside as damaged "
        f"({', '.join(aside)}): a start {start} would drop that run's progress; run again with --start_over "
        f"to start {start} anyway (the damaged folders stay), or rename one back to its step (e.g. {aside[-1]} "
        f"-> {aside[-1].split(DAMAGED)[0]}) to read it again")
  if aside:
    warn(f"warning: --start_over: {checkpointer.directory} holds only checkpoints set aside as damaged "
         f"({', '.join(aside)}), left for inspection; starting {start}")
  if restore_from:
    with Checkpointer(find_checkpoints(restore_from), read_only=True) as source:
      return _latest_readable(executor, source, check, warn, False, tries, backoff_s)
  return None
