"""A plan compiled for a mesh: the components a unit's engine and the executor call.

docs/DESIGN.md, "Components". `compile(plan, mesh)` turns a resolved `Plan`'s values into
- `ParamGather`: the parameter collectives of every unit (the master shard into the parameter shard, the
  forward gather, what is kept for the backward, the backward's re-gather) — `Plan.gather` on
  `Plan.sharding`;
- `GradReduction`: a unit's gradient reduction over A_g, inside its backward — `Plan.reduction`;
- `BoundarySync`: the accumulated gradient's sync at the end of the window (reduce-scatter over
  A_os \\ A_g, all-reduce over the replicas, or the same all-reduce inside the last backward) —
  `Plan.sync` (a stateful component may replace its all-reduce: `zerojax.state.stateful`);
- the schedule: the remat mode and whether scanned units prefetch — `Plan.schedule`;
- `HostOffload`: which train-state fields live in host memory — `Sharding.offload` (`zerojax.engine.offload`).
The unit (`zerojax.engine.unit`), its prefetch call order and the step body call these; none reads the plan.
Components are the same for every unit: a unit binds them to its leaves in its `UnitMeta`.

`compile` decides once, from the mesh's sizes, what a device does not need: an axis of size 1 moves no
data, so no collective runs over it, and a group of one device neither gathers, reduces, quantizes (qwZ,
float8, qgZ: the data never leaves the device, so quantizing would only lose precision and time) nor
prefetches. On a 1 x 1 mesh every plan then runs what `dp` runs (docs/DESIGN.md, "Components").

References:
  ZeRO: Rajbhandari et al. 2020, §5. ZeRO++: Wang et al. 2023, §3.1-3.3. MiCS: Zhang et al. 2022,
  §3.3-3.4. AMSP: Chen et al. 2023, §IV. LoCo: Xie et al. 2024, §3. SDP4Bit: Jia et al. 2024, §3.2.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from zerojax import comm, gpu_aot, mesh as mesh_lib
from zerojax.quant import kernel_choice
from zerojax.engine.layout import LeafLayout, pad_flat, unflatten_leaf
from zerojax.mesh import axis_sizes, group_size, owner_index
from zerojax.engine.offload import HostOffload
from zerojax.plan import Plan

SEED = 0x5D4B  # the base key of stochastic rounding (the same in every run: the step makes it vary)


@dataclasses.dataclass(frozen=True)
class ParamGather:
  """How a unit's parameters reach its compute (ZeRO §5.3; qwZ, ZeRO++ §3.1; hpZ, §3.2; MiCS §3.3).

  Attributes:
    axes: A_p's axes of size > 1, the axes the parameter shards are gathered over (none: nothing moves,
      the shard is the whole leaf).
    to_param: A_os \\ A_p's axes of size > 1, in order: the master shard is gathered over them into the
      parameter shard.
    degree: devices along A_p.
    dtype: the parameters' dtype on the wire; `compute_dtype` the one the unit computes in.
    wire_format: the gather's wire format (`comm.formats`: qwZ's int8/int4, or float8 blocks; None:
      unquantized, always where `axes` is empty); `quantize_backward` whether the backward's re-gather is
      quantized too (without hpZ).
    hierarchical: gather across nodes first, then inside the node (MiCS §3.3); only where `axes` hold
      both a node axis and a gpu axis.
    secondary: hpZ's secondary axes of size > 1 (None: no hpZ; (): a secondary group of one device, which
      keeps the whole gathered weights and re-gathers nothing); `secondary_degree` the devices along them.
    rotate, backend: Hadamard-rotated blocks; the quantization kernels.
    widen_once: on one device (nothing ever moves) the master is rounded to `dtype` and widened to
      `compute_dtype` once per step in `from_master`, as a plain jitted step casts its weights, instead of
      at each call of each unit, forward and backward. (On larger meshes dp, ZeRO-1 and ZeRO-2 keep the
      per-call cast: the same values, but XLA's other fusion moves the last bits of their golden values.)
  """
  axes: tuple[str, ...]
  to_param: tuple[str, ...]
  degree: int
  dtype: str
  compute_dtype: str
  wire_format: comm.WireFormat | None
  quantize_backward: bool
  hierarchical: bool
  secondary: tuple[str, ...] | None
  secondary_degree: int
  rotate: bool
  backend: str | None
  widen_once: bool = False

  @property
  def moves(self) -> bool:
    """Whether the unit's gather moves data (some axis of A_p has more than one device); without it the
    parameter shard is the whole flat leaf and `forward` / `backward` return the shards as they are."""
    return bool(self.axes)

  @property
  def shard_dtype(self) -> str:
    """The dtype of the parameter shards the units get: `dtype`, the one they travel in, or with
    `widen_once` already `compute_dtype`."""
    return self.compute_dtype if self.widen_once else self.dtype

  def from_master(self, master):
    """The executor's step 0: master shards (over A_os) -> parameter shards (over A_p), rounded to `dtype`,
    in `shard_dtype`."""
    cast, widen = lambda m: m.astype(self.dtype), lambda m: m.astype(self.shard_dtype)
    if not self.to_param:
      return jax.tree.map(lambda m: widen(cast(m)), master)
    return jax.tree.map(lambda m: widen(comm.all_gather_raw(cast(m), self.to_param, axis=m.ndim - 1, tiled=True)),
                        master)

  def forward(self, shards: list, backward: bool = False) -> list:
    """The unit's full flat leaves `[padded_i]`, gathered over A_p (quantized with qwZ or float8)."""
    quantize = not backward or self.quantize_backward
    return comm.all_gather_unit(shards, self.axes, fmt=self.wire_format if quantize else None,
                                backend=self.backend, hierarchical=self.hierarchical, rotate=self.rotate)

  def secondary_shards(self, flats: list) -> list:
    """hpZ (ZeRO++ §3.2): this device's slice of each gathered leaf along the secondary axes."""
    if not self.secondary:  # a secondary group of one device: the whole gathered leaf
      return list(flats)
    k, idx = self.secondary_degree, owner_index(self.secondary)
    return [lax.dynamic_index_in_dim(f.reshape(k, -1), idx, keepdims=False) for f in flats]

  def keep(self, shards: list, flats: list) -> list:
    """What a unit keeps of its weights for the backward: the primary shard, or with hpZ the secondary
    shard of the (dequantized) gathered weights, so the backward uses exactly the forward's weights."""
    return self.secondary_shards(flats) if self.secondary is not None else shards

  def backward(self, kept: list) -> list:
    """The backward's gather of the kept shards: over the secondary axes inside the node (hpZ, ZeRO++
    §3.2), else over A_p like the forward (quantized when `quantize_backward`)."""
    if self.secondary is not None:
      return comm.all_gather_unit(kept, self.secondary, hierarchical=self.hierarchical)
    return self.forward(kept, backward=True)

  def params(self, treedef, leaves: tuple[LeafLayout, ...], flats: list) -> Any:
    """The unit's parameter tree from its gathered flat leaves, in the compute dtype."""
    return jax.tree.unflatten(treedef, [unflatten_leaf(f, l).astype(self.compute_dtype)
                                        for f, l in zip(flats, leaves)])

  def cotangents(self, leaves: tuple[LeafLayout, ...], layers: int | None = None) -> list:
    """Zero cotangents of the parameter shards: the gradient leaves through the sinks."""
    lead = () if layers is None else (layers,)
    return [jnp.zeros(lead + (l.padded // self.degree,), self.shard_dtype) for l in leaves]


@dataclasses.dataclass(frozen=True)
class GradReduction:
  """A unit's gradient reduction over A_g inside its backward (ZeRO §5.2; qgZ, ZeRO++ §3.3).

  Attributes:
    order: A_g's axes of size > 1 in the order the gradient shards are laid out (`Sharding.grad_order`);
      `sizes` along it. None: a group of one device, whose gradient is its chunk (no collective).
    dtype: the dtype gradients are reduced and accumulated in.
    all_to_all: an unquantized gradient goes by the 2-hop all-to-all instead of `psum_scatter`.
    hop_formats, stages: qgZ's wire format per hop, (intra-node, inter-node) (`comm.formats`; None:
      unquantized, always where `order` is empty) and pipeline stages; `rotate`, `backend` as for
      `ParamGather`.
    error_feedback, stochastic_rounding: qgZ's fidelity options; each needs the unit's per-call state
      (`zerojax.engine.unit.UnitState`): the errors an in-backward component keeps (LoCo §3), the
      rounding key this component folds (`seeds`).
    owner: the plan's name, for errors.
  """
  order: tuple[str, ...]
  sizes: tuple[int, ...]
  dtype: str
  all_to_all: bool
  hop_formats: tuple[comm.WireFormat, comm.WireFormat] | None
  stages: int
  rotate: bool
  backend: str | None
  error_feedback: bool
  stochastic_rounding: bool
  owner: str

  def kept_in(self, dtype: str) -> GradReduction:
    """This reduction where nothing is reduced or accumulated: the gradient stays in `dtype`, the dtype it
    is computed in, until the optimizer step widens it (`Steps`). A wider sink would hold the same values
    at twice the bytes; `jax.grad` of a 16-bit computation keeps its 16-bit gradients the same way."""
    if self.order:
      raise ValueError(f"plan {self.owner!r}: the gradient is reduced over {self.order}; it is kept in "
                       f"reduce_dtype={self.dtype!r}")
    return dataclasses.replace(self, dtype=dtype)

  def sinks(self, layout_tree) -> Any:
    """Zero gradient sinks `[padded / |A_g|]` for a tree of `LeafLayout`s."""
    degree = math.prod(self.sizes)
    return jax.tree.map(lambda l: jnp.zeros(l.flat_shape(degree), self.dtype), layout_tree,
                        is_leaf=lambda x: isinstance(x, LeafLayout))

  def seeds(self, metas: dict, step, micro, rank) -> dict:
    """Inside the shard_map: `{unit: stochastic rounding's key data or None}` for `UnitState.seed`, folded
    from the step, the micro-step, the device's rank, the unit and (for a scanned unit) the layer (SDP4Bit
    §3): runs are reproducible and no two devices, units or layers share noise."""
    out = {}
    for j, (u, meta) in enumerate(sorted(metas.items())):
      out[u] = None
      if self.stochastic_rounding:
        key = jax.random.key(SEED)
        for x in (step, micro, rank, j):
          key = jax.random.fold_in(key, x)
        layers = meta.leaves[0].layers
        out[u] = jax.random.key_data(key if layers is None else jax.random.split(key, layers))
    return out

  def __call__(self, grads: Any, leaves: tuple[LeafLayout, ...], error=None, seed=None):
    """`(reduced chunks, new error-feedback buffers or None)` of a unit's gradient tree; `error`: the
    errors to add back (`(e_send, e_node)`, LoCo §3), `seed`: stochastic rounding's key data."""
    flats = [pad_flat(g.astype(self.dtype), l) for g, l in zip(jax.tree.leaves(grads), leaves)]
    if (self.error_feedback and error is None) or (self.stochastic_rounding and seed is None):
      raise ValueError(f"plan {self.owner!r}: grad_error_feedback / stochastic_rounding need the unit's qgZ "
                       "state (ShardedUnit.state), which the executor's step passes to every unit; call the "
                       "unit through the executor's model (zerojax.unit, from_linen, from_nnx)")
    if not self.order:  # one device: nothing to reduce, nothing quantized, so nothing dropped
      return flats, (None if error is None else jax.tree.map(jnp.zeros_like, error))
    fidelity = {}
    if self.hop_formats:
      fidelity = {"rotate": self.rotate, "error": error,
                  "key": None if seed is None else jax.random.wrap_key_data(seed)}
    out = comm.reduce_scatter_unit(flats, self.order, self.sizes, formats=self.hop_formats, stages=self.stages,
                                   backend=self.backend, all_to_all=self.all_to_all, **fidelity)
    return out if error is not None else (out, None)


@dataclasses.dataclass(frozen=True)
class BoundarySync:
  """The accumulated gradient's sync at the end of an accumulation window: a reduce-scatter over
  A_os \\ A_g (ZeRO-1, AMSP's T_os, §IV), then an all-reduce over the replica axes (MiCS §3.4's 2-hop
  synchronisation). With `in_backward` the all-reduce runs inside each unit's backward of the window's
  last micro-step instead (`ReplicaSync.sync_in_backward`).

  Attributes:
    to_opt: A_os \\ A_g's axes of size > 1, in order.
    replicas: the replica axes (outside A_os) of size > 1.
    in_backward: the replica all-reduce rides with the units' gradient reductions.
  """
  to_opt: tuple[str, ...]
  replicas: tuple[str, ...]
  in_backward: bool

  def __call__(self, acc, all_reduce: bool = True):
    """`acc` reduce-scattered over `to_opt`, then (with `all_reduce`) all-reduced over the replicas."""
    if self.to_opt:
      acc = jax.tree.map(lambda g: lax.psum_scatter(g, self.to_opt, scatter_dimension=g.ndim - 1, tiled=True),
                         acc)
    if self.replicas and all_reduce:
      acc = jax.tree.map(lambda g: lax.psum(g, self.replicas), acc)
    return acc


@dataclasses.dataclass(frozen=True)
class Components:
  """A plan compiled for a mesh (see the module docstring).

  Attributes:
    gather, reduction, sync: the communication components.
    remat: the remat mode every unit runs (`Schedule.remat` resolved).
    prefetch: whether a scanned unit run by `zerojax.engine.scan_layers` prefetches its layers (never where the
      gather moves nothing: there is nothing to fetch ahead).
    mean_axes: the mesh's axes of size > 1, over which the step averages its loss, metrics and mutable
      collections (`mean`); those of one replica where the replicas train apart.
    replicas_apart: the axes over which the replicas train apart between syncs (`ReplicaSync.trains_apart`,
      DiLoCo: the nodes, possibly of size 1); () for every other plan. The executor's `Placement` keeps
      one copy of the state per replica over them.
    offload: which train-state fields live in host memory (`zerojax.engine.offload.HostOffload`, from
      `Sharding.offload`).
  """
  gather: ParamGather
  reduction: GradReduction
  sync: BoundarySync
  remat: str
  prefetch: bool
  mean_axes: tuple[str, ...] = ()
  replicas_apart: tuple[str, ...] = ()
  offload: HostOffload = HostOffload()

  @property
  def reduces(self) -> bool:
    """Whether any collective reduces the gradient: over A_g in the backward, or at the boundary."""
    return bool(self.reduction.order or self.sync.to_opt or self.sync.replicas)

  def mean(self, x):
    """`x` averaged over the data-parallel devices (`lax.pmean` over `mean_axes`; `x` itself on one)."""
    return lax.pmean(x, self.mean_axes) if self.mean_axes else x


def compile(plan: Plan, mesh: Mesh, gpu: bool | None = None) -> Components:  # noqa: A001 (the plan's compile step)
  """The components that run a resolved `plan` (`Plan.resolve(mesh)`) on `mesh`.

  An axis of size 1 moves nothing: every collective, quantization and prefetch is decided here from the
  axes of size > 1 (the module docstring); on meshes without such axes the plan's axes are kept as they
  are. `gpu`: whether to make a GPU's choices (the kernels); None: whether the mesh's devices are GPUs.
  """
  s, g, r = plan.sharding, plan.gather, plan.reduction
  sizes = axis_sizes(mesh)
  moving = lambda axes: tuple(a for a in axes if sizes[a] > 1)
  node = lambda a: mesh_lib.is_node_axis(a)
  # No kernel_backend named: on GPUs each op's fastest measured kernel (pallas_kernels.kernel_table), else xla.
  kernels = kernel_choice.FASTEST if (gpu_aot.is_gpu(mesh) if gpu is None else gpu) else None
  p_axes = moving(s.param_axes)
  secondary = moving(g.secondary_axes) if p_axes and g.secondary_axes else None
  gather = ParamGather(
      axes=p_axes, to_param=moving(s.opt_order[len(s.param_axes):]), degree=group_size(mesh, s.param_axes),
      dtype=g.param_dtype, compute_dtype=g.compute_dtype or g.param_dtype,
      wire_format=g.wire_format if p_axes else None, quantize_backward=g.quantize_backward_gather,
      hierarchical=bool(g.hierarchical) and any(map(node, p_axes)) and not all(map(node, p_axes)),
      secondary=secondary, secondary_degree=group_size(mesh, secondary) if secondary else 1,
      rotate=g.rotate and bool(p_axes), backend=g.kernel_backend or kernels, widen_once=mesh.size == 1)
  g_axes = moving(s.grad_order)
  reduction = GradReduction(
      order=g_axes, sizes=tuple(sizes[a] for a in g_axes), dtype=r.reduce_dtype,
      all_to_all=r.gradient_all_to_all and bool(g_axes), hop_formats=r.hop_formats if g_axes else None,
      stages=r.qgz_stages, rotate=r.rotate and bool(g_axes),
      backend=r.kernel_backend or kernels, error_feedback=r.grad_error_feedback,
      stochastic_rounding=r.stochastic_rounding, owner=plan.name)
  to_opt, replicas = moving(s.opt_order[len(s.grad_order):]), moving(s.replica_axes(mesh))
  apart = s.replica_axes(mesh) if plan.sync.trains_apart else ()  # DiLoCo: no step reduces over the replicas
  replicas = () if apart else replicas
  # `Plan` refuses sync_in_backward where A_os is finer than A_g (`to_opt` is then empty).
  sync = BoundarySync(to_opt, replicas, in_backward=bool(plan.sync.sync_in_backward and replicas))
  return Components(gather, reduction, sync, plan.remat_mode, bool(plan.schedule.prefetch) and gather.moves,
                    mean_axes=tuple(a for a in moving(mesh.axis_names) if a not in apart), replicas_apart=apart,
                    offload=HostOffload.of(plan, mesh))
