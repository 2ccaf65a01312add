"""Convergence: each plan's final held-out loss against its dense reference, seed by seed.

Every run is `train.py` on the default model and data (`configs/base.gin`: a 4-layer byte-level GPT on the
Python standard library's sources, batch 32 x 128) with 8 CPU devices as 2 nodes x 4, in its own process
and a fresh temporary workdir (never a stale checkpoint; no checkpoints written). For every seed
(`train.seed`: the initial parameters and the data order) the dense references and the plans run
interleaved, seed-major: seed 0's references, then seed 0's plans, then seed 1's, ... A plan's gap at a
seed is its final eval loss over its dense reference's at the same seed, in percent; per plan the JSON
holds the per-seed gaps, their mean, min, max and standard deviation, and every run's losses, step time
and wall time, with the corpus, steps, batch, mesh, gin settings, jax version and git commit. A failed run
is recorded with its error and the benchmark goes on; the JSON is rewritten after every run, so a stopped
benchmark keeps what it finished.

The dense reference of a plan is the same plan with its compression off:
  zero3  (configs/zero3.gin): for ZeRO++ and its variants (qwZ, qgZ off; hpZ alone is bitwise ZeRO-3).
  mics   (configs/mics.gin, one node per partition group): for MiCS + Radius (dense replica all-reduce)
         and DiLoCo over MiCS (replicas synced every step).

Plans (`--plans`: names or groups, comma-separated; default the group `default`):
  default:        zeropp, zeropp_int4, mics_radius, diloco_mics (the shipped lossy plans).
  ablation:       ZeRO++'s ablation (ZeRO++ §5.4, Table 5): qwz, hpz, qgz, qwz+hpz, zeropp,
                  zeropp_nonblocked (one scale per shard).
  int4_ablation:  int4 weights and gradients with each fidelity option (docs/fidelity.md): int4, int4+ef,
                  int4+rotate, int4+sr, int4+hops (zeropp_int4 with weight blocks of 256), pairs and
                  triples with +hops.
The ZeRO-3-referenced plans also get their per-step wire bytes per device from their formats (`wire_bytes`).
`--plan_param NAME=VALUE` is added to the plans' runs only (not the references'), to measure a change of
a plan against the same references.

The dense references are deterministic per seed on one machine, so `--references_from PREVIOUS.json` takes
their runs from a previous result file when their spec, steps, evaluation settings and extra gin params
match (each reused row says from which file and commit; `references_reused` lists them, and what was not
reused and why); the others run. `--check_reference NAME:SEED` reruns one reused reference and records its
final eval loss beside the stored one (`reference_check`; a mismatch is recorded, the benchmark goes on).

  python benchmarks/bench_convergence.py [--seeds 3] [--steps 300] [--plans default|ablation|int4_ablation|a,b]
      [--out benchmarks/convergence.json] [--png PNG] [--gin_param NAME=VALUE ...] [--plan_param NAME=VALUE ...]
      [--references_from PREVIOUS.json [--check_reference NAME:SEED]]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import error_text, git  # noqa: E402

# The dense references: a plan's own layout with nothing compressed.
REFERENCES = {
    "zero3": ["configs/zero3.gin"],
    "mics": ["configs/mics.gin"],
}
# name: (reference, [gin file, gin params...])
PLANS = {
    # the shipped lossy plans
    "zeropp": ("zero3", ["configs/zeropp.gin"]),
    "zeropp_int4": ("zero3", ["configs/zeropp_int4.gin"]),
    "mics_radius": ("mics", ["configs/mics_radius.gin", "radius.density=0.4", "radius.period=20",
                             "radius.dense_steps=30"]),
    "diloco_mics": ("mics", ["configs/diloco_mics.gin", "diloco.every=10"]),
    # ZeRO++'s ablation
    "qwz": ("zero3", ["configs/qwz.gin"]),
    "hpz": ("zero3", ["configs/hpz.gin"]),
    "qgz": ("zero3", ["configs/qgz.gin"]),
    "qwz+hpz": ("zero3", ["configs/zeropp.gin", "zeropp.grad_bits=None"]),
    "zeropp_nonblocked": ("zero3", ["configs/zeropp.gin", "zeropp.weight_block=0", "zeropp.grad_block=0"]),
    # int4 weights and gradients, fidelity options
    "int4": ("zero3", ["configs/zeropp.gin", "zeropp.weight_bits=4"]),
    "int4+ef": ("zero3", ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_error_feedback=True"]),
    "int4+rotate": ("zero3", ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.rotate=True"]),
    "int4+sr": ("zero3", ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.stochastic_rounding=True"]),
    "int4+hops": ("zero3", ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)"]),
    "int4+hops+rotate": ("zero3", ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)",
                                   "zeropp.rotate=True"]),
    "int4+hops+sr": ("zero3", ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)",
                               "zeropp.stochastic_rounding=True"]),
    "int4+hops+ef": ("zero3", ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)",
                               "zeropp.grad_error_feedback=True"]),
    "int4+hops+rotate+ef": ("zero3", ["configs/zeropp.gin", "zeropp.weight_bits=4", "zeropp.grad_bits=(8, 4)",
                                      "zeropp.rotate=True", "zeropp.grad_error_feedback=True"]),
}
GROUPS = {
    "default": ["zeropp", "zeropp_int4", "mics_radius", "diloco_mics"],
    "ablation": ["qwz", "hpz", "qgz", "qwz+hpz", "zeropp", "zeropp_nonblocked"],
    "int4_ablation": ["zeropp", "int4", "int4+ef", "int4+rotate", "int4+sr", "int4+hops", "zeropp_int4"],
}

# The mesh of train.py's default on CPUs (2 nodes x 4 devices); the default model's padded parameters.
NODES, GPUS = 2, 4
PARAMS = 937_984


def wire_bytes(spec: list[str], params: int) -> dict:
  """Per-step bytes one device sends, from a ZeRO-3/ZeRO++ config's formats (ring all-gathers,
  all-to-alls; each quantized block of `zeropp.weight_block` / `grad_block` elements, 256 by default, adds a
  4-byte scale; block 0, one scale per shard, counts none): forward gather over all devices (qwZ bits or
  bf16), backward gather (hpZ: bf16 inside the node; else as forward), gradient reduce-scatter (fp32, or
  qgZ's two hops). Returns {"total_MB", "cross_node_MB"} (cross-node: the share of each collective's peers
  on another node, the uniform-peer model of `zerojax.analysis.wire_model`)."""
  gin, kv = os.path.basename(spec[0]), dict(p.split("=", 1) for p in spec[1:])
  w_bits = {"zero3.gin": None, "hpz.gin": None, "qgz.gin": None}.get(gin, 8)
  w_bits = {"zeropp_int4.gin": 4}.get(gin, w_bits)
  w_bits = None if kv.get("zeropp.weight_bits") == "None" else int(kv.get("zeropp.weight_bits", w_bits or 0)) or None
  hpz = gin in ("zeropp.gin", "zeropp_int4.gin", "hpz.gin")
  g = kv.get("zeropp.grad_bits", {"zeropp_int4.gin": "(8, 4)", "zeropp.gin": "4", "qgz.gin": "4"}.get(gin, "None"))
  g_bits = None if g == "None" else (eval(g) if g.startswith("(") else (int(g), int(g)))
  w, w_block, g_block = NODES * GPUS, int(kv.get("zeropp.weight_block", 256)), int(kv.get("zeropp.grad_block", 256))
  fmt = lambda bits, block=g_block: 2.0 if bits is None else bits / 8 + (4 / block if block else 0.0)  # 0: a scale per shard
  cross = lambda k_node, k: (k - k_node) / k  # peers on another node
  fwd = (w - 1) / w * params * fmt(w_bits, w_block)
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


def _operative(config: str, name: str) -> int | str | None:
  """The value of `name` (e.g. 'train.batch_size') in a run's operative config.gin."""
  for line in config.splitlines():
    if line.startswith(name + " = "):
      value = line.split(" = ", 1)[1].strip()
      return int(value) if value.isdigit() else value
  return None


def run(spec: list[str], seed: int, args) -> dict:
  """One train.py run of `spec` ([gin file, gin params...]) at `seed`; a row for the JSON (with `error`
  instead of the losses when it failed), plus `_curve` (the train losses) for the plot."""
  gin_file, *params = spec
  params = params + [f"train.steps={args.steps}", f"train.seed={seed}", f"train.eval_every={args.eval_every}",
                     f"train.eval_batches={args.eval_batches}", "train.checkpoint_every=0",
                     "train.progress=False"] + args.gin_param
  row = {"gin_file": gin_file, "gin_params": params}
  work = tempfile.mkdtemp(prefix="zjx-convergence-")
  t0 = time.time()
  try:
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--gin_file={gin_file}", f"--workdir={work}",
           *[f"--gin_param={p}" for p in params]]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # train.py's default: 8 CPU devices
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout or None)
    if r.returncode:
      tail = [l for l in (r.stderr.strip() or r.stdout.strip()).splitlines()  # without jax's start-up lines
              if not l.startswith("WARNING: All log messages before absl") and "cudart_stub" not in l][-5:]
      raise RuntimeError(f"train.py exit {r.returncode}: " + " | ".join(tail)[-800:])
    with open(os.path.join(work, "summary.json")) as f:
      s = json.load(f)
    with open(os.path.join(work, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    with open(os.path.join(work, "config.gin")) as f:
      config = f.read()
    row.update(final_eval_loss=s["final_eval_loss"], final_loss=s["final_loss"], first_loss=s["first_loss"],
               step=s["step"], status=s["status"], skipped_steps=s["skipped_steps"], plan=s["plan"],
               median_step_time_s=s["median_step_time_s"],
               eval_losses=[[x["step"], x["eval_loss"]] for x in rows if x.get("eval_loss") is not None],
               _curve=[[x["step"], x["loss"]] for x in rows if x.get("loss") is not None],
               _run={"corpus": s["data"], "mesh": s["mesh"], "nodes": s["nodes"], "vocab_size": s["vocab_size"],
                     "batch_size": _operative(config, "train.batch_size"),
                     "seq_len": _operative(config, "model_config.seq_len"),
                     "accum_steps": _operative(config, "train.accum_steps"),
                     "memory_bytes_per_device": (s.get("memory_bytes_per_device") or {}).get("total")})
    if s["final_eval_loss"] is None:
      row["error"] = f"no finite final eval loss (status {s['status']}, step {s['step']})"
  except Exception as e:  # noqa: BLE001  (recorded; the benchmark goes on)
    row["error"] = error_text(e, 1000)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  row["wall_s"] = round(time.time() - t0, 1)
  return row


def summarize(out: dict, params: int) -> dict:
  """Per plan: per-seed gaps over its reference's run of the same seed (percent), their mean, min, max and
  standard deviation; per reference its losses."""
  loss = {(r["name"], r["seed"]): r.get("final_eval_loss") for r in out["runs"] if "error" not in r}
  results, refs = {}, {}
  for name in out["references"]:
    ev = [loss.get((name, s)) for s in out["seeds"]]
    done = [e for e in ev if e is not None]
    refs[name] = {"eval_loss": ev, "mean_eval_loss": statistics.mean(done) if done else None}
    if name == "zero3":
      refs[name]["wire_bytes"] = wire_bytes(REFERENCES[name], params)
  for name in out["plans"]:
    ref = PLANS[name][0]
    ev = [loss.get((name, s)) for s in out["seeds"]]
    base = [loss.get((ref, s)) for s in out["seeds"]]
    gaps = [100 * (e / b - 1) if e is not None and b is not None else None for e, b in zip(ev, base)]
    diffs = [e - b if e is not None and b is not None else None for e, b in zip(ev, base)]
    g = [x for x in gaps if x is not None]
    done = [e for e in ev if e is not None]
    r = {"reference": ref, "seeds": out["seeds"], "eval_loss": ev, "reference_eval_loss": base,
         "gap_pct": gaps, "gap_abs": diffs, "n": len(g),
         "mean_eval_loss": statistics.mean(done) if done else None,
         "mean_gap_pct": statistics.mean(g) if g else None,
         "min_gap_pct": min(g) if g else None, "max_gap_pct": max(g) if g else None,
         "std_gap_pct": statistics.stdev(g) if len(g) > 1 else None}
    if ref == "zero3":
      r["wire_bytes"] = wire_bytes(PLANS[name][1], params)
    results[name] = r
  return {"references_summary": refs, "results": results}


def reuse_references(path: str, refs: list[str], seeds: list[int], args) -> tuple[list[dict], dict, dict]:
  """From a previous result file: the rows of `refs`' runs at `seeds` whose spec, steps, evaluation
  settings and extra gin params match this benchmark's (each with `reused_from`: file and commit), a
  record of what was and was not reused, and the previous file's corpus, mesh and batch."""
  with open(path) as f:
    prev = json.load(f)
  origin = {"file": os.path.relpath(path, ROOT), "git_commit": prev.get("git_commit")}
  ps = prev.get("settings", {})
  mismatch = [k for k, a, b in [("steps", prev.get("steps"), args.steps),
                                ("eval_every", ps.get("eval_every"), args.eval_every),
                                ("eval_batches", ps.get("eval_batches"), args.eval_batches),
                                ("extra_gin_params", ps.get("extra_gin_params"), args.gin_param)] if a != b]
  rows, record = [], {**origin, "reused": {}, "not_reused": {}}
  for name in refs:
    spec = prev.get("references", {}).get(name, {}).get("spec")
    if mismatch or spec != REFERENCES[name]:
      record["not_reused"][name] = f"differs in {mismatch or ['spec']}"
      continue
    got = [r for r in prev["runs"] if r["name"] == name and r["seed"] in seeds and "error" not in r]
    rows += [{**r, "reused_from": r.get("reused_from", origin)} for r in got]
    record["reused"][name] = [r["seed"] for r in got]
  info = {k: prev.get(k) for k in ("corpus", "mesh", "nodes", "batch", "vocab_size")}
  return rows, record, info


def write(out: dict, path: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(out, f, indent=1)
  os.replace(tmp, path)


def plot(curves: dict, path: str, steps: int) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, curve in curves.items():
    ax.plot([c[0] for c in curve], [c[1] for c in curve], label=name, lw=1.8 if name in REFERENCES else 1)
  ax.set(xlabel="step", ylabel="train loss (bytes, nats)", title=f"Loss curves, seed 0, {steps} steps",
         ylim=(None, 3.5))
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seeds", type=int, default=3, help="train.seed = 0 .. N-1")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--plans", default="default",
                  help=f"groups ({', '.join(GROUPS)}) and/or names from {', '.join(PLANS)}, comma-separated")
  ap.add_argument("--out", default=os.path.join(HERE, "convergence.json"))
  ap.add_argument("--png", default=None, help="also plot the train loss curves of seed 0 here")
  ap.add_argument("--eval_every", type=int, default=50)
  ap.add_argument("--eval_batches", type=int, default=16, help="held-out batches of each evaluation")
  ap.add_argument("--timeout", type=int, default=3 * 3600, help="seconds before a run counts as failed (0: none)")
  ap.add_argument("--gin_param", action="append", default=[], help="added to every run (references too)")
  ap.add_argument("--plan_param", action="append", default=[], help="added to the plans' runs only")
  ap.add_argument("--references_from", default=None,
                  help="a previous result JSON: reuse its reference runs where spec, steps and settings match")
  ap.add_argument("--check_reference", default=None,
                  help="NAME:SEED of a reused reference to rerun and compare with the stored final eval loss")
  ap.add_argument("--params", type=int, default=PARAMS,
                  help="padded parameters of the model (the default config's), for the wire bytes")
  args = ap.parse_args(argv)
  plans = list(dict.fromkeys(p for name in args.plans.split(",") if name for p in GROUPS.get(name, [name])))
  unknown = [n for n in plans if n not in PLANS]
  if unknown:
    ap.error(f"unknown plans {unknown}; choose from {sorted(PLANS)} or a group {sorted(GROUPS)}")
  refs = list(dict.fromkeys(PLANS[p][0] for p in plans))
  seeds = list(range(args.seeds))
  commit = git("rev-parse", "HEAD")
  import jax  # only its version: the runs are their own processes
  out = {"benchmark": "convergence", "argv": sys.argv[1:] if argv is None else list(argv),
         "started": datetime.datetime.now().isoformat(timespec="seconds"),
         "git_commit": commit, "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
         "jax": jax.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
         "steps": args.steps, "seeds": seeds,
         "settings": {"model": "configs/base.gin (4-layer byte-level GPT, d_model 128, 4 heads)",
                      "devices": NODES * GPUS, "eval_every": args.eval_every, "eval_batches": args.eval_batches,
                      "checkpoint_every": 0, "extra_gin_params": args.gin_param,
                      "gap": "100 * (plan's final eval loss / its reference's at the same seed - 1)"},
         "references": {r: {"spec": REFERENCES[r]} for r in refs},
         "plans": {p: {"reference": PLANS[p][0], "spec": PLANS[p][1] + args.plan_param} for p in plans},
         "corpus": None, "batch": None, "mesh": None, "runs": []}
  if args.references_from:
    rows, out["references_reused"], info = reuse_references(args.references_from, refs, seeds, args)
    out["runs"] += rows
    if rows:
      out.update(info)
  reused = {(r["seed"], r["name"]) for r in out["runs"]}
  check = None
  if args.check_reference:
    name, seed = args.check_reference.split(":")
    check = (int(seed), name)
    if check not in reused:
      out["reference_check"] = {"name": name, "seed": int(seed), "error": "not a reused reference run"}
      check = None
  order = [(seed, name) for seed in seeds for name in refs + plans  # seed-major: references first
           if (seed, name) not in reused or (seed, name) == check]
  curves, t_start = {}, time.time()
  print(f"bench_convergence: {len(order)} runs ({len(seeds)} seeds x {len(refs)} references + {len(plans)} plans; "
        f"{len(reused)} reference runs reused, {int(check is not None)} rerun as a check), {args.steps} steps "
        f"each, writing {args.out}", file=sys.stderr, flush=True)
  for i, (seed, name) in enumerate(order):
    spec = REFERENCES[name] if name in REFERENCES else PLANS[name][1] + args.plan_param
    print(f"[{i + 1}/{len(order)}] seed {seed} {name} ...", file=sys.stderr, flush=True)
    row = run(spec, seed, args)
    curve, info = row.pop("_curve", None), row.pop("_run", None)
    if (seed, name) == check:  # a reused reference rerun: recorded beside the stored row, which stays
      stored = next(r for r in out["runs"] if (r["seed"], r["name"]) == check)
      rerun = row.get("final_eval_loss")
      out["reference_check"] = {"name": name, "seed": seed, "stored_final_eval_loss": stored["final_eval_loss"],
                                "stored_from": stored["reused_from"], "rerun_final_eval_loss": rerun,
                                "rerun_error": row.get("error"), "rerun_git_commit": commit,
                                "identical": rerun == stored["final_eval_loss"],
                                "abs_diff": None if rerun is None else abs(rerun - stored["final_eval_loss"])}
      write(out, args.out)
      print(f"[{i + 1}/{len(order)}] check of seed {seed} {name}: {out['reference_check']}", file=sys.stderr, flush=True)
      continue
    if info and out["corpus"] is None:
      out["corpus"] = info.pop("corpus")
      out["mesh"], out["nodes"] = info.pop("mesh"), info.pop("nodes")
      out["batch"] = {k: info.pop(k) for k in ("batch_size", "seq_len", "accum_steps")}
      out["vocab_size"] = info.pop("vocab_size")
    if info:
      row["memory_bytes_per_device"] = info.get("memory_bytes_per_device")
    if curve and seed == seeds[0]:
      curves[name] = curve
    out["runs"].append({"seed": seed, "name": name, "role": "reference" if name in REFERENCES else "plan", **row})
    out.update(summarize(out, args.params))
    out["wall_s"] = round(time.time() - t_start, 1)
    write(out, args.out)
    if "error" in row:
      msg = f"FAILED ({row['error'][:300]})"
    else:
      msg = f"eval {row['final_eval_loss']:.4f}, {row['median_step_time_s']:.3f} s/step"
      gap = out["results"].get(name, {}).get("gap_pct", [None] * len(seeds))[seeds.index(seed)]
      if gap is not None:
        msg += f", gap {gap:+.2f}% over {PLANS[name][0]}"
    left = (time.time() - t_start) / (i + 1) * (len(order) - i - 1)
    print(f"[{i + 1}/{len(order)}] seed {seed} {name}: {msg}; {row['wall_s']:.0f} s; "
          f"about {left / 60:.0f} min left", file=sys.stderr, flush=True)
  if args.png and curves:
    plot(curves, args.png, args.steps)
  for name, r in out["results"].items():
    if r["n"]:
      print(f"{name} vs {r['reference']}: gaps {', '.join('-' if g is None else f'{g:+.2f}%' for g in r['gap_pct'])}; "
            f"mean {r['mean_gap_pct']:+.2f}% [{r['min_gap_pct']:+.2f}, {r['max_gap_pct']:+.2f}]"
            + (f", std {r['std_gap_pct']:.2f}" if r["std_gap_pct"] is not None else ""), file=sys.stderr)
  print(json.dumps(out["results"], indent=1))
  return out


if __name__ == "__main__":
  main()
