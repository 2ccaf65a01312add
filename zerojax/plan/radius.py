"""Radius's plan value: the sparse replica sync's settings (`ReplicaSync.replica_sync`), validating
themselves; `zerojax.state.radius.RadiusSync` runs them.

References:
  Radius: Zheng & Zhang, §4.1-4.3 (Algorithms 1-2).
"""
from __future__ import annotations

import dataclasses
import math

from zerojax.plan.names import Name


@dataclasses.dataclass(frozen=True)
class Radius:
  """Radius's sparse replica sync (Radius §4, Algorithms 1–2), the value of `ReplicaSync.replica_sync`.

  Steps `0 .. dense_steps - 1` all-reduce densely, exactly like the plan without Radius. From then on,
  every `period` steps a *select* step all-reduces gradient + residual densely, zeroes the residual and
  picks the k largest |optimizer update| (for AdamW lr·|m̂/(√v̂+ε) + λw|, Algorithm 2) in each device's
  shard of every leaf; the steps in between all-reduce only the k selected values and add the rest of
  the local gradient to the residual. Every replica selects from the same values, so the indices agree
  with no communication. k = ⌈density · c⌉ for a shard of c elements of a leaf (per layer). The ranking
  is the update's magnitude, so a select step whose learning rate is 0 (a warm-up from 0) ranks only
  ties and keeps the lowest positions: switch after it (`dense_steps` >= 1).

  Attributes:
    density: fraction of the gradient sent on sparse steps, in (0, 1] (the paper's d; 0.4 by default).
    period: steps per selection window (the paper's T, 200).
    dense_steps: steps trained densely before the first selection (the paper's threshold; it
      switches after 15–20% of training).
  """
  density: float = 0.4
  period: int = 200
  dense_steps: int = 0

  def __post_init__(self):
    if not 0 < self.density <= 1:
      raise ValueError(f"radius density={self.density} is outside (0, 1]; use the fraction of the gradient "
                       "to send, e.g. 0.4")
    if int(self.period) != self.period or self.period < 1:
      raise ValueError(f"radius period={self.period} must be a whole number of steps >= 1 (the paper uses 200)")
    if int(self.dense_steps) != self.dense_steps or self.dense_steps < 0:
      raise ValueError(f"radius dense_steps={self.dense_steps} must be a whole number of steps >= 0")

  def label(self) -> Name:
    """Its part of the plan's label: "radius(d=0.4,T=200)", with ",dense=N" after dense steps."""
    dense = f",dense={self.dense_steps}" if self.dense_steps else ""
    return Name(f"radius(d={self.density:g},T={self.period}{dense})", "radius")

  def shard_k(self, chunk: int) -> int:
    """Selected elements of a shard of `chunk` elements: ⌈density · chunk⌉ (at least 1)."""
    return max(1, math.ceil(round(self.density * chunk, 6)))


def radius(density: float = 0.4, period: int = 200, dense_steps: int = 0) -> Radius:
  """Radius's replica sync (see `Radius`): `mics(replica_sync=radius(density=0.1))`."""
  return Radius(density=density, period=period, dense_steps=dense_steps)
