"""Variants of one gin config side by side on the emulated cluster: step time and cross-node bytes.

Each variant is the config plus its own gin params. Every repetition runs each variant once as a whole
`cluster.py` run (its own processes and links), in `common.interleaved`'s alternating order, so a slow
phase of the shared machine falls on every variant alike. Per variant:
the median step time over the repetitions with its min and max, the cross-node payload bytes per step per
node, and per repetition its step time over the first variant's (median, min, max). A variant whose run fails is
recorded with its error and left out of the later repetitions; the JSON is rewritten after every run.

  sudo python benchmarks/cluster_variants.py --gin_file configs/zeropp_int4.gin \\
      --variant "blocks 256=zeropp.weight_block=256" --variant "blocks 64=zeropp.weight_block=64" \\
      --rate 100mbit --reps 3 --out benchmarks/int4_blocks_cluster.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster  # noqa: E402
from common import error_text, git, interleaved, spread  # noqa: E402


def run(cluster_argv: list[str], params: list[str]) -> dict:
  """One `cluster.py` run of the config with a variant's gin params: its step time and bytes."""
  out = cluster.run(cluster.parser().parse_args(cluster_argv + [f"--gin_param={p}" for p in params]))
  return {"step_s": out["median_step_time_s"],
          "cross_node_payload_bytes_per_step_per_node": out["cross_node_payload_bytes_per_step_per_node"]}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog="Every other option goes to cluster.py (--gin_file, --rate, --steps, --nodes, ...).")
  ap.add_argument("--variant", action="append", required=True, help="NAME=GIN_PARAM[;GIN_PARAM...]")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out", default=None)
  args, cluster_argv = ap.parse_known_args(argv)
  bad = [v for v in args.variant if "=" not in v]
  if bad:
    ap.error(f"--variant {bad[0]!r} has no '='; write NAME=GIN_PARAM[;GIN_PARAM...], e.g. "
             "'blocks 64=zeropp.weight_block=64'")
  settings = cluster.parser().parse_args(cluster_argv)  # cluster.py's own errors, before any run
  variants = {name: [p for p in params.split(";") if p]
              for name, _, params in (v.partition("=") for v in args.variant)}
  names = list(variants)
  out = {"benchmark": "cluster_variants", "argv": sys.argv[1:] if argv is None else argv,
         "started": datetime.datetime.now().isoformat(), "git_commit": git("rev-parse", "HEAD"),
         "gin_file": settings.gin_file, "variants": variants, "rate": settings.rate, "steps": settings.steps,
         "mesh": {"node": settings.nodes, "gpu": settings.devices}, "runs": [], "errors": []}
  rep = {"r": 0}

  def record(name, _, row):  # the cluster's own step time and bytes (interleaved's wall times are not used)
    out["runs"].append({"rep": rep["r"], "variant": name, **row})
    out["results"] = summarize(out["runs"], names)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(out, f, indent=1)

  interleaved({name: (lambda _, name=name: run(cluster_argv, variants[name])) for name in names}, args.reps,
              before=lambda r: rep.update(r=r), after=record,
              on_error=lambda name, e: out["errors"].append({"rep": rep["r"], "variant": name, "error": error_text(e)}))
  print(json.dumps(out.get("results"), indent=1))
  return out


def summarize(runs: list[dict], names: list[str]) -> dict:
  by = {(r["rep"], r["variant"]): r for r in runs}
  of = lambda xs: spread(xs) if xs else None
  res = {}
  for name in names:
    mine = [r for r in runs if r["variant"] == name]
    ratio = [r["step_s"] / by[(r["rep"], names[0])]["step_s"] for r in mine if (r["rep"], names[0]) in by]
    res[name] = {"step_s": of([r["step_s"] for r in mine]),
                 "cross_node_payload_MB_per_step_per_node": of(
                     [r["cross_node_payload_bytes_per_step_per_node"] / 1e6 for r in mine]),
                 f"step_over_{names[0]}": of(ratio), "n": len(mine)}
  return res


if __name__ == "__main__":
  main()
