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
from zerojax.planner import agree, trial
from zerojax.planner.cost import Workload, comm_time, model_state_bytes, offload_time, quant_time, step_time
from zerojax.planner.space import COLUMNS, Point, grad_options, param_options, plan_space


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
  return Workload(tuple(units), executor.accum_steps, np.dtype(executor.plan.gather.param_dtype).itemsize,
                  round(opt_bytes / numel), compute_s, activation_bytes,
                  np.dtype(executor.plan.reduction.reduce_dtype).itemsize)


def _row(pt: Point, nodes: int, gpus: int, work: Workload, profile: dict, c: float, c0: float, act: int,
         uniform: bool, overlap: str, cap: float | None) -> dict:
  full = comm_time(pt, work, profile, gpus)
  times = full if uniform else comm_time(pt, work, profile, gpus, spanning_only=True)
  q = quant_time(pt, work, gpus)
  mem = model_state_bytes(pt, dataclasses.replace(work, activation_bytes=act), gpus)
  t_off = offload_time(pt, work)
  return {"plan": pt.name(nodes * gpus), "s_p": pt.s_p, "s_g": pt.s_g, "s_os": pt.s_os, **pt.columns(), **times,
          "T_quant": q, "T_offload": t_off, "compute_s": c,
          "T_step": step_time(c + q, times["T_comm"], overlap) + t_off,
          "T_step_uniform": c0 + q + full["T_comm"] + t_off, "bytes_per_device": mem["total"],
          "host_bytes_per_device": mem["host"], "model_state_bytes": mem["model_state"],
          "fits": cap is None or mem["total"] <= cap}


def pareto(rows: list[dict]) -> list[dict]:
  """The rows no other row dominates: none is at least as fast in compute + quantization, in
  communication and in memory, and faster or smaller in one (ties keep the first)."""
  key = lambda r: (r["compute_s"] + r["T_quant"], r["T_comm"], r["bytes_per_device"])
  out = []
  for i, r in enumerate(rows):
    a = key(r)
    if not any(all(x <= y for x, y in zip(key(o), a)) and (key(o) != a or j < i)
               for j, o in enumerate(rows) if j != i):
      out.append(r)
  return out


def rank(nodes: int, gpus: int, work: Workload, profile: dict, *, memory_cap_bytes: float | None = None,
         techniques: bool = False, lossy: bool = False, compute: dict | None = None, overlap: str = "none",
         prune: bool = True, keep: tuple[Point, ...] = ()) -> list[dict]:
  """One row per point, fastest predicted step first: name, degrees, techniques, times, memory, fits.

  `techniques` ranks every technique on every degree point (`space.with_techniques`; `lossy` adds int4
  weights and Radius). The step is additive in a point's parameter techniques (T_p, qwZ's kernels, hpZ's
  memory) and its gradient techniques (T_g, T_os^0, qgZ's kernels, gradient and residual memory), so with
  `prune` each set is cut to its Pareto front (`pareto`) before they are combined, and only the
  combinations' front is ranked: what is left out is slower and no smaller than a row that is kept.

  With `memory_cap_bytes`, every point over the cap is ranked a second time with its master weights and
  optimizer states in host memory (`offload=True`): only the device's bytes count against the cap, and
  the step pays `cost.offload_time`. A point that fits is ranked with offload only where that costs
  nothing (`offload_twins`), and then after its plan without it.

  `compute` is `planner.compute.per_plan`'s table over the degree points (None: `work.compute_s` for
  every plan, AMSP as written); its `quant_s_per_element` prices qwZ/qgZ's kernels. Each row also holds
  `T_step_uniform`, the step predicted with DP's compute for every plan, to compare. The points in `keep`
  (e.g. the named plans, `trial.baselines`) always have a row, pruned or not."""
  rows = []
  uniform = compute is None or compute["mode"] == "uniform"
  c0 = work.compute_s if compute is None else compute["dp_s"]
  if compute is not None and compute.get("quant_s_per_element") is not None:
    work = dataclasses.replace(work, quant_s_per_element=compute["quant_s_per_element"])
  world = nodes * gpus
  for base in plan_space(nodes, gpus):
    name = base.name(world)
    c = c0 if uniform else compute["compute_s"][name]
    act = work.activation_bytes if compute is None else compute["temp_bytes"][name]
    row = lambda pt: _row(pt, nodes, gpus, work, profile, c, c0, act, uniform, overlap, memory_cap_bytes)
    if not techniques:
      rows.append(row(base))
      rows += [row(t) for t in offload_twins([rows[-1]], work)]
      continue
    params = [base.with_(**o) for o in param_options(base, world, gpus, lossy)]
    grads = [base.with_(**o) for o in grad_options(base, world, gpus, lossy)]
    if prune:
      params = [point_of(r) for r in pareto([row(p) for p in params])]
      grads = [point_of(r) for r in pareto([row(g) for g in grads])]
    combos = [row(p.with_(g.settings)) for p in params for g in grads]
    kept = pareto(combos) if prune else combos
    have = {point_of(r) for r in kept}
    kept += [row(pt) for pt in keep if pt.base == base and pt not in have]
    rows += kept + [row(t) for t in offload_twins(kept, work)]
  # at equal step time the plan without offload first, then the smaller
  return sorted(rows, key=lambda r: (r["T_step"], bool(r["offload"]), r["bytes_per_device"], r["plan"]))


def offload_twins(rows: list[dict], work: Workload) -> list[Point]:
  """The points of `rows` with their master weights and optimizer states in host memory (`space.OFFLOAD`)
  that are ranked: where the row does not fit the memory cap, or where offload costs nothing
  (`cost.offload_time`, e.g. CPU devices, whose host memory is their own: an infinite host link). A plan
  that fits without offload and pays for it is not offered with it."""
  out = []
  for r in rows:
    twin = point_of(r).with_(offload=True)
    if not r["offload"] and (not r["fits"] or offload_time(twin, work) <= 0):
      out.append(twin)
  return out


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
  tried = [r for r in rows if "trial_s" in r]
  if "trial_s" in best:
    out = (f"{best['plan']}: fastest of the {len(tried)} plans measured on this cluster ({best['trial_s']:.3f} s "
           f"per step; predicted {best['T_step']:.3f} s)")
  else:
    out = f"{best['plan']}: fastest predicted step ({best['T_step']:.3f} s)"
  faster = [r for r in rows[:rows.index(best)] if not r["fits"]]
  if faster:
    need = ", ".join(f"{r['plan']} {r['bytes_per_device'] / 2**30:.4f} GiB" for r in faster[:4])
    out += (f" of the plans that fit the cap of {memory_cap_gb} GiB per device; faster but over the cap: {need}"
            + (f" and {len(faster) - 4} more" if len(faster) > 4 else ""))
  return out


def point_of(row: dict) -> Point:
  """The point of a ranked row (also of a row read back from JSON): its degrees and its techniques'
  columns (`space.COLUMNS`)."""
  return Point(row["s_p"], row["s_g"], row["s_os"], **{k: row[k] for k in COLUMNS if k in row})


def render(rows: list[dict], chosen: dict | None = None) -> str:
  head = (f"{'plan':<36}{'s_p':>4}{'s_g':>4}{'s_os':>5}{'C s':>8}{'T_comm s':>10}{'T_step s':>10}{'MB/device':>11}"
          "  fits" + ("  trial s" if any("trial_s" in r for r in rows) else ""))
  lines = [head, "-" * len(head)]
  for r in rows:
    mark = " <- chosen" if chosen is not None and r is chosen else ""
    tried = f"{r['trial_s']:>9.3f}" if "trial_s" in r else ""
    lines.append(f"{r['plan']:<36}{r['s_p']:>4}{r['s_g']:>4}{r['s_os']:>5}{r['compute_s']:>8.3f}{r['T_comm']:>10.3f}"
                 f"{r['T_step']:>10.3f}{r['bytes_per_device'] / 1e6:>11.2f}  {'yes' if r['fits'] else 'no '}{tried}{mark}")
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Auto:
  """`train.plan = @auto()`: the planner picks the plan at the start of the run.

  Attributes:
    profile: a profile JSON written by `python -m zerojax.planner.profile` (None: measure one now).
    memory_cap_gb: per-device memory available for model states and activations (None: no cap).
    techniques: rank every technique on every degree point (qwZ, hpZ, qgZ with per-hop bits,
      hierarchical gathers, 16-bit reduction; `space`); False: the shard degrees only (AMSP as written).
    lossy: also rank int4 weights and Radius's sparse replica sync, which change what is trained by more
      than ZeRO++'s int8 weights / int4 gradients do (their accuracy cost: `benchmarks/RESULTS.md`).
    compute: how each plan's compute is known (`planner.compute`): "uniform" (default: DP's step
      measured in this process, every collective from the profile; it ranked plans best on the emulated
      cluster), "anchors" (four plans measured, the rest fitted), "measured" (every plan measured).
    overlap: "none" (step = compute + communication) or "full" (the larger of the two).
    trials: how many of the fastest predicted plans that fit are run on this cluster before choosing
      (`planner.trial`), with ZeRO-3, ZeRO++ and MiCS (group = node) where they fit; the fastest
      measured is chosen. 0: choose on the prediction alone.
    trial_steps: timed steps per trial (after one warm-up step; the median is taken).

  On several processes the decision is one for the whole cluster (`planner.agree`): process 0 says
  whether the profile file exists, the measured compute is the slowest process's, process 0 ranks and
  its table and choice are broadcast.
  """
  profile: str | None = None
  memory_cap_gb: float | None = None
  techniques: bool = True
  lossy: bool = False
  compute: str = "uniform"
  overlap: str = "none"
  name: str = "auto"
  trials: int = 3
  trial_steps: int = 3

  def __post_init__(self):
    if not isinstance(self.trials, int) or self.trials < 0:
      raise ValueError(f"auto.trials = {self.trials!r}: use a count >= 0 (0: choose on the prediction alone)")
    if not isinstance(self.trial_steps, int) or self.trial_steps < 1:
      raise ValueError(f"auto.trial_steps = {self.trial_steps!r}: use a count >= 1")

  def label(self) -> str:
    """Its name ("auto") until the planner picks the plan, whose own label (`Plan.label`) the run then shows."""
    return self.name

  def load(self, mesh, log=print) -> dict | None:
    """The profile file, or a profile measured now (written to `self.profile` when that is set). Whether
    the file exists is process 0's answer; the profile itself is needed (and returned) on process 0 only
    when there are several processes (None on the others)."""
    from zerojax.planner import profile as profile_lib
    nodes, gpus = mesh_lib.base_shape(mesh)
    lead = jax.process_index() == 0
    exists = agree.from_process0(bool(lead and self.profile and os.path.exists(self.profile)))
    if exists:  # process 0 reads it; a file it cannot use stops every process with the same error
      prof, error = None, None
      if lead:
        try:
          prof = load_profile(self.profile, nodes, gpus)
        except (PlanError, ValueError, OSError) as e:
          error = str(e)
      error = agree.from_process0(error)
      if error:
        raise PlanError(error)
      return prof
    log(f"zerojax: auto: profiling the collectives of this {nodes} x {gpus} cluster"
        + (f" (no profile at {self.profile})" if self.profile else ""))
    prof = profile_lib.profile(mesh, [65536, 524288, 2097152])
    if self.profile and lead:
      with open(self.profile, "w") as f:
        json.dump(prof, f, indent=2)
    return prof

  def plan_for(self, mesh, work: Workload, make_executor, batch, log=print):
    """(the chosen Plan, the ranked rows) for `mesh` and the workload; `make_executor(Plan)` builds the
    model under a plan on the mesh, `batch` one step's batch, to measure compute and run the trials.
    Every process gets the same plan and rows (process 0's ranking on the slowest process's compute,
    then the trials' slowest-process times)."""
    from zerojax.planner import compute as compute_lib
    nodes, gpus = mesh_lib.base_shape(mesh)
    prof = self.load(mesh, log)
    table = compute_lib.per_plan(make_executor, plan_space(nodes, gpus), nodes, gpus, work, batch,
                                 mode=self.compute, log=log)
    table = agree.compute_table(table)
    cap = self.memory_cap_gb * 2**30 if self.memory_cap_gb else None
    base = [pt for pt in trial.baselines(nodes, gpus) if self.techniques or pt == pt.base]
    decision = None
    if jax.process_index() == 0:
      try:
        rows = rank(nodes, gpus, work, prof, memory_cap_bytes=cap, techniques=self.techniques, lossy=self.lossy,
                    compute=table, overlap=self.overlap, keep=tuple(base) if self.trials else ())
        decision = {"rows": rows, "chosen": rows.index(choose(rows, cap))}
      except (PlanError, ValueError) as e:  # e.g. a profile without a group: every process stops alike
        decision = {"error": str(e)}
    decision = agree.from_process0(decision)
    if "error" in decision:
      raise PlanError(decision["error"])
    rows = decision["rows"]
    best = rows[decision["chosen"]]
    if self.trials:
      fitting = [(r["plan"], point_of(r)) for r in rows if r["fits"]]
      cands = trial.candidates(fitting, self.trials, [(n, p) for n, p in fitting if p in base])
      log(f"zerojax: auto: measuring {len(cands)} plans on this cluster ({self.trials} fastest predicted and "
          "the named plans; `auto.trials = 0` skips this)")
      seconds = trial.run(cands, make_executor, nodes, gpus, batch, steps=self.trial_steps, log=log)
      for r in rows:
        if r["plan"] in seconds:
          r["trial_s"] = seconds[r["plan"]]
      best = min((r for r in rows if "trial_s" in r), key=lambda r: r["trial_s"])
    log(render(rows, best))
    log(f"zerojax: auto chose {why(rows, best, self.memory_cap_gb)}")
    return point_of(best).plan(nodes, gpus), rows


def auto(profile: str | None = None, memory_cap_gb: float | None = None, techniques: bool = True,
         lossy: bool = False, compute: str = "uniform", overlap: str = "none", trials: int = 3,
         trial_steps: int = 3) -> Auto:
  """The AMSP planner as a plan value (gin: `train.plan = @auto()`, `auto.profile = 'p.json'`)."""
  return Auto(profile, memory_cap_gb, techniques, lossy, compute, overlap, trials=trials, trial_steps=trial_steps)
