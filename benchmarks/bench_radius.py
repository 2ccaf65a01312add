"""MiCS with dense against Radius replica sync: step time and cross-node bytes on the emulated cluster,
and convergence after the same budget.

Cluster (`--reps` interleaved repetitions: rep 1 of every config, then rep 2, ...): MiCS with a partition
group of one node, so the only cross-node traffic is the replica all-reduce; accumulation 1, default
model, `--steps` steps. The Radius runs select at step 0 (`radius.dense_steps = 0`, `period = 200`), so
the measured steps (2 .. steps - 1) are all sparse; a select step is a dense step plus a top-k. Per
config: median step time (min–max) and measured cross-node payload bytes per step per node, and the
step time of a 200-step window (1 select + 199 sparse, the select step timed as dense).

Convergence (`--convergence`, one process, 8 simulated devices, unshaped): `train.py` with
`configs/mics.gin` against `configs/mics_radius.gin` (dense for 40 steps, windows of 20) at each
density, 200 steps; final train and held-out loss.

Overhead (`--overhead N`, one process, no network): the dense MiCS step, the same with the replica
sync after the window (`sync_in_backward=False`) and the Radius sparse step (d = 0.4), timed N times in
interleaved order: what the sparse step costs in compute.

  sudo python benchmarks/bench_radius.py --reps 3 --convergence --overhead 25
  python benchmarks/bench_radius.py --from_json benchmarks/radius.json --overhead 25   # add to a report

The persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`, a temporary folder unless set) lets
repetitions after the first skip compiling. Writes `benchmarks/radius.json` and the Radius section of
`benchmarks/RESULTS.md`.

Before/after (`--compare`, cluster, root): this tree and each `--repo` checkout (e.g. a git worktree of an
older commit), each run a subprocess of the emulated cluster whose `train.py` processes import that
checkout (`PYTHONPATH`, working directory); the cluster itself is this tree's `cluster.py`, so only the
trained code differs. Per repetition, in alternating order: dense MiCS (`configs/mics.gin`) and MiCS +
Radius (`configs/mics_radius.gin` with `--density`, `--period`, `--dense_steps`; default 0.1, 50, 2) in
every checkout. The window holds sparse steps only: it starts after the select step and the first sparse
step (each compiles its program on first use; the select step also all-reduces the whole gradient) and
ends before the next select step; the dense runs use the same window. Prints JSON (and writes `--out`):
per checkout the sparse and dense step times (median and min-max of the runs' medians, quartiles of all
window steps), sparse/dense per repetition, bytes per step per node on the links, and the sparse step
against the first checkout. `--smoke`: a tiny model, one repetition of two timed steps (checks that it
runs; its times mean nothing).

  sudo python benchmarks/bench_radius.py --compare --repo /tmp/radius_old --reps 5 --out /tmp/radius_cmp.json

Both live in `benchmarks/radius_compare.py`.

Programs (`--programs OUT`, no cluster, no root, nothing timed): in every checkout, one process of 2 x 4
CPU devices runs the same config's steps through its phases (dense, select, sparse) and compiles each
phase's program; writes what differs: per program its normalized HLO hash (benchmarks/hlo_fingerprint.py),
collectives (op, dtype, shapes, replica groups, bytes, node egress), scheduled ops (fusions, sorts, top-k,
gathers, scatters, copies, transposes), XLA's cost analysis; per checkout the losses of those steps and
the Python calls of each step call (the host path). benchmarks/radius_programs.json:

  python benchmarks/bench_radius.py --programs benchmarks/radius_programs.json --repo /tmp/radius_old

References:
  Radius: Zheng & Zhang, §6.2 (per-step time −21% at d = 0.4), §6.3 (training error).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster  # noqa: E402
from common import interleaved, write_section  # noqa: E402
import radius_compare  # noqa: E402

SECTION = "## Radius: sparse replica sync on the emulated cluster"


def configs(densities: list[float]) -> dict[str, list[str]]:
  out = {"dense": []}
  for d in densities:
    out[f"radius_d{d:g}"] = ["mics.replica_sync=@radius()", f"radius.density={d}", "radius.period=200",
                             "radius.dense_steps=0"]
  return out


def run_cluster(params: list[str], args) -> dict:
  argv = ["--gin_file=configs/mics.gin", f"--nodes={args.nodes}", f"--devices={args.devices}",
          f"--rate={args.rate}", f"--steps={args.steps}", "--gin_param=train.accum_steps=1",
          *[f"--gin_param={p}" for p in params]]
  return cluster.run(cluster.parser().parse_args(argv))


def run_convergence(name: str, gin_file: str, params: list[str], steps: int) -> dict:
  with tempfile.TemporaryDirectory(prefix="zjx-radius-") as workdir:
    cmd = [sys.executable, os.path.join(cluster.REPO, "train.py"), f"--gin_file={gin_file}", f"--workdir={workdir}",
           f"--gin_param=train.steps={steps}", "--gin_param=train.progress=False",
           "--gin_param=train.checkpoint_every=0", *[f"--gin_param={p}" for p in params]]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run(cmd, cwd=cluster.REPO, env=env, capture_output=True, text=True)
    if r.returncode:
      raise RuntimeError(f"{name}: train.py failed:\n{(r.stdout + r.stderr)[-3000:]}")
    with open(os.path.join(workdir, "summary.json")) as f:
      s = json.load(f)
  return {"config": name, "gin_file": gin_file, "gin_params": params, "steps": steps,
          "final_loss": s["final_loss"], "final_eval_loss": s["final_eval_loss"],
          "median_step_time_s": s["median_step_time_s"]}


def run_overhead(reps: int) -> dict:
  """Median and min seconds per step of dense, dense synced after the window, and sparse (d = 0.4)."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, cluster.REPO)
  import jax
  import numpy as np
  import zerojax
  from zerojax.models.gpt import GPTConfig, gpt
  from zerojax.train.optim import make_optimizer
  model, mesh = gpt(GPTConfig(256, 128, 128, 4, 4, 4)), zerojax.make_mesh(2, 4)  # base.gin's model
  batch = np.random.default_rng(0).integers(0, 256, (1, 32, 129)).astype(np.int32)
  variants = {"dense": zerojax.mics(compute_dtype="float32"),
              "dense, sync after the window": zerojax.mics(compute_dtype="float32", sync_in_backward=False),
              "radius sparse d=0.4": zerojax.mics(compute_dtype="float32",
                                                  replica_sync=zerojax.radius(density=0.4, period=10 ** 6))}
  runs = {}
  for name, plan in variants.items():
    ex = zerojax.Executor(model, make_optimizer(total_steps=200), dataclasses.replace(plan, pad_multiple=256), mesh)
    state, step, b = ex.init(jax.random.key(0)), ex.step_fn(), jax.device_put(batch, ex.batch_sharding)
    for _ in range(2):  # compile; Radius: the select step, then the sparse one
      state, m = step(state, b)
      float(m.loss)
    runs[name] = [state, step, b]

  def stepper(r):
    def step(i):
      r[0], m = r[1](r[0], r[2])
      float(m.loss)
    return step
  times = interleaved({name: stepper(r) for name, r in runs.items()}, reps, order="fixed")
  return {name: {"median_s": statistics.median(ts), "min_s": min(ts), "reps": reps} for name, ts in times.items()}


def summarize(runs: list[dict], period: int = 200) -> list[dict]:
  rows = []
  dense = [r for r in runs if r["config"] == "dense"]
  t_dense = statistics.median(r["t"] for r in dense) if dense else None
  b_dense = statistics.median(r["bytes"] for r in dense) if dense else None
  for name in dict.fromkeys(r["config"] for r in runs):
    rs = [r for r in runs if r["config"] == name]
    t, b = statistics.median(r["t"] for r in rs), statistics.median(r["bytes"] for r in rs)
    window = t if name == "dense" else (t_dense + (period - 1) * t) / period
    rows.append({"config": name, "reps": len(rs), "T": t, "T_min": min(r["t"] for r in rs),
                 "T_max": max(r["t"] for r in rs), "cross_node_MB_per_step": b / 1e6,
                 "bytes_vs_dense": b / b_dense if b_dense else None,
                 "T_vs_dense": t / t_dense if t_dense else None, "T_window_200": window,
                 "window_vs_dense": window / t_dense if t_dense else None})
  return rows


def markdown(report: dict) -> str:
  lines = [SECTION, "",
           f"{report['date']}, {report['cpus']} CPU cores shared with other jobs, `benchmarks/bench_radius.py "
           f"{' '.join(report['argv'])}`: MiCS (partition group = one node) on {report['nodes']} nodes x "
           f"{report['devices']} devices, links {report['rate']}, default GPT, batch 32, accumulation 1. "
           f"Medians of {report['reps']} interleaved repetitions of {report['steps']} steps (min–max in "
           "brackets); the Radius runs' measured steps are sparse steps. Cross-node MB: measured payload "
           "bytes per step per node on the links. Window of 200: one select step (timed as the dense step) "
           "and 199 sparse steps. (The select step is step 0, where the warm-up's learning rate is 0, so "
           "it keeps the lowest positions: bytes and times do not depend on which.)", "",
           "| replica sync | s/step | vs dense | cross-node MB/step | vs dense | 200-step window vs dense |",
           "|---|---|---|---|---|---|"]
  for r in report["rows"]:
    lines.append(f"| {r['config']} | {r['T']:.3f} [{r['T_min']:.3f}–{r['T_max']:.3f}] | {r['T_vs_dense']:.2f} | "
                 f"{r['cross_node_MB_per_step']:.3f} | {r['bytes_vs_dense']:.3f} | {r['window_vs_dense']:.2f} |")
  if report.get("convergence"):
    lines += ["", f"Convergence after the same budget ({report['convergence'][0]['steps']} steps, one process, 8 "
              "simulated devices; Radius dense for the first 40 steps, then windows of 20 steps):", "",
              "| config | final train loss | final held-out loss | held-out vs dense |", "|---|---|---|---|"]
    base = report["convergence"][0]["final_eval_loss"]
    for c in report["convergence"]:
      lines.append(f"| {c['config']} | {c['final_loss']:.4f} | {c['final_eval_loss']:.4f} | "
                   f"{c['final_eval_loss'] - base:+.4f} |")
  if report.get("overhead"):
    o = report["overhead"]
    lines += ["", f"Compute overhead (one process, no network, {next(iter(o.values()))['reps']} interleaved "
              "steps each, median [min]): " + "; ".join(f"{k} {v['median_s']:.3f} s [{v['min_s']:.3f}]"
                                                         for k, v in o.items()) + "."]
  return "\n".join(lines) + "\n"


# -- before/after: this tree against other checkouts, interleaved ------------------------------------

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--densities", default="0.4,0.1")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--nodes", type=int, default=2)
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--rate", default="100mbit")
  ap.add_argument("--convergence", action="store_true", help="also train 200 steps per config (no cluster)")
  ap.add_argument("--convergence_steps", type=int, default=200)
  ap.add_argument("--overhead", type=int, default=0, help="also time N interleaved steps in one process")
  ap.add_argument("--from_json", default=None, help="reuse this report's cluster and convergence figures")
  ap.add_argument("--json", default=os.path.join(HERE, "radius.json"))
  ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
  ap.add_argument("--compare", action="store_true", help="interleaved before/after runs of this tree and each "
                  "--repo on the cluster (prints JSON; writes --out; not radius.json or RESULTS.md)")
  ap.add_argument("--programs", metavar="OUT", default=None, help="compile the dense/select/sparse programs of "
                  "this tree and each --repo, compare them, write OUT (no cluster)")
  ap.add_argument("--repo", action="append", default=[], help="another checkout to run beside this tree, e.g. a "
                  "git worktree of an older commit (repeatable)")
  ap.add_argument("--density", type=float, default=0.1, help="--compare/--programs: radius.density")
  ap.add_argument("--period", type=int, default=50, help="--compare/--programs: radius.period")
  ap.add_argument("--dense_steps", type=int, default=2, help="--compare/--programs: radius.dense_steps")
  ap.add_argument("--timed_steps", type=int, default=8, help="--compare: sparse steps timed per run")
  ap.add_argument("--port", type=int, default=12355, help="--compare: the cluster's coordinator port")
  ap.add_argument("--smoke", action="store_true", help="--compare/--programs: tiny model; --compare: one "
                  "repetition of two timed steps (checks that it runs)")
  ap.add_argument("--out", default=None, help="--compare: also write the JSON here")
  args = ap.parse_args(argv)
  if args.smoke:
    args.reps, args.timed_steps = 1, 2
  if args.programs:
    report = radius_compare.run_programs(args)
    with open(args.programs, "w") as f:
      json.dump(report, f, indent=1)
    print(json.dumps({"sparse_vs_dense_node_egress": report["sparse_vs_dense_node_egress"],
                      "compare": report["compare"]}, indent=1))
    return 0
  if args.compare:
    report = radius_compare.run_compare(args)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("checkouts", "window", "summary")}, indent=1))
    return 0
  if args.from_json:
    with open(args.from_json) as f:
      report = json.load(f)
    if args.overhead:
      report["overhead"] = run_overhead(args.overhead)
    return _write(report, args)
  if os.geteuid() != 0:
    print("bench_radius: the cluster emulator needs root (network namespaces and tc)", file=sys.stderr)
    return 1
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="zjx-jax-cache-"))
  densities = [float(d) for d in args.densities.split(",") if d]
  start, runs = time.time(), []
  for rep in range(args.reps):
    for name, params in configs(densities).items():
      r = run_cluster(params, args)
      runs.append({"config": name, "rep": rep, "t": r["median_step_time_s"],
                   "bytes": r["cross_node_payload_bytes_per_step_per_node"], "wall_s": r["wall_s"]})
      print(f"bench_radius: rep {rep + 1} {name}: {r['median_step_time_s']:.3f} s/step, "
            f"{r['cross_node_payload_bytes_per_step_per_node'] / 1e6:.3f} MB/step", file=sys.stderr, flush=True)
  report = {"argv": sys.argv[1:] if argv is None else list(argv), "date": datetime.date.today().isoformat(),
            "cpus": os.cpu_count(), "nodes": args.nodes, "devices": args.devices, "rate": args.rate,
            "reps": args.reps, "steps": args.steps, "runs": runs, "rows": summarize(runs)}
  if args.convergence:
    conv = [("dense", "configs/mics.gin", [])] + [
        (f"radius_d{d:g}", "configs/mics_radius.gin", [f"radius.density={d}"]) for d in densities]
    report["convergence"] = []
    for name, gin_file, params in conv:
      report["convergence"].append(run_convergence(name, gin_file, params, args.convergence_steps))
      print(f"bench_radius: convergence {name}: {report['convergence'][-1]}", file=sys.stderr, flush=True)
  report["wall_s"] = time.time() - start
  if args.overhead:
    report["overhead"] = run_overhead(args.overhead)
  return _write(report, args)


def _write(report: dict, args) -> int:
  with open(args.json, "w") as f:
    json.dump(report, f, indent=2)
  write_section(args.results, markdown(report), SECTION)
  print(json.dumps({k: report.get(k) for k in ("rows", "convergence", "overhead")}, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
