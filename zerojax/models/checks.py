"""First contact with a flax model: what `from_linen` and `from_nnx` are handed, checked at wrap time.

Each misuse a user meets when first wrapping a model nobody on this project wrote fails in one line that
names the fix, before any step is compiled: an object holding the flax module (a Hugging Face model
wrapper, or any object with the module at `.module` or `.model`) instead of the module, a module drawing
from an rng stream the wrapper was not told of (Hugging Face models draw "dropout" when
`deterministic=False`), a `loss_fn` returning something other than a scalar loss or `(loss, aux)` (e.g.
the model's output object, a mapping or a dataclass), or a collective over an axis zerojax does not bind.
The checks look at structure (attributes, mappings, array shapes), not at class names.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Mapping, Sequence

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _is_hf_wrapper(module) -> bool:
  """A Hugging Face Flax model (`FlaxPreTrainedModel`): a linen `.module` with its `.params` beside it."""
  return isinstance(getattr(module, "module", None), nn.Module) and hasattr(module, "params")


_HELD = ((nn.Module, "a flax linen Module", "from_linen"), (nnx.Module, "an NNX Module", "from_nnx"))


def _check_holder(module) -> None:
  """Raises TypeError if `module` holds a flax module at `.module` or `.model` (a wrapper object)."""
  for attr in ("module", "model"):
    held = getattr(module, attr, None)
    for kind, what, adapter in _HELD:
      if isinstance(held, kind):
        raise TypeError(f"module is {_a(type(module).__name__)} holding {what} at .{attr}; pass that module: "
                        f"zerojax.{adapter}(wrapped.{attr}, ...)")


def check_linen_module(module) -> None:
  """Raises TypeError unless `module` is a flax linen Module."""
  if isinstance(module, nn.Module):
    return
  if _is_hf_wrapper(module):
    raise TypeError(f"module is a {type(module).__name__}, a Hugging Face model wrapper; pass its linen module "
                    "`zerojax.from_linen(hf_model.module, ...)` and its weights "
                    "`ex.init_from_params(hf_model.params)`")
  _check_holder(module)
  what = "an NNX module: use zerojax.from_nnx" if isinstance(module, nnx.Module) else \
      "not a flax linen Module: pass an unbound nn.Module instance"
  raise TypeError(f"module is a {type(module).__name__}, {what}")


def check_nnx_module(module) -> None:
  """Raises TypeError unless `module` is an NNX module or a constructor of one."""
  if _is_hf_wrapper(module):
    raise TypeError(f"module is a {type(module).__name__}, a Hugging Face model wrapper around a linen module; "
                    "use `zerojax.from_linen(hf_model.module, ...)` and `ex.init_from_params(hf_model.params)`")
  if isinstance(module, nn.Module):
    raise TypeError(f"module is a {type(module).__name__}, a flax linen Module; use zerojax.from_linen")
  if isinstance(module, nnx.Module):
    return
  _check_holder(module)
  if not callable(module):
    raise TypeError(f"module is a {type(module).__name__}; pass an nnx.Module or a function `rngs -> module`")


@contextlib.contextmanager
def rng_streams(rngs: Sequence[str]):
  """Turns flax's `InvalidRngError` (a stream the module draws from and was not given) into a ValueError
  naming zerojax's `rngs=` argument with the stream added."""
  try:
    yield
  except flax.errors.InvalidRngError as e:
    m = re.search(r'needs PRNG for "([^"]+)"', str(e))
    if m is None:
      raise
    name = m.group(1)
    raise ValueError(f"the module draws from the rng stream {name!r} in training, which rngs={tuple(rngs)} "
                     f"does not name; pass rngs={tuple(rngs) + (name,)} (Hugging Face Flax models draw "
                     "'dropout' when deterministic=False)") from None


@contextlib.contextmanager
def bound_axes():
  """Turns the NameError of a collective over an unbound axis (e.g. `BatchNorm(axis_name="batch")`,
  written for pmap) into a ValueError naming the fix."""
  try:
    yield
  except NameError as e:
    raise ValueError(f"the module calls a collective over an axis that is not bound ({e}); zerojax owns the "
                     "mesh axes for sharding and averages mutable collections (batch_stats) over the "
                     "data-parallel devices after each step: drop the unit's collective (e.g. BatchNorm's "
                     "axis_name)") from None


def _a(name: str) -> str:
  return ("an " if name[:1].lower() in "aeiou" else "a ") + name


_ARRAY = (jax.Array, np.ndarray, np.generic, int, float)  # jax.Array includes tracers


def _arrays(tree) -> bool:
  return all(isinstance(x, _ARRAY) for x in jax.tree.leaves(tree))


def _hint(x) -> str:
  """How to return a scalar loss (and aux) from `x`, an output object, a mapping or a dataclass."""
  if isinstance(x, Mapping) and "loss" in x:
    return f" (return out['loss'], {'out' if _arrays(x) else 'dict(out)'})"
  if getattr(x, "loss", None) is not None:
    return f" (return out.loss, {'out' if _arrays(x) else 'vars(out)'})"
  if hasattr(x, "logits"):
    return " (the model's output: compute the loss from its .logits)"
  return ""


def _scalar_problem(x) -> str | None:
  """Why `x` (traced) is not a floating scalar; None if it is."""
  if not isinstance(x, _ARRAY):
    return _a(type(x).__name__) + _hint(x)
  if np.shape(x) != ():
    return f"an array of shape {np.shape(x)} (reduce it to the mean loss of the micro-batch)"
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    return f"a scalar of dtype {jnp.result_type(x)} (a loss is floating point)"
  return None


def check_loss_output(out: Any) -> bool:
  """Checks `loss_fn`'s output, traced, by its structure; returns whether it has aux.

  Raises:
    ValueError: the output is neither a floating scalar nor a 2-tuple `(loss, aux)` whose loss is one and
      whose aux is a pytree of arrays.
  """
  has_aux = isinstance(out, (tuple, list))
  if has_aux and len(out) != 2:
    problem = f"a {len(out)}-tuple (put the extra outputs in aux, e.g. a dict)"
  else:
    problem = _scalar_problem(out[0] if has_aux else out)
    problem = problem and ("(loss, aux) with a loss that is " + problem if has_aux else problem)
  if not problem and has_aux and not _arrays(out[1]):
    bad = next(x for x in jax.tree.leaves(out[1]) if not isinstance(x, _ARRAY))
    problem = (f"(loss, aux) with an aux holding {_a(type(bad).__name__)} (aux is a pytree of arrays, "
               "e.g. a dict)")
  if problem:
    raise ValueError(f"loss_fn must return a scalar loss or (loss, aux); it returned {problem}")
  return has_aux


def loss_form(f: Callable, *args) -> bool:
  """Traces `f(*args)`, a `loss_fn` output, with `jax.eval_shape` and checks it inside the trace, so that
  an output that is no pytree of arrays gets `check_loss_output`'s error too; returns whether it has aux."""
  has_aux = []
  jax.eval_shape(lambda *a: has_aux.append(check_loss_output(f(*a))), *args)
  return has_aux[0]
