"""A plan: where model states are sharded and how each collective is done, as a few small values.

docs/DESIGN.md, "A plan is a few small values". A `Plan` is a name and five values
(`zerojax.plan.values`): `Sharding` (A_p ⊆ A_g ⊆ A_os), `Gather` (dtype, qwZ, hpZ, hierarchical),
`Reduction` (dtype, ring or 2-hop, qgZ and its fidelity options), `ReplicaSync` (dense, in the backward,
Radius) and `Schedule` (remat, prefetch). Each value validates its own fields; `Plan` checks the rules
between them. The named strategies are one-line constructors of it, and the executor compiles it for a
mesh into the components that run it (`zerojax.engine.components`):

| plan    | params A_p   | grads A_g    | optimizer states A_os | replica sync            |
|---------|--------------|--------------|-----------------------|-------------------------|
| DP      | ()           | ()           | ()                    | all-reduce over D       |
| ZeRO-1  | ()           | ()           | (node, gpu)           | -                       |
| ZeRO-2  | ()           | (node, gpu)  | (node, gpu)           | -                       |
| ZeRO-3  | (node, gpu)  | (node, gpu)  | (node, gpu)           | -                       |
| MiCS    | group of k   | group of k   | group of k            | all-reduce over replicas|
| ZeRO++  | (node, gpu)  | (node, gpu)  | (node, gpu)           | - ; int8 gather, hpZ, qgZ|

Gradients are reduce-scattered over A_g in each unit's backward, and over A_os \\ A_g once per accumulation
window (ZeRO-1's only reduction: `components.BoundarySync`). Any plan with replica axes may sparsify its
replica all-reduce with Radius (`replica_sync=radius(...)`).

References:
  ZeRO: Rajbhandari et al. 2020, §5 (stages 1-3).
  MiCS: Zhang et al. 2022, §3.1 (partition groups), §3.3 (hierarchical all-gather), §3.4 (2-hop
    gradient synchronisation).
  ZeRO++: Wang et al. 2023, §3.1 (qwZ), §3.2 (hpZ), §3.3 (qgZ).
  AMSP: Chen et al. 2023, §IV (shard degrees per component).
  Radius: Zheng & Zhang, §4.1 and Algorithm 1 (periodic top-k replica sync).
"""
from __future__ import annotations

import dataclasses
import math

from jax.sharding import Mesh

from zerojax import gpu_aot, mesh as mesh_lib
from zerojax.mesh import AXES
from zerojax.plan.radius import Radius, radius  # noqa: F401  (re-exported: gin registers `zerojax.plan.radius`)
from zerojax.plan.diloco import Diloco, diloco  # noqa: F401  (re-exported: gin registers `zerojax.plan.diloco`)
from zerojax.plan.names import Name
from zerojax.plan.values import Gather, Reduction, ReplicaSync, Schedule, Sharding

VALUES = {"sharding": Sharding, "gather": Gather, "reduction": Reduction, "sync": ReplicaSync,
          "schedule": Schedule}
# A plan's settings by name (what the constructors and gin take): `{field: the value that owns it}`.
# `rotate` and `kernel_backend` belong to both quantizing values: a plan-level setting sets both.
FIELDS = {f.name: v for v, cls in VALUES.items() for f in dataclasses.fields(cls)}
SHARED = ("rotate", "kernel_backend")


def carries_state(reduction: Reduction, sync: ReplicaSync) -> bool:
  """Whether a plan has a component carrying state across steps (`zerojax.state.train_state.STATEFUL`):
  qgZ's error feedback, Radius's residual, DiLoCo's outer state. Each reads the whole step's updates."""
  return bool(reduction.grad_error_feedback) or sync.replica_sync is not None or sync.outer_sync is not None


def update_mode(sharding: Sharding, reduction: Reduction, sync: ReplicaSync) -> str:
  """Where and how the optimizer's update runs, the one place it is decided: "device" (no offloaded state),
  else `Sharding.offload_update` ("streamed", "bulk", "host"), where "streamed" becomes "bulk" for a plan
  that `carries_state`: its components read the whole step's updates, so every offloaded state comes to
  the device at once after the backward (docs/offload.md)."""
  if not sharding.offload:
    return "device"
  if sharding.offload_update == "streamed" and carries_state(reduction, sync):
    return "bulk"
  return sharding.offload_update


@dataclasses.dataclass(frozen=True, init=False)
class Plan:
  """How model states are sharded and communicated: five small values, each validating its own fields,
  and the rules across them checked here.

  `Plan(name, sharding=Sharding(...), gather=Gather(...), ...)` builds it from values; every setting can
  also be given by its field name (`Plan(weight_bits=8)`, `zeropp(grad_bits=(8, 4))`, gin's
  `zeropp.weight_bits = 4`), on top of the given values. `dataclasses.replace(plan, prefetch=True)`
  changes one setting. The executor compiles a plan for a mesh into the per-unit components that run it
  (`zerojax.engine.components.compile`).

  Attributes:
    name: label used in logs and reports.
    sharding: `Sharding`, where the parameters, gradients and optimizer states are sharded.
    gather: `Gather`, how the parameters are gathered (dtype, qwZ, hpZ, hierarchical).
    reduction: `Reduction`, how the gradients are reduced (dtype, ring or 2-hop, qgZ and its fidelity).
    sync: `ReplicaSync`, how the replicas sync (dense, in the backward, Radius).
    schedule: `Schedule`, remat and prefetch.
  """
  name: str
  sharding: Sharding
  gather: Gather
  reduction: Reduction
  sync: ReplicaSync
  schedule: Schedule

  def __init__(self, name: str = "zero3", sharding: Sharding | None = None, gather: Gather | None = None,
               reduction: Reduction | None = None, sync: ReplicaSync | None = None,
               schedule: Schedule | None = None, **fields):
    given = {"sharding": sharding, "gather": gather, "reduction": reduction, "sync": sync, "schedule": schedule}
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
      raise TypeError(f"plan {name!r}: unknown setting {unknown[0]!r}; the settings are {sorted(FIELDS)}")
    try:
      values = {v: given[v] if given[v] is not None else VALUES[v]() for v in VALUES}
      if fields:
        values = _from_fields(name, {**_fields_of(values), **fields})
    except ValueError as e:
      raise ValueError(f"plan {name!r}: {e}") from None
    object.__setattr__(self, "name", name)
    for v, value in values.items():
      object.__setattr__(self, v, value)
    self._check_across()

  def settings(self) -> dict:
    """Every setting by its field name: `Plan(name, **plan.settings())` is the same plan (the shared
    settings are one value each: `_check_across`)."""
    return _fields_of({v: getattr(self, v) for v in VALUES})

  def label(self) -> str:
    """The plan's one label, the name the trainer's log and summary and the CLI show: its sharding
    (`Sharding.stage`), then each technique its values name (`labels()`), joined by "+".

    E.g. "dp", "zero3", "mics(group=8)+hier", "zero3+qwZ(int8)+hpZ(gpu)+qgZ(int4)",
    "mics(group=gpu)+radius(d=0.4,T=20,dense=40)". A resolved plan (`Plan.resolve`, what an executor
    holds) names its groups by the mesh's axes ("mics(group=gpu.2)"). Settings that change neither the
    sums nor the wire are left out: `compute_dtype` (a local cast), `remat`, `prefetch`,
    `sync_in_backward`, `qgz_stages`, `kernel_backend` and `pad_multiple` (the same numbers, to float
    reassociation).
    """
    return "+".join(n.label for n in [self.sharding.stage(), *self.techniques()])

  def techniques(self) -> list[Name]:
    """The techniques' parts of the label (and of the planner's ids, `Point.suffix`), in this order: the
    gather's, the reduction's, the host offload, the replica sync's."""
    return [*self.gather.labels(), *self.reduction.labels(), *self.sharding.labels(), *self.sync.labels()]

  def _check_across(self) -> None:
    """The rules between values: each quantization needs the collective it quantizes, hpZ's group lies
    inside the parameter group, and a setting both quantizing values hold (`rotate` where both quantize,
    `kernel_backend`) is one setting."""
    s, g, r = self.sharding, self.gather, self.reduction
    if g.quantized and not s.param_axes:
      what = "weight_bits" if g.weight_bits else "weight_format"
      raise ValueError(f"plan {self.name!r}: {what} quantizes the parameter all-gather, but param_axes is "
                       f"empty; shard the parameters (e.g. zero3) or drop {what}")
    if self.sync.sync_in_backward and _finer(s.opt_axes, s.grad_axes):
      raise ValueError(f"plan {self.name!r}: sync_in_backward=True all-reduces each unit's gradient shard inside "
                       f"the backward, but opt_axes={s.opt_axes} shard finer than grad_axes={s.grad_axes} (the "
                       "window's reduce-scatter comes first); drop sync_in_backward or shard both alike")
    if g.weight_bits and r.grad_bits and g.rotate != r.rotate:
      raise ValueError(f"plan {self.name!r}: Gather(rotate={g.rotate}) but Reduction(rotate={r.rotate}); rotate is "
                       "one setting of the plan: set it on both values or pass rotate= to the constructor")
    if g.kernel_backend != r.kernel_backend:
      raise ValueError(f"plan {self.name!r}: Gather(kernel_backend={g.kernel_backend!r}) but "
                       f"Reduction(kernel_backend={r.kernel_backend!r}); kernel_backend is one setting of the "
                       "plan: set it on both values or pass kernel_backend= to the constructor")
    if g.secondary_axes is not None and not isinstance(g.secondary_axes, int) and \
        not isinstance(s.param_axes, int):
      within = lambda a: a in s.param_axes or a.split(".")[0] in s.param_axes
      if not g.secondary_axes or not all(within(a) for a in g.secondary_axes):
        raise ValueError(f"plan {self.name!r}: hpZ secondary_axes={g.secondary_axes} must be a non-empty "
                         f"subset of param_axes={s.param_axes}, e.g. ('gpu',)")
    if s.offload and s.offload_update == "host" and carries_state(self.reduction, self.sync):
      raise ValueError(f"plan {self.name!r}: offload_update='host' runs the whole update on the host, but its "
                       "qgZ error feedback, Radius or DiLoCo reads the step's updates on the device; use "
                       "offload_update='streamed'")
    if self.reduction.quantized and not s.grad_axes:
      raise ValueError(f"plan {self.name!r}: qgZ (grad_bits, grad_format) quantizes the gradient reduce-scatter, but "
                       "grad_axes is empty; shard the gradients (zero2/zero3/mics) or drop grad_bits")

  @property
  def update_mode(self) -> str:
    """Where and how the optimizer's update runs (`update_mode`)."""
    return update_mode(self.sharding, self.reduction, self.sync)

  @property
  def remat_mode(self) -> str:
    """`schedule.remat`, with "auto" (or None) not yet chosen by memory (`zerojax.planner.remat`) resolved
    by the rule: "none" without sharded parameters, else "full"."""
    if self.schedule.remat not in (None, "auto"):
      return self.schedule.remat
    return "none" if self.sharding.param_axes in ((), 1) else "full"

  @property
  def alignment(self) -> int:
    """Leaves are padded to a multiple of (devices x alignment), the one padding decision: the
    `Sharding.pad_multiple` asked for and the quantizing values' blocks (qwZ's never cross an owner
    chunk, qgZ's never a pipeline stage)."""
    return math.lcm(self.sharding.pad_multiple, self.gather.alignment, self.reduction.alignment,
                    self.sync.alignment)

  def _group_fields(self) -> dict:
    s = self.sharding
    return {"param_axes": s.param_axes, "grad_axes": s.grad_axes, "opt_axes": s.opt_axes,
            "secondary_axes": self.gather.secondary_axes}

  def groups(self) -> tuple[int, ...]:
    """The group sizes the plan names as ints: the mesh is factored at each (`mesh.factor`)."""
    return tuple(sorted({a for a in self._group_fields().values() if isinstance(a, int)}))

  def check_groups(self, mesh: Mesh) -> None:
    """Raises a one-line error for a group size the mesh cannot form (names the allowed sizes)."""
    nodes, gpus = mesh_lib.base_shape(mesh)
    for f, axes in self._group_fields().items():
      if isinstance(axes, int):
        mesh_lib.check_group(axes, nodes, gpus, what=f"plan {self.name!r}: {f}")

  def resolve(self, mesh: Mesh, gpu: bool | None = None) -> "Plan":
    """The plan on `mesh`'s own axes (`mesh` factored by `mesh.factor(mesh, self.groups())`).

    A group size becomes the axes of its group (`mesh.group_axes`); a whole axis (`"gpu"`) the mesh
    factors (`"gpu.4"`, `"gpu.2"`) is replaced by its factors, major first; `hierarchical=None` becomes
    whether the parameter group spans nodes, `prefetch=None` whether the mesh is of GPUs (see
    `Schedule.prefetch`; `gpu`, if given, instead). Raises for a plan the mesh cannot run.
    """
    self.check_groups(mesh)

    def expand(axes):
      if axes is None:
        return None
      if isinstance(axes, int):
        return mesh_lib.group_axes(mesh, axes)
      out = []
      for a in axes:
        parts = [m for m in mesh.axis_names if a not in mesh.axis_names and m.startswith(a + ".")]
        out.extend(parts or [a])
      return tuple(out)
    s = self.sharding
    sharding = dataclasses.replace(s, param_axes=expand(s.param_axes), grad_axes=expand(s.grad_axes),
                                   opt_axes=expand(s.opt_axes))
    p = sharding.param_axes
    spans = any(mesh_lib.is_node_axis(a) for a in p) and any(not mesh_lib.is_node_axis(a) for a in p)
    if self.gather.hierarchical and not spans:
      raise ValueError(f"plan {self.name!r}: hierarchical=True, but the parameter group {p} of the mesh "
                       f"{mesh_lib.axis_sizes(mesh)} does not span nodes; use hierarchical=None (automatic) "
                       "or False")
    hierarchical = bool(spans if self.gather.hierarchical is None else self.gather.hierarchical)
    gather = dataclasses.replace(self.gather, secondary_axes=expand(self.gather.secondary_axes),
                                 hierarchical=hierarchical)
    prefetch = self.schedule.prefetch
    if prefetch is None:  # on GPUs the default (zerojax.gpu_aot): the layer loops' collectives overlap compute
      prefetch = (gpu_aot.is_gpu(mesh) if gpu is None else gpu) and bool(p)
    return Plan(self.name, sharding, gather, self.reduction, self.sync,
                dataclasses.replace(self.schedule, prefetch=prefetch))

  def validate(self, mesh: Mesh) -> None:
    """Raises if the plan names an axis the mesh does not have, its groups do not nest, or Radius has
    no replicas to sync."""
    for f, axes in self._group_fields().items():
      for a in axes or ():
        if a not in mesh.axis_names:
          raise ValueError(f"plan {self.name!r}: {f} names axis {a!r}, but the mesh has axes "
                           f"{tuple(mesh.axis_names)}")
    try:
      self.sharding.check_nesting()
    except ValueError as e:
      raise ValueError(f"plan {self.name!r}: {e}") from None
    if self.sync.replica_sync is not None and not self.sharding.replica_axes(mesh):
      raise ValueError(f"plan {self.name!r}: replica_sync=radius(...) sparsifies the replica all-reduce, but "
                       f"the optimizer states are sharded over every device of the mesh {mesh_lib.axis_sizes(mesh)} "
                       "(no replicas); use it with dp, mics or a plan whose opt_axes leave replicas, or drop it")
    outer = self.sync.outer_sync
    if outer is not None:
      replicas = self.sharding.replica_axes(mesh)
      node = tuple(a for a in mesh.axis_names if mesh_lib.is_node_axis(a))
      if set(replicas) != set(node) or not node:
        raise ValueError(f"plan {self.name!r}: outer_sync=diloco(...) syncs across nodes and needs the model "
                         f"states sharded inside each node and replicated across nodes, but on the mesh "
                         f"{mesh_lib.axis_sizes(mesh)} they are replicated over {replicas or 'no axis'}; use "
                         "mics() (group = one node) with it")
    secondary = self.gather.secondary_axes
    if secondary is not None and not set(secondary) <= set(self.sharding.param_axes):
      raise ValueError(f"plan {self.name!r}: the hpZ secondary group {secondary} must lie inside the "
                       f"parameter group {self.sharding.param_axes}; use a smaller secondary group")


def _finer(opt, grad) -> bool:
  """Whether optimizer states are sharded over more devices than gradients (False when that depends on
  the mesh: one named by axes, the other by size)."""
  if isinstance(opt, int) and isinstance(grad, int):
    return opt != grad
  if isinstance(opt, int) or isinstance(grad, int):
    return False
  return set(opt) != set(grad)


def _fields_of(values: dict) -> dict:
  """The settings of `values` by field name (a shared setting from the value that uses it)."""
  out = {}
  for v in VALUES:
    out.update({f.name: getattr(values[v], f.name) for f in dataclasses.fields(values[v])
                if f.name not in SHARED})
  g, r = values["gather"], values["reduction"]
  out["rotate"] = g.rotate or r.rotate  # equal where both quantize (`Plan._check_across`)
  out["kernel_backend"] = g.kernel_backend  # == r.kernel_backend (`Plan._check_across`)
  return out


def _from_fields(name: str, fields: dict) -> dict:
  """The five values from settings by field name; `rotate` goes to each value that quantizes."""
  rotate = fields["rotate"]
  if rotate and not (fields["weight_bits"] or fields["grad_bits"]):
    raise ValueError("rotate=True rotates quantization blocks, but neither weight_bits nor grad_bits is "
                     "set; set one or drop rotate")
  shared = {"gather": {"rotate": bool(rotate and fields["weight_bits"])},
            "reduction": {"rotate": bool(rotate and fields["grad_bits"])}}
  out = {}
  for v in ("schedule", "sync", "sharding", "gather", "reduction"):  # the order errors are reported in
    own = {f.name: fields[f.name] for f in dataclasses.fields(VALUES[v])}
    out[v] = VALUES[v](**{**own, **shared.get(v, {})})
  return {v: out[v] for v in VALUES}


def dp(**kw) -> Plan:
  """Data parallelism: everything replicated, one dense gradient all-reduce per step."""
  return Plan(name="dp", param_axes=(), grad_axes=(), opt_axes=(), **kw)


def zero1(**kw) -> Plan:
  """ZeRO stage 1 (ZeRO §5.1): optimizer states sharded over all devices."""
  return Plan(name="zero1", param_axes=(), grad_axes=(), opt_axes=AXES, **kw)


def zero2(**kw) -> Plan:
  """ZeRO stage 2 (ZeRO §5.2): gradients reduce-scattered per layer, optimizer states sharded."""
  return Plan(name="zero2", param_axes=(), grad_axes=AXES, opt_axes=AXES, **kw)


def zero3(**kw) -> Plan:
  """ZeRO stage 3 (ZeRO §5.3): parameters, gradients and optimizer states sharded over all devices.

  `zero3(reduce_dtype="bfloat16")` is ZeRO-3 as DeepSpeed runs it by default and as ZeRO++'s evaluation
  compares against (16-bit gradients, reduced in 16 bits on the wire: `Reduction.reduce_via`);
  `configs/zero3_bf16grad.gin`.
  """
  kw.setdefault("name", "zero3")
  return Plan(param_axes=AXES, grad_axes=AXES, opt_axes=AXES, **kw)


def mics(group_size: int | None = None, hierarchical: bool | None = None, **kw) -> Plan:
  """MiCS (Zhang et al. 2022): model states sharded inside partition groups, replicated across them.

  The partition group is `group_size` consecutive devices (§3.2): a divisor of a node's devices, one node
  (the default, `None`), or a whole number of nodes dividing the cluster. Gradients are reduce-scattered
  inside the group every micro-step and all-reduced over the replicas once per accumulation window (§3.4,
  the 2-hop synchronisation); a group that spans nodes gathers hierarchically (§3.3) unless
  `hierarchical=False`. Further plan fields (qwZ `weight_bits`, qgZ `grad_bits`, hpZ `secondary_axes`)
  compose as for any plan.
  """
  group = ("gpu",) if group_size is None else group_size
  kw.setdefault("name", "mics")
  return Plan(param_axes=group, grad_axes=group, opt_axes=group, hierarchical=hierarchical, **kw)


def zeropp(weight_bits: int | None = 8, secondary_axes=("gpu",), grad_bits: int | None = 4, **kw) -> Plan:
  """ZeRO++ (Wang et al. 2023): ZeRO-3 with qwZ (§3.1), hpZ (§3.2) and qgZ (§3.3).

  Each technique is one argument; pass None to switch it off (the ablation of ZeRO++ §5.4).
  """
  kw.setdefault("name", "zeropp")
  return Plan(param_axes=AXES, grad_axes=AXES, opt_axes=AXES, weight_bits=weight_bits,
              secondary_axes=secondary_axes, grad_bits=grad_bits, **kw)


def amsp(s_p: int, s_g: int, s_os: int, **kw) -> Plan:
  """AMSP (Chen et al. 2023, §IV): parameters, gradients and optimizer states sharded over groups of
  s_p | s_g | s_os consecutive devices and replicated across them; `zerojax.planner` picks the degrees."""
  kw.setdefault("name", f"amsp-p{s_p}-g{s_g}-os{s_os}")
  kw.setdefault("hierarchical", None)
  return Plan(param_axes=s_p, grad_axes=s_g, opt_axes=s_os, **kw)


PLANS = {"dp": dp, "zero1": zero1, "zero2": zero2, "zero3": zero3, "mics": mics, "zeropp": zeropp}
