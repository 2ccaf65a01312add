"""A toy in-backward component, the second beside qgZ's error feedback: each device counts the backward
calls of each unit (of each layer of a scanned unit), a count carried through the units' backward.

It is this one file plus its registration (`train_state.STATEFUL.append(BackwardCount)`); the engine,
the executor, the checkpoint spec and the memory report take it as they take error feedback. `of` turns
it on for a plan named "toy-backward" (a real technique reads the plan setting that owns it).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.state.stateful import InBackward, Stored, keep


@dataclasses.dataclass(frozen=True, eq=False)
class BackwardCount(InBackward):
  """`{unit: [devices, (layers,)]}` float32 (a cotangent is a float): the backward calls each device ran."""
  name = "backward_count"
  setting = "Plan(name='toy-backward')"

  mesh: Mesh
  layers: dict  # {unit: (layers,) or ()}

  @classmethod
  def of(cls, plan, mesh, layout, metas):
    if plan.name != "toy-backward":
      return None
    return cls(mesh, {u: tuple(m.leaves[0].flat_shape()[:-1]) for u, m in sorted(metas.items())})

  @classmethod
  def refuse_restore(cls, where, key):
    return f"checkpoint {where} holds the toy's backward counts ({key}); restore it with a plan named 'toy-backward'"

  def init(self, flat):
    return {u: jnp.zeros((self.mesh.size, *l), jnp.float32) for u, l in self.layers.items()}

  def specs(self):
    return {u: P(tuple(self.mesh.axis_names)) for u in self.layers}

  def body_in(self, state, phase):
    return state, self.specs()

  def body_out_specs(self, phase):
    return self.specs()

  def unit_states(self, local):
    return {u: rows[0] for u, rows in local.items()}

  def backward(self, value, grads, reduced, dropped):
    return value + 1

  def update(self, state, out, updates, step, finite, phase):
    return keep(finite, out, state)

  def memory_bytes(self):
    return sum(4 * math.prod(l) for l in self.layers.values())

  def stored(self):
    rows = NamedSharding(self.mesh, P(tuple(self.mesh.axis_names)))
    return [Stored((self.mesh.size, *self.layers[u]), jnp.float32, rows) for u in sorted(self.layers)]
