"""AMSP's plan space: shard degrees s_p ≤ s_g ≤ s_os, and every communication technique on top of them.

Each degree is a 2-D mesh s = s^0 (devices inside a node) x s^1 (nodes), with s^0 | G and s^1 | N (Eqs.
5–6), nested per axis (s_p^k | s_g^k | s_os^k, the dependency rule of §IV-B), and s_g ∈ {s_p, s_os}
(§IV-C.3). AMSP's node-spanning rule (Eq. 7, `eq7=True`, the default) asks a group that spans nodes to
use every device of them: s^1 > 1 ⇒ s^0 = G. Each degree is then one group of consecutive ranks (a
divisor of a node, or whole nodes) and one int, and 128 x 8 has 121 points; without it (`eq7=False`) a
group may take s^0 < G devices of each of s^1 nodes, and 128 x 8 has 688 points (AMSP §V-B). DP,
ZeRO-1/2/3 and MiCS of every group size are Eq. 7 points. The executor and the profile run groups of
consecutive ranks, so the points outside Eq. 7 are enumerated (to count and inspect them) but not planned.

With `techniques=True` every degree point also comes with every technique a user could name on it (one
entry each in `TECHNIQUES`, the enumeration):

  parameters  (s_p > 1)  qwZ 8 bits (ZeRO++ §3.1; 4 bits only with `lossy`), hpZ with the secondary
                         shard in the node (§3.2, when s_p spans nodes), a flat or a hierarchical gather
                         (MiCS §3.3, when s_p spans nodes)
  gradients   (s_g > 1)  qgZ 8 or 4 bits, and per hop (8 in the node, 4 across nodes; ZeRO++ §3.3,
                         SDP4Bit §3.2) when s_g spans nodes, or float8 hops (FP8-LM §2.1)
  reduction              16-bit gradients (`reduce_dtype = bfloat16`, DeepSpeed's ZeRO-3 default and
                         ZeRO++'s baseline), or fp32
  replicas    (s_os < N G) Radius's sparse replica sync (Radius §4), or DiLoCo's outer sync across nodes
                         (MiCS with one node per group), only with `lossy`
  memory                 master weights and optimizer states in host memory (`Sharding.offload`), ranked
                         by the solver for a point over the memory cap, or where it costs nothing
                         (`solve.offload_twins`)

qwZ int8 and qgZ int4 are ZeRO++ as published (trained to the baseline's loss, ZeRO++ §5.3) and count
as not lossy; int4 weights, Radius's top-k and DiLoCo change what is trained by more than that and are
taken only when the user allows it. `Point.of(plan, nodes, gpus)` is a plan's point, e.g. that of a plan a
user picks by name (the gin configs in `configs/`).

A point is its degrees and the `Plan` settings its techniques change (`Point.settings`), nothing else: a
technique is the settings it sets (hpZ: `secondary_axes=("gpu",)`; Radius: `replica_sync=radius()`), the
cost model (`planner.cost`) reads it from the plan value that owns the setting (`point.gather.weight_bits`,
`point.sync.replica_sync`), and the ranked rows spell it as a column (`hpz=True`, `weight_bits=8`;
`COLUMNS`), as `Point(...)` also takes it. Adding a technique to the space is one entry in `TECHNIQUES`.

A plan has one label (`Plan.label`, the name the trainer's log and summary and the CLI show), each plan
value naming its own part (`zerojax.plan.names`): its sharding, then each technique that changes what is
computed or what goes on the wire, e.g. "zero3+qwZ(int8)+hpZ(gpu)+qgZ(int4)" or
"mics(group=gpu)+radius(d=0.4,T=20,dense=40)". The planner's ids (`Point.name`, "mics-4+qwz8") are
spelled from the same parts (`names.degrees`, `Plan.techniques`), short, since ranked rows,
`benchmarks/planner.json` and the tests store them.

References:
  AMSP: Chen et al. 2023, §IV-B (dependency rule), §V-B (Eqs. 3–7, pre-filter and brute-force search).
  ZeRO++: Wang et al. 2023, §3.1–3.3 (qwZ, hpZ, qgZ), §5.3 (convergence).
  MiCS: Zhang et al. 2022, §3.1 (partition groups), §3.3 (hierarchical gather). Radius: Zheng & Zhang, §4.
  ZeRO: Rajbhandari et al. 2020, §5 (stages 1-3). FP8-LM: Peng et al. 2023, §2.1 (float8 gather).
  SDP4Bit: Jia et al. 2024, §3.2 (rotation, per-hop bits). LoCo: Xie et al. 2024, §3 (error feedback).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

from zerojax import mesh as mesh_lib
from zerojax.plan import Plan, diloco, names, radius
from zerojax.plan.values import Gather, Reduction, ReplicaSync, Sharding

BLOCK = names.BLOCK  # elements per qwZ/qgZ quantization block (the Plan defaults)
OFFLOAD = ("opt_state", "master")  # what a point with `offload` keeps in host memory (`Sharding.offload`)
DEFAULTS = Plan().settings()  # a point's plan settings besides its own fields (`Point.suffix`)
def degrees(nodes: int, gpus: int) -> list[int]:
  """Valid shard degrees of a nodes x gpus cluster: divisors of a node's devices, then whole nodes."""
  inside = [d for d in range(1, gpus + 1) if gpus % d == 0]
  return inside + [gpus * m for m in range(2, nodes + 1) if nodes % m == 0]


@dataclasses.dataclass(frozen=True)
class Technique:
  """One entry of the space's enumeration (AMSP §IV-B: a choice on top of the shard degrees).

  `settings` are the `Plan` settings it sets, by name (None: `{column: value}`); `slot` what it fills (the
  techniques of one slot exclude each other: one gather format, one reduction, one replica sync); `side`
  where the solver ranks it (`param_options` and `grad_options` are Pareto-pruned apart, `solve.rank`;
  "memory": added by the solver under a memory cap); `applies(point, world, gpus)` the degree points it is
  enumerated on; `lossy` whether it changes what is trained by more than ZeRO++ as published (ZeRO++
  §5.3), ranked only with `auto.lossy = True`. A ranked row and `Point(...)` spell it `column=value`
  (`hpz=True`, `weight_bits=8`); the column's off value (`off`) leaves it out."""
  column: str
  value: object
  side: str
  slot: str
  applies: Callable[[Point, int, int], bool]
  settings: dict | None = None
  lossy: bool = False

  def __post_init__(self):
    if self.settings is None:
      object.__setattr__(self, "settings", {self.column: self.value})

  @property
  def off(self):
    """The column's value without the technique: False for an on/off technique, else None."""
    return False if self.value is True else None


_always = lambda pt, world, gpus: True
_params = lambda pt, world, gpus: pt.s_p > 1
_params_span = lambda pt, world, gpus: pt.s_p > gpus  # the parameter group spans nodes
_grads = lambda pt, world, gpus: pt.s_g > 1
_replicas = lambda pt, world, gpus: pt.s_os < world
_node_groups = lambda pt, world, gpus: pt.s_os == gpus < world and pt.intra is None  # MiCS, one node per group

# The techniques of the space (AMSP §V-B enumerates them with the degrees): `with_techniques` takes one or
# none of each slot, in this order. A technique is one entry here; `cost` prices it from the plan values
# its settings change (`point.gather`, `point.reduction`, `point.sync`, `point.sharding`).
TECHNIQUES = (
  # parameters: qwZ (ZeRO++ §3.1), hpZ's secondary shard in the node (§3.2), MiCS §3.3's hierarchical gather
  Technique("weight_bits", 8, "params", "gather", _params),
  Technique("weight_bits", 4, "params", "gather", _params, lossy=True),
  Technique("hpz", True, "params", "hpz", _params_span, {"secondary_axes": ("gpu",)}),
  Technique("hierarchical", True, "params", "hierarchical", _params_span),
  # gradients: qgZ, per hop across nodes (ZeRO++ §3.3, SDP4Bit §3.2), float8 hops (FP8-LM §2.1), or the
  # 16-bit reduction (DeepSpeed's ZeRO-3 default, ZeRO++'s baseline); qgZ is its own reduction
  Technique("grad_bits", 8, "grads", "reduction", _grads),
  Technique("grad_bits", 4, "grads", "reduction", _grads),
  Technique("grad_bits", (8, 4), "grads", "reduction", lambda pt, world, gpus: pt.s_g > gpus),
  Technique("grad_format", "float8_e4m3fn", "grads", "reduction", _grads),
  Technique("reduce16", True, "grads", "reduction", _always, {"reduce_dtype": "bfloat16"}),
  # replicas: Radius's sparse sync (Radius §4), DiLoCo's outer sync across nodes (diloco()'s defaults)
  Technique("radius", True, "grads", "replicas", _replicas, {"replica_sync": radius()}, lossy=True),
  Technique("diloco", True, "grads", "replicas", _node_groups, {"outer_sync": diloco()}, lossy=True),
  # memory: master weights and optimizer states in host memory (`Sharding.offload`), under a memory cap
  Technique("offload", True, "memory", "offload", _always, {"offload": OFFLOAD}),
)
COLUMNS = {t.column: t.off for t in TECHNIQUES}  # a ranked row's technique columns and their off values
_BY_COLUMN = {(t.column, t.value): t.settings for t in TECHNIQUES}
_OFF = {c: {k: DEFAULTS[k] for t in TECHNIQUES if t.column == c for k in t.settings} for c in COLUMNS}


def _settings_of(name: str, value) -> dict:
  """The plan settings a `Point(...)` keyword stands for: a technique (`hpz=True`, `weight_bits=8`), a
  technique column off (`hpz=False`, `weight_bits=None`: its settings at their defaults), or a plan setting
  (`secondary_axes=("gpu",)`)."""
  value = tuple(value) if isinstance(value, list) else value  # a row read back from JSON
  if (name, value) in _BY_COLUMN:
    return _BY_COLUMN[name, value]
  if name in COLUMNS and value == COLUMNS[name]:
    return _OFF[name]
  if name in DEFAULTS:
    return {name: value}
  raise TypeError(f"Point: {name}={value!r} is neither a technique ({', '.join(COLUMNS)}) nor a plan setting")


@dataclasses.dataclass(frozen=True, init=False)
class Point:
  """One point of the space (AMSP §IV-B): shard degrees, the plan settings its techniques change, and for
  a point outside Eq. 7 the in-node parts (s_p^0, s_g^0, s_os^0) of its degrees (None: s^0 = min(s, G)).

  `settings` holds `(name, value)` of each `Plan` setting other than its default, by name (the constructor
  takes them as a mapping or pairs). `Point(8, 8, 8, weight_bits=8, hpz=True)` takes each technique as a
  ranked row spells it (`TECHNIQUES`) or a plan setting (`secondary_axes=("gpu",)`). What a technique does is read from the plan value that owns its setting:
  `point.gather` (qwZ, hpZ, the hierarchical gather), `point.reduction` (qgZ, the 16-bit reduction),
  `point.sync` (Radius, DiLoCo), `point.sharding` (offload)."""
  s_p: int
  s_g: int
  s_os: int
  settings: tuple[tuple[str, object], ...]
  intra: tuple[int, int, int] | None

  def __init__(self, s_p: int, s_g: int, s_os: int, settings=(), intra: tuple[int, int, int] | None = None,
               **techniques):
    out = dict(settings)
    for name, value in techniques.items():
      out.update(_settings_of(name, value))
    unknown = sorted(set(out) - set(DEFAULTS))
    if unknown:
      raise TypeError(f"Point: {unknown[0]!r} is not a plan setting")
    for f, v in (("s_p", s_p), ("s_g", s_g), ("s_os", s_os), ("intra", intra)):
      object.__setattr__(self, f, v)
    object.__setattr__(self, "settings", tuple(sorted(((k, v) for k, v in out.items() if v != DEFAULTS[k]),
                                                      key=lambda kv: kv[0])))

  @classmethod
  def of(cls, plan: Plan, nodes: int, gpus: int) -> Point:
    """The point of `plan` on a nodes x gpus cluster, as the space enumerates it: its degrees (each
    component's group size), and each technique of `TECHNIQUES` its settings turn on. What runs alike on
    this cluster is spelled as the space spells it: `hierarchical=None` is whether the parameter group
    spans nodes, hpZ in a parameter group inside one node is none (its secondary shard is the whole group),
    per-hop `grad_bits` in a gradient group inside one node are the intra-node hop's (the only hop). A
    Radius or DiLoCo sync of any settings is the space's one (`radius()`, `diloco()`), and the settings no
    technique sets (`sync_in_backward`, `remat`, the dtypes of the run, ...) are left out. Raises for a
    plan the cluster cannot run (a group it cannot form, a technique that does not apply there).

    The named plans are points this way: `trial.baselines` (ZeRO-3, ZeRO++, MiCS) from the constructors
    their configs call, and every config of `configs/` in `tests/test_planner_space.py`."""
    size = {"node": nodes, "gpu": gpus}
    degree = lambda axes: axes if isinstance(axes, int) else math.prod(size[a] for a in axes)
    sh = plan.sharding
    pt = cls(degree(sh.param_axes), degree(sh.grad_axes), degree(sh.opt_axes))
    for f in ("param_axes", "grad_axes", "opt_axes"):
      if isinstance(getattr(sh, f), int):
        mesh_lib.check_group(getattr(sh, f), nodes, gpus, what=f"plan {plan.name!r}: {f}")
    f = plan.settings()
    spans = {"p": pt.s_p > gpus, "g": pt.s_g > gpus}
    f["hierarchical"] = spans["p"] if f["hierarchical"] is None else f["hierarchical"]
    if not spans["p"]:
      f["secondary_axes"] = None
    if isinstance(f["grad_bits"], tuple) and not spans["g"]:
      f["grad_bits"] = f["grad_bits"][0]
    f["replica_sync"] = radius() if f["replica_sync"] is not None else None
    f["outer_sync"] = diloco() if f["outer_sync"] is not None else None
    on = [t for t in TECHNIQUES if all(f[k] == v for k, v in t.settings.items())]
    for t in on:
      if not t.applies(pt, nodes * gpus, gpus):
        raise ValueError(f"plan {plan.name!r}: {t.column}={t.value!r} does not apply to its point "
                         f"{pt.name(nodes * gpus)} on {nodes} x {gpus} devices")
    return pt.with_(**{t.column: t.value for t in on})

  @property
  def sharding(self) -> Sharding:
    """Where the point shards its model states: its degrees as group sizes, and `offload`."""
    return _sharding(_values(self.settings).sharding, self.s_p, self.s_g, self.s_os)

  @property
  def gather(self) -> Gather:
    return _values(self.settings).gather

  @property
  def reduction(self) -> Reduction:
    return _values(self.settings).reduction

  @property
  def sync(self) -> ReplicaSync:
    return _values(self.settings).sync

  @property
  def base(self) -> Point:
    """The same degrees with no technique."""
    return Point(self.s_p, self.s_g, self.s_os, intra=self.intra)

  def with_(self, settings=(), **techniques) -> Point:
    """The same degrees with these plan settings and techniques (as `Point(...)` takes them) set too."""
    return Point(self.s_p, self.s_g, self.s_os, {**dict(self.settings), **dict(settings)}, self.intra, **techniques)

  def techniques(self) -> list[Technique]:
    """The entries of `TECHNIQUES` whose plan settings the point's include."""
    own = {**DEFAULTS, **dict(self.settings)}
    return [t for t in TECHNIQUES if all(own[k] == v for k, v in t.settings.items())]

  def columns(self) -> dict:
    """The point's techniques as a ranked row spells them (`COLUMNS`), e.g. weight_bits 8, hpz True."""
    return {**COLUMNS, **{t.column: t.value for t in self.techniques()}}

  @property
  def quantized(self) -> bool:
    return self.gather.quantized or self.reduction.quantized

  @property
  def lossy(self) -> bool:
    """int4 weights, Radius or DiLoCo (the `lossy` techniques): allowed only with `auto.lossy = True`."""
    return any(t.lossy for t in self.techniques())

  def meshes(self, gpus: int) -> tuple[tuple[int, int], ...]:
    """((s_p^0, s_p^1), (s_g^0, s_g^1), (s_os^0, s_os^1))."""
    intra = self.intra or tuple(min(s, gpus) for s in (self.s_p, self.s_g, self.s_os))
    return tuple((i, s // i) for i, s in zip(intra, (self.s_p, self.s_g, self.s_os)))

  def name(self, world: int) -> str:
    """The planner's id of the point ("mics-4+qwz8"), from the pieces of the plan's label (`names.degrees`,
    `Plan.techniques`) but short: ranked rows, `benchmarks/planner.json` and the tests store it.
    On a mesh its label is `point.plan(nodes, gpus).resolve(mesh).label()` (e.g. "zero3+hier+qwZ(int8)")."""
    if self.intra is not None:
      (p0, p1), (g0, g1), (o0, o1) = self.meshes(gpus=0)  # gpus unused: intra is given
      return f"amsp-p{p0}x{p1}-g{g0}x{g1}-os{o0}x{o1}" + self.suffix()
    if self.s_p == self.s_g == self.s_os == world and self.settings == ZEROPP.settings:
      return "zeropp"  # ZeRO++ as published (`zerojax.plan.zeropp`, configs/zeropp.gin)
    return names.degrees(self.s_p, self.s_g, self.s_os, world).short + self.suffix()

  def suffix(self) -> str:
    """The techniques' part of the id, e.g. "+hier+qwz8+hpz+qgz8-4+radius"."""
    return "".join(f"+{n.short}" for n in _values(self.settings).techniques())

  def plan(self, nodes: int, gpus: int, **fields) -> Plan:
    """The executor's plan for this point (groups named by size; the executor factors the mesh)."""
    if self.intra is not None:
      raise ValueError(f"point {self.name(nodes * gpus)} breaks AMSP's node-spanning rule (Eq. 7); the executor "
                       "runs groups of consecutive devices only: use plan_space(..., eq7=True)")
    return Plan(name=self.name(nodes * gpus), param_axes=self.s_p, grad_axes=self.s_g, opt_axes=self.s_os,
                **{**dict(self.settings), **fields})


ZEROPP = Point(1, 1, 1, weight_bits=8, hpz=True, grad_bits=4)  # ZeRO++'s techniques, as published


@functools.lru_cache(maxsize=None)
def _values(settings: tuple) -> Plan:
  """The plan of a point's settings, built once per settings: its gather, reduction and replica sync do not
  depend on the degrees (`Point.sharding` puts them in)."""
  return Plan("point", **dict(settings))


@functools.lru_cache(maxsize=None)
def _sharding(base: Sharding, s_p: int, s_g: int, s_os: int) -> Sharding:
  return dataclasses.replace(base, param_axes=s_p, grad_axes=s_g, opt_axes=s_os)


def options(pt: Point, world: int, gpus: int, lossy: bool, side: str) -> list[dict]:
  """Every combination of `side`'s techniques that `pt`'s degrees may use, one or none per slot, in the
  order of `TECHNIQUES` (the first: none), each as a ranked row spells it (`Point.columns`)."""
  slots, off = {}, {}
  for t in TECHNIQUES:
    if t.side == side:
      slots.setdefault(t.slot, [None])
      off[t.column] = t.off
      if (lossy or not t.lossy) and t.applies(pt, world, gpus):
        slots[t.slot].append(t)
  return [{**off, **{t.column: t.value for t in combo if t}} for combo in itertools.product(*slots.values())]


def param_options(pt: Point, world: int, gpus: int, lossy: bool = False) -> list[dict]:
  """The parameter techniques a point with these degrees may use: qwZ bits x hpZ x gather."""
  return options(pt, world, gpus, lossy, "params")


def grad_options(pt: Point, world: int, gpus: int, lossy: bool = False) -> list[dict]:
  """The gradient techniques: fp32, qgZ (int8, int4, per hop when s_g spans nodes, or float8 hops) or a
  16-bit reduction, each with a dense replica sync or (with `lossy`) Radius's, or DiLoCo's."""
  return options(pt, world, gpus, lossy, "grads")


def with_techniques(pt: Point, nodes: int, gpus: int, lossy: bool = False) -> list[Point]:
  """Every point with `pt`'s degrees and the techniques it may use (the first is `pt` itself)."""
  world = nodes * gpus
  return [pt.with_(**a, **b) for a, b in
          itertools.product(param_options(pt, world, gpus, lossy), grad_options(pt, world, gpus, lossy))]


def plan_space(nodes: int, gpus: int, *, techniques: bool = False, lossy: bool = False,
               eq7: bool = True) -> list[Point]:
  """Every valid point, in a stable order (by s_p, then s_os, then s_g; with `techniques`, each degree
  point followed by its technique variants); `eq7=False` adds the points whose node-spanning groups use
  fewer than all devices of their nodes (after the Eq. 7 points, without techniques)."""
  ds = degrees(nodes, gpus)
  out = []
  for p in ds:
    for os_ in ds:
      if os_ % p:
        continue
      for g in sorted({p, os_}):
        pt = Point(p, g, os_)
        out += with_techniques(pt, nodes, gpus, lossy) if techniques else [pt]
  for d in ds:
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
