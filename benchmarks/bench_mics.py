"""MiCS partition groups against ZeRO-3 and ZeRO++ on the emulated cluster: T beside C and W.

For each cluster shape and accumulation, every plan runs at every link rate and on unshaped links, the
whole set repeated `--reps` times in interleaved order (rep 1 of every plan, then rep 2, ...), so slow
phases of a shared machine fall on all plans alike. Per plan and rate it reports the median step time T
with its min–max, the compute time C (median on unshaped links), the wire time W (measured cross-node
payload bytes per step per node / link rate), T / max(C, W), and the speedup over ZeRO-3 (ratio of the
medians of the same rate).

  sudo python benchmarks/bench_mics.py --shapes 2x4,4x2 --rates 100mbit,1gbit --accum 1,4 --reps 3

Plans per shape: `zero3`, `zeropp`, and MiCS (as in `configs/mics*.gin`: replica all-reduce inside the last
micro-step's backward) for every multi-device group size that divides the
cluster (`mics.group_size` = G/2, G, 2G, ...), plus the 2-node group with a flat gather (`hierarchical
= False`) to compare with the hierarchical one. Prints JSON, writes `benchmarks/mics.json` and the MiCS
section of `benchmarks/RESULTS.md`.

`--set overlap` runs every plan instead (DP, ZeRO-1/2/3, ZeRO-3 with 16-bit gradients, prefetch, ZeRO++,
MiCS with group = node) and adds η = (C + W − T) / min(C, W); `--batches 32,8` repeats the grid per
batch size (a section of its own for batches other than 32):

  sudo python benchmarks/bench_mics.py --set overlap --shapes 2x4 --rates 100mbit,1gbit --accum 1 \
      --batches 32 --reps 3 --json benchmarks/overlap.json

References:
  MiCS: Zhang et al. 2022, §3.2 (group sizes), §3.3 (hierarchical gather), §3.4 (2-hop sync).
  ZeRO: Rajbhandari et al. 2020, §7 (overlap); ZeRO++: Wang et al. 2023, §5 (the 16-bit baseline).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster  # noqa: E402
from common import write_section  # noqa: E402

RATE_BITS = {"mbit": 1e6, "gbit": 1e9, "kbit": 1e3}


def rate_bytes_per_s(rate: str) -> float | None:
  m = re.match(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$", rate)
  return float(m.group(1)) * RATE_BITS[m.group(2)] / 8 if m else None


OVERLAP = {  # --set overlap: every plan, the fair ZeRO-3 baseline and prefetch (the overlap issue's table)
    "dp": ["train.plan=@dp()"],
    "zero1": ["train.plan=@zero1()"],
    "zero2": ["train.plan=@zero2()"],
    "zero3": ["train.plan=@zero3()"],
    "zero3_bf16grad": ["train.plan=@zero3()", "zero3.reduce_dtype='bfloat16'"],
    "zero3_prefetch": ["train.plan=@zero3()", "zero3.prefetch=True"],
    "zero3_bf16grad_prefetch": ["train.plan=@zero3()", "zero3.reduce_dtype='bfloat16'", "zero3.prefetch=True"],
    "zeropp": ["train.plan=@zeropp()"],
    "zeropp_prefetch": ["train.plan=@zeropp()", "zeropp.prefetch=True"],
    "mics_node": ["train.plan=@mics()", "mics.sync_in_backward=True"],
}
TITLES = {"mics": "## MiCS partition groups on the emulated cluster",
          "overlap": "## Overlap: T against C and W for every plan, 16-bit ZeRO-3 and prefetch"}


def plans_for(nodes: int, gpus: int, which: str = "mics") -> dict[str, list[str]]:
  """Config name -> gin params, for every plan compared on a nodes x gpus cluster."""
  if which == "overlap":
    return dict(OVERLAP)
  world = nodes * gpus
  out = {"zero3": ["train.plan=@zero3()"], "zeropp": ["train.plan=@zeropp()"]}
  groups = [g for g in range(2, world + 1) if gpus % g == 0 or (g % gpus == 0 and nodes % (g // gpus) == 0)]
  for g in groups:
    if g == world and g != 2 * gpus:
      continue  # the whole cluster is ZeRO-3 (kept only as the 2-node group of a 2-node cluster)
    out[f"mics_{g}"] = ["train.plan=@mics()", f"mics.group_size={g}", "mics.sync_in_backward=True"]
    if g == 2 * gpus:  # a group of two nodes: the hierarchical gather against the flat one
      out[f"mics_{g}_flat"] = out[f"mics_{g}"] + ["mics.hierarchical=False"]
  return out


def run_one(nodes, gpus, rate, accum, params, args, batch: int = 32) -> dict:
  argv = ["--gin_file=configs/base.gin", f"--nodes={nodes}", f"--devices={gpus}", f"--rate={rate}",
          f"--steps={args.steps}", f"--gin_param=train.accum_steps={accum}", f"--gin_param=train.batch_size={batch}",
          *[f"--gin_param={p}" for p in params + args.gin_param],
          *([f"--timeout={args.run_timeout}"] if getattr(args, "run_timeout", None) else [])]
  return cluster.run(cluster.parser().parse_args(argv))


def summarize(runs: list[dict]) -> list[dict]:
  rows = []
  keys = sorted({(r["shape"], r["batch"], r["accum"], r["plan"]) for r in runs})
  by = lambda **kw: [r for r in runs if all(r[k] == v for k, v in kw.items())]
  for shape, batch, accum, plan in keys:
    c_runs = by(shape=shape, batch=batch, accum=accum, plan=plan, rate="none")
    c = statistics.median(r["t"] for r in c_runs) if c_runs else None
    for rate in sorted({r["rate"] for r in runs if r["rate"] != "none"}):
      rs = by(shape=shape, batch=batch, accum=accum, plan=plan, rate=rate)
      if not rs:
        continue
      t = statistics.median(r["t"] for r in rs)
      bytes_ = statistics.median(r["bytes"] for r in rs)
      w = bytes_ / rate_bytes_per_s(rate)
      base = by(shape=shape, batch=batch, accum=accum, plan="zero3", rate=rate)
      t3 = statistics.median(r["t"] for r in base) if base else None
      rows.append({"shape": shape, "batch": batch, "accum": accum, "plan": plan, "rate": rate, "T": t,
                   "T_min": min(r["t"] for r in rs), "T_max": max(r["t"] for r in rs), "reps": len(rs),
                   "C": c, "W": w, "cross_node_MB_per_step": bytes_ / 1e6,
                   "T_over_max_CW": t / max(c, w) if c else None,
                   "eta": (c + w - t) / min(c, w) if c and min(c, w) > 0 else None,
                   "speedup_vs_zero3": t3 / t if t3 else None})
  return rows


def title(which: str, batches: list[int]) -> str:
  """The RESULTS.md section of a set; runs at other batch sizes than the default 32 get their own."""
  return TITLES[which] + ("" if batches == [32] else f" (batch {', '.join(map(str, batches))})")


def markdown(report: dict) -> str:
  lines = [title(report["set"], report["batches"]), "",
           f"{report['date']}, {report['cpus']} CPU cores, default GPT, `benchmarks/bench_mics.py "
           f"{' '.join(report['argv'])}`. Medians of {report['reps']} interleaved repetitions (min–max in "
           "brackets). C: the same plan's step time on unshaped links; W: measured cross-node payload bytes "
           "per step per node / link rate; T / max(C, W) = 1 is the physical limit; overlap efficiency "
           "η = (C + W − T) / min(C, W) (1: the shorter of compute and wire fully hidden, 0: none).", "",
           "| nodes x gpus | batch | accum | rate | plan | T s/step | C | W | T/max(C,W) | η | cross-node MB/step | vs ZeRO-3 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in report["rows"]:
    if r["C"] is None:  # --no_unshaped: C comes from the invocation this one is merged with
      continue
    lines.append(f"| {r['shape']} | {r['batch']} | {r['accum']} | {r['rate']} | {r['plan']} | "
                 f"{r['T']:.3f} [{r['T_min']:.3f}–{r['T_max']:.3f}] | {r['C']:.3f} | {r['W']:.3f} | {r['T_over_max_CW']:.2f} | {r['eta']:.2f} | "
                 f"{r['cross_node_MB_per_step']:.2f} | {r['speedup_vs_zero3']:.2f}x |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", default="2x4,4x2", help="NODESxGPUS list")
  ap.add_argument("--rates", default="100mbit,1gbit", help="link rates; unshaped runs (C) are added")
  ap.add_argument("--accum", default="1,4", help="train.accum_steps values")
  ap.add_argument("--batches", default="32", help="train.batch_size values")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--no_unshaped", action="store_true", help="skip the unshaped runs (C measured by another "
                  "invocation whose JSON is merged with this one)")
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--set", default="mics", choices=sorted(TITLES), help="which plans: MiCS groups, or the "
                  "overlap table (ZeRO-3 fp32/bf16 gradients, prefetch, ZeRO++)")
  ap.add_argument("--plans", default=None, help="only these plan names (see plans_for)")
  ap.add_argument("--flat_accum", type=int, default=4, help="run the flat-gather variants at this accumulation only")
  ap.add_argument("--gin_param", action="append", default=[])
  ap.add_argument("--json", default=os.path.join(HERE, "mics.json"))
  ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
  args = ap.parse_args(argv)
  if os.geteuid() != 0:
    print("bench_mics: the cluster emulator needs root (network namespaces and tc)", file=sys.stderr)
    return 1
  shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  rates = [r for r in args.rates.split(",") if r] + ([] if args.no_unshaped else ["none"])
  accums = [int(a) for a in args.accum.split(",")]
  batches = [int(b) for b in args.batches.split(",")]
  only = set(args.plans.split(",")) if args.plans else None
  keep = lambda name, accum: (not only or name in only) and (not name.endswith("_flat") or accum == args.flat_accum)
  runs = []
  total = args.reps * len(batches) * sum(
      len(rates) * len([p for a in accums for p in plans_for(*s, args.set) if keep(p, a)]) for s in shapes)
  for rep in range(args.reps):
    for nodes, gpus in shapes:
      for batch, accum in [(b, a) for b in batches for a in accums]:
        for rate in rates:
          for name, params in plans_for(nodes, gpus, args.set).items():
            if not keep(name, accum):
              continue
            r = run_one(nodes, gpus, rate, accum, params, args, batch)
            runs.append({"shape": f"{nodes}x{gpus}", "batch": batch, "accum": accum, "rate": rate, "plan": name,
                         "rep": rep, "t": r["median_step_time_s"],
                         "bytes": r["cross_node_payload_bytes_per_step_per_node"]})
            print(f"bench_mics: [{len(runs)}/{total}] {nodes}x{gpus} batch {batch} accum {accum} {rate} {name}: "
                  f"{r['median_step_time_s']:.3f} s/step", file=sys.stderr, flush=True)
  report = {"argv": sys.argv[1:] if argv is None else list(argv), "date": datetime.date.today().isoformat(),
            "cpus": os.cpu_count(), "reps": args.reps, "set": args.set, "batches": batches, "runs": runs,
            "rows": summarize(runs)}
  with open(args.json, "w") as f:
    json.dump(report, f, indent=2)
  write_section(args.results, markdown(report), title(args.set, batches))
  print(json.dumps(report["rows"], indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
