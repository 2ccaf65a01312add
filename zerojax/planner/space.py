"""AMSP's plan space: shard degrees s_p ≤ s_g ≤ s_os for parameters, gradients and optimizer states.

Each degree is a 2-D mesh s = s^0 (devices inside a node) x s^1 (nodes), with s^0 | G and s^1 | N (Eqs.
5–6), nested per axis (s_p^k | s_g^k | s_os^k, the dependency rule of §IV-B), and s_g ∈ {s_p, s_os}
(§IV-C.3). AMSP's node-spanning rule (Eq. 7, `eq7=True`, the default) asks a group that spans nodes to
use every device of them: s^1 > 1 ⇒ s^0 = G. Each degree is then one group of consecutive ranks (a
divisor of a node, or whole nodes) and one int, and 128 x 8 has 121 points; without it (`eq7=False`) a
group may take s^0 < G devices of each of s^1 nodes, and 128 x 8 has 688 points (AMSP §V-B). DP,
ZeRO-1/2/3 and MiCS of every group size are Eq. 7 points; with `zeropp=True` each point with sharded
parameters also comes with ZeRO++'s qwZ/hpZ/qgZ. The executor and the profile run groups of consecutive
ranks, so the points outside Eq. 7 are enumerated (to count and inspect them) but not planned.

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
  """One point of the space: shard degrees, whether ZeRO++'s techniques are on, and for a point outside
  Eq. 7 the in-node parts (s_p^0, s_g^0, s_os^0) of its degrees (None: s^0 = min(s, G))."""
  s_p: int
  s_g: int
  s_os: int
  zeropp: bool = False
  intra: tuple[int, int, int] | None = None

  def meshes(self, gpus: int) -> tuple[tuple[int, int], ...]:
    """((s_p^0, s_p^1), (s_g^0, s_g^1), (s_os^0, s_os^1))."""
    intra = self.intra or tuple(min(s, gpus) for s in (self.s_p, self.s_g, self.s_os))
    return tuple((i, s // i) for i, s in zip(intra, (self.s_p, self.s_g, self.s_os)))

  def name(self, world: int) -> str:
    if self.intra is not None:
      (p0, p1), (g0, g1), (o0, o1) = self.meshes(gpus=0)  # gpus unused: intra is given
      return f"amsp-p{p0}x{p1}-g{g0}x{g1}-os{o0}x{o1}" + ("+zeropp" if self.zeropp else "")
    known = {(1, 1, 1): "dp", (1, 1, world): "zero1", (1, world, world): "zero2", (world, world, world): "zero3"}
    base = known.get((self.s_p, self.s_g, self.s_os))
    if base is None and self.s_p == self.s_g == self.s_os:
      base = f"mics-{self.s_p}"
    base = base or f"amsp-p{self.s_p}-g{self.s_g}-os{self.s_os}"
    return base + ("+zeropp" if self.zeropp else "")

  def plan(self, nodes: int, gpus: int, **fields) -> Plan:
    """The executor's plan for this point (groups named by size; the executor factors the mesh)."""
    if self.intra is not None:
      raise ValueError(f"point {self.name(nodes * gpus)} breaks AMSP's node-spanning rule (Eq. 7); the executor "
                       "runs groups of consecutive devices only: use plan_space(..., eq7=True)")
    kw = dict(fields)
    if self.zeropp:
      kw.update(weight_bits=8, grad_bits=4 if self.s_g > 1 else None)
      if self.s_p > gpus:
        kw["secondary_axes"] = ("gpu",)  # hpZ: the backward gather stays inside the node
    kw.setdefault("hierarchical", None)
    return Plan(name=self.name(nodes * gpus), param_axes=self.s_p, grad_axes=self.s_g, opt_axes=self.s_os, **kw)


def plan_space(nodes: int, gpus: int, *, zeropp: bool = False, eq7: bool = True) -> list[Point]:
  """Every valid point, in a stable order (by s_p, then s_os, then s_g); `eq7=False` adds the points
  whose node-spanning groups use fewer than all devices of their nodes (after the Eq. 7 points)."""
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
  if not eq7:
    out += _beyond_eq7(nodes, gpus)
  return out


def _beyond_eq7(nodes: int, gpus: int) -> list[Point]:
  """The points with a degree s^0 x s^1 where s^1 > 1 and s^0 < G (nested per axis, s_g ∈ {s_p, s_os})."""
  div = lambda n: [d for d in range(1, n + 1) if n % d == 0]
  meshes = [(a, b) for a in div(gpus) for b in div(nodes)]
  out = []
  for p in meshes:
    for o in meshes:
      if o[0] % p[0] or o[1] % p[1]:
        continue
      for g in sorted({p, o}):
        trio = (p, g, o)
        if all(m[1] == 1 or m[0] == gpus for m in trio):
          continue  # an Eq. 7 point, already listed
        out.append(Point(*(a * b for a, b in trio), intra=tuple(m[0] for m in trio)))
  return out
