"""Is `auto` never behind a named plan? The planner's choice on the emulated cluster against ZeRO-3,
ZeRO++, MiCS (group = node) and the best measured plan, over a grid of clusters, links and accumulation.

For each shape (`--shapes`) and link rate (`--rates`) the collectives are profiled once on the emulated
cluster (`cluster.py --profile`); for each accumulation (`--accums`) the planner ranks the whole plan
space with auto's default model (`python -m zerojax.cli.plan --json`: DP's compute measured once in one
process, every collective from the profile, every technique, Pareto-pruned; `--lossy` adds int4 weights
and Radius). Then, in `--reps` interleaved rounds, the cluster runs:

  auto      `train.plan = @auto()` with that profile, end to end (every process plans, one decision; its
            trials run the fastest predicted plans and the named ones on the cluster, `planner.trial`)
  named     ZeRO-3, ZeRO++ and MiCS with group = node, as their configs (`configs/*.gin`) run them
  points    the candidates of `--space`: `top` (default) the `--top` fastest predicted points; `front`
            every point the pruned ranking keeps; `all` every point of the space (slow: 129 at 2 x 4)

Per cell: the model's choice (`auto.trials = 0`) and the plans auto ran after its trials (one per
round), auto's step time and its run's wall time beside ZeRO-3's (the trials' start-up cost), the named
plans', the measured best (of what was run), auto over
best (the goal: within 5%, never above 1.10x) and Spearman's rank correlation of predicted and measured
step times over the points with a prediction. Step times are medians over the rounds (interleaved, so a
slow phase of the machine falls on every plan alike); run it on a quiet machine.

  sudo .venv/bin/python benchmarks/bench_planner.py --shapes 2x4,4x2 --rates 100mbit,1gbit --accums 1,4 --reps 3

Prints JSON, writes `benchmarks/planner.json` and the AMSP section of `benchmarks/RESULTS.md`.

`--user` asks a user's question instead: does `auto` cost me anything against the plan it picks? Per
cell, `--reps` interleaved rounds (the order alternating) of auto's own run (`train.plan = @auto()`,
trials included) and the plan it chose, started by name (its config, or its `amsp(...)` bindings):
each run's median step time, their medians with min and max, and auto over the named run (goal: within
5%). Writes `benchmarks/planner_user.json`.

  sudo .venv/bin/python benchmarks/bench_planner.py --user --shapes 2x4 --rates 100mbit,1gbit --accums 1 --reps 5

References:
  AMSP: Chen et al. 2023, §V (planner), §VI-D (ablation of the strategies).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_mics  # noqa: E402
import cluster  # noqa: E402
from common import spread, write_section  # noqa: E402

NAMED = {"zero3": ["train.plan=@zero3()"], "zeropp": ["train.plan=@zeropp()"],
         "mics_node": ["train.plan=@mics()", "mics.sync_in_backward=True"]}
NAMED_POINT = {"zero3": "zero3", "zeropp": "zeropp", "mics_node": "mics-{gpus}"}  # their points' names


def spearman(a: list[float], b: list[float]) -> float:
  def ranks(x):
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    for pos, i in enumerate(order):
      r[i] = float(pos)
    return r
  ra, rb = ranks(a), ranks(b)
  n = len(a)
  return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else float("nan")


def gin_params(row: dict) -> list[str]:
  """`train.py` bindings that run a ranked row's point (`planner.space.Point.plan` as gin)."""
  out = ["train.plan=@amsp()", f"amsp.s_p={row['s_p']}", f"amsp.s_g={row['s_g']}", f"amsp.s_os={row['s_os']}",
         f"amsp.hierarchical={bool(row['hierarchical'])}"]
  if row["weight_bits"]:
    out.append(f"amsp.weight_bits={row['weight_bits']}")
  if row["hpz"]:
    out.append("amsp.secondary_axes=('gpu',)")
  if row["grad_bits"]:
    bits = row["grad_bits"]
    out.append(f"amsp.grad_bits={tuple(bits) if isinstance(bits, list) else bits}")
  if row.get("grad_format"):
    out.append(f"amsp.grad_format='{row['grad_format']}'")
  if row["reduce16"]:
    out.append("amsp.reduce_dtype='bfloat16'")
  if row["radius"]:
    out.append("amsp.replica_sync=@radius()")
  return out


def predict(profile_path: str, nodes: int, gpus: int, accum: int, lossy: bool, compute: str,
            gin_param: list[str]) -> dict:
  """auto's ranking (`zerojax.cli.plan --json`, its default model) and every point's prediction."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  cmd = [sys.executable, "-m", "zerojax.cli.plan", "--json", "--gin_file=configs/base.gin", f"--profile={profile_path}",
         f"--mesh={nodes}x{gpus}", f"--gin_param=train.accum_steps={accum}", f"--compute={compute}",
         *(["--lossy"] if lossy else []),
         *[f"--gin_param={p}" for p in gin_param]]
  r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  if r.returncode:
    raise RuntimeError(f"planner failed:\n{r.stderr[-3000:]}")
  pred = json.loads(r.stdout)
  sys.path.insert(0, REPO)
  from zerojax import planner
  from zerojax.planner import cost
  work = cost.Workload(**{**pred["workload"], "units": tuple(tuple(u) for u in pred["workload"]["units"])})
  with open(profile_path) as f:
    prof = json.load(f)
  every = planner.rank(nodes, gpus, work, prof, techniques=True, lossy=lossy, compute=pred["compute"], prune=False)
  pred["every"] = {r["plan"]: r for r in every}
  return pred


def candidates(pred: dict, space: str, top: int) -> dict[str, dict]:
  """The ranked rows to run: name -> row."""
  rows = list(pred["every"].values()) if space == "all" else pred["rows"]
  rows = sorted(rows, key=lambda r: r["T_step"])
  return {r["plan"]: r for r in (rows[:top] if space == "top" else rows)}


FAILED: list[dict] = []  # runs that failed or hung (each attempt), written to the report


def run(nodes: int, gpus: int, rate: str, accum: int, params: list[str], args, what: str) -> dict | None:
  """One emulated-cluster run; a run that fails or hangs (`--run_timeout`) is tried once more, then left
  out of the cell (logged, and listed in the report's `failed`)."""
  for attempt in (1, 2):
    try:
      return bench_mics.run_one(nodes, gpus, rate, accum, params, args)
    except cluster.ClusterError as e:
      print(f"bench_planner: {what}: attempt {attempt} failed: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
      FAILED.append({"run": what, "attempt": attempt, "error": str(e)[-2000:]})
  return None


def cell(nodes: int, gpus: int, rate: str, accum: int, prof_path: str, args) -> dict:
  pred = predict(prof_path, nodes, gpus, accum, args.lossy, args.compute, args.gin_param)
  chosen = pred["chosen"]
  print(f"bench_planner: {nodes}x{gpus} {rate} accum {accum}: auto chooses {chosen}", file=sys.stderr, flush=True)
  points = candidates(pred, args.space, args.top)
  points.setdefault(chosen, pred["every"][chosen])
  runs = {name: gin_params(r) for name, r in points.items()}
  runs.update(NAMED)
  runs["auto"] = ["train.plan=@auto()", f"auto.profile='{prof_path}'", f"auto.lossy={args.lossy}",
                  f"auto.compute='{args.compute}'"]
  measured, walls, auto_plans = {}, {}, []
  for rep in range(args.reps):
    for name, params in runs.items():
      r = run(nodes, gpus, rate, accum, params, args, f"{nodes}x{gpus} {rate} accum {accum} rep {rep} {name}")
      if r is None:
        continue
      measured.setdefault(name, []).append(r["median_step_time_s"])
      walls.setdefault(name, []).append(r["wall_s"])
      if name == "auto":
        auto_plans.append(r["plan"])
      print(f"bench_planner: {nodes}x{gpus} {rate} accum {accum} rep {rep} {name}: {r['median_step_time_s']:.3f} s/step",
            file=sys.stderr, flush=True)
  t = {k: statistics.median(v) for k, v in measured.items()}
  for k in [k for k in runs if k not in t]:  # failed in every round: no time
    t[k] = float("inf")
  named_pt = {k: v.format(gpus=gpus) for k, v in NAMED_POINT.items()}
  predicted = {k: pred["every"][k]["T_step"] for k in points}
  predicted.update({k: pred["every"][named_pt[k]]["T_step"] for k in NAMED})
  best = min(t, key=t.get)
  names = sorted(predicted)
  return {
      "shape": f"{nodes}x{gpus}", "rate": rate, "accum": accum, "auto_choice": chosen,
      "auto_plans": auto_plans, "auto_wall_s": statistics.median(walls.get("auto", [float("inf")])),
      "zero3_wall_s": statistics.median(walls.get("zero3", [float("inf")])),
      "auto_predicted_s": pred["every"][chosen]["T_step"], "auto_s": t["auto"], "auto_choice_s": t[chosen],
      "zero3_s": t["zero3"], "zeropp_s": t["zeropp"], "mics_node_s": t["mics_node"], "best": best,
      "best_s": t[best], "auto_over_best": t["auto"] / t[best], "auto_choice_over_best": t[chosen] / t[best],
      "spearman": spearman([predicted[n] for n in names], [t[n] for n in names]), "plans_run": len(runs),
      "space_size": len(pred["every"]), "front_size": len(pred["rows"]),
      "rows": [{"plan": n, "predicted_s": predicted.get(n), "measured_s": t[n],
                "measured_min_max": [min(measured[n]), max(measured[n])]} for n in sorted(t, key=t.get)],
      "compute": pred["compute"]}


def by_name(plan: str, pred: dict, gpus: int) -> list[str]:
  """`train.py` bindings that start the plan `auto` chose by name: its config where it is a named plan,
  else its point's `amsp(...)` bindings."""
  for name, point in NAMED_POINT.items():
    if point.format(gpus=gpus) == plan:
      return NAMED[name]
  return gin_params(pred["every"][plan])


def user_cell(nodes: int, gpus: int, rate: str, accum: int, prof_path: str, args) -> dict:
  """auto's own run against the plan it chose started by name, interleaved (`--user`)."""
  pred = predict(prof_path, nodes, gpus, accum, args.lossy, args.compute, args.gin_param)
  auto = ["train.plan=@auto()", f"auto.profile='{prof_path}'", f"auto.lossy={args.lossy}",
          f"auto.compute='{args.compute}'"]
  t = {"auto": [], "named": []}
  chosen, plans = None, []
  for rep in range(args.reps):
    order = ("auto", "named") if rep % 2 == 0 or chosen is None else ("named", "auto")  # auto first: its choice
    for what in order:
      if what == "named" and chosen is None:
        continue
      params = auto if what == "auto" else by_name(chosen, pred, gpus)
      r = run(nodes, gpus, rate, accum, params, args, f"{nodes}x{gpus} {rate} accum {accum} rep {rep} {what}")
      if r is None:
        continue
      if what == "auto":
        plans.append(r["plan"])
        chosen = chosen or r["plan"]
      t[what].append(r["median_step_time_s"])
      print(f"bench_planner: {nodes}x{gpus} {rate} rep {rep} {what} ({r['plan']}): "
            f"{r['median_step_time_s']:.3f} s/step", file=sys.stderr, flush=True)
  out = {"shape": f"{nodes}x{gpus}", "rate": rate, "accum": accum, "auto_plans": plans, "chosen": chosen,
         "named_params": by_name(chosen, pred, gpus) if chosen else None}
  if t["auto"] and t["named"]:
    out.update(auto_s={**spread(t["auto"]), "runs": t["auto"]}, named_s={**spread(t["named"]), "runs": t["named"]},
               auto_over_named=statistics.median(t["auto"]) / statistics.median(t["named"]),
               auto_over_named_range=[min(t["auto"]) / max(t["named"]), max(t["auto"]) / min(t["named"])])
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", default="2x4,4x2", help="NODESxDEVICES, comma-separated")
  ap.add_argument("--rates", default="100mbit,1gbit")
  ap.add_argument("--accums", default="1,4")
  ap.add_argument("--reps", type=int, default=3, help="interleaved rounds over all plans (median of them)")
  ap.add_argument("--steps", type=int, default=7)
  ap.add_argument("--space", default="top", choices=("top", "front", "all"), help="which points to run")
  ap.add_argument("--top", type=int, default=8, help="with --space top: how many of the fastest predicted")
  ap.add_argument("--lossy", action="store_true", help="let auto take int4 weights and Radius")
  ap.add_argument("--compute", default="uniform", choices=("uniform", "anchors", "measured"),
                  help="auto's compute model (`zerojax.planner.compute`; default uniform, auto's default)")
  ap.add_argument("--gin_param", action="append", default=[])
  ap.add_argument("--run_timeout", type=float, default=600, help="seconds before a hung run is stopped and retried")
  ap.add_argument("--user", action="store_true",
                  help="auto's own run against the plan it chose started by name, interleaved (planner_user.json)")
  ap.add_argument("--json", default=None, help="default benchmarks/planner.json (--user: planner_user.json)")
  ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
  args = ap.parse_args(argv)
  args.json = args.json or os.path.join(HERE, "planner_user.json" if args.user else "planner.json")
  try:
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s]
    accums = [int(a) for a in args.accums.split(",") if a]
  except ValueError:
    ap.error(f"--shapes {args.shapes!r} / --accums {args.accums!r}: use e.g. --shapes 2x4,4x2 --accums 1,4")
  if os.geteuid() != 0:
    print("bench_planner: the cluster emulator needs root", file=sys.stderr)
    return 1
  # The same programs run once per round: later rounds load them from the persistent cache.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="zjx-jax-cache-"))
  report = {"argv": sys.argv[1:] if argv is None else list(argv), "date": datetime.date.today().isoformat(),
            "cpus": os.cpu_count(), "reps": args.reps, "space": args.space, "top": args.top, "lossy": args.lossy,
            "compute": args.compute,
            "cells": [], "profiles": {}}
  for nodes, gpus in shapes:
    for rate in [r for r in args.rates.split(",") if r]:
      prof_path = os.path.join(tempfile.mkdtemp(prefix="zjx-prof-"), "profile.json")
      report["profiles"][f"{nodes}x{gpus} {rate}"] = cluster.run_profile(cluster.parser().parse_args(
          [f"--profile={prof_path}", f"--nodes={nodes}", f"--devices={gpus}", f"--rate={rate}"]))
      for accum in accums:
        report["cells"].append((user_cell if args.user else cell)(nodes, gpus, rate, accum, prof_path, args))
        report["failed"] = FAILED
        with open(args.json, "w") as f:  # after every cell: a long grid keeps what it measured
          json.dump(report, f, indent=2)
  if args.user:
    print(json.dumps(report["cells"], indent=2))
    return 0
  write_section(args.results, markdown(report), "## AMSP planner on the emulated cluster")
  print(json.dumps([{k: v for k, v in c.items() if k not in ("rows", "compute")} for c in report["cells"]], indent=2))
  return 0


def markdown(report: dict) -> str:
  lines = ["## AMSP planner on the emulated cluster", "",
           (f"{report['date']}, {report['cpus']} CPU cores, default GPT, `benchmarks/bench_planner.py "
            f"{' '.join(report['argv'])}`. Median step time of {report['reps']} interleaved run(s) per plan. *auto*: "
            "`train.plan = @auto()` run end to end; *auto's choice*: the plan it chose, run as a point; *best*: "
            f"the fastest of what was run (space `{report['space']}`"
            + (f", the {report['top']} fastest predicted points" if report["space"] == "top" else "")
            + ", the named plans and auto). Spearman: predicted vs measured over the points and named plans."), "",
           "| cluster | rate | accum | model's choice | auto ran (per round) | auto s | ZeRO-3 s | ZeRO++ s | MiCS (node) s "
           "| best | best s | auto / best | Spearman |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for c in report["cells"]:
    ran = ", ".join(f"`{p}`" for p in c.get("auto_plans", []))
    lines.append(f"| {c['shape']} | {c['rate']} | {c['accum']} | `{c['auto_choice']}` | {ran} | {c['auto_s']:.3f} | "
                 f"{c['zero3_s']:.3f} | {c['zeropp_s']:.3f} | {c['mics_node_s']:.3f} | `{c['best']}` | {c['best_s']:.3f} | "
                 f"{c['auto_over_best']:.2f} | {c['spearman']:.2f} |")
  return "\n".join(lines + [""])


if __name__ == "__main__":
  sys.exit(main())
