"""Picks a plan for a model and a cluster: `python -m zerojax.cli.plan --gin_file=... --profile=P.json`.

Builds the gin config's model as `train.py` would, measures its compute once (data parallelism on this
process's devices: no slow link involved) and the activation bytes of its compiled step, then ranks
every point of AMSP's plan space by predicted step time (the profile's α-β fits of each collective over
each group, plus the compute) and prints the table: plan, shard degrees, predicted communication and
step seconds, bytes per device, whether it fits `--memory_cap_gb`. `--json` prints the rows as JSON.
Without `--profile` the collectives are profiled now, on this process's devices.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gin_file", action="append", required=True, help="gin config of train.py (repeatable)")
  ap.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
  ap.add_argument("--profile", default=None, help="JSON from `python -m zerojax.planner.profile`")
  ap.add_argument("--memory_cap_gb", type=float, default=None, help="per-device memory cap in GiB")
  ap.add_argument("--zeropp", action="store_true", help="also rank ZeRO++ variants (qwZ/hpZ/qgZ)")
  ap.add_argument("--mesh", default="2x4", help="NODESxGPUS of the cluster to plan for (default 2x4)")
  ap.add_argument("--json", action="store_true", help="print the ranked rows as JSON")
  args = ap.parse_args(argv)
  try:
    nodes, gpus = (int(v) for v in args.mesh.lower().split("x"))
  except ValueError:
    ap.error(f"--mesh {args.mesh!r} is not NODESxGPUS; use e.g. 2x4")
  from zerojax import mesh as mesh_lib
  mesh_lib.request_cpu_devices(nodes * gpus)
  import dataclasses

  from zerojax import planner, plan as plans
  from zerojax.cli.account import _gin_executor
  from zerojax.planner import profile as profile_lib

  ex, train_args, cfg = _gin_executor(args.gin_file, args.gin_param + ["train.plan=@zero3()"], nodes)
  batch = np.zeros((ex.accum_steps, train_args["batch_size"], cfg.seq_len + 1), np.int32)
  dp = lambda: type(ex)(ex.model, ex.user_optimizer, plans.dp(param_dtype=ex.plan.param_dtype,
                                                         compute_dtype=ex.plan.compute_dtype), ex.mesh,
                        accum_steps=ex.accum_steps)
  compute_s, _ = planner.solve.measure_compute(dp, batch)
  _, temp = planner.solve.measure_compute(lambda: ex, batch, reps=1)
  work = dataclasses.replace(planner.workload(ex), compute_s=compute_s, activation_bytes=temp)
  if args.profile:
    try:
      prof = planner.load_profile(args.profile, nodes, gpus)
    except planner.PlanError as e:
      raise SystemExit(f"error: {e}")
  else:
    prof = profile_lib.profile(ex.mesh, [65536, 524288, 2097152])
  cap = args.memory_cap_gb * 2**30 if args.memory_cap_gb else None
  rows = planner.rank(nodes, gpus, work, prof, memory_cap_bytes=cap, zeropp=args.zeropp)
  try:
    best = planner.choose(rows, cap)
  except planner.PlanError as e:
    raise SystemExit(f"error: {e}")
  if args.json:
    print(json.dumps({"chosen": best["plan"], "compute_s": compute_s, "activation_bytes": temp, "rows": rows},
                     indent=2))
  else:
    print(f"mesh {nodes} x {gpus}, compute {compute_s:.3f} s/step (measured), activations {temp / 1e6:.1f} MB/device")
    print(planner.render(rows, best))
    print(f"chosen: {best['plan']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
