"""Optimizers for flat ZeRO shards: optax chains with decoupled weight decay masked by leaf name."""
from __future__ import annotations

import inspect

import gin
import jax
import optax

from zerojax.engine.layout import path_names

# Leaves whose name ends with one of these get weight decay; biases and LayerNorm scales do not.
DECAYED = ("kernel", "wte", "wpe", "w_out")


def decay_mask(params) -> dict:
  """True for leaves whose last path element names a matrix (see `DECAYED`)."""
  def is_decayed(path, _):
    return path_names(path)[-1] in DECAYED
  return jax.tree_util.tree_map_with_path(is_decayed, params)


def warmup_cosine(learning_rate: float, warmup_steps: int, total_steps: int):
  """Linear warmup from 0 to `learning_rate`, then a cosine decay to a tenth of it at `total_steps`."""
  return optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(warmup_steps, 1),
                                            max(total_steps, warmup_steps + 1), learning_rate * 0.1)


def make_schedule(total_steps: int):
  """The learning rate `make_optimizer` (as gin configures it) applies at each update (0-based)."""
  bound = dict(gin.get_bindings("make_optimizer"))
  defaults = {k: p.default for k, p in inspect.signature(make_optimizer).parameters.items()}
  get = lambda k: bound.get(k, defaults[k])
  return warmup_cosine(get("learning_rate"), get("warmup_steps"), total_steps)


@gin.configurable
def make_optimizer(name: str = "adamw", learning_rate: float = 3e-3, warmup_steps: int = 20,
                   total_steps: int = 200, weight_decay: float = 0.1, clip_norm: float | None = 1.0,
                   b1: float = 0.9, b2: float = 0.95) -> optax.GradientTransformation:
  """Builds `clip_by_global_norm -> {adamw|lion|sgd}` with a warmup-cosine schedule.

  Every transformation here is elementwise, so it is valid on ZeRO's flat padded shards.

  Args:
    name: 'adamw', 'lion' or 'sgd' (with momentum b1).
    learning_rate: the peak learning rate, reached after the warmup; the cosine decays it to a tenth.
    warmup_steps: steps of linear warmup from 0.
    total_steps: length of the schedule (`train` passes train.steps).
    weight_decay: decoupled weight decay of the matrices (`DECAYED`).
    clip_norm: clip the gradient's global norm to this (None: no clipping).
    b1: first-moment decay (adamw, lion) or momentum (sgd).
    b2: second-moment decay (adamw, lion).
  """
  schedule = warmup_cosine(learning_rate, warmup_steps, total_steps)
  if name == "adamw":
    opt = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask)
  elif name == "lion":
    opt = optax.lion(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask)
  elif name == "sgd":
    opt = optax.chain(optax.add_decayed_weights(weight_decay, mask=decay_mask), optax.sgd(schedule, momentum=b1))
  else:
    raise ValueError(f"optimizer {name!r} is not known; use 'adamw', 'lion' or 'sgd'")
  return optax.chain(optax.clip_by_global_norm(clip_norm), opt) if clip_norm else opt
