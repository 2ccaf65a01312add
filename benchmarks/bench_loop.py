"""The training loop's own cost, before and after it stopped waiting on the host, and the MFU chain.

  python benchmarks/bench_loop.py [--before REV] [--steps 40] [--reps 3] [--out benchmarks/loop.json]

1. Host time per step and data wait. `train.py` on the default model and config (`configs/zero3.gin`, 8 CPU
   devices), the loop of this tree against the loop of `--before` (a git revision, checked out in a
   temporary worktree: the loop that read the loss after every step and built each batch after the step
   returned), interleaved `--reps` times. From each run's wall clock and `metrics.jsonl`: the median step
   time, the wall time per step (the run's steady-state wall clock over its steps), and where recorded the
   data wait. On CPUs the "device" is the host's cores: what should move is the time between steps (the
   batch built beside the step, the read one step late); the step itself cannot.
2. The MFU chain, on a compile-only H100: the metrics' formula (`zerojax.train.run_metrics`) for the 737M
   GPT of the GPU kit (docs/gpu.md: d_model 2048, 12 layers, 16 heads, vocabulary 32,000, sequence 1,024,
   batch 8) at the step time the kit measured on the H100 (114.6 ms), with the peak of the compile-only
   target's device kind: the MFU `metrics.jsonl` would report on that GPU.

Prints JSON; a failed run is recorded, the benchmark goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import error_text, print_and_save, spread  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = {"d_model": 2048, "num_layers": 12, "num_heads": 16, "vocab_size": 32000, "seq_len": 1024, "batch": 8,
       "step_s": 0.1146, "source": "docs/gpu.md: the second H100 run, remat full, 2026-11-26"}


def one_run(tree: str, steps: int) -> dict:
  with tempfile.TemporaryDirectory() as work:
    cmd = [sys.executable, os.path.join(tree, "train.py"), "--gin_file=configs/zero3.gin", f"--workdir={work}",
           f"--gin_param=train.steps={steps}", "--gin_param=train.progress=False", "--gin_param=train.eval_every=0",
           "--gin_param=train.checkpoint_every=0"]
    env = {**os.environ, "PYTHONPATH": tree}
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
      return {"error": out.stderr.strip().splitlines()[-1][:400] if out.stderr.strip() else "failed"}
    recs = [json.loads(l) for l in open(os.path.join(work, "metrics.jsonl"))]
  steady = recs[2:]  # step 1 compiles, step 2 may finish its tail
  wall = (steady[-1]["time"] - recs[1]["time"]) / len(steady)
  row = {"step_time_ms": 1e3 * statistics.median(r["step_time_s"] for r in steady),
         "wall_per_step_ms": 1e3 * wall, "run_s": time.perf_counter() - t0}
  if "data_wait_s" in steady[0]:
    row["data_wait_ms"] = 1e3 * statistics.median(r["data_wait_s"] for r in steady)
  return row


def kit_mfu() -> dict:
  from zerojax import gpu_aot, hardware
  from zerojax.models.gpt import GPTConfig
  from zerojax.train import run_metrics
  from zerojax.train.model_spec import ModelSpec
  kind = gpu_aot.target_field("h100", "device_description_str")
  spec = ModelSpec("gpt", GPTConfig(vocab_size=KIT["vocab_size"], seq_len=KIT["seq_len"], d_model=KIT["d_model"],
                                    num_heads=KIT["num_heads"], num_layers=KIT["num_layers"]))
  rates = run_metrics.Rates(KIT["batch"] * KIT["seq_len"], run_metrics.flops_per_token(spec), 1,
                            hardware.peak_flops(kind))
  return {"device_kind": kind, "flops_per_token": run_metrics.flops_per_token(spec), **KIT,
          **rates.of(KIT["step_s"])}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--before", default=None, help="git revision of the loop before (default: none, after only)")
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  trees = {"after": ROOT}
  tmp = None
  if args.before:
    tmp = tempfile.mkdtemp(prefix="zerojax_before_")
    subprocess.run(["git", "worktree", "add", "--detach", tmp, args.before], cwd=ROOT, check=True,
                   capture_output=True)
    trees["before"] = tmp
  runs = {name: [] for name in trees}
  try:
    for rep in range(args.reps):
      for name, tree in trees.items():
        try:
          row = one_run(tree, args.steps)
        except Exception as e:  # noqa: BLE001 - recorded
          row = {"error": error_text(e)}
        runs[name].append(row)
        print(f"rep {rep} {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
  finally:
    if tmp:
      subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=ROOT, capture_output=True)
  loop = {}
  for name, rows in runs.items():
    ok = [r for r in rows if "error" not in r]
    loop[name] = {k: spread([r[k] for r in ok]) for k in ("step_time_ms", "wall_per_step_ms", "data_wait_ms")
                  if ok and all(k in r for r in ok)}
    loop[name]["runs"] = rows
  result = {"loop": loop, "kit_mfu": kit_mfu(), "steps": args.steps, "reps": args.reps, "before": args.before,
            "machine": f"{os.cpu_count()} cores",
            "command": " ".join(["python", "benchmarks/bench_loop.py"] + sys.argv[1:])}

  def summary(r):
    parts = [f"{n}: wall/step {v['wall_per_step_ms']['median']:.0f} ms" for n, v in r["loop"].items()
             if "wall_per_step_ms" in v]
    k = r["kit_mfu"]
    return "; ".join(parts) + f"; kit 737M GPT at {k['step_s'] * 1e3:.1f} ms: {k['model_tflops_per_device']:.0f} TF/s, MFU {k.get('mfu', 0):.3f}"
  print_and_save(result, summary, args.out)


if __name__ == "__main__":
  main()
