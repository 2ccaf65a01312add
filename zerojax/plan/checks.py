"""The field checks the plan values share: each raises a one-line error naming the setting and the fix.

References:
  docs/DESIGN.md, "A plan is a few small values".
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp

from zerojax.quant import kernel_choice

Axes = tuple[str, ...] | int  # mesh axes by name, or a group of that many consecutive devices


def axes(axes: Sequence[str] | str | int) -> Axes:
  if isinstance(axes, int) and not isinstance(axes, bool):
    if axes < 1:
      raise ValueError(f"a group of {axes} devices: use a positive group size")
    return axes
  return (axes,) if isinstance(axes, str) else tuple(axes)


def dtype_name(value: str | None, field: str) -> None:
  if value is None:
    return
  try:
    jnp.dtype(value)
  except TypeError:
    raise ValueError(f"{field}={value!r} is not a dtype name (use 'float32' or 'bfloat16')") from None


def one_of(value, field: str, allowed: tuple) -> None:
  if value not in allowed:
    raise ValueError(f"{field}={value!r}; use one of {allowed}")


def block_size(value: int, field: str) -> None:
  if value < 0 or value % 2:
    raise ValueError(f"{field}={value} must be an even block size, or 0 for one scale per shard")


def kernel_backend(value: str | None) -> None:
  if value is not None and value not in kernel_choice.BACKENDS:
    raise ValueError(f"kernel_backend={value!r}; use one of {kernel_choice.BACKENDS} or None (the default backend)")


def rotatable(block: int, field: str) -> None:
  if block < 2 or block & (block - 1):
    raise ValueError(f"rotate=True needs a power-of-two {field}, got {block}; use e.g. 256")


OFFLOADABLE = ("opt_state", "master")  # the train-state fields `Sharding.offload` may put in host memory


def offload(value) -> tuple[str, ...]:
  """`Sharding.offload` as a tuple in `OFFLOADABLE`'s order; a string or an unknown name is refused."""
  if value is None:
    return ()
  if isinstance(value, str) or not all(isinstance(v, str) for v in value):
    raise ValueError(f"offload={value!r} must be a tuple of field names, e.g. ('opt_state',) or "
                     "('opt_state', 'master')")
  unknown = [v for v in value if v not in OFFLOADABLE]
  if unknown:
    raise ValueError(f"offload names {unknown[0]!r}; use a tuple of {OFFLOADABLE} (() for none)")
  return tuple(f for f in OFFLOADABLE if f in value)
