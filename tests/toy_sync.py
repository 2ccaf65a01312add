"""A toy stateful technique, the worked example of docs/DESIGN.md ("Adding a stateful technique"): a
replica sync that all-reduces the gradient itself every other step and counts the steps it synced.

It is this one file plus its registration (`train_state.STATEFUL.append(ToySync)`); the executor, the
checkpoint spec and the memory report take it as they take Radius. `of` turns it on for a plan named
"toy" (a real technique reads the plan setting that owns it).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.state.stateful import Stored, SyncsReplicas, keep


@dataclasses.dataclass(frozen=True)
class ToySync(SyncsReplicas):
  """Every other step ("toy"): the dense replica all-reduce, run by the component; counts those steps."""
  name = "toy"
  setting = "Plan(name='toy')"
  phases = ("toy",)

  mesh: Mesh
  replicas: tuple[str, ...]

  @classmethod
  def of(cls, plan, mesh, layout, metas):
    return cls(mesh, plan.sharding.replica_axes(mesh)) if plan.name == "toy" else None

  @classmethod
  def refuse_restore(cls, where, key):
    return f"checkpoint {where} holds the toy sync's count ({key}); restore it with a plan named 'toy'"

  def init(self, flat):
    return jnp.zeros((), jnp.int32)

  def specs(self):
    return P()

  def phase(self, state):
    return "toy" if int(state.step) % 2 else None

  def sync(self, grads, local, denom, phase):
    total = jax.tree.map(lambda g: lax.psum(g, self.replicas), grads) if self.replicas else grads
    return jax.tree.map(lambda g: g / denom, total), None

  def update(self, state, out, updates, step, finite, phase):
    return keep(finite, state + 1, state) if phase == "toy" else state

  def memory_bytes(self):
    return 4

  def stored(self):
    return [Stored((), jnp.int32, NamedSharding(self.mesh, P()))]
