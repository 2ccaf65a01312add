"""The train step of every shipped config compiled for H100s without a GPU, and a LLaMA-7B-shaped table.

Needs jax's CUDA plugin (`pip install -e '.[gpu-aot]'`); nothing runs on a GPU (`zerojax.gpu_aot`).

  python benchmarks/bench_gpu_compile.py [--out benchmarks/gpu/compile.json] [--dump_hlo DIR]
      every configs/*.gin plan (auto.gin aside: it measures this machine) on 2 x 4 H100s: per collective
      its role, async / in a layer loop / matmuls and kernels between start and done, the layer loops'
      overlap per role (every role found in them), gathered weights alive, kernels, compiled memory beside
      memory_report, compile time; --dump_hlo writes each scheduled program to DIR/<config>.hlo.
  python benchmarks/bench_gpu_compile.py --llama [--meshes 2x8,8x8] [--plans zero3,zeropp,mics]
      [--out benchmarks/gpu/llama7b.json]
  python benchmarks/bench_gpu_compile.py --offload [--meshes 1x8,2x8,8x8] [--sizes 7B,13B,30B,65B]
      the "Will it fit?" table with offload: ZeRO-3 on LLaMA-shaped GPTs, with and without
      offload=("opt_state", "master"): device peak and host bytes per GPU from the compiled program beside
      memory_report, and the largest shape that fits each mesh (benchmarks/gpu/offload_fit.json).
  python benchmarks/bench_gpu_compile.py --diloco_overlap
      configs/diloco_mics.gin's sync step without and with Streaming DiLoCo's overlap (α = 0.5 and 0):
      the cross-node all-reduce and the matmuls scheduled while it is in flight
      (benchmarks/gpu/diloco_overlap.json).
  python benchmarks/bench_gpu_compile.py --remat dots,none --plans zero3,zeropp
      each plan under each remat mode, prefetch off and on, on tests/test_gpu_compile.py's small GPT:
      layer-loop collectives with a matmul between start and done, gathered bytes alive in the layer
      loops (benchmarks/gpu/remat_prefetch.json).
      a LLaMA-7B-shaped GPT (32 layers, d_model 4096, 32 heads, vocab 32000, sequence 4096, MLP width
      16384 = 4 x d_model: GELU's two matrices hold 12 d^2 per layer, as LLaMA's three SwiGLU matrices of
      width 11008 do to 0.3%; 6.7 B parameters), bf16 compute, remat full, one sequence per device:
      per-device compiled memory vs memory_report vs an 80 GB H100 (fits, by how much), bytes each node
      sends to other nodes per step in units of M (ZeRO++ Table 1: ZeRO-3 3 M, ZeRO++ 0.75 M), compile time.

Prints one JSON object and writes it to --out. CPU timings on a shared 2-core machine are noisy.

References:
  ZeRO++: Wang et al. 2023, Table 1 (cross-node communication per step). MiCS: Zhang et al. 2022, §3.
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

if not jax.config.jax_platforms:
  jax.config.update("jax_platforms", "cpu")

import gin  # noqa: E402

from zerojax import gpu_aot  # noqa: E402
from zerojax.executor import aot  # noqa: E402
from zerojax.analysis import step_report  # noqa: E402
from zerojax.analysis.collectives import collectives_from_hlo  # noqa: E402
from zerojax.analysis.schedule import schedule_from_hlo  # noqa: E402
from zerojax.cli import compile as compile_cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_BYTES = 80e9  # "80 GB" (the target config's device_memory_size is 84.9e9 bytes, 79.1 GiB)
LLAMA = ["model_config.vocab_size=32000", "model_config.seq_len=4096", "model_config.d_model=4096",
         "model_config.num_heads=32", "model_config.num_layers=32", "model_config.mlp_ratio=4",
         "train.compute_dtype='bfloat16'"]
PLANS = {"zero3": "configs/zero3.gin", "zeropp": "configs/zeropp.gin", "mics": "configs/mics.gin"}
TABLE1 = {"zero3": 3.0, "zeropp": 0.75, "mics": None}  # ZeRO++ Table 1, cross-node volume per step / M


def compile_config(config: str, params: list, nodes: int, gpus: int, batch: int | None = None,
                   phase: str | None = None):
  gin.clear_config()
  try:
    built, args, cfg = compile_cli.gin_executor([config], params, "h100", nodes, gpus)
    ex = built.executor
    b = batch or args["batch_size"]
    b = b if b % ex.world == 0 else ex.world
    prog, seconds = aot.compile_step(ex, (ex.accum_steps, b, cfg.seq_len + 1), phase=phase)
    return ex, prog, seconds, b, built.remat
  finally:
    gin.clear_config()


def shipped(dump_hlo: str | None = None) -> dict:
  rows = []
  configs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "*.gin"))
                   if not p.endswith(("base.gin", "auto.gin")))
  for config in configs:
    ex, prog, seconds, batch, remat = compile_config(config, [], 2, 4)
    if dump_hlo:
      os.makedirs(dump_hlo, exist_ok=True)
      with open(os.path.join(dump_hlo, os.path.basename(config).replace(".gin", ".hlo")), "w") as f:
        f.write(prog.as_text())
    rep = compile_cli.report(ex, prog, seconds, remat)
    rep.update(config=config, batch_size=batch)
    rows.append(rep)
    print(f"{config}: {seconds:.1f} s, overlap {rep['overlap']}, alive {rep['gathered_alive']['bytes'] / 1e6:.3f} MB",
          file=sys.stderr, flush=True)
  return {"device": "NVIDIA H100 80GB HBM3 (compile-only)", "mesh": "2x4", "jax": jax.__version__,
          "notes": ["nothing ran: the programs were compiled for compile-only H100s on a CPU machine",
                    "matmuls_between / kernels_between: what the schedule runs between a collective's start "
                    "and done", "role: from the JAX source path; a collective XLA combined from several (no "
                    "path of its own) gets its parts' role (zerojax.analysis.schedule.recovered_role)",
                    "overlap: per role, the layer-loop collectives (in_loop) and those with a matmul between "
                    "start and done (overlapped)", "compile_s: measured on a shared 2-core CPU machine (noisy)"],
          "configs": rows}


def diloco_overlap() -> dict:
  """configs/diloco_mics.gin's sync step (phase "outer0") on 2 x 4 H100s, without Streaming DiLoCo's
  overlap and with it at α = 0.5 and α = 0: each cross-node collective, with what the schedule runs between
  its start and done."""
  rows = []
  for params in ([], ["diloco.overlap=True", "diloco.mix=0.5"], ["diloco.overlap=True", "diloco.mix=0.0"]):
    ex, prog, seconds, batch, _ = compile_config("configs/diloco_mics.gin", params, 2, 4, phase="outer0")
    cross = [{**s.to_json(), "cross_node_bytes_per_device": s.collective.cross_node_bytes_per_device}
             for s in schedule_from_hlo(prog.as_text(), ex.mesh) if s.collective.cross_node_bytes_per_device]
    rows.append({"gin_params": params, "batch_size": batch, "compile_s": seconds, "cross_node": cross})
    print(f"{params}: {[(c['op'], c['matmuls_between']) for c in cross]}", file=sys.stderr, flush=True)
  return {"device": "NVIDIA H100 80GB HBM3 (compile-only)", "mesh": "2x4", "jax": jax.__version__,
          "config": "configs/diloco_mics.gin", "phase": "outer0", "rows": rows}


SMALL = ["model_config.d_model=64", "model_config.seq_len=32", "model_config.num_layers=4", "train.batch_size=8"]


def remat_prefetch(plans: list, modes: list) -> dict:
  """Each plan under each remat mode with prefetch off and on (tests/test_gpu_compile.py's small GPT):
  per layer-loop role the collectives with a matmul between start and done, and the gathered bytes alive
  in each layer loop (those gathered outside it separately)."""
  rows = []
  for plan in plans:
    for mode in modes:
      for prefetch in (False, True):
        params = SMALL + [f"{plan}.remat='{mode}'", f"{plan}.prefetch={prefetch}"]
        ex, prog, seconds, _, remat = compile_config(PLANS[plan], params, 2, 4)
        rep = compile_cli.report(ex, prog, seconds, remat)
        rows.append({"plan": plan, "remat": mode, "prefetch": prefetch, "overlap": rep["overlap"],
                     "layer_loops": rep["gathered_alive"]["layer_loops"]})
        print(rows[-1], file=sys.stderr, flush=True)
  overlapped = lambda r: sum(e["overlapped"] for e in r["overlap"].values())
  in_loop = lambda r: sum(e["in_loop"] for e in r["overlap"].values())
  total = {p: {"overlapped": sum(overlapped(r) for r in rows if r["prefetch"] is p),
               "in_loop": sum(in_loop(r) for r in rows if r["prefetch"] is p)} for p in (False, True)}
  return {"device": "NVIDIA H100 80GB HBM3 (compile-only)", "mesh": "2x4", "jax": jax.__version__,
          "gpt": SMALL, "rows": rows, "layer_loop_collectives_with_a_matmul": {
              "prefetch off": total[False], "prefetch on": total[True]}}


def llama(meshes: list, plans: list) -> dict:
  rows = []
  for mesh in meshes:
    nodes, gpus = (int(v) for v in mesh.split("x"))
    for plan in plans:
      params = LLAMA + (["mics.group_size=None"] if plan == "mics" else [])
      ex, prog, seconds, batch, remat = compile_config(PLANS[plan], params, nodes, gpus, batch=nodes * gpus)
      text = prog.as_text()
      mem = gpu_aot.memory(prog)
      model = compile_cli.memory_report(ex)["expected"]
      acc = step_report(ex, collectives_from_hlo(text, ex.mesh))
      rep = compile_cli.report(ex, prog, seconds, remat)
      row = {"plan": plan, "mesh": mesh, "prefetch": ex.components.prefetch, "parameters": acc["model_parameters"],
             "batch_per_device": batch // ex.world, "seq_len": 4096, "compile_s": round(seconds, 1),
             "compiled_memory": mem, "memory_report": model,
             "fits_80GB": mem["peak"] <= H100_BYTES, "headroom_GB": round((H100_BYTES - mem["peak"]) / 1e9, 2),
             "cross_node_bytes_per_node": acc["cross_node_bytes_per_node"],
             "cross_node_over_M": round(acc["table1"]["total"]["over_model"], 3),
             "table1_over_M": {k: round(v["over_model"], 3) for k, v in acc["table1"].items()},
             "zeropp_table1_over_M": TABLE1[plan],
             "overlap": rep["overlap"], "gathered_alive": rep["gathered_alive"]}
      rows.append(row)
      print(json.dumps({k: row[k] for k in ("plan", "mesh", "compile_s", "fits_80GB", "headroom_GB",
                                            "cross_node_over_M")}), file=sys.stderr, flush=True)
  return {"device": "NVIDIA H100 80GB HBM3 (compile-only)", "jax": jax.__version__,
          "model": "LLaMA-7B-shaped GPT: 32 layers, d_model 4096, 32 heads, MLP 16384 (GELU), vocab 32000, "
                   "seq 4096, bf16 compute and wire, fp32 master weights and AdamW states, remat full",
          "notes": ["peak: compiled.memory_analysis() per device (arguments + outputs - aliased + temporaries "
                    "when XLA gives no peak)", "cross_node_over_M: bytes a node sends to other nodes per step "
                    "(ring-order model) / M, M = parameters x 2 bytes",
                    "compile_s: a shared 2-core CPU machine (noisy)"],
          "rows": rows}


# LLaMA shapes (Touvron et al. 2023, Table 2): layers, d_model, heads. The MLP is GELU of width 4 d_model
# (8 d^2 per layer, as SwiGLU's three matrices of width ~8/3 d_model).
LLAMA_SIZES = {"7B": (32, 4096, 32), "13B": (40, 5120, 40), "30B": (60, 6656, 52), "65B": (80, 8192, 64)}


def llama_shape(size: str) -> list:
  layers, d, heads = LLAMA_SIZES[size]
  return [p for p in LLAMA if not p.startswith(("model_config.d_model", "model_config.num_heads",
                                                 "model_config.num_layers"))] + [
      f"model_config.d_model={d}", f"model_config.num_heads={heads}", f"model_config.num_layers={layers}"]


def offload_table(meshes: list, sizes: list, plan: str = "zero3") -> dict:
  """The "Will it fit?" table with offload: per LLaMA shape and mesh, the compiled step's device peak and
  host bytes per GPU with and without `offload=("opt_state", "master")`, beside `memory_report`."""
  rows = []
  for mesh in meshes:
    nodes, gpus = (int(v) for v in mesh.split("x"))
    for size in sizes:
      for offload in ((), ("opt_state", "master")):
        params = llama_shape(size) + [f"{plan}.offload={offload!r}"]
        try:
          ex, prog, seconds, batch, remat = compile_config(PLANS[plan], params, nodes, gpus, batch=nodes * gpus)
        except Exception as e:  # noqa: BLE001  (a benchmark records what failed and goes on)
          rows.append({"plan": plan, "size": size, "mesh": mesh, "offload": list(offload),
                       "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
          continue
        mem = gpu_aot.memory(prog)
        model = compile_cli.memory_report(ex)["expected"]
        acc = step_report(ex, collectives_from_hlo(prog.as_text(), ex.mesh))
        row = {"plan": plan, "size": size, "mesh": mesh, "offload": list(offload),
               "parameters": acc["model_parameters"], "compile_s": round(seconds, 1),
               "device_peak_GB": round(mem["device_peak"] / 1e9, 2), "xla_peak_GB": round(mem["peak"] / 1e9, 2),
               "host_GB": round(mem["host"]["argument"] / 1e9, 2),
               "memory_report_device_GB": round(model["device"] / 1e9, 2),
               "memory_report_host_GB": round(model["host"] / 1e9, 2),
               "fits_80GB": mem["device_peak"] <= H100_BYTES, "compiled_memory": mem}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("size", "mesh", "offload", "device_peak_GB", "host_GB", "fits_80GB",
                                              "compile_s")}), file=sys.stderr, flush=True)
  largest = {}
  for mesh in meshes:
    for offload in ("none", "opt_state,master"):
      fit = [r for r in rows if r["mesh"] == mesh and ",".join(r["offload"]) in (offload, "" if offload == "none" else offload)
             and r.get("fits_80GB")]
      largest[f"{mesh} offload={offload}"] = max(fit, key=lambda r: r["parameters"])["size"] if fit else None
  return {"device": "NVIDIA H100 80GB HBM3 (compile-only)", "jax": jax.__version__, "plan": plan,
          "model": "LLaMA-shaped GPTs (layers, d_model, heads of LLaMA 7B/13B/33B/65B; GELU MLP of width 4 "
                   "d_model; vocab 32000, seq 4096), bf16 compute and wire, fp32 master weights and AdamW "
                   "states, remat full, one sequence per device",
          "notes": ["device_peak: zerojax.gpu_aot.memory's bound on the device's peak (XLA's peak counts host "
                    "buffers too)", "host_GB: host arguments per GPU (the offloaded master weights and optimizer "
                    "states)", "compile_s: a shared 2-core CPU machine (noisy)"],
          "largest_that_fits": largest, "rows": rows}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--llama", action="store_true", help="the LLaMA-7B-shaped table instead of the shipped configs")
  ap.add_argument("--meshes", default="2x8,8x8")
  ap.add_argument("--plans", default="zero3,zeropp,mics")
  ap.add_argument("--remat", default=None, help="e.g. dots,none: --plans under these remat modes, prefetch "
                  "off and on (benchmarks/gpu/remat_prefetch.json)")
  ap.add_argument("--offload", action="store_true", help="the Will-it-fit table with and without offload "
                  "(LLaMA 7B-65B shapes; benchmarks/gpu/offload_fit.json)")
  ap.add_argument("--sizes", default="7B,13B,30B,65B")
  ap.add_argument("--diloco_overlap", action="store_true", help="DiLoCo's sync step with and without overlap "
                  "(benchmarks/gpu/diloco_overlap.json)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--dump_hlo", default=None, help="shipped configs: write each scheduled program to DIR/<config>.hlo")
  args = ap.parse_args()
  if args.remat:
    result = remat_prefetch([p for p in args.plans.split(",") if p in PLANS], args.remat.split(","))
    out = args.out or os.path.join(ROOT, "benchmarks", "gpu", "remat_prefetch.json")
  elif args.offload:
    result = offload_table(args.meshes.split(","), args.sizes.split(","))
    out = args.out or os.path.join(ROOT, "benchmarks", "gpu", "offload_fit.json")
  elif args.diloco_overlap:
    result = diloco_overlap()
    out = args.out or os.path.join(ROOT, "benchmarks", "gpu", "diloco_overlap.json")
  elif args.llama:
    result = llama(args.meshes.split(","), args.plans.split(","))
    out = args.out or os.path.join(ROOT, "benchmarks", "gpu", "llama7b.json")
  else:
    result = shipped(args.dump_hlo)
    out = args.out or os.path.join(ROOT, "benchmarks", "gpu", "compile.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
