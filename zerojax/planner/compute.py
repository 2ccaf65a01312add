"""The compute side of a plan's step: what a plan costs besides its bytes on the slow links.

AMSP's cost model (§IV-C) charges communication only and every plan the same compute. Plans differ in
compute too: sharded parameters (s_p > 1) are gathered in forward and again, with the unit's forward
recomputed, in backward; sharded gradients (s_g > 1) are reduce-scattered every micro-step instead of
accumulated in place; the optimizer updates Φ/s_os elements; qwZ/qgZ add quantize/dequantize kernels.
The planner gets each plan's compute C(plan) in one of three ways (`mode`):

  uniform   (default) C = the DP step measured once, the same for every plan (AMSP as written).
  anchors   the step of a few anchor plans (DP, ZeRO-1, ZeRO-2, ZeRO-3) is measured in this process,
            and C(plan) = c · f(plan) is fitted on them, with features f = (1, optimizer elements Φ/s_os,
            gradient bytes reduced per step when s_g > 1, parameter bytes gathered per step when s_p > 1
            (gather + recompute)). With one anchor per feature the fit is exact on the anchors.
  measured  the step of every degree point is measured in this process (`--measure_compute`).

In every mode C is that of the point's shard degrees; what a technique adds to it (qwZ/qgZ's quantize
and dequantize kernels) is `cost.quant_time`, from `quant_rate`: the seconds per element of one block
quantize + dequantize measured in this process.

A step measured in this process runs every collective through memory, so it already holds the cost of
the collectives inside a node; the planner then adds from the profile only the collectives whose groups
span nodes (`cost.comm_time(..., spanning_only=True)`). On a cluster whose nodes are single processes
(the emulated cluster, or one GPU node measured alone) this is the honest split: the in-node part is
measured, the cross-node part is modelled.

Uniform is the default because it ranked best where it was checked: on the emulated cluster (2 x 4,
accumulation 4, `benchmarks/bench_planner.py`) Spearman 0.82 / 0.69 at 100 Mbit/s / 1 Gbit/s, against
0.79 / 0.33 (anchors) and 0.77 / 0.43 (measured). One-process step times of the same plan varied by up to
1.6x between two measurements a few minutes apart, more than the plans differ in compute, and a fit on
four such anchors amplifies it; per-plan compute pays where plans differ in compute by more than that.

References:
  AMSP: Chen et al. 2023, §IV-C (communication model), §V-C (recompute), Table V (overlap).
  ZeRO++: Wang et al. 2023, §3 (qwZ/qgZ kernels).
"""
from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from zerojax import gpu_aot
from zerojax.planner.cost import Workload
from zerojax.planner.space import Point

MODES = ("uniform", "anchors", "measured")


def anchors(world: int) -> list[Point]:
  """DP, ZeRO-1, ZeRO-2, ZeRO-3: one plan per feature."""
  return [Point(1, 1, 1), Point(1, 1, world), Point(1, world, world), Point(world, world, world)]


def features(pt: Point, work: Workload) -> np.ndarray:
  """(1, Φ/s_os, gradient bytes reduced per step, parameter bytes gathered per step)."""
  per_step = work.accum * work.numel
  return np.array([1.0, work.numel / pt.s_os, float(work.grad_bytes * per_step) if pt.s_g > 1 else 0.0,
                   float(2 * work.param_bytes * per_step) if pt.s_p > 1 else 0.0])


def fit(measured: dict[Point, float], work: Workload) -> np.ndarray:
  """Least-squares coefficients of `features` on the measured anchors (negative ones set to 0)."""
  pts = list(measured)
  x = np.stack([features(p, work) for p in pts])
  y = np.array([measured[p] for p in pts])
  scale = np.maximum(np.abs(x).max(axis=0), 1.0)
  coef = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
  return np.maximum(coef, 0.0)


def predict(coef: np.ndarray, pt: Point, work: Workload) -> float:
  return float(features(pt, work) @ coef)


def quant_rate(elements: int = 1 << 20, bits: int = 8, reps: int = 3) -> float:
  """Seconds per element of one block quantize + dequantize (qwZ/qgZ's kernels, ZeRO++ §4.2) on this
  process's first device: the median of `reps` runs after a warm-up."""
  from zerojax.quant import quantization
  from zerojax.planner.space import BLOCK

  @jax.jit
  def roundtrip(x):
    v, s = quantization.quantize(x, bits, BLOCK)
    return quantization.dequantize(v, s, bits, BLOCK)
  x = jax.device_put(np.linspace(-1, 1, elements, dtype=np.float32), jax.local_devices()[0])
  roundtrip(x).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    roundtrip(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times) / elements


def measure(executor, batch, reps: int = 3) -> tuple[float, int]:
  """Median seconds of the executor's step in this process (after a warm-up) and the compiled step's
  activation and temporary bytes per device (XLA's memory analysis)."""
  state = executor.init(jax.random.key(0))
  step = executor.step_fn()
  batch = jax.device_put(batch, executor.batch_sharding)
  compiled = step.lower(state, batch).compile()  # compiled once: the timed calls run this program
  mem = gpu_aot.memory(compiled)  # None where the platform analyses no memory
  state, m = compiled(state, batch)
  m.loss.block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state, m = compiled(state, batch)
    m.loss.block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), mem["temp"] if mem else 0


def per_plan(make_executor, points: list[Point], nodes: int, gpus: int, work: Workload, batch, *,
             mode: str = "uniform", reps: int = 3, log=None) -> dict:
  """{"mode", "compute_s": {plan name: s}, "temp_bytes": {plan name: bytes}, "measured": {name: s},
  "dp_s", "quant_s_per_element"}: each point's compute in `mode`. `make_executor(Plan)` builds an
  executor on the mesh; `points` are the degree points to rank (techniques add `cost.quant_time`)."""
  if mode not in MODES:
    raise ValueError(f"compute mode {mode!r} is not one of {MODES}; use 'uniform' (default), 'anchors' or 'measured'")
  world = nodes * gpus
  todo = points if mode == "measured" else anchors(world) if mode == "anchors" else [Point(1, 1, 1)]
  seconds, temp = {}, {}
  for i, pt in enumerate(todo):
    s, t = measure(make_executor(pt.plan(nodes, gpus)), batch, reps)
    seconds[pt], temp[pt.name(world)] = s, t
    if log:
      log(f"zerojax: planner: compute [{i + 1}/{len(todo)}] {pt.name(world)}: {s:.3f} s/step in this process")
  dp_s = seconds.get(Point(1, 1, 1))
  if mode == "measured":
    compute = {pt.name(world): seconds[pt] for pt in points}
  elif mode == "anchors":
    coef = fit(seconds, work)
    compute = {pt.name(world): predict(coef, pt, work) for pt in points}
  else:
    compute = {pt.name(world): dp_s for pt in points}
  worst = max(temp.values())  # plans not measured: the largest measured activation/temporary bytes
  return {"mode": mode, "compute_s": compute, "dp_s": dp_s, "measured": {p.name(world): s for p, s in seconds.items()},
          "temp_bytes": {pt.name(world): temp.get(pt.name(world), worst) for pt in points},
          "quant_s_per_element": quant_rate()}
