"""The values a plan is made of, each validating its own fields: where model states are sharded
(`Sharding`), how parameters are gathered (`Gather`), how gradients are reduced (`Reduction`), how
replicas sync (`ReplicaSync`, with Radius's `Radius`) and when collectives run (`Schedule`).

docs/DESIGN.md, "A plan is a few small values". Each field keeps the name the plan constructors and gin
take (`zeropp.weight_bits`), so an error names the setting the user wrote; the rules between values are
`zerojax.plan.Plan`'s.

References:
  ZeRO: Rajbhandari et al. 2020, §5 (stages 1-3). MiCS: Zhang et al. 2022, §3.1, §3.3-3.4.
  ZeRO++: Wang et al. 2023, §3.1 (qwZ), §3.2 (hpZ), §3.3 (qgZ). AMSP: Chen et al. 2023, §IV.
  Radius: Zheng & Zhang, §4.1-4.3. LoCo: Xie et al. 2024, §3. SDP4Bit: Jia et al. 2024, §3.2.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import Mesh

from zerojax.comm import formats
from zerojax.mesh import AXES
from zerojax.plan import checks, names
from zerojax.plan.checks import Axes
from zerojax.plan.diloco import Diloco
from zerojax.plan.radius import Radius
REDUCE_VIA = ("auto", "all_to_all", "reduce_scatter")
REMAT = ("full", "dots", "none", "offloaded")  # what a unit keeps for its backward (`zerojax.engine.remat`)


@dataclasses.dataclass(frozen=True)
class Sharding:
  """Where each model-state component is sharded (ZeRO §5; MiCS §3.1; AMSP §IV): A_p ⊆ A_g ⊆ A_os.

  Each field names mesh axes (`("node", "gpu")`, `("gpu",)`) or is an int k: a group of k consecutive
  devices (a divisor of a node's devices, or whole nodes). The executor factors the mesh so that every
  such group is a set of axes (`mesh.factor`) and resolves the plan onto it (`Plan.resolve`); the devices
  outside a group that hold the same shard are the replica axes.

  Attributes:
    param_axes: A_p, mesh axes the parameters (P) are sharded over between layers.
    grad_axes: A_g ⊇ A_p, mesh axes the accumulated gradient (G) is sharded over.
    opt_axes: A_os ⊇ A_g, mesh axes the fp32 master weights and optimizer states are sharded over.
    pad_multiple: every leaf is zero-padded to a multiple of (devices x lcm(pad_multiple, the blocks the
      quantizing values need)), `Plan.alignment`: a multiple wanted on top of the blocks, e.g. one
      layout of the shards for every plan of a run (`train.pad_multiple`, 256).
    offload: the train-state fields that live in host memory (ZeRO-Offload, Ren et al. 2021, §4):
      `()` (none), `("opt_state",)` (the optimizer states), `("opt_state", "master")` (and the fp32
      master weights). The step moves them to the device for its update and back (`zerojax.engine.offload`).
    offload_update: where and how the update of offloaded states runs: on the device, "streamed" (chunk by
      chunk, at most three units' states on the device at once; docs/offload.md) or "bulk" (every state
      fetched at once after the backward, as MaxText does); or "host" (on the host with `compute_on`, only
      the gradients moving down and the 16-bit parameters up: ZeRO-Offload, Ren et al. 2021, §4).
  """
  param_axes: Axes = AXES
  grad_axes: Axes = AXES
  opt_axes: Axes = AXES
  pad_multiple: int = 1
  offload: tuple[str, ...] = ()
  offload_update: str = "streamed"

  def __post_init__(self):
    if isinstance(self.pad_multiple, bool) or not isinstance(self.pad_multiple, int) or self.pad_multiple < 1:
      raise ValueError(f"pad_multiple={self.pad_multiple!r} must be a whole number >= 1 (e.g. 256)")
    object.__setattr__(self, "offload", checks.offload(self.offload))
    if self.offload_update not in ("streamed", "bulk", "host"):
      raise ValueError(f"offload_update={self.offload_update!r}; use 'streamed' (on the device, chunk by chunk), "
                       "'bulk' or 'host' (on the host)")
    for f in ("param_axes", "grad_axes", "opt_axes"):
      object.__setattr__(self, f, checks.axes(getattr(self, f)))
      axes = getattr(self, f)
      if not isinstance(axes, int) and len(set(axes)) != len(axes):
        raise ValueError(f"{f}={axes} repeats an axis")
    self.check_nesting()

  def check_nesting(self) -> None:
    """Raises unless params ⊆ grads ⊆ optimizer states (group sizes: each divides the next)."""
    p, g, os_ = self.param_axes, self.grad_axes, self.opt_axes
    if all(isinstance(a, int) for a in (p, g, os_)):
      ok = g % p == 0 and os_ % g == 0
    elif any(isinstance(a, int) for a in (p, g, os_)):
      return  # checked once resolved onto a mesh
    else:
      ok = set(p) <= set(g) <= set(os_)
    if not ok:
      raise ValueError(f"shard groups must nest, params {p} ⊆ grads {g} ⊆ optimizer states {os_}; a "
                       "component cannot be sharded over devices its successor is replicated over")

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

  def stage(self, every=AXES) -> names.Name:
    """The label's first part: "zero3", "mics(group=gpu)", "amsp(p=2,g=4,os=8)" (`names.degrees`)."""
    return names.degrees(self.param_axes, self.grad_axes, self.opt_axes, every)

  def labels(self) -> list[names.Name]:
    """Its technique in the label: "offload(opt_state,master)" (`zerojax.plan.names` lists every part)."""
    return [names.part("offload", list(self.offload), "offload")] if self.offload else []


@dataclasses.dataclass(frozen=True)
class Gather:
  """How parameters are gathered (ZeRO §5.3; qwZ, ZeRO++ §3.1; hpZ, ZeRO++ §3.2; MiCS §3.3).

  Attributes:
    param_dtype: dtype of the parameters on the wire (and in compute unless `compute_dtype` is set).
    compute_dtype: dtype the gathered parameters are cast to before the unit's computation (None:
      `param_dtype`). E.g. bf16 on the wire with fp32 compute, faster than bf16 math on CPUs.
    weight_bits: qwZ: the forward all-gather moves block-quantized values of this many bits (8 or 4)
      and their scales; None gathers in `param_dtype`.
    weight_block: elements per qwZ quantization block; 0 = one scale per shard (non-blocked, the
      baseline of ZeRO++ §3.1 / Fig. 2).
    quantize_backward_gather: with qwZ and without hpZ, re-gather quantized in backward too (the
      backward then uses exactly the forward's dequantized weights).
    hierarchical: MiCS §3.3 all-gather for groups that span nodes: gather across nodes among devices
      with the same local rank first (all in parallel), then inside the node. Same output as the flat
      gather, (p - k) M / p instead of (p - 1) M / p bytes across nodes. None: on exactly when the
      parameter group spans nodes (MiCS's default); True on a group inside one node is an error.
    secondary_axes: hpZ: after a unit's forward keep only its secondary shard, the slice of the
      gathered weights for this device's position along these axes (⊆ param_axes, e.g. the node,
      `("gpu",)`); the backward all-gather runs over them only. None: no hpZ.
    rotate: quantize every qwZ block times a Hadamard matrix, undone after dequantization (SDP4Bit
      §3.2): outliers are spread over the block. Needs `weight_bits` and a power-of-two block.
    kernel_backend: quantization kernels, "xla", "pallas" or "triton" (None: the default backend).
    weight_format: a wire format by name (`comm.formats.FORMATS`), e.g. "float8_e4m3fn": the forward
      gather moves the weights as 8-bit floats with one fp32 scale per `weight_block` (max |w| / 448), the
      float counterpart of qwZ's int8 (FP8-LM, Peng et al. 2023, §2.1); None: off. Not with `weight_bits`.
  """
  param_dtype: str = "bfloat16"
  compute_dtype: str | None = None
  weight_bits: int | None = None
  weight_block: int = 256
  quantize_backward_gather: bool = True
  hierarchical: bool | None = False
  secondary_axes: Axes | None = None
  rotate: bool = False
  kernel_backend: str | None = None
  weight_format: str | None = None

  def __post_init__(self):
    checks.one_of(self.weight_format, "weight_format", (None, *formats.FORMATS))
    if self.weight_format and self.weight_bits:
      raise ValueError(f"weight_format={self.weight_format!r} and weight_bits={self.weight_bits} both quantize "
                       "the gather; set one of them")
    if self.secondary_axes is not None:
      object.__setattr__(self, "secondary_axes", checks.axes(self.secondary_axes))
    checks.one_of(self.weight_bits, "weight_bits", (None, 4, 8))
    checks.block_size(self.weight_block, "weight_block")
    if self.rotate:
      if not isinstance(self.wire_format, formats.BlockInt):
        raise ValueError("rotate=True rotates qwZ's integer blocks, but weight_bits is None; set it or drop rotate")
      checks.rotatable(self.weight_block, "weight_block")
    for f in ("param_dtype", "compute_dtype"):
      checks.dtype_name(getattr(self, f), f)
    checks.kernel_backend(self.kernel_backend)

  @property
  def wire_format(self) -> formats.WireFormat | None:
    """The forward gather's wire format: `weight_format`'s, else qwZ's integer one; None: `param_dtype`."""
    if self.weight_format:
      return formats.of(self.weight_format, self.weight_block)
    return formats.integer(self.weight_bits, self.weight_block)

  @property
  def quantized(self) -> bool:
    """Whether the forward gather moves quantized blocks (qwZ, or the float8 gather)."""
    return self.wire_format is not None

  @property
  def alignment(self) -> int:
    """Elements a device's shard is a multiple of: qwZ's blocks never cross an owner chunk."""
    return self.wire_format.alignment if self.quantized else 2

  def labels(self) -> list[names.Name]:
    """Its techniques in the label: params(...), hier, qwZ(...), gather(...), hpZ(...) (`zerojax.plan.names`)."""
    dtype, fmt, block = self.param_dtype, self.wire_format, names.block(self.weight_block)
    fwd = ["fwd-only"] if not self.quantize_backward_gather and not self.secondary_axes else []
    return names.present(
        dtype != "bfloat16" and names.part("params", [dtype], names.short_dtype(dtype) + "params"),
        self.hierarchical and names.Name("hier", "hier"),
        self.weight_bits and names.part("qwZ", [fmt.short, *block, *["rot"] * self.rotate, *fwd], f"qwz{fmt.token}"),
        self.weight_format and names.part("gather", [self.weight_format, *block, *fwd], "fp8"),
        self.secondary_axes and names.part("hpZ", [names.group(self.secondary_axes)], "hpz"))


@dataclasses.dataclass(frozen=True)
class Reduction:
  """How gradients are reduced over A_g (ZeRO §5.2; qgZ, ZeRO++ §3.3; LoCo §3; SDP4Bit §3.2).

  Attributes:
    reduce_dtype: dtype gradients are reduced and accumulated in (fp32). 16-bit (bf16/fp16) is
      DeepSpeed's ZeRO-3 default (`communication_data_type`) and the baseline of ZeRO++'s evaluation.
    reduce_via: how an unquantized gradient is reduce-scattered over A_g: "reduce_scatter" (one
      `psum_scatter`, a ring on GPUs), "all_to_all" (qgZ's two hops, inside the node then across nodes,
      moving the gradient's raw words and summing in fp32: `comm.reduce.all_to_all_reduce_scatter`), or
      "auto" (the default): "all_to_all" when `reduce_dtype` is 16-bit, so 16-bit gradients stay 16 bits
      on the wire on every backend (XLA:CPU widens a 16-bit reduce-scatter to fp32), else
      "reduce_scatter". With qgZ (`grad_bits`), which is its own all-to-all, only "auto" is valid.
    grad_bits: qgZ: the gradient reduce-scatter becomes a 2-hop all-to-all of block-quantized values of
      this many bits (4 or 8): inside the node, then across nodes. A pair `(intra, inter)` sets each
      hop's bits, e.g. `(8, 4)`: int8 inside the node, int4 across nodes (SDP4Bit §3.2). A group with
      one hop uses the bits of that hop.
    grad_format: qgZ's hops in a wire format by name (`comm.formats.FORMATS`) instead of `grad_bits`'
      integers, e.g. "float8_e4m3fn": 8-bit float gradients with one fp32 scale per block (FP8-LM §2.1),
      rounded to nearest (no `rotate`, no `stochastic_rounding`). Not with `grad_bits`.
    grad_block: elements per qgZ quantization block; 0 = one scale per slab (non-blocked).
    qgz_stages: qgZ pipeline stages (ZeRO++ §4.1.2, Algorithm 2); results do not depend on it.
    rotate: Hadamard-rotate every qgZ block before quantizing (SDP4Bit §3.2); needs `grad_bits` and a
      power-of-two block.
    stochastic_rounding: qgZ rounds stochastically (`floor(x / scale + u)`, unbiased), with noise seeded
      by the step, micro-step, unit, layer and device: reproducible, independent per device.
    grad_error_feedback: qgZ with error feedback (LoCo §3): what each quantization of qgZ drops (the
      first hop's error of the local gradient, the second hop's error of the node-local sums) is kept
      per device and added to the same positions' values at the next micro-step, so nothing is lost,
      only delayed. The errors are train state (`zerojax.state.error_feedback.ErrorFeedback`, checkpointed); they cost one
      fp32 copy of the unit's local gradient plus 1/G of it per device.
    kernel_backend: quantization kernels, "xla", "pallas" or "triton" (None: the default backend).
  """
  reduce_dtype: str = "float32"
  reduce_via: str = "auto"
  grad_bits: int | tuple[int, int] | None = None
  grad_format: str | None = None
  grad_block: int = 256
  qgz_stages: int = 1
  rotate: bool = False
  stochastic_rounding: bool = False
  grad_error_feedback: bool = False
  kernel_backend: str | None = None

  def __post_init__(self):
    if isinstance(self.grad_bits, list):
      object.__setattr__(self, "grad_bits", tuple(self.grad_bits))
    if isinstance(self.grad_bits, tuple):
      if len(self.grad_bits) != 2 or any(b not in (4, 8) for b in self.grad_bits):
        raise ValueError(f"grad_bits={self.grad_bits!r}; use 4, 8 or a pair (intra-node, inter-node) of "
                         "them, e.g. (8, 4)")
    else:
      checks.one_of(self.grad_bits, "grad_bits", (None, 4, 8))
    checks.one_of(self.grad_format, "grad_format", (None, *formats.FORMATS))
    if self.grad_format and self.grad_bits:
      raise ValueError(f"grad_format={self.grad_format!r} and grad_bits={self.grad_bits} both quantize qgZ's "
                       "hops; set one of them")
    if self.grad_format and (self.rotate or self.stochastic_rounding) and \
        not isinstance(self.hop_formats[0], formats.BlockInt):
      raise ValueError(f"grad_format={self.grad_format!r} rounds to nearest without rotation; drop rotate and "
                       "stochastic_rounding, or use grad_bits")
    for f in ("grad_error_feedback", "stochastic_rounding"):
      if getattr(self, f) and not self.quantized:
        raise ValueError(f"{f}=True acts on qgZ's quantization, but grad_bits is None; set grad_bits "
                         "(e.g. 4) or drop it")
    checks.block_size(self.grad_block, "grad_block")
    if self.qgz_stages < 1:
      raise ValueError(f"qgz_stages={self.qgz_stages} must be at least 1")
    if self.rotate:
      if not self.quantized:
        raise ValueError("rotate=True rotates qgZ's blocks, but grad_bits is None; set it or drop rotate")
      checks.rotatable(self.grad_block, "grad_block")
    checks.one_of(self.reduce_via, "reduce_via", REDUCE_VIA)
    if self.quantized and self.reduce_via != "auto":
      raise ValueError(f"reduce_via={self.reduce_via!r} with qgZ (grad_bits={self.grad_bits}, grad_format="
                       f"{self.grad_format}), which is its own 2-hop all-to-all; leave reduce_via='auto'")
    checks.dtype_name(self.reduce_dtype, "reduce_dtype")
    checks.kernel_backend(self.kernel_backend)
    if self.stochastic_rounding and self.kernel_backend == "triton":
      raise ValueError("stochastic_rounding=True is not in the triton kernels; use kernel_backend='pallas' or "
                       "'xla'")

  @property
  def hop_formats(self) -> tuple[formats.WireFormat, formats.WireFormat] | None:
    """qgZ's wire format per hop, (intra-node, inter-node); None without qgZ."""
    return formats.hops(self.grad_bits, self.grad_format, self.grad_block)

  @property
  def quantized(self) -> bool:
    """Whether qgZ quantizes the gradient reduction (`grad_bits` or `grad_format`)."""
    return bool(self.grad_bits or self.grad_format)

  @property
  def hop_bits(self) -> tuple[int, int] | None:
    """qgZ's bits per hop, (intra-node, inter-node); None without qgZ."""
    return None if self.hop_formats is None else tuple(f.bits for f in self.hop_formats)

  @property
  def gradient_all_to_all(self) -> bool:
    """Whether unquantized gradients are reduced by the 2-hop all-to-all (`reduce_via`)."""
    if self.reduce_via == "auto":
      dtype = jnp.dtype(self.reduce_dtype)
      return dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
    return self.reduce_via == "all_to_all"

  @property
  def alignment(self) -> int:
    """Elements a device's shard is a multiple of: qgZ's blocks never cross a pipeline stage."""
    return self.hop_formats[0].alignment * self.qgz_stages if self.quantized else 2

  def labels(self) -> list[names.Name]:
    """Its techniques in the label: qgZ(...), grads(...) (`zerojax.plan.names`)."""
    hops, dtype, via = list(dict.fromkeys(self.hop_formats or ())), self.reduce_dtype, self.reduce_via  # distinct hops
    flags = [n for n, on in (("rot", self.rotate), ("ef", self.grad_error_feedback), ("sr", self.stochastic_rounding))
             if on]
    moved = via != "auto" and (via == "all_to_all") != Reduction(reduce_dtype=dtype).gradient_all_to_all
    return names.present(
        hops and names.part("qgZ", ["/".join(h.short for h in hops), *names.block(self.grad_block), *flags],
                            "qgz" + "-".join(h.token for h in hops)),
        (dtype != "float32" or moved) and names.part("grads", [dtype, *[via] * moved],
                                                     names.short_dtype(dtype) + "grad" + f"-{via}" * moved))


@dataclasses.dataclass(frozen=True)
class ReplicaSync:
  """How gradients are all-reduced over the replica axes, the devices outside A_os (MiCS §3.4; Radius §4).

  Attributes:
    sync_in_backward: for plans with replicas and A_g = A_os (DP, MiCS): the last micro-step of an
      accumulation window all-reduces each unit's gradient over the replica axes inside its backward,
      overlapping the sync with the remaining backward compute; False syncs after the window (MiCS §3.4
      as written). Same sums either way (to float reassociation). Needs every unit called once per
      micro-batch, which is checked at trace time (a model whose layers are traced twice, as flax's
      `nn.scan` does, is refused with a one-line error): opt-in, on in `configs/mics*.gin`. A plan
      whose A_os is finer than A_g (ZeRO-1, AMSP) reduce-scatters after the window first: refused.
    replica_sync: None, a dense all-reduce; `radius(...)`, Radius's periodic top-k with a residual
      (`Radius`). Radius syncs after the accumulation window (select and sparse steps do not use
      `sync_in_backward`; its dense warm-up steps do).
    outer_sync: None; or `diloco(...)` (`Diloco`): the replicas (the nodes) do not sync their gradients at
      all; each trains its own replica for `every` steps, then DiLoCo's outer optimizer syncs them.
  """
  sync_in_backward: bool = False
  replica_sync: Radius | None = None
  outer_sync: Diloco | None = None

  def __post_init__(self):
    if self.replica_sync is not None and not isinstance(self.replica_sync, Radius):
      raise ValueError(f"replica_sync={self.replica_sync!r}; use None (dense all-reduce) or "
                       "radius(density=..., period=..., dense_steps=...)")
    if self.outer_sync is not None and not isinstance(self.outer_sync, Diloco):
      raise ValueError(f"outer_sync={self.outer_sync!r}; use None or diloco(every=..., fragments=..., bits=...)")
    if self.outer_sync is not None and self.replica_sync is not None:
      raise ValueError("outer_sync=diloco(...) replaces the replicas' gradient sync that replica_sync=radius(...) "
                       "sparsifies; use one of them")

  @property
  def alignment(self) -> int:
    return self.outer_sync.alignment if self.outer_sync is not None else 1

  @property
  def trains_apart(self) -> bool:
    """Whether the replicas train apart between syncs (DiLoCo's outer sync, Algorithm 1): each keeps its
    own master weights and optimizer states, and no step reduces over them."""
    return self.outer_sync is not None

  def labels(self) -> list[names.Name]:
    """Its techniques in the label: diloco(...) (`Diloco.label`), radius(...) (`Radius.label`)."""
    return [v.label() for v in (self.outer_sync, self.replica_sync) if v is not None]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When a unit's collectives run against its compute (ZeRO §5.3 and §7; ZeRO §6.1 for remat).

  Attributes:
    remat: what a unit's backward recomputes. "full": the whole forward, from the unit's inputs and the
      re-gathered weights (ZeRO-3's default: nothing but the inputs is kept between forward and
      backward). "dots": keeps the outputs of the matmuls with the weights
      (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`) and the attention's output
      (`zerojax.engine.remat.ATTENTION`), and recomputes the rest. "none": keeps
      every residual of the forward and recomputes nothing. "offloaded": "full" with the kept inputs
      in host memory between the forward and the backward (each layer's input crosses the host link
      each way): the device holds no layer's input through the step. In every mode the backward re-gathers the
      weights (hpZ: from the secondary shard) instead of keeping them, so "dots" and "none" cost
      activation memory (per layer, for the whole backward), never gathered weights. "auto" or None (the
      default): the fastest of "none", "dots", "full" whose compiled step fits the device's memory ("offloaded"
      where none fits), chosen where the batch is known (`zerojax.planner.remat.choose`: `train.py`, `cli.compile`); on
      CPUs, and for an executor built without that choice, "none" when the parameters are not sharded
      (DP, ZeRO-1/2), else "full" (`Plan.remat_mode`).
    prefetch: inside a scanned unit run by `zerojax.engine.scan_layers`, gather layer i+1 while layer i computes
      (forward), and in backward gather layer i-1 and reduce layer i+1's gradient while layer i's
      backward runs (`zerojax.engine.prefetch`): a schedule of the unit's own engine, so it composes with every
      other field. At most two gathered layers are alive. False: each layer gathers when it runs. Same
      numbers either way (to float reassociation). None (the default): on for a mesh of GPUs when the
      parameters are sharded (every remat mode), off on CPUs; `Plan.resolve` decides. On GPUs it is what
      lets the layer loops' collectives overlap compute (`zerojax.gpu_aot`).
  """
  remat: str | None = None
  prefetch: bool | None = None

  def __post_init__(self):
    if self.prefetch is not None and not isinstance(self.prefetch, bool):
      raise ValueError(f"prefetch={self.prefetch!r}; use True, False or None (on for GPUs)")
    checks.one_of(self.remat, "remat", (None, "auto", *REMAT))
