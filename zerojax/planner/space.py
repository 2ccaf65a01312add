"""AMSP's plan space: shard degrees s_p ≤ s_g ≤ s_os for parameters, gradients and optimizer states.

Each degree is a group of consecutive ranks that divides a node or spans whole nodes, so AMSP's
node-spanning rule (Eq. 7: a group larger than a node uses every GPU of its nodes) and the divisibility
rules (Eqs. 5–6) hold by construction; degrees nest (s_p | s_g | s_os, the dependency rule of §IV-B) and
s_g ∈ {s_p, s_os} (§IV-C.3). DP, ZeRO-1/2/3 and MiCS of every group size are points of the space; with
`zeropp=True` each point with sharded parameters also comes with ZeRO++'s qwZ/hpZ/qgZ.

References:
  AMSP: Chen et al. 2023, §IV-B (dependency rule), §V-B (Eqs. 3–7, pre-filter and brute-force search).
"""
from __future__ import annotations

import dataclasses

from zerojax import mesh as mesh_lib
from zerojax.plan import Plan


def degrees(nodes: int, gpus: int) -> list[int]:
  """Valid shard degrees of a nodes x gpus cluster: divisors of a node's devices, then whole nodes."""
  inside = [d for d in range(1, gpus + 1) if gpus % d == 0]
  return inside + [gpus * m for m in range(2, nodes + 1) if nodes % m == 0]


@dataclasses.dataclass(frozen=True)
class Point:
  """One point of the space: shard degrees and whether ZeRO++'s techniques are on."""
  s_p: int
  s_g: int
  s_os: int
  zeropp: bool = False

  def name(self, world: int) -> str:
    known = {(1, 1, 1): "dp", (1, 1, world): "zero1", (1, world, world): "zero2", (world, world, world): "zero3"}
    base = known.get((self.s_p, self.s_g, self.s_os))
    if base is None and self.s_p == self.s_g == self.s_os:
      base = f"mics-{self.s_p}"
    base = base or f"amsp-p{self.s_p}-g{self.s_g}-os{self.s_os}"
    return base + ("+zeropp" if self.zeropp else "")

  def plan(self, nodes: int, gpus: int, **fields) -> Plan:
    """The executor's plan for this point (groups named by size; the executor factors the mesh)."""
    kw = dict(fields)
    if self.zeropp:
      kw.update(weight_bits=8, grad_bits=4 if self.s_g > 1 else None)
      if self.s_p > gpus:
        kw["secondary_axes"] = ("gpu",)  # hpZ: the backward gather stays inside the node
    kw.setdefault("hierarchical", None)
    return Plan(name=self.name(nodes * gpus), param_axes=self.s_p, grad_axes=self.s_g, opt_axes=self.s_os, **kw)


def plan_space(nodes: int, gpus: int, *, zeropp: bool = False) -> list[Point]:
  """Every valid point, in a stable order (by s_p, then s_os, then s_g)."""
  ds = degrees(nodes, gpus)
  out = []
  for p in ds:
    for os_ in ds:
      if os_ % p:
        continue
      for g in sorted({p, os_}):
        out.append(Point(p, g, os_))
        if zeropp and p > 1:
          out.append(Point(p, g, os_, zeropp=True))
  for pt in out:
    for d in (pt.s_p, pt.s_g, pt.s_os):
      mesh_lib.check_group(d, nodes, gpus)
  return out
