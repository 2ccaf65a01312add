"""Trials: the planner's few best predictions and the named plans, measured on this cluster.

A cost model ranks a space of hundreds of plans in milliseconds, but it is a model: on the emulated
cluster its step times were off by a median 20% and up to 2.3x (`benchmarks/planner.json`; in-step
costs of reductions and conversions the collective profile does not see), enough to reorder plans a
few percent apart. AMSP runs the plan its model
chooses (§V); DeepSpeed's autotuner measures every candidate it keeps. `auto` does both: the model
prunes the space to the `k` fastest predicted plans that fit, to which the plans a user would pick by
hand are added (ZeRO-3, ZeRO++, MiCS with group = node, where they fit), and each of these is compiled
and run for a few steps on the real mesh with the real batch shape; the fastest measured is chosen.
So `auto` is never slower than a named plan it tried by more than the trials' noise.

On several processes every process runs the same trials in the same order (the candidates come from
process 0's table); each trial's time is the slowest process's (`agree.slowest`), so all choose alike.

References:
  AMSP: Chen et al. 2023, §V (planner), §VI-D (strategies compared by measurement).
"""
from __future__ import annotations

from zerojax import plan
from zerojax.planner import agree, compute
from zerojax.planner.space import Point

# The named plans every trial set holds (where they fit): the constructors configs/zero3.gin, zeropp.gin and
# mics.gin call, with the settings those configs give them (tests/test_planner_space.py checks the points agree).
BASELINES = {"zero3": plan.zero3, "zeropp": plan.zeropp, "mics": plan.mics}


def baselines(nodes: int, gpus: int) -> list[Point]:
  """The points of ZeRO-3, ZeRO++ and MiCS (group = node) on this cluster (`Point.of`)."""
  return [Point.of(make(), nodes, gpus) for make in BASELINES.values()]


def candidates(fitting: list[tuple[str, Point]], k: int, base: list[tuple[str, Point]]) -> list[tuple[str, Point]]:
  """The first `k` of `fitting` ((name, point) of the rows that fit, fastest predicted first), then the
  baselines `base` (those that fit) not among them."""
  out = list(fitting[:k])
  have = {p for _, p in out}
  return out + [(n, p) for n, p in base if p not in have]


def time_step(executor, batch, steps: int = 3) -> float:
  """Median seconds of `steps` train steps of `executor` on `batch` (host array, every process the same)
  after one warm-up step (`compute.measure`: compiled once, the state freed on return)."""
  return compute.measure(executor, batch, steps)[0]


def run(cands: list[tuple[str, Point]], make_executor, nodes: int, gpus: int, batch, *, steps: int = 3,
        log=None) -> dict[str, float]:
  """{name: seconds per step} of every candidate, each the slowest process's median (`time_step`)."""
  out = {}
  for i, (name, pt) in enumerate(cands):
    out[name] = time_step(make_executor(pt.plan(nodes, gpus)), batch, steps)
    if log:
      log(f"zerojax: auto: trial [{i + 1}/{len(cands)}] {name}: {out[name]:.3f} s/step")
  return agree.slowest(out)
