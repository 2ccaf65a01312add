"""DiLoCo over MiCS (`configs/diloco_mics.gin`): what it saves on slow links and what it costs in loss.

  python benchmarks/bench_diloco.py --convergence [--steps 300] [--variants mics,h5,h10,...]
      [--out benchmarks/diloco_convergence.json] [--plot benchmarks/diloco_convergence.png]
      train.py on the default model and data (8 CPU devices as 2 nodes x 4) for `--steps` steps with MiCS
      (group = node) and DiLoCo variants over it; per run the eval losses of metrics.jsonl and the final
      eval loss (summary.json), and its difference from MiCS's. The JSON is rewritten after every run, so
      a stopped sweep keeps what it finished. Variants: mics, h<H> (every=H, fp32), h<H>f<F> (F fragments),
      h<H>int4 / h<H>int8 (quantized outer gradients), lr<x> / m<y> (outer learning rate, momentum),
      ov / ovmix<α> (Streaming DiLoCo's overlap, the mixing factor), and combinations, e.g. h10f4int4,
      h10lr1.0m0, h10f4ovmix0.
  python benchmarks/bench_diloco.py --cluster [--rates 100mbit,1gbit] [--systems mics,zeropp,h10,h50]
      [--reps 3] [--out benchmarks/diloco_cluster.json]
      step time and cross-node bytes per step on the emulated 2 x 4 cluster (`benchmarks/cluster.py`:
      one process per node, links shaped with tc; needs root), the systems interleaved per repetition;
      the window of each DiLoCo run starts after its first sync (whose program compiles there) and spans
      whole sync windows, so its figures are means over inner and outer steps. Systems: mics, zeropp,
      h<H> (DiLoCo over MiCS), h<H>qwz (over MiCS with qwZ). `summarize` gives per rate and system the
      median step time with its spread and the ratios to MiCS and ZeRO++ within each repetition.

Prints the JSON; a run that fails is recorded with its error (never a stop).

References:
  DiLoCo: Douillard et al. 2023, §4 (H, the outer optimizer). Streaming DiLoCo: Douillard et al. 2025, §2.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def variant_params(name: str) -> tuple[str, list[str]]:
  """(gin file, gin params) of a variant name (see the module docstring)."""
  if name == "mics":
    return "configs/mics.gin", []
  if name == "zeropp":
    return "configs/zeropp.gin", []
  m = re.fullmatch(r"h(\d+)(?:f(\d+))?(int4|int8)?(?:lr([\d.]+))?(?:m([\d.]+))?(?:ov(?:mix([\d.]+))?)?(qwz)?", name)
  if not m:
    raise ValueError(f"variant {name!r}: use mics, zeropp or h<H>[f<F>][int4|int8][lr<outer lr>][m<momentum>]"
                     "[ov[mix<alpha>]][qwz], e.g. h10f4int4, h10lr1.0m0, h10f4ovmix0")
  every, frags, bits, lr, mom, mix, qwz = m.groups()
  params = [f"diloco.every={every}", f"diloco.fragments={frags or 1}",
            f"diloco.bits={bits[3:] if bits else None}"]
  params += [f"diloco.lr={lr}"] * bool(lr) + [f"diloco.momentum={mom}"] * bool(mom)
  if "ov" in name:
    params += ["diloco.overlap=True"] + [f"diloco.mix={mix}"] * bool(mix)
  return "configs/diloco_mics.gin", params + (["mics.weight_bits=8"] if qwz else [])


def convergence(args) -> dict:
  out = {"steps": args.steps, "model": "configs/base.gin (4-layer byte-level GPT, d_model 128)",
         "mesh": "2 x 4 CPU devices, one process", "runs": {}}
  for name in args.variants.split(","):
    gin_file, params = variant_params(name)
    with tempfile.TemporaryDirectory() as work:
      cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--gin_file={gin_file}", f"--workdir={work}",
             f"--gin_param=train.steps={args.steps}", "--gin_param=train.progress=False",
             f"--gin_param=train.eval_every={args.eval_every}", "--gin_param=train.checkpoint_every=0",
             *[f"--gin_param={p}" for p in params]]
      t0 = time.time()
      r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
      row = {"gin_file": gin_file, "gin_params": params, "wall_s": round(time.time() - t0, 1)}
      if r.returncode:
        row["error"] = r.stderr.strip().splitlines()[-1][:400] if r.stderr.strip() else f"exit {r.returncode}"
      else:
        summary = json.load(open(os.path.join(work, "summary.json")))
        rows = [json.loads(line) for line in open(os.path.join(work, "metrics.jsonl"))]
        row.update(final_eval_loss=summary["final_eval_loss"], plan=summary["plan"],
                   eval_losses=[(x["step"], x["eval_loss"]) for x in rows if "eval_loss" in x],
                   median_step_time_s=summary.get("median_step_time_s"))
    out["runs"][name] = row
    print(json.dumps({"variant": name, **{k: row.get(k) for k in ("final_eval_loss", "error", "wall_s")}}),
          file=sys.stderr, flush=True)
    base = out["runs"].get("mics", {}).get("final_eval_loss")
    for r_ in out["runs"].values():
      if base is not None and r_.get("final_eval_loss") is not None:
        r_["over_mics"] = r_["final_eval_loss"] - base
    if args.out:
      with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
  if args.plot:
    plot(out, args.plot)
  return out


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, r in result["runs"].items():
    if "eval_losses" in r:
      steps, losses = zip(*r["eval_losses"])
      ax.plot(steps, losses, label=f"{name} ({r['final_eval_loss']:.3f})", lw=2.2 if name == "mics" else 1.2,
              color="black" if name == "mics" else None)
  ax.set_xlabel("step")
  ax.set_ylabel("held-out loss")
  ax.set_title(f"DiLoCo over MiCS (2 nodes x 4), {result['steps']} steps: outer sync every H steps")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def cluster_runs(args) -> dict:
  import cluster

  out = {"rates": args.rates.split(","), "reps": args.reps, "runs": []}
  for rep in range(args.reps):
    systems = args.systems.split(",")
    for rate in out["rates"]:
      for name in (systems if rep % 2 == 0 else systems[::-1]):
        gin_file, params = variant_params(name.replace("qwz", "") if name == "micsqwz" else name)
        every = int(re.match(r"h(\d+)", name).group(1)) if name.startswith("h") else 0
        # DiLoCo: the window starts after the first sync (its program compiles there) and spans whole windows
        start = every + 1 if every else 2
        window = max(every, 10) * (2 if every and every < 20 else 1)
        steps = start + window + 2
        argv = [f"--gin_file={gin_file}", *[f"--gin_param={p}" for p in params + ["train.accum_steps=1",
                "train.eval_every=0", "train.checkpoint_every=0"]],
                "--rate", rate, "--steps", str(steps), "--from_step", str(start), "--to_step", str(start + window)]
        try:
          row = cluster.run(cluster.parser().parse_args(argv))
          row = {k: row[k] for k in ("median_step_time_s", "cross_node_bytes_per_step_per_node",
                                     "cross_node_payload_bytes_per_step_per_node", "window", "plan")}
          row["mean_step_time_s"] = row["window"]["seconds"] / row["window"]["steps"]
        except Exception as e:  # noqa: BLE001  (recorded, the others go on)
          row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        row.update(system=name, rate=rate, rep=rep)
        out["runs"].append(row)
        print(json.dumps({k: row.get(k) for k in ("system", "rate", "mean_step_time_s",
                                                  "cross_node_bytes_per_step_per_node", "error")}),
              file=sys.stderr, flush=True)
        if args.out:
          with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
  out.update(summarize(out["runs"]))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return out


def summarize(runs: list) -> dict:
  """Per rate and system: the step time's median and spread over the repetitions, the bytes a node sends
  per step, and the step time over MiCS's and over ZeRO++'s of the same repetition (median and spread)."""
  from common import spread

  ok = [r for r in runs if "error" not in r]
  time_of = {(r["rate"], r["system"], r["rep"]): r["mean_step_time_s"] for r in ok}
  out = {}
  for rate in sorted({r["rate"] for r in ok}):
    for system in dict.fromkeys(r["system"] for r in ok if r["rate"] == rate):
      mine = [r for r in ok if r["rate"] == rate and r["system"] == system]
      row = {"mean_step_time_s": spread([r["mean_step_time_s"] for r in mine]),
             "cross_node_bytes_per_step_per_node": statistics.median(r["cross_node_bytes_per_step_per_node"]
                                                                     for r in mine), "reps": len(mine)}
      for base in ("mics", "zeropp"):
        ratios = [r["mean_step_time_s"] / time_of[(rate, base, r["rep"])] for r in mine
                  if (rate, base, r["rep"]) in time_of]
        if ratios and system != base:
          row[f"over_{base}"] = spread(ratios)
      out.setdefault(rate, {})[system] = row
  return {"summary": out}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--convergence", action="store_true")
  ap.add_argument("--cluster", action="store_true")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--eval_every", type=int, default=50)
  ap.add_argument("--variants", default="mics,h5,h10,h20,h50,h10f4,h10int4,h50f4int4")
  ap.add_argument("--systems", default="mics,zeropp,h10,h50,h10qwz")
  ap.add_argument("--rates", default="100mbit,1gbit")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out", default=None)
  ap.add_argument("--plot", default=None)
  args = ap.parse_args(argv)
  result = cluster_runs(args) if args.cluster else convergence(args)
  print(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
