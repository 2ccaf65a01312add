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
  python benchmarks/bench_offload.py --fit [--d_model 4096] [--seq 1024] [--host_bytes B] [--host_fraction 0.85]
      [--max_probes 6] [--out benchmarks/gpu/offload_fit_run.json]
      on one device: the largest GPT (d_model fixed, layers searched) that trains with
      offload=("opt_state", "master") while the host memory its compiled step needs fits `--host_fraction`
      of the host's: the host, not the device, is the limit the search starts from. The need per layer
      and the fixed rest come from the step compiled for 1 and 2 layers (`host_need`: the donated host
      buffers updated in place, 12 bytes per parameter). From there it bisects the layers down to the largest
      that trains. Every try runs in its own process, so an out-of-memory error releases everything it held,
      and so does the description of the device (the search's own process never starts its backend). The
      size found then runs without offload, in its own process too (out of memory where offload was needed).
      Rows: losses, ms per step, the compiled program's memory (device and host). The GPU kit runs it;
      `--compile_only h100 --device_bytes B --host_bytes B` compiles each try for a compile-only H100 instead,
      as a GPU's jax types it (`aot.compile_as_on_gpu`; a try fits when the device peak is at most B and
      the host bytes at most the host's). `--fit_probe --layers L [--out F]` is one such try; with `--bulk` the states
      are fetched at once after the backward, as before the streamed update.

  python benchmarks/bench_offload.py --moves --compile_only h100 [--d_model 1024] [--layers 8] [--seq 512]
      the --fit GPT on one compile-only H100, compiled as on a GPU (`aot.compile_as_on_gpu`) without
      offload and with offload=("opt_state", "master") for each `--updates` (bulk, streamed, host): the
      device peak, and per step the bytes moved host->device and device->host and the pairs of opposite moves
      in flight at once (`zerojax.analysis.host_moves`).
  `--updates` (cost mode too, default "streamed"): where the offloaded update runs (`Sharding.offload_update`);
  "host" is timed with both fields offloaded only (it needs them); "streamed_serial" is "streamed" compiled with
  XLA's default of two moves between host and device in flight (`gpu_aot.ASYNC_MOVES`), the schedule in which
  a layer's fetches and stores queue one behind another.

Prints one JSON object; `--out` also writes it.

References:
  ZeRO-Offload: Ren et al. 2021, §4 (what moves to the host), §6 (model sizes one GPU trains with it).
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zerojax  # noqa: E402
import zerojax.plan as plans  # noqa: E402
from zerojax import gpu_aot  # noqa: E402
from zerojax.executor import aot  # noqa: E402
from zerojax.models.gpt import GPTConfig, gpt  # noqa: E402
from zerojax.train.optim import make_optimizer  # noqa: E402
from zerojax.executor.memory import memory_report  # noqa: E402
from common import error_text, interleaved, spread  # noqa: E402

SETTINGS = ((), ("opt_state",), ("opt_state", "master"))
STATE_BYTES = 18  # per parameter: bf16 weights 2, fp32 gradients 4, master 4, AdamW's moments 8


SERIAL = "streamed_serial"  # `--updates`: "streamed" compiled with XLA's default of two async moves in flight


@contextlib.contextmanager
def moves_in_flight(update: str):
  """For `SERIAL`: the user's XLA_FLAGS setting XLA's default of two async moves in flight, which wins over
  `Executor.compiler_options` (the fetches and stores of a layer then queue one behind another: the schedule
  before the offloaded step raised it)."""
  if update != SERIAL:
    yield "streamed" if update == "none" else update
    return
  old = os.environ.get("XLA_FLAGS")
  os.environ["XLA_FLAGS"] = f"{old or ''} --{gpu_aot.ASYNC_MOVES}=2"
  try:
    yield "streamed"
  finally:
    os.environ.pop("XLA_FLAGS") if old is None else os.environ.update(XLA_FLAGS=old)


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
  updates = args.updates.split(",")
  for name in args.plans.split(","):
    for off, update in [((), "streamed")] + [(o, u) for o in SETTINGS[1:] for u in updates
                                             if u not in ("host", SERIAL) or o == SETTINGS[-1]]:
      key = f"{name} offload={','.join(off) or 'none'}" + (f" update={update}" if off and len(updates) > 1 else "")
      try:
        with moves_in_flight(update) as where:
          plan = getattr(plans, name)(offload=off, offload_update=where, compute_dtype=args.dtype)
          ex, compiled, state = system(plan, cfg, mesh, batches)
        shards = [ex.shard_batch(b) for b in batches]
        state, m = compiled(state, shards[0])  # first step: warm
        systems[key] = {"compiled": compiled, "state": state, "shards": shards, "plan": name, "off": off}
        rows[key] = {"plan": name, "offload": list(off), "update": update, "memory": gpu_aot.memory(compiled), "times": [],
                     "losses": []}
      except Exception as e:  # noqa: BLE001  (recorded, the others go on)
        rows[key] = {"plan": name, "offload": list(off), "update": update, "error": error_text(e)}

  def stepper(s):
    def step(i):
      s["state"], m = s["compiled"](s["state"], s["shards"][i])
      jax.block_until_ready(m.loss)
      return m
    return step

  def loss(key, i, m):
    if i == 0:
      rows[key]["losses"].append([])
    rows[key]["losses"][-1].append(float(m.loss))
  times = interleaved({key: stepper(s) for key, s in systems.items()}, args.reps,
                      steps=args.steps, after=loss)
  for key, ts in times.items():
    rows[key]["times"] = ts
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


def gpt_params(d: int, layers: int, vocab: int = 32000) -> int:
  """Parameters of the --fit GPT: 12 d^2 per layer, the embedding and the head."""
  return 12 * d * d * layers + 2 * vocab * d


def fit_executor(args, layers: int, setting: tuple, update: str | None = None):
  """(the --fit GPT of `layers` with offload `setting` on one device, a token batch [1, 1, seq + 1]): on the
  device present, or with `--compile_only` on a compile-only GPU (`aot.compile_step` compiles it as a GPU
  gets it: `aot.compile_as_on_gpu`)."""
  d = args.d_model
  cfg = GPTConfig(vocab_size=32000, seq_len=args.seq, d_model=d, num_heads=d // 128, num_layers=layers)
  mesh = zerojax.make_mesh(1, 1, devices=gpu_aot.devices(args.compile_only, 1, 1) if args.compile_only
                           else jax.devices()[:1])
  update = update or ("bulk" if getattr(args, "bulk", False) else "streamed")  # bulk: every state fetched at once
  ex = zerojax.Executor(gpt(cfg), make_optimizer(total_steps=1000),
                        plans.dp(offload=setting, offload_update=update, compute_dtype="bfloat16"), mesh)
  return ex, np.random.default_rng(0).integers(0, 32000, (1, 1, args.seq + 1)).astype(np.int32)


def compiled_memory(args, ex, batch) -> dict:
  """`gpu_aot.memory` of `ex`'s step compiled for `--compile_only` (as on a GPU) or the device present, and
  `host_bytes_used`: the host memory the program needs (arguments, outputs not aliased to them, temporaries),
  or where the platform does not count host memory apart (CPUs) the offloaded states' (`memory_report`)."""
  prog = aot.compile_step(ex, batch.shape)[0]
  mem = gpu_aot.memory(prog)
  h = mem["host"]
  counted = h["argument"] + h["output"] - h["alias"] + h["temp"]
  return {"memory": mem, "host_bytes_used": counted or memory_report(ex)["expected"]["host"]}


def moves(args) -> dict:
  """`--moves`: the --fit GPT of `--layers` compiled for `--compile_only` as on a GPU, without offload and with
  each of `--updates`: device peak, host<->device bytes per direction and overlapping opposite moves."""
  from zerojax.analysis.host_moves import host_moves
  rows = {}
  for update in ["none"] + args.updates.split(","):
    with moves_in_flight(update) as where:
      ex, batch = fit_executor(args, args.layers, () if update == "none" else ("opt_state", "master"), where)
      prog = aot.compile_step(ex, batch.shape)[0]
    moved = host_moves(prog.as_text())
    moved.pop("per_computation")
    rows[update] = {"memory": gpu_aot.memory(prog), **moved}
  return {"device": args.compile_only, "jax": jax.__version__, "d_model": args.d_model, "layers": args.layers,
          "seq": args.seq, "parameters": gpt_params(args.d_model, args.layers), "rows": rows}


def host_need(args) -> dict:
  """The host bytes the offloaded step needs, from its compiled program for 1 and 2 layers: per layer and
  fixed (embedding, head), so that the search's first try is the largest the host holds."""
  used = [compiled_memory(args, *fit_executor(args, n, ("opt_state", "master")))["host_bytes_used"] for n in (1, 2)]
  per_layer = used[1] - used[0]
  return {"per_layer": per_layer, "fixed": used[0] - per_layer,
          "per_parameter": round(per_layer / gpt_params(args.d_model, 1, vocab=0), 3)}


def host_layers(host_bytes: float, fraction: float, need: dict) -> int:
  """The most layers whose host bytes (`host_need`) fit `fraction` of the host."""
  return max(0, int((fraction * host_bytes - need["fixed"]) // need["per_layer"]))


def child(args, flags: list) -> dict:
  """This script with `flags` in a process of its own: whatever it allocated, an out-of-memory error included,
  is released with that process. The JSON of its last line starting "PROBE ", or its error."""
  cmd = [sys.executable, os.path.abspath(__file__), *flags, "--d_model", str(args.d_model), "--seq", str(args.seq),
         "--steps", str(args.steps)]
  if args.compile_only:
    cmd += ["--compile_only", args.compile_only, "--device_bytes", str(args.device_bytes or 0), "--host_bytes",
            str(args.host_bytes)]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.probe_timeout)
    lines = [l for l in r.stdout.splitlines() if l.startswith("PROBE ")]
    return json.loads(lines[-1][6:]) if lines else {"ok": False, "error": f"exit {r.returncode}: " + (
        r.stderr.strip().splitlines() or ["no output"])[-1][:500]}
  except subprocess.TimeoutExpired:
    return {"ok": False, "error": f"no result within {args.probe_timeout} s"}


def probe(args, layers: int, setting: tuple) -> dict:
  """One size and offload setting in its own process (`--fit_probe`, `child`): its row."""
  row = {"layers": layers, "parameters": gpt_params(args.d_model, layers), "offload": list(setting)}
  t0 = time.perf_counter()
  row.update(child(args, ["--fit_probe", "--layers", str(layers), "--offload", ",".join(setting) or "none"]),
             offload=list(setting))
  row["seconds"] = round(time.perf_counter() - t0, 1)
  return row


def describe(args) -> dict:
  """`--fit_describe`: the device (kind, platform, memory limit) and `host_need`. --fit runs it in a process
  of its own (`child`): the search's process never starts the GPU's backend, whose allocator would hold
  the device memory the tries need."""
  dev = gpu_aot.devices(args.compile_only, 1, 1)[0] if args.compile_only else jax.devices()[0]
  stats = {} if args.compile_only else dev.memory_stats() or {}
  return {"ok": True, "device": dev.device_kind, "platform": dev.platform, "device_bytes": stats.get("bytes_limit"),
          "host_need": host_need(args)}


def largest(hi: int, ok, max_probes: int) -> int:
  """The largest n in [1, hi] with ok(n) (ok falls from true to false once as n grows), 0 when none: tries
  hi first (the host's limit), then bisects; at most `max_probes` calls of ok."""
  lo, probes = 0, 0
  while hi > lo and probes < max_probes:
    n = hi if probes == 0 else (lo + hi + 1) // 2
    probes += 1
    if ok(n):
      lo = n
    else:
      hi = n - 1
  return lo


def run_one(args) -> dict:
  """`--fit_probe`: the GPT of `--layers` with `--offload` on one device, in this process: trained `--steps`
  steps (ok: it trained), or compiled for `--compile_only` as on a GPU (`compile_as_on_gpu`; ok: the device
  peak fits `--device_bytes` and the host's bytes `--host_bytes`)."""
  setting = () if args.offload == "none" else tuple(args.offload.split(","))
  out = {}
  try:
    ex, batch = fit_executor(args, args.layers, setting)
    if args.compile_only:  # the compiled program's device peak and host bytes against the limits
      out = compiled_memory(args, ex, batch)
      out["ok"] = out["memory"]["device_peak"] <= args.device_bytes and out["host_bytes_used"] <= args.host_bytes
      return out
    state, shard = ex.init(jax.random.key(0)), ex.shard_batch(batch)
    compiled = ex.step_fn().lower(state, shard).compile()
    out["memory"], losses, times = gpu_aot.memory(compiled), [], []
    for _ in range(args.steps):
      t0 = time.perf_counter()
      state, m = compiled(state, shard)
      losses.append(float(m.loss))
      times.append(time.perf_counter() - t0)
    out.update(ok=True, losses=losses, ms_per_step=spread([t * 1e3 for t in times[1:] or times]))
  except Exception as e:  # noqa: BLE001  (out of memory is the expected outcome of a size over the device)
    out.update(ok=False, error=error_text(e))
  return out


def fit(args) -> dict:
  """The largest GPT (d_model `--d_model`, layers searched) whose states the host holds with
  offload=("opt_state", "master"), trained on one device (or compiled for `--compile_only`); each try in its
  own process. The host is the limit: at most `--host_fraction` of its memory holds what the compiled step
  needs there (`host_need`), and the search starts there; it bisects the layers down to the largest that trains (`--max_probes` tries).
  The same size without offload then runs in its own process (out of memory where offload was needed)."""
  args.host_bytes = args.host_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  off = ("opt_state", "master")
  info = child(args, ["--fit_describe"])
  args.device_bytes = args.device_bytes or info.get("device_bytes")
  out = {"device": info.get("device"), "platform": info.get("platform"), "jax": jax.__version__,
         "device_bytes": args.device_bytes, "host_bytes": args.host_bytes, "host_fraction": args.host_fraction,
         "d_model": args.d_model, "seq": args.seq, "offload": list(off), "host_need": info.get("host_need"),
         "search": []}
  if not info.get("ok"):
    out["error"] = f"describing the device and the host's need failed: {info.get('error')}"
    return out
  if args.compile_only and not args.device_bytes:
    out["error"] = "--compile_only needs --device_bytes (the device's memory to fit)"
    return out
  hi = host_layers(args.host_bytes, args.host_fraction, info["host_need"])
  out["host_limit_layers"] = hi
  rows = {}
  found = largest(hi, lambda layers: rows.setdefault(layers, probe(args, layers, off))["ok"], args.max_probes)
  out["search"] = list(rows.values())
  if not found:
    out["error"] = "no size trained with offload within the probes" if hi else "the host holds no layer"
    return out
  best = rows[found]
  out["largest"] = {"layers": best["layers"], "parameters": best["parameters"],
                    "host_bytes_needed": info["host_need"]["fixed"] + best["layers"] * info["host_need"]["per_layer"],
                    "state_bytes_without_offload": STATE_BYTES * best["parameters"],
                    "limited_by": "host" if best["layers"] == out["host_limit_layers"] else "device"}
  out["runs"] = {"with_offload": best, "without_offload": probe(args, best["layers"], ())}
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--fit", action="store_true")
  ap.add_argument("--fit_probe", action="store_true", help="--fit's one try (run by --fit in a process of its own)")
  ap.add_argument("--fit_describe", action="store_true", help="--fit's device and host need (a process of its own)")
  ap.add_argument("--offload", default="opt_state,master", help="--fit_probe: the setting (or none)")
  ap.add_argument("--moves", action="store_true", help="compiled moves and device peak per update (--compile_only)")
  ap.add_argument("--updates", default="streamed", help="offload_update values: streamed, bulk, host (comma-separated)")
  ap.add_argument("--bulk", action="store_true", help="--fit_probe: fetch every state at once (offload_update='bulk')")
  ap.add_argument("--host_fraction", type=float, default=0.85, help="--fit: of the host's memory, for the states")
  ap.add_argument("--max_probes", type=int, default=6, help="--fit: sizes tried with offload")
  ap.add_argument("--probe_timeout", type=float, default=900, help="--fit: seconds for one try")
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
  if args.moves:
    args.d_model, args.seq = args.d_model or 1024, args.seq or 512
    result = moves(args)
  elif args.fit or args.fit_probe or args.fit_describe:
    args.d_model, args.seq = args.d_model or 4096, args.seq or 1024
    if args.fit_describe:
      row = describe(args)
      print("PROBE " + json.dumps(row))
      return row
    if args.fit_probe:
      row = run_one(args)
      row.update(layers=args.layers, d_model=args.d_model, seq=args.seq, offload=args.offload, jax=jax.__version__,
                 update="bulk" if args.bulk else "streamed",
                 parameters=gpt_params(args.d_model, args.layers))
      print("PROBE " + json.dumps(row))
      if args.out:
        with open(args.out, "w") as f:
          f.write(json.dumps(row, indent=1) + "\n")
      return row
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
