"""`train.profile_steps = (START, STOP)`: a `jax.profiler` trace of those steps, in `workdir/profile`.

TensorBoard's profile plugin reads it (`pip install tensorboard xprof`: the xprof package is the plugin;
then `tensorboard --logdir WORKDIR/profile`), and Perfetto opens its `perfetto_trace.json.gz`
(`jax.profiler.start_trace(create_perfetto_trace=True)`). Each traced step is marked as a step
(`jax.profiler.StepTraceAnnotation("train", step_num=N)`, from the step's dispatch to the next one's), so
the plugin's overview and trace viewer show steps START..STOP by number. Only the lead process traces.
"""
from __future__ import annotations

import os

import jax

FOLDER = "profile"
STEP_NAME = "train"  # the name of the steps' marks in the trace


class Profile:
  """Starts the trace before step START and stops it after step STOP (steps count from 1)."""

  def __init__(self, workdir: str, steps: tuple[int, int] | None, lead: bool = True):
    if steps is not None:
      if len(tuple(steps)) != 2 or not 1 <= steps[0] <= steps[1]:
        raise ValueError(f"train.profile_steps={steps!r}; use (START, STOP) with 1 <= START <= STOP, e.g. (3, 5)")
    self.steps = tuple(steps) if steps is not None and lead else None
    self.folder = os.path.join(workdir, FOLDER)
    self.on = False
    self._mark = None  # the open step's annotation

  def before(self, step: int) -> None:
    """Called before step `step` is dispatched: starts the trace at START, marks each step to STOP."""
    if self.steps and step == self.steps[0] and not self.on:
      jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
      self.on = True
    self._end_mark()
    if self.on and step <= self.steps[1]:
      self._mark = jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step)
      self._mark.__enter__()

  def after(self, step: int) -> None:
    if self.on and step >= self.steps[1]:
      self.close()

  def close(self) -> None:
    self._end_mark()
    if self.on:
      self.on = False
      jax.profiler.stop_trace()

  def _end_mark(self) -> None:
    if self._mark is not None:
      self._mark.__exit__(None, None, None)
      self._mark = None
