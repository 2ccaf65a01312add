"""Radius before and after a change: the dense/select/sparse programs compared (`--programs`) and the
sparse step timed against dense MiCS on the emulated cluster for this tree and other checkouts
(`--compare`), as `benchmarks/bench_radius.py --compare/--programs` runs them.

The timed window starts after the select step and the first sparse step (both compile on first use, and
the select step moves a dense all-reduce) and ends before the next select step, so it holds sparse steps
only.

References:
  Radius: Zheng & Zhang, §6.2, §6.3. MiCS: Zhang et al. 2022, §3.4.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster  # noqa: E402
from common import spread  # noqa: E402

SMOKE_MODEL = ["model_config.seq_len=16", "model_config.d_model=32", "model_config.num_heads=2",
               "model_config.num_layers=2"]  # tests/golden_configs.py's tiny model
PHASES = ("dense", "select", "sparse")


def checkouts(repos: list[str]) -> list[dict]:
  """This tree, then each `--repo`, with the commit each holds (`+dirty`: tracked files changed)."""
  out, seen = [], set()
  for path in [cluster.REPO] + [os.path.abspath(r) for r in repos]:
    if not os.path.isfile(os.path.join(path, "train.py")) or not os.path.isdir(os.path.join(path, "zerojax")):
      raise SystemExit(f"bench_radius: {path} is not a zerojax checkout (no train.py and zerojax/)")
    git = lambda *a: subprocess.run(["git", "-C", path, *a], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or None
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    label = (commit or os.path.basename(path)) + ("+dirty" if dirty else "")
    label = label if label not in seen else f"{label}@{path}"
    seen.add(label)
    out.append({"label": label, "path": path, "commit": commit, "dirty": dirty})
  return out


def compare_configs(args) -> dict[str, tuple[str, list[str]]]:
  """`{name: (gin file, gin params)}`: dense MiCS and the issue's MiCS + Radius, accumulation 1."""
  common = ["train.accum_steps=1"] + (SMOKE_MODEL if args.smoke else [])
  radius = [f"radius.density={args.density}", f"radius.period={args.period}", f"radius.dense_steps={args.dense_steps}"]
  return {"dense": ("configs/mics.gin", common), "radius": ("configs/mics_radius.gin", common + radius)}


def compare_window(args) -> tuple[int, int, int]:
  """(from_step, to_step, steps) of `cluster.py`: a row of metrics.jsonl logged as step s is the step
  that ran as step s - 1, and the window times rows from_step + 1 .. to_step. Steps 0 .. dense_steps - 1
  are dense, dense_steps selects and dense_steps + 1 is the first sparse step (both compile on first
  use), so the window starts at row dense_steps + 2; it ends before the next select step and before the
  run's last step (its checkpoint and evaluation)."""
  start = args.dense_steps + 2
  end = start + args.timed_steps
  if end - 1 >= args.dense_steps + args.period:
    raise SystemExit(f"bench_radius: --timed_steps {args.timed_steps} reaches the next select step (step "
                     f"{args.dense_steps + args.period}); use fewer steps or a longer --period")
  return start, end, end + 1


_RUN_CLUSTER = """import json, sys
sys.path.insert(0, {here!r})
import cluster
cluster.REPO = {repo!r}  # train.py and its working directory: the checkout's
sys.exit(cluster.main(json.loads({argv!r})))
"""


def run_checkout(checkout: dict, gin_file: str, params: list[str], args, workdir: str) -> dict:
  """One emulated-cluster run of `checkout`'s train.py (a subprocess with the checkout's PYTHONPATH);
  cluster.py's JSON plus the window's step times from metrics.jsonl."""
  start, end, steps = compare_window(args)
  argv = [f"--gin_file={gin_file}", f"--nodes={args.nodes}", f"--devices={args.devices}", f"--rate={args.rate}",
          f"--steps={steps}", f"--from_step={start}", f"--to_step={end}", f"--workdir={workdir}",
          f"--port={args.port}", *[f"--gin_param={p}" for p in params]]
  env = {**os.environ, "PYTHONPATH": checkout["path"]}
  code = _RUN_CLUSTER.format(here=HERE, repo=checkout["path"], argv=json.dumps(argv))
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=checkout["path"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    stdout, stderr = proc.communicate()
  finally:  # stopped (Ctrl-C, SIGTERM): cluster.py removes its namespaces and processes on SIGTERM
    if proc.poll() is None:
      proc.terminate()
      proc.wait()
  if proc.returncode:
    raise RuntimeError(f"{checkout['label']} {gin_file}: cluster run failed:\n{(stdout + stderr)[-3000:]}")
  out = json.loads(stdout[stdout.index("{"):])
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      rows[row["step"]] = row
  out["times"] = [rows[s]["step_time_s"] for s in range(start + 1, end + 1)]
  return out


def _spread(xs: list[float]) -> dict:
  xs = sorted(xs)
  q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
  return {**spread(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def summarize_compare(runs: list[dict], labels: list[str]) -> dict:
  """Per checkout: the sparse and dense step (median and min-max over the runs' medians; quartiles of
  every window step), sparse/dense per repetition, bytes; the sparse step against the first checkout."""
  out = {}
  for label in labels:
    mine = [r for r in runs if r["checkout"] == label]
    row = {}
    for cfg in ("radius", "dense"):
      rs = [r for r in mine if r["config"] == cfg]
      if not rs:
        continue
      runs_t = _spread([r["t"] for r in rs])
      row["sparse" if cfg == "radius" else "dense"] = {
          "s_per_step": runs_t["median"], "runs_min": runs_t["min"], "runs_max": runs_t["max"],
          "steps": _spread([t for r in rs for t in r["times"]]),
          "bytes_per_step_per_node": statistics.median(r["bytes"] for r in rs)}
    paired = {}
    for r in mine:
      paired.setdefault(r["rep"], {})[r["config"]] = r
    ratios = [p["radius"]["t"] / p["dense"]["t"] for p in paired.values() if {"radius", "dense"} <= set(p)]
    if ratios:
      row["sparse_vs_dense"] = {**_spread(ratios), "per_rep": ratios}
    if "sparse" in row and "dense" in row:
      row["bytes_sparse_vs_dense"] = row["sparse"]["bytes_per_step_per_node"] / row["dense"]["bytes_per_step_per_node"]
    out[label] = row
  first = out.get(labels[0], {}).get("sparse")
  for label in labels[1:]:
    other = out[label].get("sparse")
    if first and other:
      out[label]["sparse_vs_" + labels[0]] = other["s_per_step"] / first["s_per_step"]
      out[labels[0]]["sparse_vs_" + label] = first["s_per_step"] / other["s_per_step"]
  return out


def _stop(signum, _frame):
  raise KeyboardInterrupt(f"signal {signum}")


def run_compare(args) -> dict:
  """The interleaved before/after runs (see the module docstring); returns the report."""
  if os.geteuid() != 0:
    raise SystemExit("bench_radius: the cluster emulator needs root (network namespaces and tc)")
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="zjx-jax-cache-"))
  trees, configs_ = checkouts(args.repo), compare_configs(args)
  order = [(c, name) for c in trees for name in configs_]
  start, end, steps = compare_window(args)
  runs, began = [], time.time()
  signal.signal(signal.SIGTERM, _stop)  # SIGTERM as Ctrl-C: the running cluster is stopped and cleaned up
  with tempfile.TemporaryDirectory(prefix="zjx-radius-cmp-") as tmp:
    for rep in range(args.reps):
      for c, name in (order if rep % 2 == 0 else order[::-1]):  # alternate: drift hits both alike
        gin_file, params = configs_[name]
        workdir = os.path.join(tmp, f"{rep}-{len(runs)}")
        r = run_checkout(c, gin_file, params, args, workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        runs.append({"checkout": c["label"], "config": name, "rep": rep, "t": r["median_step_time_s"],
                     "times": r["times"], "bytes": r["cross_node_payload_bytes_per_step_per_node"],
                     "wall_s": r["wall_s"], **({"warning": r["warning"]} if "warning" in r else {})})
        print(f"bench_radius: rep {rep + 1} {c['label']} {name}: {r['median_step_time_s']:.3f} s/step "
              f"[{min(r['times']):.3f}-{max(r['times']):.3f}], "
              f"{r['cross_node_payload_bytes_per_step_per_node'] / 1e6:.3f} MB/step", file=sys.stderr, flush=True)
  return {"argv": sys.argv[1:], "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
          "smoke": args.smoke, "nodes": args.nodes, "devices": args.devices, "rate": args.rate, "reps": args.reps,
          "checkouts": trees, "configs": {k: {"gin_file": f, "gin_params": p} for k, (f, p) in configs_.items()},
          "window": {"from_step": start, "to_step": end, "steps": steps, "timed_steps": args.timed_steps,
                     "ran_as_steps": [start, end - 1]},
          "summary": summarize_compare(runs, [c["label"] for c in trees]), "runs": runs,
          "wall_s": time.time() - began}


# -- the compiled programs of every checkout ----------------------------------------------------------

def dump_programs(out_dir: str, gin_file: str, params: list[str], nodes: int, run_steps: int) -> None:
  """In a checkout's own process (its zerojax on PYTHONPATH, 8 CPU devices): runs `run_steps` steps of
  `gin_file`'s config through the phases (each step's phase, loss, Python calls of the step call), then
  writes each phase's optimized HLO and XLA's cost analysis to `out_dir` (the programs the run compiled,
  loaded again from a private compilation cache). Only APIs every checkout since cbbe03c has."""
  import gin
  import jax
  import numpy as np
  import zerojax
  from zerojax.cli import account
  cache = tempfile.mkdtemp(prefix="zjx-radius-programs-")  # the run's programs, loaded again by lower()
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  build = getattr(account, "gin_executor", None) or getattr(account, "_gin_executor")
  ex, targs, _ = build([gin_file], params, nodes)
  ex = getattr(ex, "executor", ex)  # gin_executor returns the trainer's `Built` since d49fd22
  seq = gin.query_parameter("model_config.seq_len")
  shape = (targs["accum_steps"], targs["batch_size"], seq + 1)
  rng = np.random.default_rng(0)
  meta = {"zerojax": os.path.dirname(zerojax.__file__), "mesh": {k: int(v) for k, v in ex.mesh.shape.items()},
          "batch_shape": list(shape), "steps": []}
  state, step = ex.init(jax.random.key(0)), ex.step_fn()
  for i in range(run_steps):
    batch = jax.device_put(rng.integers(0, 256, shape).astype(np.int32), ex.batch_sharding)
    phase, calls = ex.phase(state), [0]

    def count(frame, event, arg):
      if event == "call":
        calls[0] += 1
    sys.setprofile(count)
    state, m = step(state, batch)
    loss = float(m.loss)
    sys.setprofile(None)
    meta["steps"].append({"step": i, "phase": phase, "loss": loss,
                          "loss_bits": hex(int(np.float32(loss).view(np.uint32))), "python_calls": calls[0]})
  batch = ex.shard_batch(np.zeros(shape, np.int32))
  meta["phases"] = {}
  for phase in PHASES:  # the Radius config: each phase's program
    compiled = step.lower(state, batch, phase=phase).compile()
    with open(os.path.join(out_dir, f"{phase}.hlo"), "w") as f:
      f.write(compiled.as_text())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    meta["phases"][phase] = {k: float(v) for k, v in (cost or {}).items() if "{" not in k}
  with open(os.path.join(out_dir, "meta.json"), "w") as f:
    json.dump(meta, f)
  shutil.rmtree(cache, ignore_errors=True)


_DUMP = """import json, sys
sys.path.insert(0, {here!r})
import radius_compare
radius_compare.dump_programs({out!r}, {gin_file!r}, json.loads({params!r}), {nodes}, {steps})
"""

KINDS = {"fusion": ("fusion",), "sort": ("sort",), "top-k": ("topk",), "gather": ("gather",),
         "scatter": ("scatter",), "copy": ("copy", "copy-start"), "transpose": ("transpose",),
         "while": ("while",), "dynamic-slice": ("dynamic-slice",), "dynamic-update-slice": ("dynamic-update-slice",),
         "dot": ("dot",), "custom-call": ("custom-call",)}


def program_facts(text: str, cost: dict, mesh_shape: tuple[int, int]) -> dict:
  """What `--programs` records of one optimized HLO text (this tree's analysis reads every checkout's)."""
  if cluster.REPO not in sys.path:
    sys.path.insert(0, cluster.REPO)  # this tree's analysis reads every checkout's programs
  import jax
  import hlo_fingerprint
  from zerojax.analysis import collectives_from_hlo
  from zerojax.analysis.hlo_text import Module
  mod = Module(text)
  fused = {m.group(1) for instrs in mod.comps.values() for i in instrs if i.opcode == "fusion"
           for m in [re.search(r"calls=%?([^\s,}]+)", i.attrs)] if m}
  scheduled, inside, executed = {}, {}, {}
  for comp, instrs in mod.comps.items():
    for i in instrs:
      op = "topk" if i.opcode == "custom-call" and "topk" in i.attrs.lower() else i.opcode
      kind = next((k for k, ops in KINDS.items() if op in ops), None)
      if kind is None:
        continue
      where = inside if comp in fused else scheduled
      where[kind] = where.get(kind, 0) + 1
      if comp not in fused:
        executed[kind] = executed.get(kind, 0) + mod.count(comp)
  mesh = jax.sharding.AbstractMesh(mesh_shape, ("node", "gpu"))
  colls = [{"op": c.op, "hlo_op": c.hlo_op, "dtype": c.dtype, "hlo_dtype": c.hlo_dtype,
            "result_shapes": [list(x) for x in c.result_shapes], "replica_groups": [list(g) for g in c.replica_groups],
            "axes": list(c.axes), "executions": c.count, "bytes_per_device": c.bytes_per_device,
            "node_egress_bytes": c.node_egress_bytes, "role": c.role} for c in collectives_from_hlo(text, mesh)]
  norm = hlo_fingerprint.normalize(text)
  return {"sha256_normalized": hashlib.sha256(norm.encode()).hexdigest(), "hlo_lines": len(norm.splitlines()),
          "ops_scheduled": scheduled, "ops_scheduled_executions": executed, "ops_inside_fusions": inside,
          "cost_analysis": {"bytes_accessed": cost.get("bytes accessed"), "flops": cost.get("flops"),
                            "transcendentals": cost.get("transcendentals")},
          "collectives": colls,
          "node_egress_bytes": sum(c["node_egress_bytes"] * c["executions"] for c in colls),
          "bytes_per_device": sum(c["bytes_per_device"] * c["executions"] for c in colls)}


def _differences(a: dict, b: dict) -> dict:
  """The fields of two `program_facts` that differ (`{field: [a, b]}`)."""
  out = {}
  for key in a.keys() | b.keys():
    if a.get(key) != b.get(key):
      if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
        out[key] = {k: [a[key].get(k), b[key].get(k)] for k in a[key].keys() | b[key].keys()
                    if a[key].get(k) != b[key].get(k)}
      else:
        out[key] = [a.get(key), b.get(key)] if key != "collectives" else "differ (see programs)"
  return out


def run_programs(args) -> dict:
  """`--programs`: every checkout's programs of the Radius config (see the module docstring)."""
  trees = checkouts(args.repo)
  gin_file, params = compare_configs(args)["radius"]
  run_steps = args.dense_steps + 4  # dense..., select, first sparse, two steady sparse steps
  env = {**{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")},
         "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.nodes * args.devices}"}
  programs, runs = {}, {}
  with tempfile.TemporaryDirectory(prefix="zjx-radius-programs-") as tmp:
    for c in trees:
      out = os.path.join(tmp, c["label"].replace("/", "_"))
      os.makedirs(out)
      code = _DUMP.format(here=HERE, out=out, gin_file=gin_file, params=json.dumps(params), nodes=args.nodes,
                          steps=run_steps)
      r = subprocess.run([sys.executable, "-c", code], cwd=c["path"], env={**env, "PYTHONPATH": c["path"]},
                         capture_output=True, text=True)
      if r.returncode:
        raise RuntimeError(f"{c['label']}: compiling the programs failed:\n{(r.stdout + r.stderr)[-3000:]}")
      with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
      if not meta["zerojax"].startswith(c["path"]):
        raise RuntimeError(f"{c['label']}: imported {meta['zerojax']}, not the checkout's zerojax")
      programs[c["label"]] = {p: program_facts(open(os.path.join(out, f"{p}.hlo")).read(), cost,
                                               (args.nodes, args.devices)) for p, cost in meta["phases"].items()}
      runs[c["label"]] = {"mesh": meta["mesh"], "batch_shape": meta["batch_shape"], "steps": meta["steps"]}
      print(f"bench_radius: programs of {c['label']}: "
            + ", ".join(f"{p} {v['sha256_normalized'][:12]}" for p, v in programs[c['label']].items()),
            file=sys.stderr, flush=True)
  first = trees[0]["label"]
  compare = {}
  for c in trees[1:]:
    other = c["label"]
    compare[f"{other} -> {first}"] = {
        "programs": {p: (_differences(programs[other][p], programs[first][p]) or "identical")
                     for p in programs[first] if p in programs[other]},
        "losses_bitwise_equal": [s["loss_bits"] for s in runs[other]["steps"]]
                                == [s["loss_bits"] for s in runs[first]["steps"]],
        "python_calls_per_step": {"before": [s["python_calls"] for s in runs[other]["steps"]],
                                  "after": [s["python_calls"] for s in runs[first]["steps"]]}}
  dense, sparse = (programs[first].get(p, {}).get("node_egress_bytes") for p in ("dense", "sparse"))
  report = {"argv": sys.argv[1:], "date": datetime.date.today().isoformat(), "checkouts": trees,
            "config": {"gin_file": gin_file, "gin_params": params,
                       "mesh": f"{args.nodes} x {args.devices} CPU devices, one process",
                       "model": "tiny (SMOKE_MODEL)" if args.smoke else "train.py's default GPT"},
            "sparse_vs_dense_node_egress": sparse / dense if dense and sparse else None,
            "compare": compare, "programs": programs, "runs": runs}
  return {**report, "reading": reading(report)}


def reading(report: dict) -> dict:
  """What `--programs`' figures say, in words built from them: per comparison which programs differ,
  whether the losses do, the host path of a steady step; and the bytes a window of sparse steps moves
  against one that holds a select step (a dense all-reduce): with r the sparse program's node egress over
  the dense one's, a window of n steps with one select step moves (1 + (n - 1) r) / n of dense."""
  out = {}
  for name, c in report["compare"].items():
    differ = {p: d for p, d in c["programs"].items() if d != "identical"}
    before, after = c["python_calls_per_step"]["before"], c["python_calls_per_step"]["after"]
    phases = [s["phase"] for s in report["runs"][report["checkouts"][0]["label"]]["steps"]]
    steady = [i for i, p in enumerate(phases) if p == "sparse"][1:]  # after the first sparse step's compile
    out[name] = {
        "programs": ("the optimized HLO of " + ", ".join(c["programs"]) + " is identical (normalized): the "
                     "same collectives, ops, fusions and cost analysis") if not differ else
                    {p: sorted(d) for p, d in differ.items()},
        "losses": f"{len(phases)} steps ({', '.join(phases)}): losses "
                  + ("bitwise equal" if c["losses_bitwise_equal"] else "differ"),
        "host_path": "Python calls per steady sparse step call: "
                     + ", ".join(f"{before[i]} before, {after[i]} after" for i in steady[:1])}
  r = report.get("sparse_vs_dense_node_egress")
  if r:
    out["bytes"] = {"sparse_step_vs_dense": r,
                    "window_with_one_select_step": {n: (1 + (n - 1) * r) / n for n in range(2, 11)}}
  return out
