"""A model as the executor runs it: ZeRO units, a loss, and what else the loss takes.

`zerojax.models` builds one from a flax module (`from_linen`, `from_nnx`); `zerojax.models.gpt` writes
one by hand. The executor (`zerojax.executor`) calls the loss through `call_loss`.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3 (units whose parameters are gathered per layer).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax


class Model(NamedTuple):
  """A model written as ZeRO units (`zerojax.from_linen` / `from_nnx` build one from a flax module).

  Attributes:
    init: `rng -> params`, a dict `{unit_name: pytree}` of logical parameters.
    loss: `(params, batch) -> scalar` mean loss of a micro-batch; calls `zerojax.unit(f)(params[u], ...)`
      for every unit `u`, and `lax.scan` over the scanned units. With `rng`, `(params, batch, rng)`; with
      `init_state`, `(params, batch, rng, state) -> (out, state)`. `out` is the loss, or `(loss, aux)`
      with `has_aux`. `rng` is None in `eval_fn`.
    scanned: names of the units whose leaves have a leading layer axis.
    has_aux: the loss returns `(loss, aux)`; aux (a pytree of arrays) is averaged over micro-batches and
      devices into `StepMetrics.aux`.
    rng: the loss takes a PRNG key per micro-batch.
    init_state: `rng -> state`, the model's mutable collections (e.g. `{"batch_stats": ...}`).
    to_user: `{unit_name: tree} -> the user's tree` (any leaves), e.g. flax's `params`; None: identity.
    from_user: the inverse of `to_user`.
    example_batch: `ShapeDtypeStruct`s of one micro-batch `[batch, ...]`, or None.
  """
  init: Callable[[jax.Array], dict]
  loss: Callable[..., Any]
  scanned: frozenset = frozenset()
  has_aux: bool = False
  rng: bool = False
  init_state: Callable[[jax.Array], Any] | None = None
  to_user: Callable[[dict], Any] | None = None
  from_user: Callable[[Any], dict] | None = None
  example_batch: Any = None


def call_loss(model: Model, params: dict, batch, rng=None, state=None):
  """`(loss, aux, state)` of one micro-batch, whichever of `Model.loss`'s signatures the model has."""
  if model.init_state is not None:
    out, state = model.loss(params, batch, rng, state)
  else:
    out = model.loss(params, batch, rng) if model.rng else model.loss(params, batch)
  loss, aux = out if model.has_aux else (out, None)
  return loss, aux, state


def identity(tree):
  return tree


def user_views(model: Model) -> tuple[Callable, Callable]:
  """`(to_user, from_user)` of `model`: its views of the user's tree, `identity` where it has none."""
  return model.to_user or identity, model.from_user or identity
