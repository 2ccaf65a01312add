"""Variants of one gin config side by side on the emulated cluster: step time and cross-node bytes.

Each variant is the config plus its own gin params. Every repetition runs each variant once as a whole
`cluster.py` run (its own processes and links), the variants in the given order on even repetitions and
reversed on odd ones, so a slow phase of the shared machine falls on every variant alike. Per variant:
the median step time over the repetitions with its min and max, the cross-node payload bytes per step per
node, and per repetition its step time over the first variant's (median, min, max). A run that fails is
recorded with its error and the benchmark goes on; the JSON is rewritten after every run.

  sudo python benchmarks/cluster_variants.py --gin_file configs/zeropp_int4.gin \\
      --variant "blocks 256=zeropp.weight_block=256" --variant "blocks 64=zeropp.weight_block=64" \\
      --rate 100mbit --reps 3 --out benchmarks/int4_blocks_cluster.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import error_text  # noqa: E402


def spread(xs: list[float]) -> dict | None:
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def run(args, params: list[str]) -> dict:
  cmd = [sys.executable, os.path.join(HERE, "cluster.py"), f"--gin_file={args.gin_file}", f"--rate={args.rate}",
         f"--steps={args.steps}", f"--nodes={args.nodes}", f"--devices={args.devices}",
         *[f"--gin_param={p}" for p in params]]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
  if r.returncode:
    raise RuntimeError(f"cluster.py exit {r.returncode}: " + r.stderr.strip()[-600:])
  out = json.loads(r.stdout)
  return {"step_s": out["median_step_time_s"],
          "cross_node_payload_bytes_per_step_per_node": out["cross_node_payload_bytes_per_step_per_node"]}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gin_file", required=True)
  ap.add_argument("--variant", action="append", required=True, help="NAME=GIN_PARAM[;GIN_PARAM...]")
  ap.add_argument("--rate", default="100mbit")
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--nodes", type=int, default=2)
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--timeout", type=float, default=1800)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  variants = {}
  for v in args.variant:
    name, _, params = v.partition("=")
    variants[name] = [p for p in params.split(";") if p]
  names = list(variants)
  commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
  out = {"benchmark": "cluster_variants", "argv": sys.argv[1:], "started": datetime.datetime.now().isoformat(),
         "git_commit": commit, "gin_file": args.gin_file, "variants": variants, "rate": args.rate,
         "steps": args.steps, "mesh": {"node": args.nodes, "gpu": args.devices}, "runs": [], "errors": []}
  for rep in range(args.reps):
    for name in (names if rep % 2 == 0 else names[::-1]):
      print(f"rep {rep + 1}/{args.reps}: {name} ...", file=sys.stderr, flush=True)
      try:
        out["runs"].append({"rep": rep, "variant": name, **run(args, variants[name])})
      except Exception as e:  # recorded; the benchmark goes on
        out["errors"].append({"rep": rep, "variant": name, "error": error_text(e)})
      out["results"] = summarize(out["runs"], names)
      if args.out:
        with open(args.out, "w") as f:
          json.dump(out, f, indent=1)
  print(json.dumps(out["results"], indent=1))
  return out


def summarize(runs: list[dict], names: list[str]) -> dict:
  by = {(r["rep"], r["variant"]): r for r in runs}
  res = {}
  for name in names:
    mine = [r for r in runs if r["variant"] == name]
    ratio = [r["step_s"] / by[(r["rep"], names[0])]["step_s"] for r in mine if (r["rep"], names[0]) in by]
    res[name] = {"step_s": spread([r["step_s"] for r in mine]),
                 "cross_node_payload_MB_per_step_per_node": spread(
                     [r["cross_node_payload_bytes_per_step_per_node"] / 1e6 for r in mine]),
                 f"step_over_{names[0]}": spread(ratio), "n": len(mine)}
  return res


if __name__ == "__main__":
  main()
