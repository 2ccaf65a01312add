"""`train.profile_steps = (START, STOP)`: a `jax.profiler` trace of those steps, in `workdir/profile`.

TensorBoard's profile plugin reads it (`tensorboard --logdir WORKDIR/profile`), and Perfetto opens its
`*.trace.json.gz` (`jax.profiler.start_trace(create_perfetto_trace=True)`). Only the lead process traces.
"""
from __future__ import annotations

import os

import jax

FOLDER = "profile"


class Profile:
  """Starts the trace before step START and stops it after step STOP (steps count from 1)."""

  def __init__(self, workdir: str, steps: tuple[int, int] | None, lead: bool = True):
    if steps is not None:
      if len(tuple(steps)) != 2 or not 1 <= steps[0] <= steps[1]:
        raise ValueError(f"train.profile_steps={steps!r}; use (START, STOP) with 1 <= START <= STOP, e.g. (3, 5)")
    self.steps = tuple(steps) if steps is not None and lead else None
    self.folder = os.path.join(workdir, FOLDER)
    self.on = False

  def before(self, step: int) -> None:
    if self.steps and step == self.steps[0] and not self.on:
      jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
      self.on = True

  def after(self, step: int) -> None:
    if self.on and step >= self.steps[1]:
      self.close()

  def close(self) -> None:
    if self.on:
      self.on = False
      jax.profiler.stop_trace()
