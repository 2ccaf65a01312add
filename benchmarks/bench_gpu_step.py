"""One train step of each zerojax plan against a plain `jax.jit(value_and_grad)` + optax step of the same
GPT, side by side in one process, on the mesh of the devices present (one GPU: a 1 x 1 mesh).

The systems: `plain` (the GPT's loss written out with `jax.lax.scan` over the blocks, parameters cast to
the compute dtype, the same remat per block and for the embedding and the head, `optax` on the whole
tree; the batch sharded over every device, the parameters and optimizer state replicated: on one
device a plain jitted step) and the plans `--plans` (default dp, zero3, zeropp, mics) through
`zerojax.Executor`. All start from the same parameters and optimizer (`make_optimizer`) and train on the
same batches. Each system is compiled ahead of time (`lower(...).compile()`: `compile_s`, and the temp,
argument and output bytes of `memory_analysis()` where the platform reports them); the compiled
program runs the first step (`first_loss`, and its difference from plain's) and the timed ones. Each
repetition times `--steps` steps of every system in turn (the order reverses from one repetition to the
next); a repetition's figure is its median step, and `ms_per_step` and `ratio_to_plain` (per repetition,
system over plain) are the median, min and max over the repetitions. A system that fails (to build,
compile or run) gets its error in its row; the others go on (exit status 1 at the end).

Prints one JSON object (stdout; a table on stderr); `--out FILE` also writes it (the GPU kit writes
OUT_DIR/step.json).

  python benchmarks/bench_gpu_step.py [--plans dp,zero3,zeropp,mics] [--d_model 2048] [--layers 12]
      [--heads 16] [--vocab 32000] [--seq 1024] [--batch 8] [--dtype bfloat16] [--remat full]
      [--steps 8] [--reps 3] [--nodes 1] [--devices N] [--out step.json]

Defaults on a GPU: the 737M-parameter GPT of the first H100 run (d_model 2048, 12 layers, 16 heads,
vocabulary 32,000, sequence 1,024, batch 8, bf16 compute, remat full), 8 steps x 3 repetitions. On CPU a
tiny GPT (d_model 64, 2 layers, 4 heads, vocabulary 256, sequence 32, batch 2 per device, fp32, steps 3
x 3 repetitions) on whatever devices exist (e.g. XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""
import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models.gpt import Block, GPTConfig, embed_tokens, gpt, head_loss  # noqa: E402
from zerojax.train.optim import make_optimizer  # noqa: E402

PLANS = "dp,zero3,zeropp,mics"
GPU = dict(d_model=2048, layers=12, heads=16, vocab=32000, seq=1024, batch=8, dtype="bfloat16",
           steps=8, reps=3)
CPU = dict(d_model=64, layers=2, heads=4, vocab=256, seq=32, batch=None, dtype="float32", steps=3, reps=3)
POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def spread(values) -> dict:
  """Median, min and max of repeated figures."""
  return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values))}


def error_text(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e)[:600]}"


def memory_of(compiled) -> dict | None:
  """Temp, argument and output bytes of a compiled program (None where the platform has no analysis)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - not every platform implements it
    return None
  if m is None:
    return None
  return {f"{f}_bytes": int(getattr(m, f"{f}_size_in_bytes", 0) or 0) for f in ("temp", "argument", "output")}


def plain_step(cfg: GPTConfig, opt, mesh, dtype: str, remat: str):
  """(jitted step (params, opt_state, batch) -> (params, opt_state, loss), replicated sharding, batch
  sharding): the GPT's loss with the plan's remat, `value_and_grad`, `optax`; donates its state."""
  block = Block(cfg)
  wrap = (lambda f: f) if remat == "none" else (lambda f: jax.checkpoint(f, policy=POLICIES[remat]))
  embed, head = wrap(embed_tokens), wrap(head_loss)
  block_fn = wrap(lambda p, x: block.apply({"params": p}, x))

  def loss(params, tokens):
    p = jax.tree.map(lambda x: x.astype(dtype), params)
    x = embed(p["embed"], tokens[:, :-1])
    x, _ = lax.scan(lambda x, q: (block_fn(q, x), None), x, p["blocks"])
    return head(p["head"], x, tokens[:, 1:])

  def step(params, opt_state, batch):
    value, g = jax.value_and_grad(loss)(params, batch[0])
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  rep = NamedSharding(mesh, P())
  b_sh = NamedSharding(mesh, P(None, tuple(mesh.axis_names)))
  return jax.jit(step, in_shardings=(rep, rep, b_sh), out_shardings=(rep, rep, rep), donate_argnums=(0, 1)), rep, b_sh


class System:
  """One system's compiled step, its state and batches; `step()` runs one step and returns the loss."""

  def __init__(self, name):
    self.name, self.row, self.fn, self.state, self.batches = name, {}, None, None, []

  def step(self, i):
    self.state, loss = self.fn(self.state, self.batches[i % len(self.batches)])
    return jax.block_until_ready(loss)


def build_plain(cfg, params, opt, mesh, batches, dtype, remat) -> System:
  s = System("plain")
  t0 = time.perf_counter()
  jitted, rep, b_sh = plain_step(cfg, opt, mesh, dtype, remat)
  p = jax.device_put(jax.tree.map(jnp.copy, params), rep)
  o = jax.jit(opt.init, out_shardings=rep)(p)
  s.batches = [jax.device_put(b, b_sh) for b in batches]
  compiled = jitted.lower(p, o, s.batches[0]).compile()
  s.row.update(compile_s=round(time.perf_counter() - t0, 3), memory=memory_of(compiled))

  def fn(state, batch):
    p, o, loss = compiled(*state, batch)
    return (p, o), loss
  s.fn, s.state = fn, (p, o)
  return s


def build_plan(name, model, params, opt, mesh, batches, dtype, remat) -> System:
  s = System(name)
  t0 = time.perf_counter()
  plan = zerojax.PLANS[name](remat=remat, param_dtype=dtype)
  ex = zerojax.Executor(model, opt, plan, mesh)
  state = ex.init_from_params(params)
  step = ex.step_fn()
  s.batches = [jax.device_put(b, ex.batch_sharding) for b in batches]
  compiled = step.lower(state, s.batches[0]).compile()
  s.row.update(plan=str(ex.plan.name), mesh={k: int(v) for k, v in ex.mesh.shape.items()},
               compile_s=round(time.perf_counter() - t0, 3), memory=memory_of(compiled))
  # The compiled program is what the step runs for a plan without stateful components (phase "dense");
  # one with them goes through the step function (which picks the phase, compiling on first use).
  program = step if ex.stateful else compiled

  def fn(state, batch):
    state, metrics = program(state, batch)
    return state, metrics.loss
  s.fn, s.state = fn, state
  return s


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--plans", default=PLANS, help=f"comma-separated zerojax.PLANS (default {PLANS})")
  for k in ("d_model", "layers", "heads", "vocab", "seq", "batch", "steps", "reps"):
    ap.add_argument(f"--{k}", type=int, default=None,
                    help=("default 8 on a GPU (rounded up to a multiple of the devices), 2 per device on CPU"
                          if k == "batch" else f"default {GPU[k]} on a GPU, {CPU[k]} on CPU"))
  ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                  help="compute dtype (fp32 master weights); default bfloat16 on a GPU, float32 on CPU")
  ap.add_argument("--remat", default="full", choices=("full", "dots", "none"))
  ap.add_argument("--nodes", type=int, default=None, help="mesh nodes (default: the process count)")
  ap.add_argument("--devices", type=int, default=None, help="use the first N devices (default: all)")
  ap.add_argument("--out", default=None, help="also write the JSON to this file")
  args = ap.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  c = {k: (getattr(args, k) if getattr(args, k) is not None else (GPU if on_gpu else CPU)[k])
       for k in GPU}
  mesh = zerojax.make_mesh(args.nodes, devices=jax.devices()[:args.devices] if args.devices else None)
  c["batch"] = c["batch"] or 2 * mesh.size
  if args.batch is None and c["batch"] % mesh.size:
    c["batch"] = -(-c["batch"] // mesh.size) * mesh.size
  cfg = GPTConfig(vocab_size=c["vocab"], seq_len=c["seq"], d_model=c["d_model"], num_heads=c["heads"],
                  num_layers=c["layers"])
  model, opt = gpt(cfg), make_optimizer(total_steps=1000)
  params = jax.jit(model.init)(jax.random.key(0))
  n_all = sum(int(x.size) for x in jax.tree.leaves(params))
  n_emb = int(params["embed"]["wte"].size + params["embed"]["wpe"].size)
  tokens = c["batch"] * c["seq"]
  flops = 6 * (n_all - n_emb) * tokens + 12 * c["layers"] * c["seq"] * c["d_model"] * tokens
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, c["vocab"], (1, c["batch"], c["seq"] + 1)).astype(np.int32)
             for _ in range(c["steps"])]

  systems, rows = {}, {}
  builders = [("plain", lambda: build_plain(cfg, params, opt, mesh, batches, c["dtype"], args.remat))]
  builders += [(n, lambda n=n: build_plan(n, model, params, opt, mesh, batches, c["dtype"], args.remat))
               for n in [p.strip() for p in args.plans.split(",") if p.strip()]]
  for name, build in builders:
    try:
      s = build()
      s.row["first_loss"] = float(s.step(0))  # the compiled program's first run: also the warmup
      systems[name] = s
      rows[name] = s.row
    except Exception as e:  # noqa: BLE001 - recorded in the row
      rows[name] = {"error": error_text(e)}
      print(f"{name}: {rows[name]['error']}", file=sys.stderr, flush=True)
  times = {k: [] for k in systems}
  for r in range(c["reps"]):
    names = list(systems) if r % 2 == 0 else list(systems)[::-1]
    for name in names:
      s = systems[name]
      if "error" in s.row:
        continue
      try:
        ts = []
        for i in range(c["steps"]):
          t0 = time.perf_counter()
          loss = s.step(i)
          ts.append(time.perf_counter() - t0)
        times[name].append(1e3 * statistics.median(ts))
        s.row["last_loss"] = float(loss)
      except Exception as e:  # noqa: BLE001 - recorded in the row
        s.row["error"] = error_text(e)
  plain = rows.get("plain", {})
  for name, row in rows.items():
    if name in times and times[name]:
      med = statistics.median(times[name])
      row["ms_per_step"] = {k: round(v, 3) for k, v in spread(times[name]).items()}
      row["ms_per_rep"] = [round(t, 3) for t in times[name]]
      row["model_tflops"] = round(flops / med / 1e9, 3)
    if "ms_per_rep" in row and "ms_per_rep" in plain and len(row["ms_per_rep"]) == len(plain["ms_per_rep"]):
      row["ratio_to_plain"] = {k: round(v, 4) for k, v in
                               spread([a / b for a, b in zip(row["ms_per_rep"], plain["ms_per_rep"])]).items()}
    if "first_loss" in row and "first_loss" in plain:
      row["first_loss_diff_vs_plain"] = row["first_loss"] - plain["first_loss"]
  result = {
      "benchmark": "gpu_step", "device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
      "jax": jax.__version__, "devices": mesh.size, "mesh": {k: int(v) for k, v in mesh.shape.items()},
      "config": dict(c, remat=args.remat, plans=args.plans),
      "model": {"params": n_all, "params_embedding": n_emb, "model_flops_per_step": flops},
      "systems": rows,
      "errors": {k: r["error"] for k, r in rows.items() if "error" in r},
      "notes": ["ms_per_step: median, min and max over the repetitions of each repetition's median step",
                "ratio_to_plain: per repetition system / plain, then median, min and max",
                "model_tflops: 6 x non-embedding params x tokens + attention, no remat, over the median step",
                "memory: compiled memory_analysis() bytes (null where the platform reports none)",
                "plain: jax.jit(value_and_grad) + optax, params replicated, batch sharded over the devices"],
  }
  text = json.dumps(result, indent=1)
  print(text, flush=True)
  print(table(result), file=sys.stderr, flush=True)
  if args.out:
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
  return result


def table(result) -> str:
  lines = [f"{result['device']} x {result['devices']}, jax {result['jax']}, {result['model']['params']:,} params",
           f"{'system':8} {'ms/step':>10} {'[min-max]':>21} {'/plain':>7} {'first loss':>11} {'diff':>10} "
           f"{'compile s':>9} {'temp MB':>9}"]
  for name, r in result["systems"].items():
    if "ms_per_step" not in r:
      lines.append(f"{name:8} ERROR {r.get('error', 'no timing')[:100]}")
      continue
    m, ratio, mem = r["ms_per_step"], r.get("ratio_to_plain", {}).get("median"), r.get("memory") or {}
    temp = mem.get("temp_bytes")
    lines.append(f"{name:8} {m['median']:>10.2f} [{m['min']:>9.2f}-{m['max']:>9.2f}] "
                 f"{'' if ratio is None else f'{ratio:.3f}':>7} {r['first_loss']:>11.5f} "
                 f"{r.get('first_loss_diff_vs_plain', float('nan')):>10.2e} {r['compile_s']:>9.2f} "
                 f"{'' if temp is None else f'{temp / 1e6:.1f}':>9}")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(1 if main()["errors"] else 0)
