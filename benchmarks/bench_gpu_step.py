"""One train step of each zerojax plan against a plain `jax.jit(value_and_grad)` + optax step of the same
GPT, side by side in one process, on the mesh of the devices present (one GPU: a 1 x 1 mesh); swept over
remat modes, attention implementations and XLA option sets.

The systems: `plain` (the GPT's loss written out with `jax.lax.scan` over the blocks, parameters cast to
the compute dtype, the same remat per block and for the embedding and the head, the same attention,
`optax` on the whole tree; the batch sharded over every device, the parameters and optimizer state
replicated: on one device a plain jitted step) and the plans `--plans` (default dp, zero3, zeropp,
mics) through `zerojax.Executor`. All start from the same parameters and optimizer (`make_optimizer`) and
train on the same batches. Each system is compiled ahead of time (`lower(...).compile()`: `compile_s`,
and the temp, argument and output bytes of `memory_analysis()` where the platform reports them); the
compiled program runs the first step (`first_loss`, and its difference from plain's) and the timed ones.
Each repetition times `--steps` steps of every system in turn (the order reverses from one repetition to
the next); a repetition's figure is its median step, and `ms_per_step` and `ratio_to_plain` (per
repetition, system over plain) are the median, min and max over the repetitions. A system that fails (to
build, compile or run) gets its error in its row; the others go on (exit status 1 at the end).

The sweep: every combination of `--remat` (full, dots, none, auto: a plan's "auto" is the mode
`zerojax.planner.remat.choose` picks for it, and plain runs the mode zero3's auto picks), `--attention`
(`zerojax.models.attention`: auto = cuDNN's fused attention on GPUs, einsum = the scores written out)
and `--xla` (named sets of XLA options: `base` = zerojax's `GPU_COMPILER_OPTIONS`, `maxtext` = MaxText's
GPU list added to them; the plans and plain compile with the same set) is one block of interleaved
repetitions; the first combination runs `--plans`, the others `--sweep_plans`. `model_tflops` is the
model's flops (6 x non-embedding parameters x tokens + attention, remat not counted) over the median
step; `mfu` divides it by the device's dense bf16 peak (`zerojax.hardware.peak_flops`) and `of_matmul` by an 8192^3 bf16
matmul measured on the device at the start (`matmul_tflops`).

`--compile_only h100 --mesh 1x1` compiles every system of every combination for compile-only GPUs
(nothing runs) and records per system the compiled memory, whether the fused attention's custom calls are
in the program and any `[batch, heads, seq, seq]` buffer, XLA's bytes accessed (`bench_added_work.xla_bytes`),
and the ratios of each plan's temporaries and bytes accessed to plain's.

Prints one JSON object (stdout; a table on stderr); `--out FILE` also writes it (the GPU kit writes
OUT_DIR/step.json).

  python benchmarks/bench_gpu_step.py [--plans dp,zero3,zeropp,mics] [--sweep_plans zero3]
      [--remat auto,full,dots,none] [--attention auto,einsum] [--xla base,maxtext] [--d_model 2048]
      [--layers 12] [--heads 16] [--vocab 32000] [--seq 1024] [--batch 8] [--dtype bfloat16] [--steps 8]
      [--reps 3] [--nodes 1] [--devices N] [--compile_only h100 --mesh 1x1] [--out step.json]

Defaults on a GPU: the 737M-parameter GPT of the first H100 run (d_model 2048, 12 layers, 16 heads,
vocabulary 32,000, sequence 1,024, batch 8, bf16 compute), remat auto, attention auto, xla base, 8 steps x
3 repetitions. On CPU a tiny GPT (d_model 64, 2 layers, 4 heads, vocabulary 256, sequence 32, batch 2 per
device, fp32, steps 3 x 3 repetitions) on whatever devices exist (e.g.
XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""
import argparse
import contextlib
import itertools
import os
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
from zerojax import gpu_aot, hardware  # noqa: E402
from zerojax.executor import aot  # noqa: E402
from zerojax.models.gpt import Block, GPTConfig, embed_tokens, gpt, head_loss  # noqa: E402
from zerojax.planner import remat as remat_choice  # noqa: E402
from zerojax.engine.remat import ATTENTION  # noqa: E402
from zerojax.plan.values import REMAT  # noqa: E402
from zerojax.train.optim import make_optimizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: the other benchmarks' helpers
from bench_added_work import xla_bytes  # noqa: E402  (XLA's bytes accessed, also of compile-only GPU programs)
from common import error_text, interleaved, print_and_save, spread  # noqa: E402

PLANS = "dp,zero3,zeropp,mics"
GPU = dict(d_model=2048, layers=12, heads=16, vocab=32000, seq=1024, batch=8, dtype="bfloat16",
           steps=8, reps=3)
CPU = dict(d_model=64, layers=2, heads=4, vocab=256, seq=32, batch=None, dtype="float32", steps=3, reps=3)
# remat as the plain step spells it: the policies zerojax's modes keep (`zerojax.engine.remat`)
POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
            # zerojax's "offloaded" recomputes what "full" does with the layers' inputs in host memory; plain
            # keeps them on the device (its fair twin: the same recompute)
            "offloaded": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.save_from_both_policies(
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                jax.checkpoint_policies.save_only_these_names(ATTENTION))}
# XLA option sets added to zerojax's own (`gpu_aot.GPU_COMPILER_OPTIONS`): MaxText's GPU list.
XLA_SETS = {
    "base": {},
    "maxtext": {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_triton_gemm": False,
                "xla_gpu_enable_command_buffer": "", "xla_gpu_enable_highest_priority_async_stream": True,
                "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30,
                "xla_gpu_all_gather_combine_threshold_bytes": 1 << 30,
                "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 30,
                "xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": True,
                "xla_gpu_enable_pipelined_all_reduce": True, "xla_gpu_enable_while_loop_double_buffering": True,
                "xla_disable_hlo_passes": "rematerialization"},
}


def memory_of(compiled) -> dict | None:
  """Temp, argument and output bytes of a compiled program (None where the platform has no analysis)."""
  m = gpu_aot.memory(compiled)
  return None if m is None else {f"{k}_bytes": m[k] for k in ("temp", "argument", "output")}


def peak_tflops(kind: str) -> float | None:
  peak = hardware.peak_flops(kind)
  return None if peak is None else peak / 1e12


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
  """A bf16 n^3 matmul's TFLOP/s on the first device (median of `reps`)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  f = jax.jit(lambda a: a @ a)
  ts = interleaved({"matmul": lambda i: jax.block_until_ready(f(a))}, reps, warmup=1)["matmul"]
  return 2 * n ** 3 / statistics.median(ts) / 1e12


@contextlib.contextmanager
def xla_options(extra: dict):
  """zerojax's GPU compiler options with `extra` added while the block runs (the executors compile
  with them; plain is given the same)."""
  saved = dict(gpu_aot.GPU_COMPILER_OPTIONS)
  gpu_aot.GPU_COMPILER_OPTIONS.update(extra)
  try:
    yield
  finally:
    gpu_aot.GPU_COMPILER_OPTIONS.clear()
    gpu_aot.GPU_COMPILER_OPTIONS.update(saved)


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
  return jax.jit(step, in_shardings=(rep, rep, b_sh), out_shardings=(rep, rep, rep), donate_argnums=(0, 1),
                 compiler_options=gpu_aot.compiler_options(mesh) or None), rep, b_sh


class System:
  """One system's compiled step, its state and batches; `step()` runs one step and returns the loss."""

  def __init__(self, name):
    self.name, self.row, self.fn, self.state, self.batches = name, {}, None, None, []

  def step(self, i):
    self.state, loss = self.fn(self.state, self.batches[i % len(self.batches)])
    return jax.block_until_ready(loss)


def evidence(compiled, cfg: GPTConfig, batch: int) -> dict:
  """What the compiled program shows of its attention: cuDNN's fused attention calls and any
  `[batch, heads, seq, seq]` buffer (the scores in memory)."""
  text = compiled.as_text()
  scores = f"{batch},{cfg.num_heads},{cfg.seq_len},{cfg.seq_len}]"
  return {"cudnn_attention_calls": text.count('custom_call_target="__cudnn$fmha'),
          "score_matrix_buffers": text.count(scores)}


def build_plain(cfg, params, opt, mesh, batches, dtype, remat, compile_only=False) -> System:
  s = System("plain")
  t0 = time.perf_counter()
  jitted, rep, b_sh = plain_step(cfg, opt, mesh, dtype, remat)
  if compile_only:
    put = lambda t, sh: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), t)
    p, o = put(params, rep), put(jax.eval_shape(opt.init, params), rep)
    s.batches = [jax.ShapeDtypeStruct(batches[0].shape, batches[0].dtype, sharding=b_sh)]
  else:
    p = jax.device_put(jax.tree.map(jnp.copy, params), rep)
    o = jax.jit(opt.init, out_shardings=rep)(p)
    s.batches = [jax.device_put(b, b_sh) for b in batches]
  s.lowered = jitted.lower(p, o, s.batches[0])
  compiled = s.lowered.compile()
  s.row.update(remat=remat, compile_s=round(time.perf_counter() - t0, 3), memory=memory_of(compiled))
  s.compiled = compiled

  def fn(state, batch):
    p, o, loss = compiled(*state, batch)
    return (p, o), loss
  s.fn, s.state = fn, (p, o)
  return s


def build_plan(name, model, params, opt, mesh, batches, dtype, remat, compile_only=False) -> System:
  s = System(name)
  t0 = time.perf_counter()
  plan = zerojax.PLANS[name](param_dtype=dtype, **({} if remat == "auto" else {"remat": remat}))
  if remat == "auto":
    plan, s.row["remat_choice"] = remat_choice.choose(model, opt, plan, mesh, (1,) + batches[0].shape[1:])
  ex = zerojax.Executor(model, opt, plan, mesh)
  if compile_only:
    state, batch = aot.abstract_inputs(ex, batches[0].shape)
    s.batches = [batch]
  else:
    state = ex.init_from_params(params)
    s.batches = [jax.device_put(b, ex.batch_sharding) for b in batches]
  step = ex.step_fn()
  s.lowered = step.lower(state, s.batches[0])
  compiled = s.lowered.compile()
  s.row.update(plan=str(ex.plan.name), remat=ex.components.remat,
               mesh={k: int(v) for k, v in ex.mesh.shape.items()},
               compile_s=round(time.perf_counter() - t0, 3), memory=memory_of(compiled))
  s.compiled = compiled
  # The compiled program is what the step runs for a plan without stateful components (phase "dense");
  # one with them goes through the step function (which picks the phase, compiling on first use).
  program = step if ex.stateful else compiled

  def fn(state, batch):
    state, metrics = program(state, batch)
    return state, metrics.loss
  s.fn, s.state = fn, state
  return s


def run_block(c, combo, names, params, opt, mesh, batches, flops, peak, measured, args) -> dict:
  """One combination (remat, attention, xla set): every system built, then `reps` interleaved
  repetitions of `steps` steps (or, compile-only, the programs' evidence)."""
  remat, attention, xla = combo
  cfg = GPTConfig(vocab_size=c["vocab"], seq_len=c["seq"], d_model=c["d_model"], num_heads=c["heads"],
                  num_layers=c["layers"], attention=attention)
  model = gpt(cfg)
  systems, rows = {}, {}
  with xla_options(XLA_SETS[xla]):
    plain_remat = remat
    if remat == "auto":  # plain runs the mode zero3's auto picks (the same memory bound)
      shape = (1,) + batches[0].shape[1:]
      plain_remat = remat_choice.choose(model, opt, zerojax.zero3(param_dtype=c["dtype"]), mesh, shape)[1]["remat"]
    builders = [("plain", lambda: build_plain(cfg, params, opt, mesh, batches, c["dtype"], plain_remat,
                                              args.compile_only))]
    builders += [(n, lambda n=n: build_plan(n, model, params, opt, mesh, batches, c["dtype"], remat, args.compile_only))
                 for n in names]
    for name, build in builders:
      try:
        s = build()
        if args.compile_only:
          s.row.update(evidence(s.compiled, cfg, c["batch"]), bytes_accessed=xla_bytes(s.compiled))
        else:
          s.row["first_loss"] = float(s.step(0))  # the compiled program's first run: also the warmup
        systems[name] = s
        rows[name] = s.row
      except Exception as e:  # noqa: BLE001 - recorded in the row
        rows[name] = {"error": error_text(e)}
        print(f"{combo} {name}: {rows[name]['error']}", file=sys.stderr, flush=True)
  if args.compile_only:
    plain = rows.get("plain", {})
    for row in rows.values():
      if (row.get("memory") or {}).get("temp_bytes") and (plain.get("memory") or {}).get("temp_bytes"):
        row["temp_ratio_to_plain"] = round(row["memory"]["temp_bytes"] / plain["memory"]["temp_bytes"], 4)
      if row.get("bytes_accessed") and plain.get("bytes_accessed"):
        row["bytes_accessed_ratio_to_plain"] = round(row["bytes_accessed"] / plain["bytes_accessed"], 4)
    return {"remat": remat, "attention": attention, "xla": xla, "systems": rows}

  def last_loss(name, i, loss):
    if i == c["steps"] - 1:
      systems[name].row["last_loss"] = float(loss)

  def failed(name, e):  # recorded in the row; the others go on
    systems[name].row["error"] = error_text(e)
  seconds = interleaved({name: s.step for name, s in systems.items()}, c["reps"], steps=c["steps"],
                        after=last_loss, on_error=failed)
  times = {name: [1e3 * t for t in ts] for name, ts in seconds.items()}
  plain = rows.get("plain", {})
  for name, row in rows.items():
    if name in times and times[name]:
      med = statistics.median(times[name])
      row["ms_per_step"] = {k: round(v, 3) for k, v in spread(times[name]).items()}
      row["ms_per_rep"] = [round(t, 3) for t in times[name]]
      row["model_tflops"] = round(flops / med / 1e9, 3)
      row["mfu"] = round(row["model_tflops"] / peak, 4) if peak else None
      row["of_matmul"] = round(row["model_tflops"] / measured, 4) if measured else None
    if "ms_per_rep" in row and "ms_per_rep" in plain and len(row["ms_per_rep"]) == len(plain["ms_per_rep"]):
      row["ratio_to_plain"] = {k: round(v, 4) for k, v in
                               spread([a / b for a, b in zip(row["ms_per_rep"], plain["ms_per_rep"])]).items()}
    if "first_loss" in row and "first_loss" in plain:
      row["first_loss_diff_vs_plain"] = row["first_loss"] - plain["first_loss"]
  systems.clear()  # the next combination's state replaces this one's
  return {"remat": remat, "attention": attention, "xla": xla, "systems": rows}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--plans", default=PLANS, help=f"comma-separated zerojax.PLANS (default {PLANS})")
  ap.add_argument("--sweep_plans", default="zero3", help="the plans of every combination after the first")
  for k in ("d_model", "layers", "heads", "vocab", "seq", "batch", "steps", "reps"):
    ap.add_argument(f"--{k}", type=int, default=None,
                    help=("default 8 on a GPU (rounded up to a multiple of the devices), 2 per device on CPU"
                          if k == "batch" else f"default {GPU[k]} on a GPU, {CPU[k]} on CPU"))
  ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                  help="compute dtype (fp32 master weights); default bfloat16 on a GPU, float32 on CPU")
  ap.add_argument("--remat", default="auto", help="comma-separated: auto, full, dots, none")
  ap.add_argument("--attention", default="auto", help="comma-separated zerojax.models.attention implementations")
  ap.add_argument("--xla", default="base", help=f"comma-separated XLA option sets: {', '.join(XLA_SETS)}")
  ap.add_argument("--nodes", type=int, default=None, help="mesh nodes (default: the process count)")
  ap.add_argument("--devices", type=int, default=None, help="use the first N devices (default: all)")
  ap.add_argument("--compile_only", default=None, choices=sorted(gpu_aot.TARGETS),
                  help="compile for compile-only GPUs of this kind (nothing runs)")
  ap.add_argument("--mesh", default="1x1", help="NODESxGPUS of --compile_only (default 1x1)")
  ap.add_argument("--out", default=None, help="also write the JSON to this file")
  args = ap.parse_args(argv)
  combos = list(itertools.product(*(v.split(",") for v in (args.remat, args.attention, args.xla))))
  for remat, attention, xla in combos:
    if remat not in ("auto", *REMAT) or xla not in XLA_SETS:
      ap.error(f"--remat {remat!r} / --xla {xla!r}: use auto or one of {REMAT}, and one of {sorted(XLA_SETS)}")
  if args.compile_only:
    gpu_aot.compile_only_host()
    nodes, gpus = (int(v) for v in args.mesh.split("x"))
    mesh = zerojax.make_mesh(nodes, devices=gpu_aot.devices(args.compile_only, nodes, gpus))
  else:
    mesh = zerojax.make_mesh(args.nodes, devices=jax.devices()[:args.devices] if args.devices else None)
  on_gpu = jax.default_backend() == "gpu" or bool(args.compile_only)
  c = {k: (getattr(args, k) if getattr(args, k) is not None else (GPU if on_gpu else CPU)[k]) for k in GPU}
  c["batch"] = c["batch"] or 2 * mesh.size
  if args.batch is None and c["batch"] % mesh.size:
    c["batch"] = -(-c["batch"] // mesh.size) * mesh.size
  cfg = GPTConfig(vocab_size=c["vocab"], seq_len=c["seq"], d_model=c["d_model"], num_heads=c["heads"],
                  num_layers=c["layers"])
  opt = make_optimizer(total_steps=1000)
  init = gpt(cfg).init
  params = jax.eval_shape(init, jax.random.key(0)) if args.compile_only else jax.jit(init)(jax.random.key(0))
  n_all = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  n_emb = int(np.prod(params["embed"]["wte"].shape) + np.prod(params["embed"]["wpe"].shape))
  tokens = c["batch"] * c["seq"]
  flops = 6 * (n_all - n_emb) * tokens + 12 * c["layers"] * c["seq"] * c["d_model"] * tokens
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, c["vocab"], (1, c["batch"], c["seq"] + 1)).astype(np.int32)
             for _ in range(c["steps"])]
  kind = str(mesh.devices.flat[0].device_kind)
  peak = peak_tflops(kind)
  measured = None
  if jax.default_backend() == "gpu":
    try:
      measured = round(matmul_tflops(), 1)
    except Exception as e:  # noqa: BLE001 - recorded
      print(f"matmul probe: {error_text(e)}", file=sys.stderr)
  names = [p.strip() for p in args.plans.split(",") if p.strip()]
  sweep_names = [p.strip() for p in args.sweep_plans.split(",") if p.strip()]
  sweep = [run_block(c, combo, names if i == 0 else sweep_names, params, opt, mesh, batches, flops, peak, measured,
                     args) for i, combo in enumerate(combos)]
  errors = {f"{b['remat']}/{b['attention']}/{b['xla']}/{k}": r["error"]
            for b in sweep for k, r in b["systems"].items() if "error" in r}
  result = {
      "benchmark": "gpu_step", "device": kind, "platform": "compile-only " + args.compile_only if args.compile_only
      else jax.default_backend(),
      "jax": jax.__version__, "devices": mesh.size, "mesh": {k: int(v) for k, v in mesh.shape.items()},
      "config": dict(c, remat=args.remat, attention=args.attention, xla=args.xla, plans=args.plans,
                     sweep_plans=args.sweep_plans),
      "model": {"params": n_all, "params_embedding": n_emb, "model_flops_per_step": flops},
      "peak_tflops": peak, "matmul_tflops": measured,
      "xla_sets": {k: {**gpu_aot.GPU_COMPILER_OPTIONS, **v} for k, v in XLA_SETS.items()},
      "systems": sweep[0]["systems"], "sweep": sweep, "errors": errors,
      "notes": ["ms_per_step: median, min and max over the repetitions of each repetition's median step",
                "ratio_to_plain: per repetition system / plain, then median, min and max",
                "model_tflops: 6 x non-embedding params x tokens + attention, no remat, over the median step; "
                "mfu: over peak_tflops (dense bf16); of_matmul: over matmul_tflops (8192^3 bf16 here)",
                "memory: compiled memory_analysis() bytes (null where the platform reports none)",
                "plain: jax.jit(value_and_grad) + optax, params replicated, batch sharded over the devices, "
                "the same attention and remat (under remat auto: the mode zero3's auto picks)"],
  }
  print_and_save(result, table, args.out)
  return result


def table(result) -> str:
  lines = [f"{result['device']} x {result['devices']}, jax {result['jax']}, {result['model']['params']:,} params, "
           f"peak {result['peak_tflops']} TF/s, matmul {result['matmul_tflops']} TF/s"]
  for block in result["sweep"]:
    lines.append(f"-- remat {block['remat']}, attention {block['attention']}, xla {block['xla']}")
    lines.append(f"{'system':8} {'remat':5} {'ms/step':>10} {'[min-max]':>21} {'/plain':>7} {'TF/s':>7} {'mfu':>6} "
                 f"{'first loss':>11} {'temp MB':>9} {'cudnn':>5} {'scores':>6}")
    for name, r in block["systems"].items():
      if "error" in r:
        lines.append(f"{name:8} ERROR {r['error'][:100]}")
        continue
      m, mem = r.get("ms_per_step"), r.get("memory") or {}
      temp = mem.get("temp_bytes")
      ratio = r.get("ratio_to_plain", {}).get("median")
      lines.append(f"{name:8} {r.get('remat', ''):5} "
                   + (f"{m['median']:>10.2f} [{m['min']:>9.2f}-{m['max']:>9.2f}] " if m else f"{'':>10} {'':>21} ")
                   + f"{'' if ratio is None else f'{ratio:.3f}':>7} {r.get('model_tflops', ''):>7} "
                   f"{'' if r.get('mfu') is None else r['mfu']:>6} {r.get('first_loss', ''):>11} "
                   f"{'' if temp is None else f'{temp / 1e6:.1f}':>9} {r.get('cudnn_attention_calls', ''):>5} "
                   f"{r.get('score_matrix_buffers', ''):>6}")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(1 if main()["errors"] else 0)
