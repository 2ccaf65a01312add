"""ZeRO++ convergence ablation (ZeRO++ §5.4, Table 5, Fig. 14): final eval loss of each technique.

Trains the default model on the default data for the same budget with ZeRO-3, qwZ, hpZ, qgZ, qwZ+hpZ,
all three, and all three with non-blocked quantization (one scale per shard), each as its own
`train.py` process in a fresh workdir (never a stale checkpoint), then prints one JSON object and writes
a PNG of the loss curves.

The int4 ablation (`--variants int4`): int4 weights and int4 gradients (`int4`: ZeRO++ with
weight_bits=4), then each fidelity option alone (`+ef` error feedback, `+rotate`, `+sr` stochastic
rounding, `+hops` int8 intra-node / int4 inter-node), pairs and triples with `+hops`, and the best
combination (`int4_best`, which is `configs/zeropp_int4.gin`: int4 weights and `+hops`), against
ZeRO-3 and ZeRO++'s default. Each variant's per-step wire bytes per
device (all and cross-node) are computed from the plan's formats (`wire_bytes`).

  python benchmarks/bench_convergence.py [--steps 200] [--seeds 0,1,2] [--variants zeropp|int4|a,b,...]
"""
import argparse
import json
import os
import shutil
import statistics
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
    "int4": ["configs/zeropp.gin", "zeropp.weight_bits=4"],
    "int4+ef": ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_error_feedback=True"],
    "int4+rotate": ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.rotate=True"],
    "int4+sr": ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.stochastic_rounding=True"],
    "int4+hops": ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)"],
    "int4+hops+rotate": ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)", "zeropp.rotate=True"],
    "int4+hops+sr": ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)",
                     "zeropp.stochastic_rounding=True"],
    "int4+hops+ef": ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)",
                     "zeropp.grad_error_feedback=True"],
    "int4+hops+rotate+ef": ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)",
                            "zeropp.rotate=True", "zeropp.grad_error_feedback=True"],
    "int4_best": ["configs/zeropp_int4.gin"],
}
GROUPS = {"zeropp": ["zero3", "qwz", "hpz", "qgz", "qwz+hpz", "zeropp", "zeropp_nonblocked"],
          "int4": ["zero3", "zeropp", "int4", "int4+ef", "int4+rotate", "int4+sr", "int4+hops", "int4_best"]}

# The default model's parameters and the mesh of train.py's default (2 nodes x 4 devices).
NODES, GPUS = 2, 4


def wire_bytes(name: str, params: int) -> dict:
  """Per-step bytes one device sends, from the variant's formats (ring all-gathers, all-to-alls; each
  quantized block adds a 4-byte scale): forward gather over all devices (qwZ bits or bf16), backward
  gather (hpZ: bf16 inside the node; else as forward), gradient reduce-scatter (fp32, or qgZ's two
  hops). Returns {"total_MB", "cross_node_MB"} (cross-node: the share of each collective's peers on
  another node, the uniform-peer model of `zerojax.analysis.wire_model`)."""
  kv = dict(p.split("=", 1) for p in VARIANTS[name][1:])
  gin = VARIANTS[name][0]
  w_bits = {"zero3.gin": None, "hpz.gin": None, "qgz.gin": None}.get(os.path.basename(gin), 8)
  w_bits = {"zeropp_int4.gin": 4}.get(os.path.basename(gin), w_bits)
  w_bits = None if kv.get("zeropp.weight_bits") == "None" else int(kv.get("zeropp.weight_bits", w_bits or 0)) or None
  hpz = os.path.basename(gin) in ("zeropp.gin", "zeropp_int4.gin", "hpz.gin")
  g = kv.get("zeropp.grad_bits", {"zeropp_int4.gin": "(8, 4)", "zeropp.gin": "4", "qgz.gin": "4"}.get(
      os.path.basename(gin), "None"))
  g_bits = None if g == "None" else (eval(g) if g.startswith("(") else (int(g), int(g)))
  w, block = NODES * GPUS, 256
  fmt = lambda bits: 2.0 if bits is None else bits / 8 + 4 / block
  cross = lambda k_node, k: (k - k_node) / k  # peers on another node
  fwd = (w - 1) / w * params * fmt(w_bits)
  fwd_x = fwd * cross(GPUS, w) * w / (w - 1)
  bwd, bwd_x = ((GPUS - 1) / GPUS * params * 2.0, 0.0) if hpz else (fwd, fwd_x)
  if g_bits is None:
    grad = (w - 1) / w * params * 4.0
    grad_x = grad * cross(GPUS, w) * w / (w - 1)
  else:
    hop1 = (GPUS - 1) / GPUS * params * fmt(g_bits[0])
    grad_x = (NODES - 1) / NODES * params / GPUS * fmt(g_bits[1])
    grad = hop1 + grad_x
  return {"total_MB": (fwd + bwd + grad) / 1e6, "cross_node_MB": (fwd_x + bwd_x + grad_x) / 1e6}


def run(name, steps, out, extra, seed=0):
  gin_file, *params = VARIANTS[name]
  workdir = os.path.join(out, f"{name}_seed{seed}")
  shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: never resume a stale checkpoint
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--gin_file={gin_file}", f"--workdir={workdir}",
         f"--gin_param=train.steps={steps}", "--gin_param=train.eval_batches=16",
         f"--gin_param=train.seed={seed}",
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
  ap.add_argument("--variants", default="zeropp",
                  help=f"a group ({', '.join(GROUPS)}) or comma-separated names from {', '.join(VARIANTS)}")
  ap.add_argument("--seeds", default="0", help="comma-separated train.seed values, e.g. 0,1,2")
  ap.add_argument("--png", default=os.path.join(ROOT, "benchmarks", "convergence.png"))
  ap.add_argument("--gin_param", action="append", default=[])
  ap.add_argument("--params", type=int, default=937_984,
                  help="padded parameters of the model (the default config's), for the wire bytes")
  args = ap.parse_args()
  names = GROUPS.get(args.variants) or args.variants.split(",")
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    ap.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)} or a group {sorted(GROUPS)}")
  seeds = [int(s) for s in args.seeds.split(",")]
  results, curves = {}, {}
  for seed in seeds:  # seed-major: a cut-short run still has every variant of the first seeds
    for name in names:
      summary, curve = run(name, args.steps, args.out, args.gin_param, seed)
      curves.setdefault(name, curve)
      r = results.setdefault(name, {"final_eval_loss": [], "final_loss": [], **wire_bytes(name, args.params)})
      r["final_eval_loss"].append(summary["final_eval_loss"])
      r["final_loss"].append(summary["final_loss"])
      print(f"{name} seed {seed}: eval {summary['final_eval_loss']:.4f}", file=sys.stderr, flush=True)
  for r in results.values():
    ev = r["final_eval_loss"]
    r["mean_eval_loss"] = statistics.mean(ev)
    r["spread"] = [min(ev), max(ev)]
  if "zero3" in results:
    base = results["zero3"]["final_eval_loss"]
    for r in results.values():  # per seed: the same data order and initialisation as ZeRO-3's run
      r["eval_loss_vs_zero3"] = statistics.mean(e / b - 1 for e, b in zip(r["final_eval_loss"], base))
  plot(curves, args.png)
  print(json.dumps({"benchmark": "zeropp_convergence", "steps": args.steps, "seeds": seeds, "results": results,
                    "png": os.path.relpath(args.png, ROOT)}))


if __name__ == "__main__":
  main()
