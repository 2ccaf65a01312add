"""Summary of the fidelity experiments (issue 57): for each change to a lossy plan, measured with
`bench_convergence.py --plan_param ... --references_from benchmarks/convergence.json`, its per-seed gaps
over the dense reference, mean and spread, beside the shipped setting's (`benchmarks/convergence.json`).

  python benchmarks/fidelity_summary.py   # -> benchmarks/fidelity_experiments.json
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_convergence import PARAMS, wire_bytes  # noqa: E402
BASE = "convergence.json"
# (plan, the change, the result file under benchmarks/[, its goal]); a goal is a mean gap in percent
GOALS = {"zeropp_int4": 0.5, "mics_radius": 1.5, "diloco_mics": 2.0}
EXPERIMENTS = [
    ("mics_radius", "radius.dense_steps=60 (dense for 20% of the 300 steps)", "convergence_radius_dense60.json"),
    ("mics_radius", "radius.period=10", "convergence_radius_period10.json"),
    ("mics_radius", "radius.rank='gradient': top-k of the all-reduced gradient + residual (an option at the "
     "commit of its file, since removed)",
     "convergence_radius_rank_gradient.json"),
    ("diloco_mics", "diloco.lr=1.3 (no momentum)", "convergence_diloco_lr1.3.json"),
    ("zeropp_int4", "zeropp.weight_block=64 (int4 weight blocks of 64 instead of 256)",
     "convergence_int4_wblock64.json"),
    ("mics_radius", "radius.period=50", "convergence_radius_period50.json"),
    ("mics_radius", "radius.period=100 (the last 69 steps' residual is never sent)",
     "convergence_radius_period100.json"),
    ("diloco_mics", "diloco.fragments=4 (Streaming DiLoCo: one layer's fragment synced every 10 steps, staggered)",
     "convergence_diloco_f4.json"),
    ("diloco_mics", "diloco.lr=0.8 (no momentum)", "convergence_diloco_lr0.8.json"),
    ("diloco_mics", "diloco.lr=0.6 (no momentum)", "convergence_diloco_lr0.6.json"),
    ("mics_radius", "radius.scope='model': top-k over each shard's whole model (every leaf and layer at once, "
     "the paper's flattened gradient on each A_os shard) instead of per leaf; an experiment never merged, "
     "benchmarks/history/radius_model_topk.patch on f2cb8f5", "convergence_radius_model_topk.json"),
    ("mics_radius", "radius.scope='model' and radius.period=50: the two best changes together (the same patch)",
     "convergence_radius_model_topk_period50.json"),
    # H = 50: the goal is set at H = 10 only; these say which outer lr a run with H = 50 should take
    ("diloco_mics", "diloco.every=50 (H = 50) at the shipped outer lr 0.6", "convergence_diloco_h50.json", None),
    ("diloco_mics", "diloco.every=50, diloco.lr=1.0", "convergence_diloco_h50_lr1.0.json", None),
    ("diloco_mics", "diloco.every=50, diloco.lr=1.3", "convergence_diloco_h50_lr1.3.json", None),
]
GOAL = object()  # an experiment's goal: its plan's in GOALS unless it names its own (None: none)


def entry(plan: str, change: str, name: str, goal=GOAL) -> dict:
  path = os.path.join(HERE, name)
  if not os.path.exists(path):
    return {"plan": plan, "change": change, "file": f"benchmarks/{name}", "error": "not measured"}
  with open(path) as f:
    d = json.load(f)
  r = d["results"].get(plan, {})
  e = {"plan": plan, "change": change, "file": f"benchmarks/{name}", "git_commit": d.get("git_commit"),
       "spec": d["plans"].get(plan, {}).get("spec"), "reference": r.get("reference"), "seeds": r.get("seeds"),
       "gap_pct": r.get("gap_pct"), "mean_gap_pct": r.get("mean_gap_pct"), "min_gap_pct": r.get("min_gap_pct"),
       "max_gap_pct": r.get("max_gap_pct"), "std_gap_pct": r.get("std_gap_pct"), "n": r.get("n"),
       "goal_mean_gap_pct": GOALS.get(plan) if goal is GOAL else goal}
  if e["reference"] == "zero3":  # per-step bytes per device from the plan's formats
    e["wire_bytes"] = wire_bytes(e["spec"], PARAMS)
  if e["mean_gap_pct"] is not None and e["goal_mean_gap_pct"] is not None:
    e["goal_met"] = e["mean_gap_pct"] <= e["goal_mean_gap_pct"]
  if "references_reused" in d:
    e["references_reused"] = d["references_reused"]
  if "reference_check" in d:
    e["reference_check"] = d["reference_check"]
  return e


def main() -> dict:
  out = {"baseline": [entry(p, "as in benchmarks/convergence.json (the shipped settings)", BASE) for p in GOALS],
         "experiments": [entry(*x) for x in EXPERIMENTS]}
  with open(os.path.join(HERE, "fidelity_experiments.json"), "w") as f:
    json.dump(out, f, indent=1)
  for e in out["baseline"] + out["experiments"]:
    gaps = ", ".join("-" if g is None else f"{g:+.2f}" for g in e.get("gap_pct") or [])
    mean = e.get("mean_gap_pct")
    print(f"{e['plan']:12s} {e['change'][:60]:60s} [{gaps}] mean {'-' if mean is None else f'{mean:+.2f}'}"
          f" std {e.get('std_gap_pct') or 0:.2f}")
  return out


if __name__ == "__main__":
  main()
