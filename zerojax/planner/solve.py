"""The AMSP solver: rank every point of the plan space by predicted step time, keep those that fit.

`rank` predicts, for each point, the communication time (T_p + T_g + T_os^0 + T_os^1 from the measured
profile), the step time (plus the measured compute) and the per-device memory; `choose` takes the
fastest that fits the memory cap. `Auto` is the value `train.plan = @auto()` binds: the trainer asks it
for a plan once it knows the model and the mesh.

References:
  AMSP: Chen et al. 2023, §V-B (pre-filter, then brute-force search), §IV-C, §IV-D.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import jax
import numpy as np

from zerojax import mesh as mesh_lib
from zerojax.planner.cost import Workload, comm_time, model_state_bytes
from zerojax.planner.space import Point, plan_space


class PlanError(ValueError):
  """No plan fits, or the profile does not describe this cluster."""


def load_profile(path: str, nodes: int, gpus: int) -> dict:
  with open(path) as f:
    prof = json.load(f)
  shape = (prof["mesh"]["nodes"], prof["mesh"]["gpus"])
  if shape != (nodes, gpus):
    raise PlanError(f"profile {path} was measured on {shape[0]} nodes x {shape[1]} gpus, but this cluster is "
                    f"{nodes} x {gpus}; profile it again with `python -m zerojax.planner.profile`")
  return prof


def workload(executor, compute_s: float = 0.0, activation_bytes: int = 0) -> Workload:
  """The cost model's view of an executor's model: unit sizes and calls, accumulation, dtypes."""
  units = []
  tree = executor.layout.tree()
  for u in tree:
    leaves = jax.tree.leaves(tree[u], is_leaf=lambda x: hasattr(x, "padded"))
    units.append((sum(l.size for l in leaves), leaves[0].layers or 1))
  opt = jax.eval_shape(executor.optimizer.init, executor._flat_shapes())
  numel = sum(l.padded * (l.layers or 1) for l in executor.layout.leaves)
  opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt) if x.ndim)
  return Workload(tuple(units), executor.accum_steps, np.dtype(executor.plan.param_dtype).itemsize,
                  round(opt_bytes / numel), compute_s, activation_bytes)


def rank(nodes: int, gpus: int, work: Workload, profile: dict, *, memory_cap_bytes: float | None = None,
         zeropp: bool = False) -> list[dict]:
  """One row per point, fastest predicted step first: name, degrees, times, memory, fits."""
  rows = []
  for pt in plan_space(nodes, gpus, zeropp=zeropp):
    times = comm_time(pt, work, profile, gpus)
    mem = model_state_bytes(pt, work, gpus)
    rows.append({"plan": pt.name(nodes * gpus), "s_p": pt.s_p, "s_g": pt.s_g, "s_os": pt.s_os,
                 "zeropp": pt.zeropp, **times, "bytes_per_device": mem["total"],
                 "model_state_bytes": mem["model_state"],
                 "fits": memory_cap_bytes is None or mem["total"] <= memory_cap_bytes})
  return sorted(rows, key=lambda r: (r["T_step"], r["bytes_per_device"]))


def choose(rows: list[dict], memory_cap_bytes: float | None = None) -> dict:
  fitting = [r for r in rows if r["fits"]]
  if not fitting:
    small = min(rows, key=lambda r: r["bytes_per_device"])
    raise PlanError(f"no plan fits the memory cap of {memory_cap_bytes / 2**30:.3f} GiB per device: the smallest, "
                    f"{small['plan']}, needs {small['bytes_per_device'] / 2**30:.3f} GiB; raise the cap or use more "
                    "devices")
  return fitting[0]


def point_of(row: dict) -> Point:
  return Point(row["s_p"], row["s_g"], row["s_os"], row["zeropp"])


def render(rows: list[dict], chosen: dict | None = None) -> str:
  head = f"{'plan':<26}{'s_p':>4}{'s_g':>4}{'s_os':>5}{'T_comm s':>10}{'T_step s':>10}{'MB/device':>11}  fits"
  lines = [head, "-" * len(head)]
  for r in rows:
    mark = " <- chosen" if chosen is not None and r is chosen else ""
    lines.append(f"{r['plan']:<26}{r['s_p']:>4}{r['s_g']:>4}{r['s_os']:>5}{r['T_comm']:>10.3f}{r['T_step']:>10.3f}"
                 f"{r['bytes_per_device'] / 1e6:>11.2f}  {'yes' if r['fits'] else 'no'}{mark}")
  return "\n".join(lines)


def measure_compute(executor_factory, batch, reps: int = 3) -> tuple[float, int]:
  """Compute seconds per step (DP on this process's devices: no slow link involved) and the activation
  and temporary bytes per device of the compiled step (XLA's memory analysis)."""
  ex = executor_factory()
  state = ex.init(jax.random.key(0))
  step = ex.step_fn()
  batch = jax.device_put(batch, ex.batch_sharding)
  compiled = step.lower(state, batch).compile()
  temp = getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0)
  state, m = step(state, batch)
  m.loss.block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    m.loss.block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), int(temp)


@dataclasses.dataclass(frozen=True)
class Auto:
  """`train.plan = @auto()`: the planner picks the plan at the start of the run.

  Attributes:
    profile: a profile JSON written by `python -m zerojax.planner.profile` (None: measure one now).
    memory_cap_gb: per-device memory available for model states and activations (None: no cap).
    zeropp: also consider ZeRO++'s qwZ/hpZ/qgZ on every point with sharded parameters.
  """
  profile: str | None = None
  memory_cap_gb: float | None = None
  zeropp: bool = False
  name: str = "auto"

  def plan_for(self, mesh, work: Workload, log=print):
    """(the chosen Plan, the ranked rows) for `mesh` and the workload."""
    from zerojax.planner import profile as profile_lib
    nodes, gpus = mesh_lib.base_shape(mesh)
    if self.profile and os.path.exists(self.profile):
      prof = load_profile(self.profile, nodes, gpus)
    else:
      log(f"zerojax: auto: profiling the collectives of this {nodes} x {gpus} cluster"
          + (f" (no profile at {self.profile})" if self.profile else ""))
      prof = profile_lib.profile(mesh, [65536, 524288, 2097152])
      if self.profile and jax.process_index() == 0:
        with open(self.profile, "w") as f:
          json.dump(prof, f, indent=2)
    cap = self.memory_cap_gb * 2**30 if self.memory_cap_gb else None
    rows = rank(nodes, gpus, work, prof, memory_cap_bytes=cap, zeropp=self.zeropp)
    best = choose(rows, cap)
    log(render(rows, best))
    why = f"fastest predicted step ({best['T_step']:.3f} s)"
    if cap is not None and rows[0] is not best:
      why += f" of the plans that fit {self.memory_cap_gb} GiB; faster {rows[0]['plan']} needs " \
             f"{rows[0]['bytes_per_device'] / 2**30:.3f} GiB"
    log(f"zerojax: auto chose {best['plan']}: {why}")
    return point_of(best).plan(nodes, gpus), rows


def auto(profile: str | None = None, memory_cap_gb: float | None = None, zeropp: bool = False) -> Auto:
  """The AMSP planner as a plan value (gin: `train.plan = @auto()`, `auto.profile = 'p.json'`)."""
  return Auto(profile, memory_cap_gb, zeropp)
