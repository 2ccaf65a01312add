"""A node dies and the others train on: time to detect, time to resume and steps lost on the emulated
cluster (`benchmarks/cluster.py --kill NODE@STEP --restart_after SECONDS`), over repetitions.

For each config, each repetition runs the cluster with the kill and the restart, and (`--baseline_reps`)
the same run uninterrupted, interleaved; the JSON gives per run the loss and rejoin records
(`zerojax.train.report.membership`), the seconds from the kill to the first step trained without the
node, the steps logged, the final node count and eval loss, and per config the medians with their
spread and the final eval loss against the uninterrupted run's. A run that fails is recorded, not raised.
The runs with a kill write the node copies every step (`--replica_every 1`), so that the steps lost measure
the restart, not the copies' cadence.

The cost of the copies on the step (`--copy_reps`, of the first config, `--copy_steps` steps each): the
median step time of uninterrupted runs with the copies off (train.py alone), written every step, and at
the default cadence (`train.replica_every_s`, both under the supervisor, `cluster.py --supervised`);
`copies` in the JSON gives the medians, the seconds one copy adds to its step and the overheads.

  python benchmarks/bench_node_loss.py [--configs configs/mics.gin configs/diloco_mics.gin] [--reps 3] \\
      [--nodes 3 --devices 2 --rate 1gbit --steps 60 --kill 2@20 --restart_after 20] [--copy_reps 3] [--out FILE]

Every plan (the issue's cases: MiCS hung, ZeRO-3 and ZeRO++ killed; ZeRO-3's copies hold a neighbour's part):

  python benchmarks/bench_node_loss.py --configs configs/mics.gin:hang configs/zero3.gin configs/zeropp.gin \\
      --reps 1 --copy_configs configs/zero3.gin --copy_reps 2 --out benchmarks/node_loss_every_plan.json

A `CONFIG:hang` case SIGSTOPs the node (`cluster.py --hang`): the supervisor's watchdog
(`--watchdog_floor`, default here 20 s) finds it. The global batch is 24 sequences (`train.batch_size=24`): it divides 3 x 2 and 2 x 2 devices (the
configs' 32 does not divide 6). Needs root, like cluster.py.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cluster  # noqa: E402
from common import spread  # noqa: E402


def spread_present(values: list) -> dict | None:
  """`spread` of the values that are not None, with their count; None where there are none."""
  values = [v for v in values if v is not None]
  return {**spread(values), "n": len(values)} if values else None


def one_run(args, gin_file: str, kill: str | None, port: int, copies: str | None = None, how: str = "kill") -> dict:
  """One run on the emulated cluster: with a fault at `kill` ("NODE@STEP"; `how` "kill": SIGKILL, "hang":
  SIGSTOP, found by the watchdog) and a restart, uninterrupted, or with `copies` ("off", "every_step",
  "default") for the copies' cost."""
  steps = args.copy_steps if copies else args.steps
  argv = [f"--gin_file={gin_file}", f"--nodes={args.nodes}", f"--devices={args.devices}", f"--rate={args.rate}",
          f"--steps={steps}", f"--port={port}", f"--timeout={args.timeout}",
          *[f"--gin_param={p}" for p in ["train.batch_size=24", *args.gin_param]]]
  if kill:
    argv += [f"--{how}={kill}", f"--restart_after={args.restart_after}",
             f"--gin_param=train.replica_every={args.replica_every}"]
    if how == "hang":
      argv += [f"--watchdog_floor={args.watchdog_floor}"]
  argv += {None: [], "off": [], "default": ["--supervised"],
           "every_step": ["--supervised", "--gin_param=train.replica_every=1"]}[copies]
  workdir = tempfile.mkdtemp(prefix="zjx-node-loss-")
  run_args = cluster.parser().parse_args(argv + [f"--workdir={workdir}"])
  started = time.time()
  try:
    out = cluster.run(run_args)
  except (cluster.ClusterError, ValueError) as e:
    return {"gin_file": gin_file, "kill": kill, "fault": how if kill else None, "copies": copies, "error": str(e)[-2000:],
            "wall_s": time.time() - started}
  finally:
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)
  rec = {"gin_file": gin_file, "kill": kill, "fault": how if kill else None, "wall_s": out["wall_s"], "final_eval_loss": out.get("final_eval_loss"),
         "final_loss": out.get("final_loss"), "median_step_time_s": out["median_step_time_s"]}
  if copies:
    rec["copies"] = copies
  if kill:
    events = (out.get("membership") or {}).get("events", [])
    lost = next((e for e in events if e["kind"] == "node_lost"), None)
    back = next((e for e in events if e["kind"] == "node_rejoined"), None)
    rec.update(final_nodes=out.get("final_nodes"), every_step_logged=out.get("steps_logged") == list(
        range(1, args.steps + 1)), largest_gap_s=out.get("largest_gap_s"), lost=lost, rejoined=back)
    if lost and lost.get("failed") is not None and lost.get("resume_s") is not None:
      rec["kill_to_training_s"] = lost["detected"] + lost["resume_s"] - lost["failed"]
  return rec


def copy_cost(runs: list[dict], every_s: float) -> dict | None:
  """The copies' cost from the `copies` runs: each mode's median step time, the seconds one copy adds to
  its step (every step against off), and that as a share of the step (every step) and of `every_s` (the
  default cadence: one copy per `every_s` seconds)."""
  ok = [r for r in runs if r.get("copies") and "error" not in r]
  if not ok:
    return None
  if len({r["gin_file"] for r in ok}) > 1:  # one entry per config
    return {g: copy_cost([r for r in ok if r["gin_file"] == g], every_s) for g in sorted({r["gin_file"] for r in ok})}
  out = {mode: spread_present([r["median_step_time_s"] for r in ok if r["copies"] == mode])
         for mode in ("off", "every_step", "default")}
  if out["off"] and out["every_step"]:
    per_copy = out["every_step"]["median"] - out["off"]["median"]
    out.update(per_copy_s=per_copy, overhead_every_step=per_copy / out["off"]["median"],
               overhead_default_cadence=max(per_copy, 0.0) / every_s)
  if out["off"] and out["default"]:
    out["measured_overhead_default"] = out["default"]["median"] / out["off"]["median"] - 1
  return out


def summarize(runs: list[dict]) -> dict:
  out = {}
  runs = [r for r in runs if not r.get("copies")]
  for gin_file in sorted({r["gin_file"] for r in runs}):
    mine = [r for r in runs if r["gin_file"] == gin_file and "error" not in r]
    killed, base = [r for r in mine if r["kill"]], [r for r in mine if not r["kill"]]
    ev = lambda kind, key: [r[kind][key] for r in killed if r.get(kind) and r[kind].get(key) is not None]
    base_eval = statistics.median([r["final_eval_loss"] for r in base]) if base else None
    out[gin_file] = {
        "runs": len(killed), "errors": sum(1 for r in runs if r["gin_file"] == gin_file and "error" in r),
        "loss_time_to_detect_s": spread_present(ev("lost", "detect_s")),
        "loss_time_to_resume_s": spread_present(ev("lost", "resume_s")),
        "loss_steps_lost": spread_present(ev("lost", "steps_lost")),
        "kill_to_training_s": spread_present([r.get("kill_to_training_s") for r in killed]),
        "rejoin_time_to_resume_s": spread_present(ev("rejoined", "resume_s")),
        "rejoin_steps_lost": spread_present(ev("rejoined", "steps_lost")),
        "faults": sorted({r.get("fault") or "kill" for r in killed}),
        "every_step_logged": all(r.get("every_step_logged") for r in killed) if killed else None,
        "largest_gap_between_steps_s": spread_present([r.get("largest_gap_s") for r in killed]),
        "final_nodes": sorted({r.get("final_nodes") for r in killed}),
        "final_eval_loss": spread_present([r["final_eval_loss"] for r in killed]),
        "uninterrupted_final_eval_loss": base_eval,
        "eval_loss_vs_uninterrupted": [r["final_eval_loss"] / base_eval - 1 for r in killed] if base_eval else None,
    }
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--configs", nargs="+", default=["configs/mics.gin", "configs/diloco_mics.gin"],
                  help="each CONFIG, or CONFIG:hang for a SIGSTOP found by the watchdog instead of a SIGKILL")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--baseline_reps", type=int, default=1, help="uninterrupted runs per config")
  ap.add_argument("--nodes", type=int, default=3)
  ap.add_argument("--devices", type=int, default=2)
  ap.add_argument("--rate", default="1gbit")
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--kill", default="2@20")
  ap.add_argument("--restart_after", type=float, default=20)
  ap.add_argument("--watchdog_floor", type=float, default=20, help="the supervisor's, for the :hang configs")
  ap.add_argument("--copy_configs", nargs="+", default=None, help="configs whose copies' cost is measured "
                  "(default: the first)")
  ap.add_argument("--replica_every", type=int, default=1, help="train.replica_every of the runs with a kill")
  ap.add_argument("--copy_reps", type=int, default=3, help="runs per mode (off, every step, default) for the copies' "
                  "cost (0: none)")
  ap.add_argument("--copy_steps", type=int, default=30)
  ap.add_argument("--gin_param", action="append", default=[])
  ap.add_argument("--port", type=int, default=12500)
  ap.add_argument("--timeout", type=float, default=1800)
  ap.add_argument("--out", default=None, help="also write the JSON here")
  args = ap.parse_args(argv)
  why = cluster.check_environment()
  if why:
    print(f"bench_node_loss: {why}", file=sys.stderr)
    return 2
  runs, port = [], args.port
  for rep in range(max(args.reps, args.baseline_reps)):
    for case in args.configs:
      gin_file, _, how = case.partition(":")
      for kill in ([args.kill] if rep < args.reps else []) + ([None] if rep < args.baseline_reps else []):
        rec = one_run(args, gin_file, kill, port, how=how or "kill")
        port += 20
        rec["rep"] = rep
        runs.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
  for rep in range(args.copy_reps):
    for gin_file in args.copy_configs or [args.configs[0].partition(":")[0]]:
      for copies in ("off", "every_step", "default"):
        rec = {**one_run(args, gin_file, None, port, copies), "rep": rep}
        port += 20
        runs.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
  from zerojax.train.trainer import train  # the default cadence, as train.py runs it
  every_s = inspect.signature(train).parameters["replica_every_s"].default
  out = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "summary": summarize(runs),
         "copies": copy_cost(runs, every_s), "runs": runs}
  text = json.dumps(out, indent=2)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
