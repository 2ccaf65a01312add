"""The pieces a plan's label is spelled from: each plan value names its own part (`Sharding.stage`, the
values' `labels()`, `Radius.label`, `Diloco.label`) and `Plan.label` joins them with "+".

A part is a `Name`: how the plan's label spells it ("qwZ(int8)", what the trainer's log and summary and the
CLI show) and how the planner's short id spells it ("qwz8": `Point.name`, stored in ranked rows and
`benchmarks/planner.json`), so both come from one place. The label is the sharding's part, then each
technique that changes what is computed or what goes on the wire, in this order (`Plan.techniques`):

  zero3, mics(group=gpu), amsp(p=,g=,os=), shard(p=,g=,os=)   `Sharding.stage`: the shard degrees (`degrees`)
  params(float32)      `Gather`: `param_dtype` other than bfloat16 (the gathers' wire dtype)
  hier                 `Gather`: MiCS §3.3's hierarchical gather (`hierarchical=True`; None is decided on the mesh)
  qwZ(int8,...)        `Gather`: ZeRO++ §3.1's quantized gather: bits, "per-shard" (or "block=N" other than 256),
                       "rot" (SDP4Bit §3.2), "fwd-only" (`quantize_backward_gather=False`, without hpZ)
  gather(float8_e4m3fn,...)  `Gather`: the float8 gather (FP8-LM §2.1), with qwZ's block and "fwd-only"
  hpZ(gpu)             `Gather`: ZeRO++ §3.2's secondary shard, over these axes (or a group size)
  qgZ(int8/int4,...)   `Reduction`: ZeRO++ §3.3's quantized reduction: each distinct hop's wire format (int8, int4,
                       fp8), the block, "rot", "ef" (LoCo §3's error feedback), "sr" (stochastic rounding)
  grads(bfloat16,...)  `Reduction`: `reduce_dtype` other than float32, and `reduce_via` where it overrides "auto"
  offload(opt_state,master)  `Sharding`: the fields kept in host memory (ZeRO-Offload §4)
  diloco(H=,F=,int4,lr=,m=,overlap(mix=))  `Diloco`: DiLoCo's outer sync across nodes: every, fragments,
                       outer-gradient bits, the outer optimizer where it is not DiLoCo's (lr 0.7, momentum 0.9,
                       Nesterov), Streaming DiLoCo's overlap with the next inner step and its α
  radius(d=,T=,dense=)  `Radius`: Radius §4's (Algorithm 1) sparse replica sync: density, period, dense steps

Settings that change neither the sums nor the wire are left out: `compute_dtype` (a local cast), `remat`,
`prefetch`, `sync_in_backward`, `qgz_stages`, `kernel_backend`, `pad_multiple` and `offload_update`.

References:
  ZeRO: Rajbhandari et al. 2020, §5 (stages 1-3). MiCS: Zhang et al. 2022, §3.1, §3.3. AMSP: Chen et al.
  2023, §IV. ZeRO++: Wang et al. 2023, §3.1-3.3. FP8-LM: Peng et al. 2023, §2.1. SDP4Bit: Jia et al. 2024,
  §3.2. LoCo: Xie et al. 2024, §3. ZeRO-Offload: Ren et al. 2021, §4. DiLoCo: Douillard et al. 2023.
  Radius: Zheng & Zhang, §4.
"""
from __future__ import annotations

from typing import NamedTuple

BLOCK = 256  # the quantizing values' default block (`Gather.weight_block`, `Reduction.grad_block`): unnamed
# ZeRO's stages (ZeRO §5), by whether params, grads and optimizer states are each sharded over every
# device (True) or over none (False).
STAGES = {(False, False, False): "dp", (False, False, True): "zero1", (False, True, True): "zero2",
          (True, True, True): "zero3"}
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class Name(NamedTuple):
  """One part of a plan's label ("qwZ(int8)") and of the planner's id of it ("qwz8")."""
  label: str
  short: str


def present(*parts) -> list[Name]:
  """The parts that are on, in order: a value lists each part as `condition and part(...)`."""
  return [p for p in parts if p]


def part(head: str, settings: list[str], short: str) -> Name:
  """A part that lists its settings: `part("qwZ", ["int8", "rot"], "qwz8")` is "qwZ(int8,rot)"."""
  return Name(f"{head}({','.join(settings)})", short)


def group(degree) -> str:
  """A shard degree as a name spells it: a group size, or its mesh axes ("node*gpu"); 1 for none."""
  return str(degree) if isinstance(degree, int) else "*".join(degree) or "1"


def block(size: int) -> list[str]:
  """A quantization block as a label spells it: nothing for the default, "per-shard" for 0, else "block=N"."""
  return [] if size == BLOCK else ["per-shard"] if size == 0 else [f"block={size}"]


def short_dtype(dtype: str) -> str:
  return SHORT_DTYPES.get(dtype, dtype)


def degrees(p, g, os_, every) -> Name:
  """The shard degrees A_p, A_g, A_os: a ZeRO stage (ZeRO §5), a MiCS group (MiCS §3.1: p = g = os), AMSP's
  degrees (AMSP §IV) or a sharding over named axes ("shard(...)"). A degree is a group size or axes; `every`
  is all devices (a point's world size, or the plan's `AXES`)."""
  def kind(d):  # True: every device; False: none; None: a group
    if d == every or (not isinstance(d, int) and not isinstance(every, int) and set(d) == set(every)):
      return True
    return False if d in ((), 1) else None
  stage = STAGES.get(tuple(kind(d) for d in (p, g, os_)))
  if stage:
    return Name(stage, stage)
  sp, sg, so = (group(d) for d in (p, g, os_))
  if p == g == os_:
    return Name(f"mics(group={sp})", f"mics-{sp}")
  what = "amsp" if any(isinstance(d, int) for d in (p, g, os_)) else "shard"
  return Name(f"{what}(p={sp},g={sg},os={so})", f"amsp-p{sp}-g{sg}-os{so}")
