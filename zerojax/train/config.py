"""Gin configs for `train.py`: files and includes found from anywhere, and the settings a resume keeps.

Config paths resolve against the working directory, then the repository root; an `include` inside a
config resolves against that config's own folder, then the repository root, then the working directory.
So `train.py` runs from any directory, and a config copied elsewhere with its includes keeps working.

A checkpoint records the run's settings (`run_settings`): the model, the batch, the accumulation and the
optimizer with its schedule. A resume compares them with the settings it runs with (`check_resume`).
"""
from __future__ import annotations

import difflib
import inspect
import json
import os
import re

import gin
from gin import config_parser

from zerojax.train.optim import make_optimizer
from zerojax.train.state_spec import CheckpointError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_INCLUDE = re.compile(r"""^\s*include\s+(['"])(?P<path>[^'"]+)\1\s*(#.*)?$""")
_LOCATION = re.compile(r"^\s*In (bindings string line \d+|file .*|call to configurable .*)$")


class ConfigError(ValueError):
  """A config that cannot run: a missing file, an unknown parameter, a bad value."""


class SettingsChanged(CheckpointError):
  """A resume whose settings differ from those its checkpoint was saved with."""


def resolve(path: str, bases, what: str) -> str:
  """The absolute path of `path`, tried as given and against each of `bases` in order."""
  tried = [path] if os.path.isabs(path) else [os.path.join(b, path) for b in bases]
  for p in tried:
    if os.path.isfile(p):
      return os.path.abspath(p)
  where = ", ".join(dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in tried))
  raise ConfigError(f"{what} {path!r} does not exist (looked in {where}); the configs are in "
                    f"{os.path.join(REPO_ROOT, 'configs')}: {', '.join(sorted(_configs()))}")


def _configs() -> list[str]:
  folder = os.path.join(REPO_ROOT, "configs")
  return [f for f in os.listdir(folder) if f.endswith(".gin")] if os.path.isdir(folder) else []


def _message(e: Exception) -> str:
  """The exception's text without gin's location lines (and the statement quoted under them), on one line."""
  token = re.search(r"Failed to parse token '([^']*)'", str(e))
  if token:
    return (f"cannot read the value {token.group(1)} (a string needs quotes, e.g. '{token.group(1)}'; "
            "numbers, None, True, False, tuples and @references need none)")
  lines = [l.strip() for l in str(e).splitlines() if l.strip() and not _LOCATION.match(l)
           and not l.startswith("    ")]
  return " ".join(lines) or type(e).__name__


def _hint(msg: str) -> str:
  """For an unknown parameter, the closest known names; for a run setting of the plan (precision, padding), where it is set."""
  d = re.search(r"Configurable '(\w+)' has denylisted kwarg '(\w+)'", msg)
  if d:
    return f" ({d.group(2)} is the run's, for every plan: set train.{d.group(2)})"
  m = re.search(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", msg)
  if not m:
    return ""
  try:
    fn = gin.config._REGISTRY.get_match(m.group(1)).wrapped
    names = list(inspect.signature(fn).parameters)
  except Exception:  # an unknown configurable or no signature: no hint
    return ""
  close = difflib.get_close_matches(m.group(2), names, n=2)
  return f" (did you mean {' or '.join(m.group(1) + '.' + c for c in close)}?)" if close else ""


def _parse_file(path: str, seen: tuple[str, ...] = ()) -> None:
  """Parses a gin file, its includes first (each resolved against this file's folder)."""
  if path in seen:
    raise ConfigError(f"config {path} includes itself (through {' -> '.join(seen)}); remove the cycle")
  with open(path) as f:
    lines = f.read().splitlines()
  for i, line in enumerate(lines):
    m = _INCLUDE.match(line)
    if m:
      bases = (os.path.dirname(path), REPO_ROOT, os.getcwd())
      _parse_file(resolve(m.group("path"), bases, f"include in {path}:{i + 1}"), seen + (path,))
      lines[i] = ""  # keeps the line numbers of the rest
  try:
    gin.parse_config("\n".join(lines))
  except (ValueError, SyntaxError, TypeError, KeyError) as e:
    line = re.search(r"In bindings string line (\d+)", str(e))
    at = f"{path}:{line.group(1)}" if line else path
    raise ConfigError(f"config {at}: {_message(e)}{_hint(str(e))}") from e


def parse(files, bindings) -> list[str]:
  """Parses gin `files` (absolute, or relative to the working directory or the repository root) and
  `bindings` (`--gin_param` strings); returns the files' absolute paths.

  Raises:
    ConfigError: a missing file or include, a syntax error, an unknown configurable or parameter.
  """
  paths = [resolve(f, (os.getcwd(), REPO_ROOT), "--gin_file") for f in files]
  for p in paths:
    _parse_file(p)
  for b in bindings:
    try:
      gin.parse_config(b)
    except (ValueError, SyntaxError, TypeError, KeyError) as e:
      raise ConfigError(f"--gin_param {b!r}: {_message(e)}{_hint(str(e))}; see train.py --help for the "
                        "parameters") from e
  return paths


def write(path: str, header: str) -> None:
  """Writes the operative config (every parameter the run used, defaults included) to `path`."""
  text = gin.operative_config_str()
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(header.rstrip() + "\n\n" + text)
  os.replace(tmp, path)


# -- the settings a resume keeps -----------------------------------------------------------------------

# Settings that make another model or optimizer state: a checkpoint never continues under other values.
FIXED = ("model_config.", "llama_config.", "train.architecture", "train.model", "make_optimizer.name")
# The schedule depends on these (make_optimizer.total_steps is train.steps).
SCHEDULE = ("train.steps", "make_optimizer.learning_rate", "make_optimizer.warmup_steps")


def optimizer_settings() -> dict:
  """`make_optimizer`'s arguments as configured (gin bindings over the defaults), `total_steps` aside."""
  values = {k: p.default for k, p in inspect.signature(make_optimizer).parameters.items() if k != "total_steps"}
  values.update({k: v for k, v in gin.get_bindings("make_optimizer").items() if k != "total_steps"})
  return {f"make_optimizer.{k}": v for k, v in values.items()}


# The data's identity (`zerojax.train.data.identity`): a resume on other data is refused unless allowed.
DATA = ("data.source", "data.tokens", "data.fingerprint")


def run_settings(model: dict, *, steps: int, batch_size: int, accum_steps: int, user_model: str | None = None,
                 data: dict | None = None) -> dict:
  """The settings recorded in each checkpoint: gin names to JSON values (`model`: the model's, e.g.
  `ModelSpec.settings()`; `train.model` only when set, so checkpoints of the built-in GPT compare as before)."""
  out = dict(model)
  if user_model is not None:
    out["train.model"] = user_model
  out.update({"train.steps": steps, "train.batch_size": batch_size, "train.accum_steps": accum_steps})
  out.update(optimizer_settings())
  out.update(data or {})
  return json.loads(json.dumps(out))  # as a checkpoint reads them back: tuples are lists


def changeable() -> set[str]:
  """Settings `--allow_changed` may name."""
  return {"train.steps", "train.batch_size", "train.accum_steps", *DATA} | {
      k for k in optimizer_settings() if not k.startswith(FIXED)}


# `train`'s counts: the least each may be, what 0 means where it is allowed, and whether None is allowed.
RUN_COUNTS = {
    "steps": (1, None, False), "batch_size": (1, None, False), "accum_steps": (1, None, False),
    "checkpoint_every": (0, "only at the end and on SIGINT/SIGTERM", False), "keep_checkpoints": (1, None, True),
    "eval_every": (0, "only at the end", False), "eval_batches": (1, None, False), "log_every": (1, None, False),
    "max_consecutive_skips": (1, None, False), "max_data_bytes": (1, None, True), "replica_every": (1, None, True),
    "num_nodes": (1, None, True), "pad_multiple": (1, None, True), "seed": (None, None, False),
}


def check_run_settings(**settings) -> None:
  """Checks `train`'s counts (`RUN_COUNTS`: steps, batch size, the intervals, ...) before anything runs;
  names it does not know are ignored, so `check_run_settings(**dict(locals()))` works in `train`.

  Raises:
    ConfigError: one line naming every value out of range, e.g. "train.steps=-5 must be at least 1".
  """
  bad = []
  for name, (least, zero, none_ok) in RUN_COUNTS.items():
    if name not in settings:
      continue
    v = settings[name]
    if v is None and none_ok:
      continue
    if isinstance(v, bool) or not isinstance(v, int):
      bad.append(f"train.{name}={v!r} must be a whole number" + (" or None" if none_ok else ""))
    elif least is not None and v < least:
      bad.append(f"train.{name}={v} must be at least {least}" + (f" (0: {zero})" if zero else ""))
  every_s = settings.get("replica_every_s", 1.0)
  if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not every_s > 0:
    bad.append(f"train.replica_every_s={every_s!r} must be a number of seconds above 0 (or set train.replica_every "
               "to a number of steps)")
  project = settings.get("wandb_project")
  if project is not None and not (isinstance(project, str) and project):
    bad.append(f"train.wandb_project={project!r} must be a W&B project name or None")
  if bad:
    raise ConfigError("; ".join(bad) + "; fix the config or --gin_param")
  if project is not None:
    wandb_module(project)  # before anything runs: a missing package is said at once


def wandb_module(project: str):
  """The `wandb` package, imported for `train.wandb_project`.

  Raises:
    ConfigError: wandb is not installed (one line naming the fix).
  """
  try:
    import wandb
  except ImportError as e:
    raise ConfigError(f"train.wandb_project={project!r} needs the wandb package: pip install 'zerojax[wandb]' "
                      "(or set train.wandb_project=None)") from e
  return wandb


class _Names(config_parser.ParserDelegate):
  """Reads gin's references and macros as their text (`@zero3()`, `%STEPS`)."""

  def configurable_reference(self, scoped_configurable_name, evaluate):
    return f"@{scoped_configurable_name}" + ("()" if evaluate else "")

  def macro(self, macro_name):
    return f"%{macro_name}"


def gin_settings() -> dict:
  """gin's operative config (every parameter the run read, defaults included) as `{"train.steps": 200,
  "train.plan": "@zero3()", ...}`: the W&B run's config (a config gin cannot read back, one with values bound
  from Python, is kept as its text: `{"gin": ...}`)."""
  text, out = gin.operative_config_str(), {}
  try:
    for s in config_parser.ConfigParser(text, _Names()):
      if isinstance(s, config_parser.BindingStatement):
        out[f"{s.scope + '/' if s.scope else ''}{s.selector}.{s.arg_name}"] = s.value
  except (SyntaxError, ValueError):
    return {"gin": text}
  return out


def check_allowed(names) -> set[str]:
  """Validates `--allow_changed` names; returns them as a set."""
  names = {n.strip() for item in names for n in item.split(",") if n.strip()}
  ok = changeable()
  for n in sorted(names):
    if n.startswith(FIXED):
      raise ConfigError(f"--allow_changed={n}: the model and the optimizer's kind never change on resume (the "
                        "checkpoint's weights and states belong to them); use a new --workdir")
    if n not in ok:
      raise ConfigError(f"--allow_changed={n} names no setting; use one of {', '.join(sorted(ok))}")
  return names


def _fmt(diffs: dict) -> str:
  return ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(diffs.items()))


def check_resume(saved: dict | None, now: dict, step: int, where: str, allowed=frozenset()) -> str | None:
  """Compares the settings a checkpoint was saved with to the run's; returns a note to print, or None.

  Args:
    saved: the checkpoint's settings (None for a checkpoint that recorded none: nothing to compare).
    now: this run's `run_settings`.
    step: the checkpoint's step.
    where: the checkpoint's folder, for messages.
    allowed: settings the user allows to differ (`--allow_changed`).

  Raises:
    CheckpointError: the model or the optimizer's kind differs (never allowed).
    SettingsChanged: other settings differ and are not allowed. Raising `train.steps` of a finished
      run (its checkpoint is at its last step) is allowed: the run continues, with a note.
  """
  if saved is None:
    return f"checkpoint {where} records no settings; they are not compared"
  diffs = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)
           and not (k.startswith("data.") and k not in saved)}  # checkpoints from before the data was recorded
  fixed = {k: d for k, d in diffs.items() if k.startswith(FIXED)}
  if fixed:
    raise CheckpointError(f"checkpoint {where} is of another model or optimizer ({_fmt(fixed)}, saved -> "
                          "now); restore it with the saved values, or use a new --workdir")
  note = None
  finished = step >= saved.get("train.steps", step + 1)
  if finished and "train.steps" in diffs and now["train.steps"] > step:
    note = (f"the run finished at step {step}; continuing to train.steps={now['train.steps']}: the "
            f"learning-rate schedule now spans {now['train.steps']} steps instead of {saved['train.steps']}")
    diffs.pop("train.steps")
  refused = {k: d for k, d in diffs.items() if k not in allowed}
  if refused and not (finished and now["train.steps"] <= step):
    what = " (changes the learning-rate schedule)" if any(k in SCHEDULE for k in refused) else ""
    raise SettingsChanged(
        f"checkpoint {where} (step {step}) was saved with other settings: {_fmt(refused)} (saved -> now)"
        f"{what}; run with the saved values, pass --allow_changed={','.join(refused)} to continue with the "
        "new ones, or use a new --workdir")
  if diffs and not refused:
    note = "; ".join(filter(None, [note, f"continuing with changed settings {_fmt(diffs)} (--allow_changed)"]))
  return note
