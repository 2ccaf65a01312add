"""The AMSP solver: rank every point of the plan space by predicted step time, keep those that fit.

`rank` predicts, for each point, the communication time (T_p + T_g + T_os^0 + T_os^1 from the measured
profile), the step time (with the plan's compute, `planner.compute`) and the per-device memory;
`choose` takes the fastest that fits the memory cap, `why` says why in one line. `Auto` is the value
`train.plan = @auto()` binds: the trainer asks it for a plan once it knows the model and the mesh.

References:
  AMSP: Chen et al. 2023, §V-B (pre-filter, then brute-force search), §IV-C, §IV-D.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from zerojax import mesh as mesh_lib
from zerojax.planner.cost import Workload, comm_time, model_state_bytes, step_time
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
  opt = jax.eval_shape(executor.optimizer.init, executor.flat_shapes())
  numel = sum(l.padded * (l.layers or 1) for l in executor.layout.leaves)
  opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt) if x.ndim)
  return Workload(tuple(units), executor.accum_steps, np.dtype(executor.plan.param_dtype).itemsize,
                  round(opt_bytes / numel), compute_s, activation_bytes,
                  np.dtype(executor.plan.reduce_dtype).itemsize)


def rank(nodes: int, gpus: int, work: Workload, profile: dict, *, memory_cap_bytes: float | None = None,
         zeropp: bool = False, compute: dict | None = None, overlap: str = "none") -> list[dict]:
  """One row per point, fastest predicted step first: name, degrees, times, memory, fits.

  `compute` is `planner.compute.per_plan`'s table (None: `work.compute_s` for every plan, AMSP as
  written). Each row also holds `T_step_uniform`, the step predicted by that uniform model, to compare."""
  rows = []
  uniform = compute is None or compute["mode"] == "uniform"
  c0 = work.compute_s if compute is None else compute["dp_s"]
  for pt in plan_space(nodes, gpus, zeropp=zeropp):
    name = pt.name(nodes * gpus)
    full = comm_time(pt, work, profile, gpus)
    times = full if uniform else comm_time(pt, work, profile, gpus, spanning_only=True)
    c = c0 if uniform else compute["compute_s"][name]
    act = work.activation_bytes if compute is None else compute["temp_bytes"][name]
    mem = model_state_bytes(pt, dataclasses.replace(work, activation_bytes=act), gpus)
    rows.append({"plan": name, "s_p": pt.s_p, "s_g": pt.s_g, "s_os": pt.s_os,
                 "zeropp": pt.zeropp, **times, "compute_s": c, "T_step": step_time(c, times["T_comm"], overlap),
                 "T_step_uniform": c0 + full["T_comm"], "bytes_per_device": mem["total"],
                 "model_state_bytes": mem["model_state"],
                 "fits": memory_cap_bytes is None or mem["total"] <= memory_cap_bytes})
  return sorted(rows, key=lambda r: (r["T_step"], r["bytes_per_device"], r["plan"]))


def choose(rows: list[dict], memory_cap_bytes: float | None = None) -> dict:
  fitting = [r for r in rows if r["fits"]]
  if not fitting:
    small = min(rows, key=lambda r: r["bytes_per_device"])
    raise PlanError(f"no plan fits the memory cap of {memory_cap_bytes / 2**30:.3f} GiB per device: the smallest, "
                    f"{small['plan']}, needs {small['bytes_per_device'] / 2**30:.3f} GiB; raise the cap or use more "
                    "devices")
  return fitting[0]


def why(rows: list[dict], best: dict, memory_cap_gb: float | None = None) -> str:
  """One line: the chosen plan, and the faster plans the memory cap ruled out with their needs."""
  out = f"{best['plan']}: fastest predicted step ({best['T_step']:.3f} s)"
  faster = [r for r in rows[:rows.index(best)] if not r["fits"]]
  if faster:
    need = ", ".join(f"{r['plan']} {r['bytes_per_device'] / 2**30:.4f} GiB" for r in faster[:4])
    out += (f" of the plans that fit the cap of {memory_cap_gb} GiB per device; faster but over the cap: {need}"
            + (f" and {len(faster) - 4} more" if len(faster) > 4 else ""))
  return out


def point_of(row: dict) -> Point:
  return Point(row["s_p"], row["s_g"], row["s_os"], row["zeropp"])


def render(rows: list[dict], chosen: dict | None = None) -> str:
  head = (f"{'plan':<26}{'s_p':>4}{'s_g':>4}{'s_os':>5}{'C s':>8}{'T_comm s':>10}{'T_step s':>10}{'MB/device':>11}"
          "  fits")
  lines = [head, "-" * len(head)]
  for r in rows:
    mark = " <- chosen" if chosen is not None and r is chosen else ""
    lines.append(f"{r['plan']:<26}{r['s_p']:>4}{r['s_g']:>4}{r['s_os']:>5}{r['compute_s']:>8.3f}{r['T_comm']:>10.3f}"
                 f"{r['T_step']:>10.3f}{r['bytes_per_device'] / 1e6:>11.2f}  {'yes' if r['fits'] else 'no'}{mark}")
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Auto:
  """`train.plan = @auto()`: the planner picks the plan at the start of the run.

  Attributes:
    profile: a profile JSON written by `python -m zerojax.planner.profile` (None: measure one now).
    memory_cap_gb: per-device memory available for model states and activations (None: no cap).
    zeropp: also consider ZeRO++'s qwZ/hpZ/qgZ on every point with sharded parameters.
    compute: how each plan's compute is known (`planner.compute`): "uniform" (default: DP's step
      measured in this process, every collective from the profile; it ranked plans best on the emulated
      cluster), "anchors" (four plans measured, the rest fitted), "measured" (every plan measured).
    overlap: "none" (step = compute + communication) or "full" (the larger of the two).
  """
  profile: str | None = None
  memory_cap_gb: float | None = None
  zeropp: bool = False
  compute: str = "uniform"
  overlap: str = "none"
  name: str = "auto"

  def load(self, mesh, log=print) -> dict:
    """The profile file, or a profile measured now (written to `self.profile` when that is set)."""
    from zerojax.planner import profile as profile_lib
    nodes, gpus = mesh_lib.base_shape(mesh)
    if self.profile and os.path.exists(self.profile):
      return load_profile(self.profile, nodes, gpus)
    log(f"zerojax: auto: profiling the collectives of this {nodes} x {gpus} cluster"
        + (f" (no profile at {self.profile})" if self.profile else ""))
    prof = profile_lib.profile(mesh, [65536, 524288, 2097152])
    if self.profile and jax.process_index() == 0:
      with open(self.profile, "w") as f:
        json.dump(prof, f, indent=2)
    return prof

  def plan_for(self, mesh, work: Workload, make_executor, batch, log=print):
    """(the chosen Plan, the ranked rows) for `mesh` and the workload; `make_executor(Plan)` builds the
    model under a plan on this process's devices, `batch` one step's batch, to measure compute."""
    from zerojax.planner import compute as compute_lib
    nodes, gpus = mesh_lib.base_shape(mesh)
    prof = self.load(mesh, log)
    points = plan_space(nodes, gpus, zeropp=self.zeropp)
    table = compute_lib.per_plan(make_executor, points, nodes, gpus, work, batch, mode=self.compute,
                                 zeropp=self.zeropp, log=log)
    cap = self.memory_cap_gb * 2**30 if self.memory_cap_gb else None
    rows = rank(nodes, gpus, work, prof, memory_cap_bytes=cap, zeropp=self.zeropp, compute=table,
                overlap=self.overlap)
    best = choose(rows, cap)
    log(render(rows, best))
    log(f"zerojax: auto chose {why(rows, best, self.memory_cap_gb)}")
    return point_of(best).plan(nodes, gpus), rows


def auto(profile: str | None = None, memory_cap_gb: float | None = None, zeropp: bool = False,
         compute: str = "uniform", overlap: str = "none") -> Auto:
  """The AMSP planner as a plan value (gin: `train.plan = @auto()`, `auto.profile = 'p.json'`)."""
  return Auto(profile, memory_cap_gb, zeropp, compute, overlap)
