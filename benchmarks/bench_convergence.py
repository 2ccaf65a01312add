"""ZeRO++ convergence ablation (ZeRO++ §5.4, Table 5, Fig. 14): final eval loss of each technique.

Trains the default model on the default data for the same budget with ZeRO-3, qwZ, hpZ, qgZ, qwZ+hpZ,
all three, and all three with non-blocked quantization (one scale per shard), each as its own
`train.py` process, then prints one JSON object and writes a PNG of the loss curves.

  python benchmarks/bench_convergence.py [--steps 200] [--out runs/convergence]
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "zero3": ["configs/zero3.gin"],
    "qwz": ["configs/qwz.gin"],
    "hpz": ["configs/hpz.gin"],
    "qgz": ["configs/qgz.gin"],
    "qwz+hpz": ["configs/zeropp.gin", "zeropp.grad_bits=None"],
    "zeropp": ["configs/zeropp.gin"],
    "zeropp_nonblocked": ["configs/zeropp.gin", "zeropp.weight_block=0", "zeropp.grad_block=0"],
}


def run(name, steps, out, extra):
  gin_file, *params = VARIANTS[name]
  workdir = os.path.join(out, name)
  if os.path.exists(os.path.join(workdir, "summary.json")):
    os.remove(os.path.join(workdir, "summary.json"))
  if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    os.remove(os.path.join(workdir, "metrics.jsonl"))
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--gin_file={gin_file}", f"--workdir={workdir}",
         f"--gin_param=train.steps={steps}", "--gin_param=train.eval_batches=16",
         "--gin_param=train.progress=False"] + [f"--gin_param={p}" for p in params + extra]
  subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    curve = [json.loads(l) for l in f]
  return summary, curve


def plot(curves, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, curve in curves.items():
    ax.plot([r["step"] for r in curve], [r["loss"] for r in curve], label=name, lw=1)
  ax.set(xlabel="step", ylabel="train loss (bytes, nats)", title="ZeRO++ ablation: loss curves", ylim=(None, 3.5))
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--out", default=os.path.join(ROOT, "runs", "convergence"))
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--png", default=os.path.join(ROOT, "benchmarks", "convergence.png"))
  ap.add_argument("--gin_param", action="append", default=[])
  args = ap.parse_args()
  results, curves = {}, {}
  for name in args.variants.split(","):
    summary, curves[name] = run(name, args.steps, args.out, args.gin_param)
    results[name] = {"final_eval_loss": summary["final_eval_loss"], "final_loss": summary["final_loss"],
                     "median_step_time_s": summary["median_step_time_s"]}
    print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
  if "zero3" in results:
    base = results["zero3"]["final_eval_loss"]
    for r in results.values():
      r["eval_loss_vs_zero3"] = r["final_eval_loss"] / base - 1
  plot(curves, args.png)
  print(json.dumps({"benchmark": "zeropp_convergence", "steps": args.steps, "results": results,
                    "png": os.path.relpath(args.png, ROOT)}))


if __name__ == "__main__":
  main()
