"""AMSP's cost and memory model on a measured collective profile.

Communication per step (AMSP §IV-C, in this executor's schedule; M micro-batches, unit sizes Φ_i, Φ the
model, b the wire bytes of a parameter, r those of a reduced gradient, 4 for fp32):

  T_p    = M Σ_i 2 t(AG, b Φ_i, s_p)                  forward and backward gathers (hpZ: backward in node)
  T_g    = M Σ_i t(RS, r Φ_i, s_g)                    per-layer gradient reduce-scatter (qgZ: all-to-all)
  T_os^0 = t(RS, rΦ/s_g, s_os/s_g) + t(AR, rΦ/s_os, s_dp/s_os)    boundary reduce-scatter, replica sync
  T_os^1 = t(AG, b Φ/s_p, s_os/s_p)                   updated parameters into the parameter shard

Each t is the profiled α + β v of that collective over that group, v the full buffer in bytes (the
nccl-tests "algbw" convention). A group is (k devices, stride s): k consecutive members of a partition
group have stride 1; the replicas of a shard of degree d have stride d; it spans nodes when k s > G.
Predicted step time is the plan's compute C (`planner.compute`) plus the communication it does not
hide: `overlap="none"` (default) T = C + T_comm, as AMSP's model sums its terms and as the CPU
collectives of the emulated cluster block; `overlap="full"` T = max(C, T_comm), the bound of perfect
overlap (AMSP §V-C, Table V). With `spanning_only` the collectives inside a node are left out: they are
in a compute measured on this process's devices.

The techniques of a point (`space.Point`) change these terms as the executor runs them (`comm_time`), each
read from the plan value that owns its setting (`point.gather`, `point.reduction`, `point.sync`,
`point.sharding`), so a technique added to the space (`space.TECHNIQUES`) is priced by what it sets:
qwZ's gathers move b/8 + 4/256 bytes per parameter, hpZ's backward gathers inside the node, a
hierarchical gather is one across nodes (stride G) and one inside, qgZ and the 16-bit reduction are a
two-hop all-to-all, r = 2 with the 16-bit reduction (4 on the wire of a psum where the backend widens
16-bit reductions, as XLA:CPU does; the all-to-all hops move raw words and stay 16-bit), and Radius
sends a fraction of the replica all-reduce. What they add to compute, qwZ's and qgZ's quantize/dequantize kernels, is `quant_time`: the
elements they touch per step times the seconds per element measured in this process
(`Workload.quant_s_per_element`, `planner.compute.quant_rate`).

Host offload (`Sharding.offload`, ZeRO-Offload §4) adds what its copies over the host link cost and does
not hide (`offload_time`): the bytes each way per update mode (`offload_bytes`), both directions at once,
the streamed update's copies of a chunk overlapped with the update of the chunk before (Megatron-Core's
chunked optimizer offloader does the same); nothing overlaps the forward and backward.

Memory per device (AMSP §IV-D with this executor's mixed precision): b Φ/s_p + rΦ/s_g + (4 + o)Φ/s_os
(o: optimizer-state bytes per parameter, 8 for Adam), plus hpZ's secondary shard, Radius's residual,
and the activations and temporaries of the compiled step.

References:
  AMSP: Chen et al. 2023, §IV-C (T_p, T_g, T_os^0, T_os^1), §IV-D (memory), §V-B (solver).
  ZeRO++: Wang et al. 2023, §3.1–3.3, §4.2. MiCS: Zhang et al. 2022, §3.3. Radius: Zheng & Zhang, §4.1.
  ZeRO-Offload: Ren et al. 2021, §4 (what crosses the host link, the update on the host).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from zerojax.plan import Radius, update_mode
from zerojax.plan.values import Reduction
from zerojax.planner.space import Point

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def group_key(k: int, stride: int) -> str:
  return f"{k}@{stride}"


def radius_fraction(r: Radius) -> float:
  """Radius's replica all-reduce over a window of `period` steps, as a fraction of the dense one: one dense
  select step, then `density` of the values on the others (Radius §4.1)."""
  return (1 + (r.period - 1) * r.density) / r.period


@dataclasses.dataclass(frozen=True)
class Workload:
  """What the cost model needs of a model and a run: unit sizes (elements per call, calls per micro-step),
  micro-batches per step, bytes of a parameter on the wire and of a reduced gradient, optimizer bytes
  per parameter, compute seconds per step of DP, activation/temporary bytes per device, seconds per
  element of a quantize + dequantize (qwZ/qgZ's kernels, `planner.compute.quant_rate`), and the bytes per
  second each device moves to and from host memory, each way at once (PCIe 5 x16: about 50 GB/s), the
  seconds of the optimizer's update per parameter on the device and the parameters per second the host
  updates (offload's cost, `offload_time`).

  Nothing here needs the model built: `Workload.transformer` describes one from its shape alone."""
  units: tuple[tuple[int, int], ...]
  accum: int
  param_bytes: int = 2
  opt_bytes_per_param: int = 8
  compute_s: float = 0.0
  activation_bytes: int = 0
  grad_bytes: int = 4
  quant_s_per_element: float = 0.0
  host_link_bytes_per_s: float = 54e9  # each way, H100 PCIe 5 (probe.json, 2026-11-26: 54.7 / 54.3 GB/s)
  # The device's optimizer update per parameter (part of C): AdamW reads and writes ~30 bytes of a parameter
  # (gradient, master, two moments in; master, moments, 16-bit weight out) at ~3 TB/s of an H100's HBM.
  update_s_per_param: float = 1e-11
  host_update_params_per_s: float = 1.17e9  # AdamW on the host, 16 cores of the H100's (probe6.json)

  @classmethod
  def transformer(cls, *, layers: int, d_model: int, d_ff: int, vocab: int, accum: int, **kw) -> Workload:
    """A LLaMA-style decoder from its shape: one unit per layer (4 d² attention + 3 d d_ff SwiGLU + 2 d
    norms), the embedding, and the head with the final norm; the executor gathers per unit."""
    layer = 4 * d_model * d_model + 3 * d_model * d_ff + 2 * d_model
    return cls(((vocab * d_model, 1), (layer, layers), (vocab * d_model + d_model, 1)), accum, **kw)

  @property
  def numel(self) -> int:
    return sum(n * calls for n, calls in self.units)


def grad_bytes(point: Point, work: Workload) -> int:
  """r, the bytes of a reduced gradient: the point's `reduce_dtype` where it sets one, else the run's."""
  dtype = point.reduction.reduce_dtype
  return jnp.dtype(dtype).itemsize if dtype != Reduction.reduce_dtype else work.grad_bytes


def hpz(point: Point, gpus: int) -> bool:
  """Whether the point's backward gathers stay inside the node: hpZ's secondary shard (`Gather.secondary_axes`,
  ZeRO++ §3.2) of a parameter group that spans nodes."""
  return point.gather.secondary_axes is not None and point.s_p > gpus


def groups_needed(point: Point, world: int, gpus: int | None = None) -> list[tuple[str, int, int]]:
  """(op, k, stride) of every collective a point runs (k > 1); `gpus` (devices per node) is needed for
  the two-hop collectives of a group that spans nodes (hierarchical gather, hpZ, qgZ, 16-bit reduction)."""
  p, g, os_ = point.s_p, point.s_g, point.s_os
  gather, red = point.gather, point.reduction
  gpus = gpus or world
  out = []
  if p > 1:
    out += [("all_gather", p // gpus, gpus), ("all_gather", gpus, 1)] if gather.hierarchical and p > gpus else \
        [("all_gather", p, 1)]
    if hpz(point, gpus):
      out.append(("all_gather", gpus, 1))
  if g > 1:
    if red.quantized or red.gradient_all_to_all:
      out += [("all_to_all", gpus, 1), ("all_to_all", g // gpus, gpus)] if g > gpus else [("all_to_all", g, 1)]
    else:
      out.append(("reduce_scatter", g, 1))
  if os_ > g:
    out.append(("reduce_scatter", os_ // g, g))
  if os_ < world:
    out.append(("all_reduce", world // os_, os_))
  if os_ > p:
    out.append(("all_gather", os_ // p, p))
  return [(op, k, s) for op, k, s in out if k > 1]


def widens_16bit(profile: dict) -> bool:
  """Whether the profiled backend moves 16-bit psum / psum_scatter as fp32 words (`profile.py` reads it
  from a compiled program; a profile without the field: true on CPU, where XLA widens them)."""
  return bool(profile.get("widens_16bit_reductions", profile.get("backend") == "cpu"))


def comm_time(point: Point, work: Workload, profile: dict, gpus: int, *, spanning_only: bool = False) -> dict:
  """T_p, T_g, T_os^0, T_os^1 and their sum T_comm (seconds per step) from the profile's α-β fits; with
  `spanning_only`, of the collectives whose groups span nodes only.

  The techniques change the terms as the executor runs them: qwZ gathers its wire format's bytes per
  element (`Gather.wire_format`: the codes and one fp32 scale per block) per parameter (again in backward
  unless hpZ, `Gather.secondary_axes`); hpZ's backward gathers the parameter dtype inside the node; a
  hierarchical gather (`Gather.hierarchical`) is a gather of v/G across nodes (stride G) and one of v
  inside the node (MiCS §3.3); qgZ and the 16-bit reduction are the two-hop all-to-all
  (`Reduction.hop_formats`, `Reduction.gradient_all_to_all`: inside the node, then v/G across nodes;
  ZeRO++ §3.3) of quantized or 16-bit words; the 16-bit reduction also halves T_os^0 (where the backend
  reduces 16-bit words: XLA:CPU widens a 16-bit psum to fp32, `widens_16bit`); Radius
  (`ReplicaSync.replica_sync`) sends a `density` fraction of the replica all-reduce on all but one step in
  `period` (Radius §4.1); DiLoCo (`ReplicaSync.outer_sync`) all-reduces the fp32 outer gradient over the
  nodes once every `every` steps."""
  world = profile["mesh"]["nodes"] * profile["mesh"]["gpus"]
  p, g, os_ = point.s_p, point.s_g, point.s_os
  gather, red, sync = point.gather, point.reduction, point.sync

  def t(op, v, k, stride):
    if k <= 1 or (spanning_only and k * stride <= gpus):
      return 0.0
    key = group_key(k, stride)
    fit = profile["groups"].get(key, {}).get(op)
    if fit is None:
      raise ValueError(f"the profile has no {op} over groups of {k} devices with stride {stride}; profile "
                       "this cluster again with `python -m zerojax.planner.profile`")
    return fit["alpha"] + fit["beta"] * v

  def gather_time(v):
    if gather.hierarchical and p > gpus:
      return t("all_gather", v / gpus, p // gpus, gpus) + t("all_gather", v, gpus, 1)
    return t("all_gather", v, p, 1)

  def two_hop(n, b0, b1):  # bytes per element of each hop
    if g > gpus:
      return t("all_to_all", b0 * n, gpus, 1) + t("all_to_all", b1 * n / gpus, g // gpus, gpus)
    return t("all_to_all", b0 * n, g, 1)

  r = grad_bytes(point, work)
  r_psum = 4 if r == 2 and widens_16bit(profile) else r  # psum / psum_scatter words on the wire
  wire = gather.wire_format.bytes_per_element() if gather.wire_format else work.param_bytes
  t_p = t_g = 0.0
  for n, calls in work.units:
    fwd = gather_time(wire * n)
    bwd = t("all_gather", work.param_bytes * n, gpus, 1) if hpz(point, gpus) else fwd
    t_p += work.accum * calls * (fwd + bwd)
    if red.hop_formats:
      t_g += work.accum * calls * two_hop(n, *(f.bytes_per_element() for f in red.hop_formats))
    elif red.gradient_all_to_all:
      t_g += work.accum * calls * two_hop(n, r, r)
    else:
      t_g += work.accum * calls * t("reduce_scatter", r_psum * n, g, 1)  # one collective over s_g
  phi = work.numel
  replicas = t("all_reduce", r_psum * phi / os_, world // os_, os_)
  if sync.replica_sync is not None:
    replicas *= radius_fraction(sync.replica_sync)
  if sync.outer_sync is not None:  # DiLoCo: the fp32 outer gradient's all-reduce once every `every` steps, no more
    replicas = t("all_reduce", 4 * phi / os_, world // os_, os_) / sync.outer_sync.every
  t_os0 = t("reduce_scatter", r_psum * phi / g, os_ // g, g) + replicas
  t_os1 = t("all_gather", work.param_bytes * phi / p, os_ // p, p)
  total = t_p + t_g + t_os0 + t_os1
  return {"T_p": t_p, "T_g": t_g, "T_os0": t_os0, "T_os1": t_os1, "T_comm": total}


def quant_elements(point: Point, work: Workload, gpus: int) -> float:
  """Elements quantized or dequantized per step and device: qwZ dequantizes each gathered unit (twice
  without hpZ); qgZ quantizes the local gradient and dequantizes what it receives, per hop."""
  out = 0.0
  for n, calls in work.units:
    per = 0.0
    if point.gather.quantized and point.s_p > 1:
      per += n * (1 if hpz(point, gpus) else 2)
    if point.reduction.quantized and point.s_g > 1:
      per += 2 * n + (2 * n / gpus if point.s_g > gpus else 0)
    out += work.accum * calls * per
  return out


def quant_time(point: Point, work: Workload, gpus: int) -> float:
  """Seconds per step of qwZ's and qgZ's quantize/dequantize kernels (`Workload.quant_s_per_element`)."""
  return work.quant_s_per_element * quant_elements(point, work, gpus)


def step_time(compute_s: float, comm_s: float, overlap: str = "none") -> float:
  """The step: compute plus unhidden communication ("none": C + T_comm; "full": max(C, T_comm))."""
  if overlap == "none":
    return compute_s + comm_s
  if overlap == "full":
    return max(compute_s, comm_s)
  raise ValueError(f"overlap={overlap!r} is not 'none' or 'full'")


def model_state_bytes(point: Point, work: Workload, gpus: int) -> dict:
  """Per-device bytes of parameters, gradients, master weights + optimizer states (AMSP §IV-D), hpZ's
  secondary shard and Radius's residual (each replica's unsent gradient, fp32, sharded like the
  parameters); `host` of them in host memory (`Sharding.offload`), `total` the device's with activations."""
  phi = work.numel
  out = {"params": work.param_bytes * phi // point.s_p,
         "grads": grad_bytes(point, work) * phi // point.s_g,
         "optimizer": (4 + work.opt_bytes_per_param) * phi // point.s_os,
         "hpz_secondary": work.param_bytes * phi // gpus if hpz(point, gpus) else 0,
         "radius_residual": 4 * phi // point.s_p if point.sync.replica_sync is not None else 0}
  out["model_state"] = sum(out.values())
  # Offload (`Sharding.offload`): master weights and optimizer states in host memory; the cap counts the
  # device's bytes only.
  out["host"] = out["optimizer"] if point.sharding.offload else 0
  out["total"] = out["model_state"] - out["host"] + work.activation_bytes
  return out


def offload_bytes(point: Point, work: Workload) -> dict:
  """Bytes per device and step over the host link with the point's offload (`Sharding.offload`,
  `Sharding.offload_update`); Φ_os = Φ / s_os, this device's parameters:

    before      to the device before the forward: the fp32 master weights (4 Φ_os) where they are offloaded,
                for step 0's cast; with the update on the host, the 16-bit weights rounded there (b Φ_os);
                none where the streamed update keeps their 16-bit rounding on the device between steps
                (16-bit weights and the update "streamed", `Plan.update_mode`: `HostOffload.keeping_forward`)
    to_device   the update's states, to the device ("streamed", "bulk"): (4 + o) Φ_os with the master
                weights, o Φ_os without (AdamW: 12 and 8 bytes per parameter); on the host ("host"), none
    to_host     the same states back; on the host, the gradients instead (r Φ_os)

  `chunk_params`: this device's parameters of each chunk of the streamed update, in order (a unit, or one
  layer of a scanned unit: `work.units`)."""
  offload, mode = point.sharding.offload, update_mode(point.sharding, point.reduction, point.sync)
  phi = work.numel / point.s_os
  if not offload:
    return {"before": 0.0, "to_device": 0.0, "to_host": 0.0, "chunk_params": []}
  chunks = [n / point.s_os for n, calls in work.units for _ in range(calls)]
  if mode == "host":
    return {"before": work.param_bytes * phi, "to_device": 0.0, "to_host": grad_bytes(point, work) * phi,
            "chunk_params": chunks}
  master = 4 if "master" in offload else 0
  state = (master + work.opt_bytes_per_param) * phi
  kept = mode == "streamed" and work.param_bytes < 4
  return {"before": 0.0 if kept else master * phi, "to_device": state, "to_host": state, "chunk_params": chunks}


def streamed(fetch: list[float], update: list[float], store: list[float]) -> float:
  """Seconds from the end of the backward to the last store of the streamed update, its chunks in order:
  chunk j's fetch waits on the fetch before it (one direction of the link) and on the store of chunk j - 2
  (at most three chunks' states on the device, by construction); its update on its fetch and on the update
  before (the device); its store on its update and on the store before (the other direction). Chunk j + 1
  so comes down while chunk j is updated and chunk j - 1 goes back: both directions at once."""
  f = u = 0.0
  s = [0.0, 0.0]  # the stores' ends, the chunks two and one before first
  for a, b, c in zip(fetch, update, store):
    f = max(f, s[-2]) + a
    u = max(u, f) + b
    s.append(max(s[-1], u) + c)
  return s[-1]


def offload_time(point: Point, work: Workload) -> float:
  """Seconds per step that offload adds to the plan's step (`offload_bytes`; B = `host_link_bytes_per_s`,
  each way at once; the device's own update, `update_s_per_param` per parameter, is in the plan's compute):

    streamed   before / B + `streamed`(each chunk's fetch, update, store) - the device's update
    bulk       before / B + to_device / B + to_host / B       (every state at once: one way, then the other)
    host       before / B + to_host / B + Φ_os / host_update_params_per_s - the device's update

  None of it overlaps the forward and backward: the master weights come before step 0's cast, and the
  update (on the device or the host) starts after the backward, because the clipping's global gradient
  norm needs every gradient (docs/offload.md). The streamed update overlaps each chunk's copies with the
  update of the chunk before and with the other direction's copies: it costs about one direction's bytes
  plus one chunk's, where the bulk fetch costs both directions'. Without offload, 0."""
  if not point.sharding.offload:
    return 0.0
  moved, link = offload_bytes(point, work), work.host_link_bytes_per_s
  chunks = moved["chunk_params"]
  own = [work.update_s_per_param * n for n in chunks]  # the device's update of each chunk
  before = moved["before"] / link
  mode = update_mode(point.sharding, point.reduction, point.sync)
  if mode == "host":
    return before + moved["to_host"] / link + sum(chunks) / work.host_update_params_per_s - sum(own)
  if mode == "bulk":
    return before + (moved["to_device"] + moved["to_host"]) / link
  share = [n / sum(chunks) for n in chunks]
  return before + streamed([moved["to_device"] * f / link for f in share], own,
                           [moved["to_host"] * f / link for f in share]) - sum(own)
