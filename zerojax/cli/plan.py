"""Picks a plan for a model and a cluster: `python -m zerojax.cli.plan --gin_file=... --profile=P.json`.

Builds the gin config's model as `train.py` would and ranks every point of AMSP's plan space (the shard
degrees and, unless `--degrees_only`, every technique on them; `--lossy` adds int4 weights and Radius) by
predicted step time: each plan's compute (`--compute`, `zerojax.planner.compute`: "uniform", the
default, charges every plan DP's step measured in this process; "anchors" measures DP, ZeRO-1, ZeRO-2
and ZeRO-3 and fits the rest; "measured" or `--measure_compute` measures every plan) plus the profile's
α-β fits of the collectives (only those that span nodes with "anchors"/"measured"), and prints the
table: plan, shard degrees, compute, communication and step seconds, bytes per device (model states +
the compiled step's activations and temporaries), whether it fits `--memory_cap_gb`. `--json` prints the rows as JSON, each
with `T_step_uniform`, the step AMSP's uniform-compute model predicts. Without `--profile` the
collectives are profiled now, on this process's devices.

`--compiled_memory a100` (or h100) compiles the train step of the `--compiled_top` fastest plans the
memory model lets fit for `--mesh` compile-only GPUs of that kind (`zerojax.planner.compiled`; needs
`pip install -e '.[gpu-aot]'`) and decides whether they fit by the compiled per-device peak instead;
those steps compute in the GPUs' dtype (bf16) unless `train.compute_dtype` sets one.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from zerojax import gpu_aot


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gin_file", action="append", required=True, help="gin config of train.py (repeatable)")
  ap.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
  ap.add_argument("--profile", default=None, help="JSON from `python -m zerojax.planner.profile`")
  ap.add_argument("--memory_cap_gb", type=float, default=None, help="per-device memory cap in GiB")
  ap.add_argument("--degrees_only", action="store_true", help="rank the shard degrees only (AMSP as written), "
                  "not the techniques on them (qwZ, hpZ, qgZ, hierarchical gathers, 16-bit reduction)")
  ap.add_argument("--lossy", action="store_true", help="also rank int4 weights and Radius's sparse replica sync")
  ap.add_argument("--compute", default="uniform", choices=("uniform", "anchors", "measured"),
                  help="how each plan's compute is known (default: DP's step, the same for every plan; it "
                  "ranked best on the emulated cluster, benchmarks/RESULTS.md)")
  ap.add_argument("--measure_compute", action="store_true", help="measure every plan's compute (= --compute "
                  "measured; one compile and a few steps per plan)")
  ap.add_argument("--overlap", default="none", choices=("none", "full"),
                  help="step = compute + communication (none) or the larger of the two (full)")
  ap.add_argument("--mesh", default="2x4", help="NODESxGPUS of the cluster to plan for (default 2x4)")
  ap.add_argument("--compiled_memory", default=None, choices=sorted(gpu_aot.TARGETS),
                  help="decide 'fits' for the top plans by their train step compiled for this GPU kind")
  ap.add_argument("--compiled_top", type=int, default=3, help="plans to compile with --compiled_memory")
  ap.add_argument("--json", action="store_true", help="print the ranked rows as JSON")
  args = ap.parse_args(argv)
  if args.compiled_top < 1:
    ap.error(f"--compiled_top {args.compiled_top}: compile at least one plan, e.g. --compiled_top 3")
  if args.compiled_memory:
    try:
      gpu_aot.compile_only_host()
    except gpu_aot.PluginMissing as e:
      raise SystemExit(f"error: --compiled_memory {args.compiled_memory}: {e}") from None
  try:
    nodes, gpus = (int(v) for v in args.mesh.lower().split("x"))
  except ValueError:
    ap.error(f"--mesh {args.mesh!r} is not NODESxGPUS; use e.g. 2x4")
  from zerojax import mesh as mesh_lib
  mesh_lib.request_cpu_devices(nodes * gpus)
  import dataclasses

  from zerojax import planner
  from zerojax.cli.account import gin_executor
  from zerojax.train import trainer
  from zerojax.planner import compute as compute_lib, profile as profile_lib

  built, train_args, cfg = gin_executor(args.gin_file, args.gin_param + ["train.plan=@zero3()"], nodes)
  ex = built.executor
  batch = np.zeros((ex.accum_steps, train_args["batch_size"], cfg.seq_len + 1), np.int32)
  run = {k: ex.plan.settings()[k] for k in trainer.RUN_SETTINGS}  # the run's settings, for every candidate
  make = lambda p: type(ex)(ex.model, ex.user_optimizer, dataclasses.replace(p, **run), ex.mesh,
                            accum_steps=ex.accum_steps)
  work = planner.workload(ex)
  world = nodes * gpus
  if args.compiled_memory and train_args.get("model"):
    raise SystemExit(f"error: --compiled_memory compiles the gin GPT (model_config), not train.model="
                     f"{train_args['model']!r}; drop --compiled_memory for a model of your own")
  if args.compiled_memory and train_args["batch_size"] % world:
    raise SystemExit(f"error: --compiled_memory: train.batch_size={train_args['batch_size']} does not split over "
                     f"{world} GPUs; use a multiple of {world}")
  if args.profile:
    try:
      prof = planner.load_profile(args.profile, nodes, gpus)
    except planner.PlanError as e:
      raise SystemExit(f"error: {e}")
  else:
    prof = profile_lib.profile(ex.mesh, [65536, 524288, 2097152])
  mode = "measured" if args.measure_compute else args.compute
  log = lambda m: print(m, file=sys.stderr, flush=True)
  table = compute_lib.per_plan(make, planner.plan_space(nodes, gpus), nodes, gpus, work, batch, mode=mode, log=log)
  work = dataclasses.replace(work, compute_s=table["dp_s"])
  cap = args.memory_cap_gb * 2**30 if args.memory_cap_gb else None
  rows = planner.rank(nodes, gpus, work, prof, memory_cap_bytes=cap, techniques=not args.degrees_only,
                      lossy=args.lossy, compute=table, overlap=args.overlap)
  if args.compiled_memory:
    from zerojax.planner import compiled
    # the GPUs' compute dtype where the run leaves it to the platform (ex, built on this host, has the CPU's)
    on_gpus = dict(run, compute_dtype=train_args.get("compute_dtype") or trainer.platform_compute_dtype("gpu"))
    memory_of = lambda pt: compiled.memory(pt, ex.model, cfg.seq_len, nodes, gpus, args.compiled_memory,
                                           accum=ex.accum_steps, batch_per_device=train_args["batch_size"] // world,
                                           optimizer=ex.user_optimizer, **on_gpus)
    rows = compiled.check_rows(rows, memory_of, cap, args.compiled_top)
  try:
    best = planner.choose(rows, cap)
  except planner.PlanError as e:
    raise SystemExit(f"error: {e}")
  if args.json:
    print(json.dumps({"chosen": best["plan"], "compute": table, "overlap": args.overlap,
                      "workload": dataclasses.asdict(work), "rows": rows}, indent=2))
  else:
    print(f"mesh {nodes} x {gpus}, compute: {mode} (DP {table['dp_s']:.3f} s/step in this process)")
    print(planner.render(rows, best))
    for r in rows:
      if r.get("fits_by") == "compiled":
        print(f"{r['plan']}: compiled for {args.compiled_memory} GPUs, peak {r['compiled']['peak'] / 2**30:.3f} GiB "
              f"per device (model {r['bytes_per_device'] / 2**30:.3f} GiB): {'fits' if r['fits'] else 'does not fit'}")
    print(f"chosen: {planner.solve.why(rows, best, args.memory_cap_gb)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
