"""Host offload (`Sharding.offload`): what it costs per step, and a model that only trains with it.

  python benchmarks/bench_offload.py [--plans zero3,mics] [--d_model 256] [--layers 4] [--steps 5]
      [--reps 5] [--out benchmarks/offload.json]
      the step time of each plan with offload (), ("opt_state",) and ("opt_state", "master") on the
      devices present (e.g. 8 CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8), the same
      GPT, optimizer and batches; each repetition times `--steps` steps of every system in turn (the order
      reverses from one repetition to the next); per system the median step of each repetition, then the
      median, min and max over repetitions, and the ratio to the same plan without offload (per
      repetition). The losses of every setting are compared with the plan's without offload (bitwise:
      `losses_equal`; recorded, never a stop).
  python benchmarks/bench_offload.py --fit [--device_bytes B] [--host_bytes B] [--out fit.json]
      on one device: a GPT whose model states (18 bytes per parameter: bf16 weights, fp32 gradients,
      master weights and AdamW's two moments) need 1.15 x the device's memory, so it does not fit without
      offload; the offload setting that fits the device (at most 80% of it) and the host (at most 60% of
      its memory) is chosen. Runs dp without offload (its error is recorded: out of memory), then with
      offload, `--steps` steps: losses, ms per step, the compiled program's memory. The GPU kit runs it;
      `--compile_only h100 --device_bytes B --host_bytes B` compiles both for a compile-only H100 instead
      (device peak against B: benchmarks/gpu/offload_fit_h100.json).

Prints one JSON object; `--out` also writes it.

References:
  ZeRO-Offload: Ren et al. 2021, §4 (what moves to the host), §6 (model sizes one GPU trains with it).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zerojax  # noqa: E402
import zerojax.plan as plans  # noqa: E402
from zerojax import gpu_aot  # noqa: E402
from zerojax.models.gpt import GPTConfig, gpt  # noqa: E402
from zerojax.train.optim import make_optimizer  # noqa: E402
from bench_gpu_step import error_text, spread  # noqa: E402  (the kit's step benchmark: the same figures)

SETTINGS = ((), ("opt_state",), ("opt_state", "master"))
STATE_BYTES = 18  # per parameter: bf16 weights 2, fp32 gradients 4, master 4, AdamW's moments 8


def memory_of(compiled) -> dict | None:
  try:
    return gpu_aot.memory(compiled)
  except Exception:  # noqa: BLE001  (not every platform analyses memory)
    return None


def system(plan, cfg, mesh, batches):
  """(executor, compiled step, state) of `plan` on `mesh`, compiled ahead of time."""
  ex = zerojax.Executor(gpt(cfg), make_optimizer(total_steps=1000), plan, mesh)
  state = ex.init(jax.random.key(0))
  shard = ex.shard_batch(batches[0])
  compiled = ex.step_fn().lower(state, shard).compile()
  return ex, compiled, state


def cost(args) -> dict:
  """Step time with each offload setting against none, interleaved (see the module docstring)."""
  devices = jax.devices()
  mesh = zerojax.make_mesh(args.nodes, len(devices) // args.nodes)
  cfg = GPTConfig(vocab_size=256, seq_len=args.seq, d_model=args.d_model, num_heads=4, num_layers=args.layers)
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 256, (args.batch_per_device * mesh.size, args.seq + 1)).astype(np.int32)
             for _ in range(args.steps)]
  rows, systems = {}, {}
  for name in args.plans.split(","):
    for off in SETTINGS:
      key = f"{name} offload={','.join(off) or 'none'}"
      try:
        plan = getattr(plans, name)(offload=off, compute_dtype=args.dtype)
        ex, compiled, state = system(plan, cfg, mesh, batches)
        shards = [ex.shard_batch(b) for b in batches]
        state, m = compiled(state, shards[0])  # first step: warm
        systems[key] = {"compiled": compiled, "state": state, "shards": shards, "plan": name, "off": off}
        rows[key] = {"plan": name, "offload": list(off), "memory": memory_of(compiled), "times": [],
                     "losses": []}
      except Exception as e:  # noqa: BLE001  (recorded, the others go on)
        rows[key] = {"plan": name, "offload": list(off), "error": error_text(e)}
  order = list(systems)
  for rep in range(args.reps):
    for key in (order if rep % 2 == 0 else order[::-1]):
      s, times, losses = systems[key], [], []
      for b in s["shards"]:
        t0 = time.perf_counter()
        s["state"], m = s["compiled"](s["state"], b)
        jax.block_until_ready(m.loss)
        times.append(time.perf_counter() - t0)
        losses.append(float(m.loss))
      rows[key]["times"].append(statistics.median(times))
      rows[key]["losses"].append(losses)
  for key, r in rows.items():
    if "error" in r:
      continue
    base = rows[f"{r['plan']} offload=none"]
    r["ms_per_step"] = spread([t * 1e3 for t in r["times"]])
    if "times" in base:
      r["ratio_to_no_offload"] = spread([a / b for a, b in zip(r["times"], base["times"])])
      r["losses_equal"] = r["losses"] == base["losses"]
  for r in rows.values():
    if "error" not in r:
      del r["times"]
      r["losses"] = r["losses"][-1]
  return {"device": devices[0].device_kind, "platform": devices[0].platform, "jax": jax.__version__,
          "mesh": {k: int(v) for k, v in mesh.shape.items()},
          "model": {"d_model": args.d_model, "layers": args.layers, "seq": args.seq, "vocab": 256,
                    "batch_per_device": args.batch_per_device, "dtype": args.dtype},
          "steps": args.steps, "reps": args.reps, "rows": rows}


def fit_size(device_bytes: float, host_bytes: float) -> tuple[int, tuple, float] | None:
  """(parameters, offload, host bytes it needs) for the --fit model, or None when no setting fits: the
  states without offload need 1.15 x the device; with offload at most 80% of it stays on the device and
  at most 60% of the host's memory holds the rest (master weights too where the host has room)."""
  n = 1.15 * device_bytes / STATE_BYTES
  for off, host_per in ((("opt_state", "master"), 12), (("opt_state",), 8)):  # the most the host can hold
    if (STATE_BYTES - host_per) * n <= 0.8 * device_bytes and host_per * n <= 0.6 * host_bytes:
      return int(n), off, host_per * n
  return None


def fit(args) -> dict:
  """A model that does not fit one device without offload, trained with it (see the module docstring);
  with `--compile_only TARGET` compiled for one compile-only GPU instead (`--device_bytes` then needed)."""
  dev = gpu_aot.devices(args.compile_only, 1, 1)[0] if args.compile_only else jax.devices()[0]
  stats = {} if args.compile_only else dev.memory_stats() or {}
  device_bytes = args.device_bytes or stats.get("bytes_limit")
  host_bytes = args.host_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  out = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
         "device_bytes": device_bytes, "host_bytes": host_bytes, "runs": {}}
  chosen = fit_size(device_bytes, host_bytes) if device_bytes else None
  if chosen is None:
    out["error"] = "no offload setting fits this device and host (or the device reports no memory limit)"
    return out
  n, off, need = chosen
  d = args.d_model
  layers = max(1, math.ceil((n - 2 * 32000 * d) / (12 * d * d)))
  cfg = GPTConfig(vocab_size=32000, seq_len=args.seq, d_model=d, num_heads=d // 128, num_layers=layers)
  params = 12 * d * d * layers + 2 * 32000 * d
  out.update(model={"d_model": d, "layers": layers, "seq": args.seq, "parameters": params,
                    "state_bytes_without_offload": STATE_BYTES * params},
             offload=list(off), host_bytes_needed=need)
  mesh = zerojax.make_mesh(1, 1, devices=[dev])
  batch = np.random.default_rng(0).integers(0, 32000, (1, 1, args.seq + 1)).astype(np.int32)  # [accum, batch, seq + 1]
  for label, setting in (("without_offload", ()), ("with_offload", off)):
    run = out["runs"][label] = {"offload": list(setting)}
    if args.compile_only:  # the kit's model checked before a GPU run: the compiled program's device peak
      plan = plans.dp(offload=setting, compute_dtype="bfloat16")
      ex = zerojax.Executor(gpt(cfg), make_optimizer(total_steps=1000), plan, mesh)
      mem = gpu_aot.memory(gpu_aot.compile_step(ex, batch.shape)[0])
      run.update(memory=mem, fits=mem["device_peak"] <= device_bytes)
      continue
    try:
      ex, compiled, state = system(plans.dp(offload=setting, compute_dtype="bfloat16"), cfg, mesh, [batch])
      run["memory"] = memory_of(compiled)
      shard, losses, times = ex.shard_batch(batch), [], []
      for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = compiled(state, shard)
        losses.append(float(m.loss))
        times.append(time.perf_counter() - t0)
      run.update(trained=True, losses=losses, ms_per_step=spread([t * 1e3 for t in times[1:] or times]))
      del state
    except Exception as e:  # noqa: BLE001  (out of memory is the expected outcome without offload)
      run.update(trained=False, error=error_text(e))
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--fit", action="store_true")
  ap.add_argument("--plans", default="zero3,mics")
  ap.add_argument("--nodes", type=int, default=2)
  ap.add_argument("--d_model", type=int, default=None)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--seq", type=int, default=None)
  ap.add_argument("--batch_per_device", type=int, default=2)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--device_bytes", type=float, default=None, help="--fit: the device's memory (default: its limit)")
  ap.add_argument("--host_bytes", type=float, default=None, help="--fit: the host's memory (default: physical)")
  ap.add_argument("--compile_only", default=None, help="--fit: compile for this compile-only GPU (h100) instead")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if args.compile_only:
    gpu_aot.compile_only_host()  # this process's own backend stays the CPU
  if args.fit:
    args.d_model, args.seq = args.d_model or 4096, args.seq or 1024
    result = fit(args)
  else:
    args.d_model, args.seq = args.d_model or 256, args.seq or 64
    result = cost(args)
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return result


if __name__ == "__main__":
  main()
