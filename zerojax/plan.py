"""A plan: which mesh axes shard each model-state component, and how each collective is done.

docs/DESIGN.md, "A plan is a choice of mesh axes". The named strategies are constructors of one `Plan`
value driving one executor (`zerojax.executor`):

| plan    | params A_p   | grads A_g    | optimizer states A_os | replica sync            |
|---------|--------------|--------------|-----------------------|-------------------------|
| DP      | ()           | ()           | ()                    | all-reduce over D       |
| ZeRO-1  | ()           | ()           | (node, gpu)           | reduce-scatter          |
| ZeRO-2  | ()           | (node, gpu)  | (node, gpu)           | -                       |
| ZeRO-3  | (node, gpu)  | (node, gpu)  | (node, gpu)           | -                       |
| MiCS    | group of k   | group of k   | group of k            | all-reduce over replicas|
| ZeRO++  | (node, gpu)  | (node, gpu)  | (node, gpu)           | - ; int8 gather, hpZ, qgZ|

Any plan with replica axes may sparsify its replica all-reduce with Radius (`replica_sync=radius(...)`).

References:
  ZeRO: Rajbhandari et al. 2020, §5 (stages 1-3).
  MiCS: Zhang et al. 2022, §3.1 (partition groups), §3.3 (2-hop gradient synchronisation).
  ZeRO++: Wang et al. 2023, §3.1 (qwZ), §3.2 (hpZ), §3.3 (qgZ).
  Radius: Zheng & Zhang, §4.1 and Algorithm 1 (periodic top-k replica sync), §4.2 and Algorithm 2
    (selection on the AdamW-corrected update), §4.3 (residual).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax.numpy as jnp
from jax.sharding import Mesh

from zerojax import gpu_aot, mesh as mesh_lib, remat
from zerojax.mesh import AXES

Axes = tuple[str, ...] | int  # mesh axes by name, or a group of that many consecutive devices
REDUCE_VIA = ("auto", "all_to_all", "reduce_scatter")
REMAT = remat.MODES


def _axes(axes: Sequence[str] | str | int) -> Axes:
  if isinstance(axes, int) and not isinstance(axes, bool):
    if axes < 1:
      raise ValueError(f"a group of {axes} devices: use a positive group size")
    return axes
  return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True)
class Radius:
  """Radius's sparse replica sync (Radius §4, Algorithms 1–2), the value of `Plan.replica_sync`.

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

  def shard_k(self, chunk: int) -> int:
    """Selected elements of a shard of `chunk` elements: ⌈density · chunk⌉ (at least 1)."""
    return max(1, math.ceil(round(self.density * chunk, 6)))


def radius(density: float = 0.4, period: int = 200, dense_steps: int = 0) -> Radius:
  """Radius's replica sync (see `Radius`): `mics(replica_sync=radius(density=0.1))`."""
  return Radius(density=density, period=period, dense_steps=dense_steps)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How model states are sharded and communicated.

  Each of `param_axes`, `grad_axes`, `opt_axes` and `secondary_axes` names mesh axes (`("node", "gpu")`,
  `("gpu",)`) or is an int k: a group of k consecutive devices (a divisor of a node's devices, or whole
  nodes). The executor factors the mesh so that every such group is a set of axes (`mesh.factor`) and
  resolves the plan onto it (`resolve`); the devices outside a group that hold the same shard are the
  replica axes.

  Attributes:
    name: label used in logs and reports.
    param_axes: A_p, mesh axes the parameters (P) are sharded over between layers.
    grad_axes: A_g ⊇ A_p, mesh axes the accumulated gradient (G) is sharded over.
    opt_axes: A_os ⊇ A_g, mesh axes the fp32 master weights and optimizer states are sharded over.
    hierarchical: MiCS §3.3 all-gather for groups that span nodes: gather across nodes among devices
      with the same local rank first (all in parallel), then inside the node. Same output as the flat
      gather, (p - k) M / p instead of (p - 1) M / p bytes across nodes. None: on exactly when the
      parameter group spans nodes (MiCS's default); True on a group inside one node is an error.
    sync_in_backward: for plans with replicas and A_g = A_os (DP, MiCS): the last micro-step of an
      accumulation window all-reduces each unit's gradient over the replica axes inside its backward,
      overlapping the sync with the remaining backward compute; False syncs after the window (MiCS §3.4
      as written). Same sums either way (to float reassociation). Needs every unit called once per
      micro-batch, which is checked at trace time (a model whose layers are traced twice, as flax's
      `nn.scan` does, is refused with a one-line error): opt-in, on in `configs/mics*.gin`.
    param_dtype: dtype of the parameters on the wire (and in compute unless `compute_dtype` is set).
    compute_dtype: dtype the gathered parameters are cast to before the unit's computation (None:
      `param_dtype`). E.g. bf16 on the wire with fp32 compute, faster than bf16 math on CPUs.
    reduce_dtype: dtype gradients are reduced and accumulated in (fp32). 16-bit (bf16/fp16) is
      DeepSpeed's ZeRO-3 default (`communication_data_type`) and the baseline of ZeRO++'s evaluation.
    reduce_via: how a unit's unquantized gradient is reduce-scattered over A_g: "reduce_scatter" (one
      `psum_scatter`, a ring on GPUs), "all_to_all" (qgZ's two hops, inside the node then across nodes,
      moving the gradient's raw words and summing in fp32: `comm.reduce.all_to_all_reduce_scatter`), or
      "auto" (the default): "all_to_all" when `reduce_dtype` is 16-bit, so 16-bit gradients stay 16 bits
      on the wire on every backend (XLA:CPU widens a 16-bit reduce-scatter to fp32), else
      "reduce_scatter". Ignored with qgZ (`grad_bits`), which is its own all-to-all.
    remat: what a unit's backward recomputes. "full": the whole forward, from the unit's inputs and the
      re-gathered weights (ZeRO-3's default: nothing but the inputs is kept between forward and
      backward). "dots": keeps the outputs of the matmuls with the weights
      (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`) and recomputes the rest. "none": keeps
      every residual of the forward and recomputes nothing. In every mode the backward re-gathers the
      weights (hpZ: from the secondary shard) instead of keeping them: residuals that are the gathered
      weights themselves are dropped after the forward, so "dots" and "none" cost activation memory
      (per layer, for the whole backward), never gathered weights. None (the default): "none" when the
      parameters are not sharded (DP, ZeRO-1/2: weights resident, nothing to re-gather), else "full".
    weight_bits: qwZ (ZeRO++ §3.1): the forward all-gather moves block-quantized values of this many
      bits (8 or 4) and their scales; None gathers in `param_dtype`.
    weight_block: elements per qwZ quantization block; 0 = one scale per shard (non-blocked, the
      baseline of ZeRO++ §3.1 / Fig. 2).
    quantize_backward_gather: with qwZ and without hpZ, re-gather quantized in backward too (the
      backward then uses exactly the forward's dequantized weights).
    secondary_axes: hpZ (ZeRO++ §3.2): after a unit's forward keep only its secondary shard, the
      slice of the gathered weights for this device's position along these axes (⊆ param_axes, default
      the node, `("gpu",)`); the backward all-gather runs over them only.
    grad_bits: qgZ (ZeRO++ §3.3): the gradient reduce-scatter becomes a 2-hop all-to-all of
      block-quantized values of this many bits (4 or 8): inside the node, then across nodes. A pair
      `(intra, inter)` sets each hop's bits, e.g. `(8, 4)`: int8 inside the node, int4 across nodes
      (SDP4Bit §3.2). A group with one hop uses the bits of that hop.
    grad_block: elements per qgZ quantization block; 0 = one scale per slab (non-blocked).
    qgz_stages: qgZ pipeline stages (ZeRO++ §4.1.2, Algorithm 2); results do not depend on it.
    kernel_backend: quantization kernels, "xla", "pallas" or "triton" (None: the default backend).
    grad_error_feedback: qgZ with error feedback (LoCo §3): what each quantization of qgZ drops (the
      first hop's error of the local gradient, the second hop's error of the node-local sums) is kept
      per device and added to the same positions' values at the next micro-step, so nothing is lost,
      only delayed. The errors are train state (`TrainState.grad_error`, checkpointed); they cost one
      fp32 copy of the unit's local gradient plus 1/G of it per device.
    rotate: quantize every block (qwZ and qgZ) times a Hadamard matrix, undone after dequantization
      (SDP4Bit §3.2): outliers are spread over the block, so its scale fits the values better. The
      block sizes must be powers of two.
    stochastic_rounding: qgZ rounds stochastically (`floor(x / scale + u)`, unbiased), with noise
      seeded by the step, micro-step, unit, layer and device: reproducible, independent per device.
    replica_sync: how gradients are all-reduced over the replica axes: None, densely; `radius(...)`,
      Radius's periodic top-k with a residual (`Radius`). Radius syncs after the accumulation window
      (select and sparse steps do not use `sync_in_backward`; its dense warm-up steps do).
    prefetch: inside a scanned unit run by `zerojax.scan_layers`, gather layer i+1 while layer i computes
      (forward), and in backward gather layer i-1 and reduce layer i+1's gradient while layer i's
      backward runs (`zerojax.prefetch`): a schedule of the unit's own engine, so it composes with every
      other field (remat modes, qgZ error feedback, stochastic rounding). At most two gathered layers are
      alive. False: each layer gathers when it runs. Same numbers either way (to float reassociation).
      None (the default): on for a mesh of GPUs when the parameters are sharded and remat is "full", off
      on CPUs; `resolve` decides. On GPUs it is what lets the layer loops' collectives overlap compute
      (`zerojax.gpu_aot`). With remat "dots" / "none" it is opt-in: there the compiled H100 program of
      zeropp keeps weights gathered outside the backward layer loop alive across it (the per-layer path
      does not).
  """
  name: str = "zero3"
  param_axes: Axes = AXES
  grad_axes: Axes = AXES
  opt_axes: Axes = AXES
  hierarchical: bool | None = False
  sync_in_backward: bool = False
  param_dtype: str = "bfloat16"
  reduce_dtype: str = "float32"
  reduce_via: str = "auto"
  remat: str | None = None
  compute_dtype: str | None = None
  weight_bits: int | None = None
  weight_block: int = 256
  quantize_backward_gather: bool = True
  secondary_axes: Axes | None = None
  grad_bits: int | tuple[int, int] | None = None
  grad_block: int = 256
  qgz_stages: int = 1
  kernel_backend: str | None = None
  replica_sync: Radius | None = None
  prefetch: bool | None = None
  grad_error_feedback: bool = False
  rotate: bool = False
  stochastic_rounding: bool = False

  def __post_init__(self):
    if self.prefetch is not None and not isinstance(self.prefetch, bool):
      raise ValueError(f"plan {self.name!r}: prefetch={self.prefetch!r}; use True, False or None (on for GPUs)")
    if self.replica_sync is not None and not isinstance(self.replica_sync, Radius):
      raise ValueError(f"plan {self.name!r}: replica_sync={self.replica_sync!r}; use None (dense all-reduce) "
                       "or radius(density=..., period=..., dense_steps=...)")
    for f in ("param_axes", "grad_axes", "opt_axes", "secondary_axes"):
      if getattr(self, f) is not None:
        object.__setattr__(self, f, _axes(getattr(self, f)))
    self._check_zeropp()
    self._check_modes()
    for f in ("param_axes", "grad_axes", "opt_axes"):
      axes = getattr(self, f)
      if not isinstance(axes, int) and len(set(axes)) != len(axes):
        raise ValueError(f"plan {self.name!r}: {f}={axes} repeats an axis")
    self._check_nesting()
    for f in ("param_dtype", "reduce_dtype", "compute_dtype"):
      if getattr(self, f) is None:
        continue
      try:
        jnp.dtype(getattr(self, f))
      except TypeError:
        raise ValueError(f"plan {self.name!r}: {f}={getattr(self, f)!r} is not a dtype name "
                         "(use 'float32' or 'bfloat16')") from None

  def _check_nesting(self) -> None:
    p, g, os_ = self.param_axes, self.grad_axes, self.opt_axes
    if all(isinstance(a, int) for a in (p, g, os_)):
      ok = g % p == 0 and os_ % g == 0
    elif any(isinstance(a, int) for a in (p, g, os_)):
      return  # checked once resolved onto a mesh
    else:
      ok = set(p) <= set(g) <= set(os_)
    if not ok:
      raise ValueError(f"plan {self.name!r}: shard groups must nest, params {p} ⊆ grads {g} ⊆ optimizer "
                       f"states {os_}; a component cannot be sharded over devices its successor is replicated "
                       "over")

  @property
  def hop_bits(self) -> tuple[int, int] | None:
    """qgZ's bits per hop, (intra-node, inter-node); None without qgZ."""
    if self.grad_bits is None:
      return None
    return tuple(self.grad_bits) if isinstance(self.grad_bits, (tuple, list)) else (self.grad_bits,) * 2

  def _check_fidelity(self) -> None:
    if isinstance(self.grad_bits, list):
      object.__setattr__(self, "grad_bits", tuple(self.grad_bits))
    if isinstance(self.grad_bits, tuple) and (len(self.grad_bits) != 2 or any(b not in (4, 8) for b in self.grad_bits)):
      raise ValueError(f"plan {self.name!r}: grad_bits={self.grad_bits!r}; use 4, 8 or a pair (intra-node, "
                       "inter-node) of them, e.g. (8, 4)")
    for f in ("grad_error_feedback", "stochastic_rounding"):
      if getattr(self, f) and not self.grad_bits:
        raise ValueError(f"plan {self.name!r}: {f}=True acts on qgZ's quantization, but grad_bits is None; "
                         "set grad_bits (e.g. 4) or drop it")
    if self.rotate:
      if not (self.grad_bits or self.weight_bits):
        raise ValueError(f"plan {self.name!r}: rotate=True rotates quantization blocks, but neither weight_bits "
                         "nor grad_bits is set; set one or drop rotate")
      for f, on in (("weight_block", self.weight_bits), ("grad_block", self.grad_bits)):
        b = getattr(self, f)
        if on and (b < 2 or b & (b - 1)):
          raise ValueError(f"plan {self.name!r}: rotate=True needs a power-of-two {f}, got {b}; use e.g. 256")

  def _check_zeropp(self) -> None:
    self._check_fidelity()
    for f, allowed in (("weight_bits", (None, 4, 8)), ("grad_bits", (None, 4, 8))):
      if getattr(self, f) not in allowed and not (f == "grad_bits" and isinstance(self.grad_bits, tuple)):
        raise ValueError(f"plan {self.name!r}: {f}={getattr(self, f)!r}; use one of {allowed}")
    for f in ("weight_block", "grad_block"):
      if getattr(self, f) < 0 or getattr(self, f) % 2:
        raise ValueError(f"plan {self.name!r}: {f}={getattr(self, f)} must be an even block size, or 0 for "
                         "one scale per shard")
    if self.qgz_stages < 1:
      raise ValueError(f"plan {self.name!r}: qgz_stages={self.qgz_stages} must be at least 1")
    if self.weight_bits and not self.param_axes:
      raise ValueError(f"plan {self.name!r}: qwZ (weight_bits) quantizes the parameter all-gather, but "
                       "param_axes is empty; shard the parameters (e.g. zero3) or drop weight_bits")
    if self.secondary_axes is not None and not isinstance(self.secondary_axes, int) and \
        not isinstance(self.param_axes, int):
      within = lambda a: a in self.param_axes or a.split(".")[0] in self.param_axes
      if not self.secondary_axes or not all(within(a) for a in self.secondary_axes):
        raise ValueError(f"plan {self.name!r}: hpZ secondary_axes={self.secondary_axes} must be a non-empty "
                         f"subset of param_axes={self.param_axes}, e.g. ('gpu',)")
    if self.grad_bits and not self.grad_axes:
      raise ValueError(f"plan {self.name!r}: qgZ (grad_bits) quantizes the gradient reduce-scatter, but "
                       "grad_axes is empty; shard the gradients (zero2/zero3/mics) or drop grad_bits")

  def _check_modes(self) -> None:
    for f, allowed in (("reduce_via", REDUCE_VIA), ("remat", (None, *REMAT))):
      if getattr(self, f) not in allowed:
        raise ValueError(f"plan {self.name!r}: {f}={getattr(self, f)!r}; use one of {allowed}")
    if self.grad_bits and self.reduce_via != "auto":
      raise ValueError(f"plan {self.name!r}: reduce_via={self.reduce_via!r} with qgZ (grad_bits={self.grad_bits}), "
                       "which is its own 2-hop all-to-all; leave reduce_via='auto'")

  @property
  def gradient_all_to_all(self) -> bool:
    """Whether unquantized gradients are reduced by the 2-hop all-to-all (`reduce_via`)."""
    if self.reduce_via == "auto":
      dtype = jnp.dtype(self.reduce_dtype)
      return dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
    return self.reduce_via == "all_to_all"

  @property
  def remat_mode(self) -> str:
    """`remat`, with None resolved: "none" without sharded parameters, else "full"."""
    if self.remat is not None:
      return self.remat
    return "none" if self.param_axes in ((), 1) else "full"

  @property
  def alignment(self) -> int:
    """Leaves are padded to a multiple of (devices x alignment): quantization blocks never cross an
    owner chunk or a qgZ pipeline stage."""
    blocks = [2]
    if self.weight_bits:
      blocks.append(self.weight_block or 2)
    if self.grad_bits:
      blocks.append((self.grad_block or 2) * self.qgz_stages)
    return math.lcm(*blocks)

  def groups(self) -> tuple[int, ...]:
    """The group sizes the plan names as ints: the mesh is factored at each (`mesh.factor`)."""
    fields = (self.param_axes, self.grad_axes, self.opt_axes, self.secondary_axes)
    return tuple(sorted({a for a in fields if isinstance(a, int)}))

  def check_groups(self, mesh: Mesh) -> None:
    """Raises a one-line error for a group size the mesh cannot form (names the allowed sizes)."""
    nodes, gpus = mesh_lib.base_shape(mesh)
    for f in ("param_axes", "grad_axes", "opt_axes", "secondary_axes"):
      if isinstance(getattr(self, f), int):
        mesh_lib.check_group(getattr(self, f), nodes, gpus, what=f"plan {self.name!r}: {f}")

  def resolve(self, mesh: Mesh) -> "Plan":
    """The plan on `mesh`'s own axes (`mesh` factored by `mesh.factor(mesh, self.groups())`).

    A group size becomes the axes of its group (`mesh.group_axes`); a whole axis (`"gpu"`) the mesh
    factors (`"gpu.4"`, `"gpu.2"`) is replaced by its factors, major first; `hierarchical=None` becomes
    whether the parameter group spans nodes, `prefetch=None` whether the mesh is of GPUs (see `prefetch`).
    Raises for a plan the mesh cannot run.
    """
    self.check_groups(mesh)

    def expand(axes, field):
      if axes is None:
        return None
      if isinstance(axes, int):
        return mesh_lib.group_axes(mesh, axes)
      out = []
      for a in axes:
        parts = [m for m in mesh.axis_names if a not in mesh.axis_names and m.startswith(a + ".")]
        out.extend(parts or [a])
      return tuple(out)
    fields = {f: expand(getattr(self, f), f) for f in ("param_axes", "grad_axes", "opt_axes", "secondary_axes")}
    resolved = dataclasses.replace(self, **fields)
    spans = any(mesh_lib.is_node_axis(a) for a in resolved.param_axes) and \
        any(not mesh_lib.is_node_axis(a) for a in resolved.param_axes)
    if self.hierarchical and not spans:
      raise ValueError(f"plan {self.name!r}: hierarchical=True, but the parameter group {resolved.param_axes} "
                       f"of the mesh {mesh_lib.axis_sizes(mesh)} does not span nodes; use hierarchical=None "
                       "(automatic) or False")
    prefetch = self.prefetch
    if prefetch is None:  # on GPUs the default (zerojax.gpu_aot): the layer loops' collectives overlap compute
      prefetch = gpu_aot.is_gpu(mesh) and bool(resolved.param_axes) and self.remat in (None, "full")
    return dataclasses.replace(resolved, prefetch=prefetch,
                               hierarchical=bool(spans if self.hierarchical is None else self.hierarchical))

  def validate(self, mesh: Mesh) -> None:
    """Raises if the plan names an axis the mesh does not have, or its groups do not nest."""
    for f in ("param_axes", "grad_axes", "opt_axes", "secondary_axes"):
      for a in getattr(self, f) or ():
        if a not in mesh.axis_names:
          raise ValueError(f"plan {self.name!r}: {f} names axis {a!r}, but the mesh has axes "
                           f"{tuple(mesh.axis_names)}")
    self._check_nesting()
    if self.replica_sync is not None and not self.replica_axes(mesh):
      raise ValueError(f"plan {self.name!r}: replica_sync=radius(...) sparsifies the replica all-reduce, but "
                       f"the optimizer states are sharded over every device of the mesh {mesh_lib.axis_sizes(mesh)} "
                       "(no replicas); use it with dp, mics or a plan whose opt_axes leave replicas, or drop it")
    if self.secondary_axes is not None and not set(self.secondary_axes) <= set(self.param_axes):
      raise ValueError(f"plan {self.name!r}: the hpZ secondary group {self.secondary_axes} must lie inside the "
                       f"parameter group {self.param_axes}; use a smaller secondary group")

  # Axis orders: each component's axes start with those of the component it is gathered into, so that
  # a tiled all-gather over the difference of axes returns the coarser shard in its original order.
  @property
  def grad_order(self) -> tuple[str, ...]:
    return self.param_axes + tuple(a for a in self.grad_axes if a not in self.param_axes)

  @property
  def opt_order(self) -> tuple[str, ...]:
    return self.grad_order + tuple(a for a in self.opt_axes if a not in self.grad_axes)

  def replica_axes(self, mesh: Mesh) -> tuple[str, ...]:
    """Axes the optimizer states are replicated over: gradients are all-reduced over them."""
    return tuple(a for a in mesh.axis_names if a not in self.opt_axes)


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
  compares against (16-bit gradients, reduced in 16 bits on the wire: `Plan.reduce_via`);
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
