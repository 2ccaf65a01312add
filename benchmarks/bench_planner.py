"""Does the AMSP planner rank plans the way the emulated cluster does?

For each link rate: profile the collectives on the emulated cluster (`cluster.py --profile`), let the
planner rank every point of the plan space for the default config (`python -m zerojax.cli.plan
--profile --measure_compute`: every plan's compute measured once in one process, no slow link), then run
every point (and ZeRO++) on the cluster, `--reps` interleaved rounds, and compare the medians with three
models of the step (`zerojax.planner.compute`):

  uniform   DP's compute + every collective from the profile (AMSP's model as written; the default)
  anchors   compute fitted on DP, ZeRO-1, ZeRO-2, ZeRO-3 + node-spanning collectives
  measured  each plan's own compute + node-spanning collectives (`--measure_compute`)

For each: Spearman's rank correlation of predicted and measured step times, and the measured time of
the model's choice against the measured best, ZeRO-3, ZeRO++ and MiCS (group = node).

  sudo python benchmarks/bench_planner.py --rates 100mbit,1gbit --accum 4 [--reps 3]

Prints JSON, writes `benchmarks/planner.json` and the AMSP section of `benchmarks/RESULTS.md`.

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


def spearman(a: list[float], b: list[float]) -> float:
  def ranks(x):
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    for pos, i in enumerate(order):
      r[i] = float(pos)
    return r
  ra, rb = ranks(a), ranks(b)
  n = len(a)
  return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def predict(profile_path: str, nodes: int, gpus: int, accum: int, gin_param: list[str]) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  cmd = [sys.executable, "-m", "zerojax.cli.plan", "--json", "--measure_compute", "--gin_file=configs/base.gin",
         f"--profile={profile_path}", f"--mesh={nodes}x{gpus}", f"--gin_param=train.accum_steps={accum}",
         *[f"--gin_param={p}" for p in gin_param]]
  r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  if r.returncode:
    raise RuntimeError(f"planner failed:\n{r.stderr[-3000:]}")
  return json.loads(r.stdout)


def predictions(pred: dict) -> dict[str, dict[str, float]]:
  """{model: {plan: predicted s/step}} for the uniform, anchors and measured models, from one planner
  run with every plan's compute measured (the anchors model refits on the four anchor plans alone)."""
  sys.path.insert(0, REPO)
  from zerojax.planner import compute, cost, space
  work = cost.Workload(**{**pred["workload"], "units": tuple(tuple(u) for u in pred["workload"]["units"])})
  measured = pred["compute"]["measured"]
  world = max(r["s_os"] for r in pred["rows"])
  anchors = {p: measured[p.name(world)] for p in compute.anchors(world)}
  coef = compute.fit(anchors, work)
  pt = lambda r: space.Point(r["s_p"], r["s_g"], r["s_os"], r["zeropp"])
  return {"uniform": {r["plan"]: r["T_step_uniform"] for r in pred["rows"]},
          "anchors": {r["plan"]: compute.predict(coef, pt(r), work) + r["T_comm"] for r in pred["rows"]},
          "measured": {r["plan"]: r["compute_s"] + r["T_comm"] for r in pred["rows"]}}


def judge(predicted: dict[str, float], measured: dict[str, float], best_s: float) -> dict:
  """Spearman of a model's predictions against the measured medians, and how its choice fared."""
  names = sorted(predicted)
  chosen = min(names, key=lambda n: (predicted[n], n))
  return {"spearman": spearman([predicted[n] for n in names], [measured[n] for n in names]), "chosen": chosen,
          "chosen_measured_s": measured[chosen], "chosen_over_best": measured[chosen] / best_s}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--nodes", type=int, default=2)
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--rates", default="100mbit,1gbit")
  ap.add_argument("--accum", type=int, default=4)
  ap.add_argument("--reps", type=int, default=3, help="interleaved rounds over all plans (median of them)")
  ap.add_argument("--steps", type=int, default=7)
  ap.add_argument("--gin_param", action="append", default=[])
  ap.add_argument("--json", default=os.path.join(HERE, "planner.json"))
  ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
  args = ap.parse_args(argv)
  if os.geteuid() != 0:
    print("bench_planner: the cluster emulator needs root", file=sys.stderr)
    return 1
  report = {"argv": sys.argv[1:] if argv is None else list(argv), "date": datetime.date.today().isoformat(),
            "cpus": os.cpu_count(), "nodes": args.nodes, "devices": args.devices, "accum": args.accum,
            "reps": args.reps, "rates": {}}
  for rate in [r for r in args.rates.split(",") if r]:
    prof_path = os.path.join(tempfile.mkdtemp(prefix="zjx-prof-"), "profile.json")
    cluster.run_profile(cluster.parser().parse_args(
        [f"--profile={prof_path}", f"--nodes={args.nodes}", f"--devices={args.devices}", f"--rate={rate}"]))
    pred = predict(prof_path, args.nodes, args.devices, args.accum, args.gin_param)
    print(f"bench_planner: {rate}: planner chose {pred['chosen']}", file=sys.stderr, flush=True)
    plans = {r["plan"]: ["train.plan=@amsp()", f"amsp.s_p={r['s_p']}", f"amsp.s_g={r['s_g']}",
                         f"amsp.s_os={r['s_os']}"] for r in pred["rows"]}
    plans["zeropp"] = ["train.plan=@zeropp()"]
    measured = {}
    for rep in range(args.reps):
      for name, params in plans.items():
        r = bench_mics.run_one(args.nodes, args.devices, rate, args.accum, params, args)
        measured.setdefault(name, []).append(r["median_step_time_s"])
        print(f"bench_planner: {rate} rep {rep} {name}: {r['median_step_time_s']:.3f} s/step", file=sys.stderr,
              flush=True)
    t = {k: statistics.median(v) for k, v in measured.items()}
    models = predictions(pred)
    rows = [{"plan": r["plan"], **{f"predicted_{m}_s": models[m][r["plan"]] for m in models},
             "predicted_comm_s": r["T_comm"], "compute_measured_s": r["compute_s"],
             "measured_s": t[r["plan"]], "measured_min_max": [min(measured[r["plan"]]), max(measured[r["plan"]])]}
            for r in pred["rows"]]
    best = min(rows, key=lambda r: r["measured_s"])
    report["rates"][rate] = {
        "profile": json.load(open(prof_path)), "compute": pred["compute"], "rows": rows,
        "best": best["plan"], "best_measured_s": best["measured_s"], "zero3_s": t.get("zero3"),
        "zeropp_s": t.get("zeropp"), "mics_node_s": t.get(f"mics-{args.devices}"), "world": args.nodes * args.devices,
        "models": {m: judge(models[m], t, best["measured_s"]) for m in models}}
  with open(args.json, "w") as f:
    json.dump(report, f, indent=2)
  bench_mics.write_section(args.results, markdown(report), "## AMSP planner on the emulated cluster")
  print(json.dumps({rate: {k: v for k, v in r.items() if k not in ("profile", "rows", "compute")}
                    for rate, r in report["rates"].items()}, indent=2))
  return 0


def markdown(report: dict) -> str:
  lines = ["## AMSP planner on the emulated cluster", "",
           (f"{report['date']}, {report['cpus']} CPU cores, {report['nodes']} nodes x {report['devices']} devices, "
           f"default GPT, accumulation {report['accum']}, `benchmarks/bench_planner.py {' '.join(report['argv'])}`. "
           f"Measured: median step time of {report['reps']} interleaved run(s) per plan. Predicted, three models "
           "(`zerojax.planner.compute`): *uniform* (the default) = DP's compute + every collective from a profile "
           "measured on the same emulated cluster (AMSP's model as written); *anchors* = compute fitted on DP, ZeRO-1, "
           "ZeRO-2 and ZeRO-3 measured in one process + the node-spanning collectives; *measured* "
           "(`--measure_compute`) = each plan's compute measured in one process + the node-spanning collectives."), ""]
  for rate, r in report["rates"].items():
    lines += [(f"**{rate}**: measured best `{r['best']}` ({r['best_measured_s']:.3f} s/step); ZeRO-3 {r['zero3_s']:.3f} s, "
              f"ZeRO++ {r['zeropp_s']:.3f} s, MiCS (node) {r['mics_node_s']:.3f} s."), "",
              "| model | Spearman | chosen | chosen measured s/step | chosen / best |", "|---|---|---|---|---|"]
    for m, j in r["models"].items():
      lines.append(f"| {m} | {j['spearman']:.2f} | `{j['chosen']}` | {j['chosen_measured_s']:.3f} | "
                   f"{j['chosen_over_best']:.2f} |")
    lines += ["", "| plan | uniform s | anchors s | measured-compute s | node-spanning comm s | measured s/step [min–max] |",
              "|---|---|---|---|---|---|"]
    for row in sorted(r["rows"], key=lambda x: x["measured_s"]):
      lines.append(f"| {row['plan']} | {row['predicted_uniform_s']:.3f} | {row['predicted_anchors_s']:.3f} | "
                   f"{row['predicted_measured_s']:.3f} | {row['predicted_comm_s']:.3f} | {row['measured_s']:.3f} "
                   f"[{row['measured_min_max'][0]:.3f}–{row['measured_min_max'][1]:.3f}] |")
    lines.append("")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
