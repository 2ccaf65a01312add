"""DiLoCo's plan value: the outer optimizer across nodes (`ReplicaSync.outer_sync`), validating itself;
`zerojax.state.diloco.OuterSync` runs it.

References:
  DiLoCo: Douillard et al. 2023, Algorithm 1 (inner steps, the outer gradient, Nesterov momentum), §3.
  Streaming DiLoCo: Douillard et al. 2025, §2.2 (fragments synced at staggered steps), §2.3 (the outer
  gradient's communication overlapped with inner steps, the mixing factor α), §2.4 (4-bit outer gradients).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import optax

from zerojax.plan.names import Name

BLOCK = 256  # elements per quantization block of a quantized outer gradient


@dataclasses.dataclass(frozen=True)
class Diloco:
  """DiLoCo's outer optimizer across the replica axes (the nodes), the value of `ReplicaSync.outer_sync`.

  Each node trains its own replica of the model for `every` inner steps, with the plan's own sharding and
  reduction inside the node and nothing crossing nodes. Then the outer gradient is all-reduced over the
  nodes: the outer parameters minus each replica's, averaged. The outer optimizer (SGD with Nesterov
  momentum, DiLoCo Algorithm 1) updates the outer parameters, and every replica restarts from them. Its
  inner optimizer states stay its own. With `fragments` F > 1 the model's layers are split into F
  fragments of consecutive layers (Streaming DiLoCo §2.2). Fragment f syncs at the steps
  s with (s + 1 + f·every/F) % every == 0, so each step syncs at most one fragment, and the cross-node
  traffic is spread over the window. With `bits` the outer gradient crosses nodes block-quantized (int8
  or int4, blocks of 256 with fp32 scales; Streaming DiLoCo §2.4 uses 4 bits).

  With `overlap` (Streaming DiLoCo §2.3 with τ = 1) a fragment's outer gradient, taken from the replica
  after the sync's inner step, crosses the nodes during the *next* inner step: the all-reduce depends on
  nothing that step computes, so it runs while the step's forward and backward do. After that step's update
  the outer step runs, and each replica keeps `mix` (α) of its own weights: θ_replica = α θ_replica +
  (1 - α) θ_outer. A sync spanning more than one inner step (τ > 1) is not offered: one step's program
  holds the whole all-reduce, so τ = 1 already hides it behind a step's compute when it fits there.

  Attributes:
    every: inner steps between two syncs of a fragment (DiLoCo's H; the paper uses 500).
    fragments: F, the number of fragments synced at staggered steps (1: the whole model at once).
    bits: None (fp32 outer gradients), 8 or 4.
    lr: the outer learning rate (0.7 in DiLoCo).
    momentum: the outer momentum (0.9 in DiLoCo); 0 for plain SGD.
    nesterov: Nesterov momentum (DiLoCo's choice) or heavy-ball.
    outer_optimizer: None (the outer optimizer is `optax.sgd(lr, momentum, nesterov)`, DiLoCo's), or any
      elementwise optax `GradientTransformation` applied to the outer gradient (e.g. `optax.adam(0.1)`;
      `lr`, `momentum` and `nesterov` then do not apply). A fragment's outer step updates the fragment's
      rows of every state leaf shaped like a parameter; scalar state such as a step count advances once per
      fragment's sync.
    overlap: the outer gradient crosses nodes during the next inner step and is applied after it.
    mix: with `overlap`, α, the share of its own weights a replica keeps when the outer parameters arrive
      (Streaming DiLoCo §2.3 uses 0.5); 0 restarts the fragment from the outer parameters.
  """
  every: int = 50
  fragments: int = 1
  bits: int | None = None
  lr: float = 0.7
  momentum: float = 0.9
  nesterov: bool = True
  overlap: bool = False
  mix: float = 0.5
  outer_optimizer: Any = None

  def __post_init__(self):
    if isinstance(self.every, bool) or int(self.every) != self.every or self.every < 1:
      raise ValueError(f"diloco every={self.every!r} must be a whole number of inner steps >= 1 (DiLoCo's H, "
                       "e.g. 50)")
    if isinstance(self.fragments, bool) or int(self.fragments) != self.fragments or not 1 <= self.fragments <= self.every:
      raise ValueError(f"diloco fragments={self.fragments!r} must be a whole number in [1, every={self.every}]")
    if self.bits not in (None, 8, 4):
      raise ValueError(f"diloco bits={self.bits!r}; use None (fp32 outer gradients), 8 or 4")
    if not self.lr > 0:
      raise ValueError(f"diloco lr={self.lr!r} must be > 0 (DiLoCo uses 0.7)")
    if not 0 <= self.momentum < 1:
      raise ValueError(f"diloco momentum={self.momentum!r} must be in [0, 1) (DiLoCo uses 0.9)")
    if self.outer_optimizer is not None and not isinstance(self.outer_optimizer, optax.GradientTransformation):
      raise ValueError(f"diloco outer_optimizer={self.outer_optimizer!r}; use None (Nesterov SGD) or an optax "
                       "GradientTransformation, e.g. optax.adam(0.1)")
    if not isinstance(self.overlap, bool):
      raise ValueError(f"diloco overlap={self.overlap!r} must be True or False")
    if not 0 <= self.mix < 1:
      raise ValueError(f"diloco mix={self.mix!r} must be in [0, 1) (Streaming DiLoCo uses 0.5; 1 would never "
                       "take the outer parameters)")

  def label(self) -> Name:
    """Its part of the plan's label: "diloco(H=50)", then the fragments, the outer gradient's bits, the outer
    optimizer's settings where they are not DiLoCo's (lr 0.7, momentum 0.9, Nesterov) and Streaming DiLoCo's
    overlap with its α, e.g. "diloco(H=10,F=4,int4,lr=1.0,m=0.0,overlap(mix=0.5))"."""
    frags = f",F={self.fragments}" if self.fragments > 1 else ""
    bits = f",int{self.bits}" if self.bits else ""
    default = Diloco()
    opt = "".join(f",{k}={getattr(self, f)}" for k, f in (("lr", "lr"), ("m", "momentum"), ("nesterov", "nesterov"))
                  if getattr(self, f) != getattr(default, f))
    opt += f",overlap(mix={self.mix:g})" if self.overlap else ""
    return Name(f"diloco(H={self.every}{frags}{bits}{opt})", "diloco")

  def optimizer(self) -> optax.GradientTransformation:
    """The outer optimizer: `outer_optimizer`, or DiLoCo's SGD with (Nesterov) momentum."""
    if self.outer_optimizer is not None:
      return self.outer_optimizer
    return optax.sgd(self.lr, momentum=self.momentum, nesterov=self.nesterov)

  @property
  def alignment(self) -> int:
    """Each shard of a leaf holds whole quantization blocks (with `bits`)."""
    return BLOCK if self.bits else 1

  def offset(self, fragment: int) -> int:
    """Inner steps into each window at which fragment `fragment` syncs: (f + 1) · every / F (the last
    fragment at the window's end, as with one fragment)."""
    return (fragment + 1) * self.every // self.fragments

  def fragment_at(self, step: int) -> int | None:
    """The fragment whose outer step inner step `step` (counted from 0) runs: the one whose offset is
    (step + 1) mod every, or with `overlap` the one of the step before (its outer gradient crosses the nodes
    during `step`); None for a step that syncs nothing."""
    step -= int(self.overlap)
    if step < 0:
      return None
    for f in range(self.fragments):
      if (step + 1) % self.every == self.offset(f) % self.every:
        return f
    return None


def diloco(every: int = 50, fragments: int = 1, bits: int | None = None, lr: float = 0.7, momentum: float = 0.9,
           nesterov: bool = True, overlap: bool = False, mix: float = 0.5, outer_optimizer: Any = None) -> Diloco:
  """DiLoCo's outer optimizer across nodes (see `Diloco`): `mics(outer_sync=diloco(every=50))`."""
  return Diloco(every=every, fragments=fragments, bits=bits, lr=lr, momentum=momentum, nesterov=nesterov,
                overlap=overlap, mix=mix, outer_optimizer=outer_optimizer)
