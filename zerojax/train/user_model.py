"""A model of the user's own for `train.py`: `--model=path/to/my_model.py:build` (or `package.module:build`).

The function is called as `build(vocab_size=..., seq_len=...)` with `model_config`'s values and returns a
`zerojax.Model` (e.g. from `zerojax.from_linen` or `from_nnx`) whose loss takes the trainer's batches:
`[batch, seq_len + 1]` int32 byte tokens (0-255). `train.py` then runs it with its own loop, plans,
checkpoints, signals and logs. The file is imported before the gin configs are parsed, so its own
`@gin.configurable` functions can be bound in them.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from zerojax.engine.model import Model
from zerojax.train.config import ConfigError

_FORM = "pass FILE.py:FUNCTION or package.module:FUNCTION, e.g. --model=my_model.py:build"


def _split(spec: str) -> tuple[str, str, bool]:
  """`(file path or module, function name, whether it is a file)`."""
  where, sep, name = spec.rpartition(":")
  if not sep or not where or not name.isidentifier():
    raise ConfigError(f"--model={spec!r}: {_FORM}")
  return where, name, where.endswith(".py") or os.sep in where


def absolute(spec: str) -> str:
  """`spec` with its file's absolute path, so the run's config.gin works from any directory."""
  where, name, is_file = _split(spec)
  return f"{os.path.abspath(where)}:{name}" if is_file else spec


def load(spec: str):
  """The function `spec` names (`"path/to/file.py:function"` or `"package.module:function"`).

  Raises:
    ConfigError: a malformed spec, a missing file or module, or no such function in it.
  """
  where, name, is_file = _split(spec)
  if is_file:
    path = os.path.abspath(where)
    if not os.path.isfile(path):
      raise ConfigError(f"--model={spec!r}: file {path} does not exist; {_FORM}")
    module_name = "zerojax_user_model_" + os.path.splitext(os.path.basename(path))[0]
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__file__", None) != path:
      sys.path.insert(0, os.path.dirname(path))  # its own imports of files beside it
      loader = importlib.util.spec_from_file_location(module_name, path)
      module = importlib.util.module_from_spec(loader)
      sys.modules[module_name] = module
      loader.loader.exec_module(module)
  else:
    try:
      module = importlib.import_module(where)
    except ModuleNotFoundError as e:
      raise ConfigError(f"--model={spec!r}: no module {where!r} ({e}); {_FORM}") from None
  fn = getattr(module, name, None)
  if not callable(fn):
    raise ConfigError(f"--model={spec!r}: {where} has no function {name!r}; define `def {name}(vocab_size, "
                      "seq_len)` returning a zerojax.Model")
  return fn


def build(spec: str, *, vocab_size: int, seq_len: int) -> Model:
  """Calls the user's function and checks that it returned a `zerojax.Model`."""
  model = load(spec)(vocab_size=vocab_size, seq_len=seq_len)
  if not isinstance(model, Model):
    raise ConfigError(f"--model={spec!r} returned a {type(model).__name__}; return a zerojax.Model, e.g. "
                      "zerojax.from_linen(module, example_batch, loss_fn, units=(Block,))")
  return model
