"""The optimizer's update of a step, one strategy per run (`Plan.update_mode`, decided once where the plan
is compiled: `zerojax.engine.offload.HostOffload.update`).

| mode       | strategy                     | what it keeps in flight                                              |
|------------|------------------------------|----------------------------------------------------------------------|
| "device"   | `OnDevice`                   | nothing offloaded: the update where the states live                  |
| "bulk"     | `OnDevice`                   | every offloaded state on the device at once, after the backward      |
| "streamed" | `offload_update.Streamed`    | at most three chunks' offloaded states (a unit, or one layer)        |
| "host"     | `OnHost`                     | none: the gradients go down, the states stay in host memory          |

Each takes the step's train state as it came in (`host`: offloaded fields in host memory), the state the
step computed with (`state`), the reduced gradients and whether the step is finite, and returns the new
master weights, optimizer states and the forward's kept rounding (`Updated`); "device" and "bulk" also
return the optimizer's updates, which a component carrying state across steps reads (only they run
with one: `Plan.update_mode`). `store` puts the new state where it lives.

References:
  ZeRO-Offload: Ren et al. 2021, §4 (the update's data flow with states in host memory), §4.1.
"""
from __future__ import annotations

import abc
from typing import Any, NamedTuple

import jax
import optax

from zerojax.engine import host_update as host_lib, layout as layout_lib
from zerojax.engine.model import Model
from zerojax.state.placement import Placement
from zerojax.state.train_state import TrainState


class Updated(NamedTuple):
  params: Any      # new master weights, in the memory their field lives in after `store`
  opt_state: Any   # new optimizer states, likewise
  forward: Any     # the new master weights' 16-bit rounding kept on the device (`TrainState.forward`), or None
  updates: Any     # the optimizer's updates, where the strategy computes them whole ("device", "bulk"), or None


class Update(abc.ABC):
  """A strategy: the update of one step (see the module docstring).

  Args:
    model, optimizer, user_optimizer, layout: as `Steps` has them (the optimizer on the flat layout; the
      user's, which the streamed update runs per chunk).
    reduce_dtype: the dtype the step's gradients are reduced in (`GradReduction.dtype`).
    placement: where the train state lives (its `offload`).
  """
  widens_per_chunk = False  # the step may leave a single micro-step's gradients in their own dtype

  def __init__(self, model: Model, optimizer: optax.GradientTransformation,
               user_optimizer: optax.GradientTransformation, layout: layout_lib.Layout, reduce_dtype,
               placement: Placement):
    self.model, self.optimizer, self.user_optimizer, self.layout = model, optimizer, user_optimizer, layout
    self.reduce_dtype, self.placement = reduce_dtype, placement

  def wide(self, grads):
    """`grads` in the reduction's dtype (a no-op where the step reduced them in it)."""
    return jax.tree.map(lambda g: g.astype(self.reduce_dtype), grads)

  @abc.abstractmethod
  def __call__(self, host: TrainState, state: TrainState, grads, finite) -> Updated:
    """The step's update (see the module docstring)."""

  def store(self, new: TrainState) -> TrainState:
    """The step's new state with each field where it lives."""
    return new


class OnDevice(Update):
  """The update on the device: "device" (no offloaded state: fetch and store do nothing) and "bulk" (every
  offloaded state comes to the device once the backward is done, `HostOffload.fetch`'s `after`, and goes
  back after the update)."""

  def __call__(self, host, state, grads, finite) -> Updated:
    where, off = self.placement, self.placement.offload
    params, opt_state = off.fetch("params", host.params, after=grads), off.fetch("opt_state", host.opt_state, after=grads)
    updates, new_opt = where.per_replica(self.optimizer.update)(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return Updated(where.keep(finite, new_params, params), where.keep(finite, new_opt, opt_state), state.forward,
                   updates)

  def store(self, new):
    off = self.placement.offload
    return new.replace(params=off.store("params", new.params), opt_state=off.store("opt_state", new.opt_state))


class OnHost(Update):
  """The update on the host (`zerojax.engine.host_update`, ZeRO-Offload §4.1): the gradients go down, the states
  and master weights are read and written in host memory and never reach the device."""

  def __call__(self, host, state, grads, finite) -> Updated:
    where = self.placement
    params, opt_state = host_lib.host_update(where.per_replica(self.optimizer.update), where.keep, grads,
                                                host.opt_state, host.params, finite)
    return Updated(params, opt_state, None, None)
