"""What each plan adds to a plain `jax.jit(value_and_grad)` + optax step of the same model, per layer.

  python benchmarks/bench_added_work.py [--platforms cpu,h100] [--meshes 1x1,2x4] [--configs dp,zero3,...]
      [--layers 4,8] [--out benchmarks/gpu/added_work.json]

For every shipped config (configs/*.gin; auto.gin aside: it measures this machine) on each mesh, the
config's train step (the executor `train.py` builds, with the model below) is compiled, and so is the
plain step of the same GPT on one device of the same kind with the batch one device of the mesh gets:
master weights in fp32, cast to the plan's param dtype and compute dtype, `jax.value_and_grad` of the
same loss with the plan's remat mode as `jax.checkpoint` of each unit (embedding, every block, head),
gradients in fp32, the same optax optimizer (`make_optimizer`), state donated. Both are compiled, never
run: on CPU (8 simulated devices) and, with jax's CUDA plugin (`zerojax.gpu_aot`), for compile-only
H100s. Figures per device (the programs are per-device SPMD programs):

  * `xla_bytes`: `compiled.cost_analysis()['bytes accessed']` of the step as XLA reports it (XLA counts a
    loop's body once, whatever its trip count; a compile-only GPU has no cost analysis, so there XLA's
    `HloCostAnalysis` of the same optimized program runs through the host's client);
  * `model`: the optimized program read instruction by instruction (`work`): every kernel weighted by the
    trip counts of the loops that hold it: `bytes` (operands read + results written; a slice of an
    operand counts as the slice, an in-place dynamic-update-slice as its update), `fusions` (non-matmul
    fusions), `kernels` (every non-matmul kernel: fusions, custom calls and unfused ops), `matmuls`,
    `collectives`, `quantized` (kernels that produce or consume s8/u8/s4/u4/f8 arrays:
    `analysis.quantized_arrays`, which leaves out cuDNN's and cuBLAS's u8/s8 workspaces).
  * `added_per_layer`: (plan - plain at L2 layers) - (plan - plain at L1 layers), over L2 - L1: what one
    more layer adds to the plan beyond the plain step; `added_fixed`: the rest (per step: the embedding and
    head units, the optimizer on sharded state, loss and metrics). `added_by_op`: the added kernels and
    bytes at L1 by the jax primitive that emitted them (the last element of the HLO op_name).

A plan with sharded state can add negative bytes at 2 x 4 (its optimizer updates 1/8 of the state).
Prints one JSON object and writes it to --out (as it goes); `--before FILE` (this benchmark's output for
the code before a change) adds `before_after`, `--notes FILE` a JSON object of notes. A full run (16
configs, two meshes, CPU and H100) takes about an hour on two cores.
"""
from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

if not jax.config.jax_platforms:
  jax.config.update("jax_platforms", "cpu")

import gin  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from zerojax import gpu_aot  # noqa: E402
from zerojax.executor import aot  # noqa: E402
from zerojax.analysis.hlo_text import OPS, Module, arrays, attr, callees, nbytes  # noqa: E402
from zerojax.analysis.quantized import quantized_arrays  # noqa: E402
from zerojax.cli import account  # noqa: E402
from zerojax.models.gpt import Block, embed_tokens, head_loss  # noqa: E402
from zerojax.train.optim import make_optimizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "configs", "*.gin"))
                 if not p.endswith(("base.gin", "auto.gin")))
MODEL = ["model_config.d_model=128", "model_config.num_heads=4", "model_config.seq_len=128",
         "model_config.vocab_size=256"]
PER_DEVICE_BATCH = 4

_SKIP = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id",
                   "after-all", "opt-barrier", "add-dependency", "while", "call", "conditional", "domain"})
_SLICES = frozenset({"slice", "dynamic-slice"})
_MATMUL_TARGETS = re.compile(r"gemm|matmul|conv", re.I)
_COLLECTIVE = tuple(OPS) + tuple(o + "-start" for o in OPS)


# ------------------------------------------------------------------------------------------ the plain step

def plain_step(cfg, optimizer, param_dtype: str, compute_dtype: str, remat: str):
  """`(params, opt_state, tokens) -> (params, opt_state, loss)`: the GPT's loss under `jax.value_and_grad`
  with each unit under `jax.checkpoint` as `remat` says, and an optax update; what every plan's step
  computes for one device's batch, without sharding, layout or collectives."""
  block = Block(cfg)
  wrap = {"full": jax.checkpoint,
          "dots": functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
          "none": lambda f: f}[remat]
  embed, layer, head = wrap(embed_tokens), wrap(lambda p, x: block.apply({"params": p}, x)), wrap(head_loss)

  def loss(p, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = embed(p["embed"], inputs)
    x = lax.scan(lambda c, lp: (layer(lp, c), None), x, p["blocks"])[0]
    return head(p["head"], x, targets)

  def step(params, opt_state, tokens):
    p = jax.tree.map(lambda m: m.astype(param_dtype).astype(compute_dtype), params)
    value, grads = jax.value_and_grad(loss)(p, tokens)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def compile_plain(ex, cfg, optimizer, batch: int):
  """The plain step of `ex`'s model, dtypes and remat for `batch` sequences, on one device of `ex`'s kind."""
  from zerojax.models.gpt import gpt

  dev = next(iter(ex.mesh.devices.flat))
  g = ex.components.gather
  step = plain_step(cfg, optimizer, g.dtype, g.compute_dtype, ex.components.remat)
  shard = SingleDeviceSharding(dev)
  abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard), t)
  params = jax.eval_shape(gpt(cfg).init, jax.random.key(0))
  opt_state = jax.eval_shape(optimizer.init, params)
  tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), np.int32, sharding=shard)
  return jax.jit(step, donate_argnums=(0, 1), compiler_options=gpu_aot.compiler_options(ex.mesh) or None).lower(
      abstract(params), abstract(opt_state), tokens).compile()


# ---------------------------------------------------------------------------------------- reading the HLO

def _top_level(mod: Module) -> dict[str, int]:
  """Computations that run kernels (the entry, loop bodies and conditions, called computations, branches,
  async wrappers), with their executions per step."""
  out, frontier = {}, [mod.entry]
  while frontier:
    comp = frontier.pop()
    if comp in out or comp not in mod.comps:
      continue
    out[comp] = mod.count(comp)
    for instr in mod.comps[comp]:
      if instr.opcode in ("while", "call", "conditional") or instr.opcode.startswith("async-start"):
        frontier += callees(instr)
  return out


def _holds(mod: Module, comp: str, pred, depth: int = 0) -> bool:
  for i in mod.comps.get(comp, []):
    if pred(i) or (depth < 8 and any(_holds(mod, c, pred, depth + 1) for c in callees(i))):
      return True
  return False


def _is_matmul(i) -> bool:
  return i.opcode in ("dot", "convolution") or (
      i.opcode == "custom-call" and bool(_MATMUL_TARGETS.search(attr(i.attrs, "custom_call_target") or "")))


def _shape(mod: Module, comp: str, instr, k: int) -> str:
  return instr.inline_shapes[k] or mod.shape_of(comp, instr.operands[k]) or ""


def _fusion_bytes(mod: Module, comp: str, instr) -> float:
  """Bytes a fusion reads and writes: an operand only sliced inside counts as its slices; a root that is an
  in-place dynamic-update-slice writes its update (and does not read the buffer it updates)."""
  body = callees(instr)[0] if callees(instr) else None
  instrs = mod.comps.get(body, [])
  params = {}
  for i in instrs:
    if i.opcode == "parameter":
      m = re.match(r"\s*(\d+)", ",".join(i.operands))
      if m:
        params[int(m.group(1))] = i
  users = mod.users.get(body, {})
  root = next((i for i in instrs if i.root), None)
  in_place = set()
  out = 0.0
  roots = [root] if root is not None and root.opcode != "tuple" else [
      mod.by_name[body].get(o) for o in (root.operands if root is not None else [])]
  for r in roots:
    if r is None:
      continue
    if r.opcode == "dynamic-update-slice":
      out += nbytes(arrays(_shape(mod, body, r, 1)))
      in_place.add(r.operands[0])
    else:
      out += nbytes(arrays(r.shape))
  for k in range(len(instr.operands)):
    p = params.get(k)
    if p is not None and p.name in in_place:
      continue
    uses = users.get(p.name, []) if p is not None else []
    if uses and all(u.opcode in _SLICES for u in uses):
      out += sum(nbytes(arrays(u.shape)) for u in uses)
    else:
      out += nbytes(arrays(_shape(mod, comp, instr, k)))
  return out


def _bytes(mod: Module, comp: str, instr) -> float:
  if instr.opcode == "fusion":
    return _fusion_bytes(mod, comp, instr)
  if instr.opcode == "dynamic-update-slice":
    return 2 * nbytes(arrays(_shape(mod, comp, instr, 1)))
  if instr.opcode in _SLICES:
    return 2 * nbytes(arrays(instr.shape))
  return nbytes(arrays(instr.shape)) + sum(nbytes(arrays(_shape(mod, comp, instr, k)))
                                           for k in range(len(instr.operands)))


def _source(instr) -> str:
  name = re.search(r'op_name="([^"]*)"', instr.attrs)
  return name.group(1).rsplit("/", 1)[-1] if name else "?"


def work(text: str) -> dict:
  """The step's kernels, trip-weighted: bytes, non-matmul fusions and kernels, matmuls, collectives,
  quantization kernels; `by_op` the non-matmul kernels and their bytes by the primitive that emitted
  them; `bytes_once` the bytes with every loop body counted once (what XLA's cost analysis counts)."""
  mod = Module(text)
  # s8/u8/s4/u4/f8 data, not cuDNN's and cuBLAS's u8/s8 workspaces (`analysis.quantized_arrays`)
  quantized = {(q.computation, q.name) for q in quantized_arrays(text)}
  tot = collections.Counter()
  by_op = collections.defaultdict(lambda: [0, 0.0])
  for comp, n in _top_level(mod).items():
    for instr in mod.comps[comp]:
      op = instr.opcode
      if op in _SKIP or op.endswith(("-done", "-update")):
        continue
      if op.startswith("async-start"):
        inner = [i for c in callees(instr) for i in mod.comps.get(c, [])]
        if not any(i.opcode in OPS for i in inner):
          continue  # an async wrapper of a kernel: the kernel is counted where it is defined
        op = "all-gather"
      b = _bytes(mod, comp, instr)
      if op in _COLLECTIVE:
        tot["collectives"] += n
        tot["collective_bytes"] += n * b
        continue
      tot["bytes"] += n * b
      tot["bytes_once"] += b
      if _is_matmul(instr) or (op == "fusion" and any(_holds(mod, c, _is_matmul) for c in callees(instr))):
        tot["matmuls"] += n
        continue
      tot["kernels"] += n
      tot["fusions"] += n * (op == "fusion")
      narrow = (comp, instr.name) in quantized or any((comp, o) in quantized for o in instr.operands)
      tot["quantized"] += n * bool(narrow)
      e = by_op[_source(instr)]
      e[0] += n
      e[1] += n * b
  out = {k: (int(v) if float(v).is_integer() else float(v)) for k, v in tot.items()}
  for k in ("bytes", "bytes_once", "fusions", "kernels", "matmuls", "collectives", "collective_bytes", "quantized"):
    out.setdefault(k, 0)
  out["by_op"] = {k: {"kernels": v[0], "bytes": v[1]} for k, v in sorted(by_op.items())}
  return out


def xla_bytes(compiled) -> float:
  """`compiled.cost_analysis()['bytes accessed']`; for a compile-only GPU, which has no cost analysis, XLA's
  own `HloCostAnalysis` of the same optimized program run through the host's client."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  if not cost:
    from jaxlib import _hlo, _jax  # noqa: PLC0415  (jaxlib's own bindings)
    cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, _hlo.hlo_module_from_text(compiled.as_text()))
  return float(cost["bytes accessed"])


def collectives_in(text: str) -> list[str]:
  """The collective instructions of an optimized HLO text (their opcodes)."""
  return re.findall(r"=\s*\S+\s+(" + "|".join(re.escape(o) for o in OPS) + r")(?:-start)?\(", text)


# --------------------------------------------------------------------------------------------- measuring

def build(config: str, layers: int, nodes: int, gpus: int, platform: str):
  """(executor, `train`'s args, model config) of `configs/<config>.gin` with the bench's GPT."""
  gin.clear_config()
  params = MODEL + [f"model_config.num_layers={layers}", f"train.batch_size={PER_DEVICE_BATCH * nodes * gpus}"]
  args = account.gin_train_args([os.path.join(ROOT, "configs", f"{config}.gin")], params)
  devices = gpu_aot.devices("h100", nodes, gpus) if platform == "h100" else jax.devices("cpu")[:nodes * gpus]
  built, args, cfg = account.build_executor(args, nodes, devices=devices)
  return built.executor, args, cfg


def measure(config: str, layers: int, nodes: int, gpus: int, platform: str, plain_cache: dict) -> dict:
  try:
    ex, args, cfg = build(config, layers, nodes, gpus, platform)
    optimizer = make_optimizer(total_steps=args["steps"])
    t0 = time.perf_counter()
    prog, _ = aot.compile_step(ex, (ex.accum_steps, args["batch_size"], cfg.seq_len + 1))
    seconds = time.perf_counter() - t0
    g = ex.components.gather
    key = (platform, layers, g.dtype, g.compute_dtype, ex.components.remat, args["steps"], ex.accum_steps)
    if key not in plain_cache:
      plain = compile_plain(ex, cfg, optimizer, PER_DEVICE_BATCH * ex.accum_steps)
      plain_cache[key] = {"xla_bytes": xla_bytes(plain), "model": work(plain.as_text())}
  finally:
    gin.clear_config()
  text = prog.as_text()
  return {"plan": ex.plan.name, "remat": ex.components.remat, "prefetch": ex.components.prefetch,
          "param_dtype": g.dtype, "compute_dtype": g.compute_dtype, "accum_steps": ex.accum_steps,
          "compile_s": round(seconds, 1), "xla_bytes": xla_bytes(prog), "model": work(text),
          "collective_ops": sorted(collections.Counter(collectives_in(text)).items()),
          "plain": plain_cache[key]}


FIELDS = ("bytes", "fusions", "kernels", "matmuls", "collectives", "quantized")


def summarize(rows: dict, l1: int, l2: int) -> dict:
  """Per plan and mesh: the step at L1 (plain vs plan, XLA's bytes and the model's), and what the plan adds
  per layer and per step."""
  a, b = rows[l1], rows[l2]
  added = lambda r, k: r["model"][k] - r["plain"]["model"][k]
  per_layer = {k: (added(b, k) - added(a, k)) / (l2 - l1) for k in FIELDS}
  fixed = {k: added(a, k) - l1 * per_layer[k] for k in FIELDS}
  by_op = {}
  for op in set(a["model"]["by_op"]) | set(a["plain"]["model"]["by_op"]):
    mine = a["model"]["by_op"].get(op, {"kernels": 0, "bytes": 0.0})
    base = a["plain"]["model"]["by_op"].get(op, {"kernels": 0, "bytes": 0.0})
    d = {"kernels": mine["kernels"] - base["kernels"], "bytes": mine["bytes"] - base["bytes"]}
    if d["kernels"] or abs(d["bytes"]) > 0:
      by_op[op] = d
  return {
      "plan": a["plan"], "remat": a["remat"], "prefetch": a["prefetch"],
      "dtypes": f"{a['param_dtype']}/{a['compute_dtype']}", "layers": [l1, l2],
      "xla_bytes": {"plain": a["plain"]["xla_bytes"], "plan": a["xla_bytes"],
                    "ratio": round(a["xla_bytes"] / a["plain"]["xla_bytes"], 4)},
      "step": {k: {"plain": a["plain"]["model"][k], "plan": a["model"][k]} for k in FIELDS},
      "added_per_layer": {k: round(v, 1) for k, v in per_layer.items()},
      "added_fixed": {k: round(v, 1) for k, v in fixed.items()},
      "added_by_op": dict(sorted(by_op.items(), key=lambda kv: -abs(kv[1]["bytes"]))),
      "collective_ops": a["collective_ops"], "compile_s": [a["compile_s"], b["compile_s"]],
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--platforms", default=None, help="cpu,h100 (default: h100 too where the CUDA plugin is)")
  parser.add_argument("--meshes", default="1x1,2x4")
  parser.add_argument("--configs", default=",".join(CONFIGS))
  parser.add_argument("--layers", default="4,8", help="two layer counts L1,L2 (per-layer figures: the difference)")
  parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "gpu", "added_work.json"))
  parser.add_argument("--notes", default=None, help="a JSON file whose object goes to the output's notes")
  parser.add_argument("--before", default=None, help="this benchmark's output for the code before a change: "
                      "its figures go beside these in `before_after`")
  args = parser.parse_args(argv)
  platforms = (args.platforms or ("cpu,h100" if gpu_aot.plugin_installed() else "cpu")).split(",")
  l1, l2 = map(int, args.layers.split(","))
  out = {"model": MODEL + [f"per-device batch {PER_DEVICE_BATCH}"], "layers": [l1, l2], "results": {}}
  if args.notes:
    with open(args.notes) as f:
      out["notes"] = json.load(f)
  for platform in platforms:
    plain_cache = {}
    for mesh in args.meshes.split(","):
      nodes, gpus = map(int, mesh.split("x"))
      for config in args.configs.split(","):
        try:
          rows = {n: measure(config, n, nodes, gpus, platform, plain_cache) for n in (l1, l2)}
        except Exception as e:  # noqa: BLE001  (a config the mesh cannot run: its one-line error)
          out["results"].setdefault(platform, {}).setdefault(mesh, {})[config] = {"error": str(e).splitlines()[0]}
          print(f"{platform} {mesh} {config}: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
          continue
        s = summarize(rows, l1, l2)
        out["results"].setdefault(platform, {}).setdefault(mesh, {})[config] = s
        _write(args.out, out)  # as it goes: a long run keeps what it measured
        print(f"{platform} {mesh} {config:15s} xla bytes x{s['xla_bytes']['ratio']:.3f}  per layer +"
              f"{s['added_per_layer']['bytes'] / 1e6:.3f} MB {s['added_per_layer']['kernels']:+.1f} kernels "
              f"({s['added_per_layer']['fusions']:+.1f} fusions)  fixed +{s['added_fixed']['bytes'] / 1e6:.3f} MB "
              f"{s['added_fixed']['kernels']:+.1f} kernels  collectives {s['step']['collectives']['plan']} "
              f"quantized {s['step']['quantized']['plan']}", file=sys.stderr, flush=True)
  if args.before:
    with open(args.before) as f:
      out["before_after"] = before_after(json.load(f)["results"], out["results"])
  print(_write(args.out, out))


def _write(path: str, out: dict) -> str:
  text = json.dumps(out, indent=1)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    f.write(text + "\n")
  return text


def before_after(before: dict, after: dict) -> dict:
  """Per platform, mesh and config measured in both: XLA's bytes over the plain step's, what a layer and
  the rest of the step add (bytes, non-matmul kernels), collectives and quantization kernels per step."""
  out = {}
  for platform, meshes in after.items():
    for mesh, configs in meshes.items():
      for config, a in configs.items():
        b = before.get(platform, {}).get(mesh, {}).get(config)
        if not b or "error" in a or "error" in b:
          continue
        fig = lambda r: {"xla_bytes_ratio": r["xla_bytes"]["ratio"],
                         "per_layer_bytes": r["added_per_layer"]["bytes"],
                         "per_layer_kernels": r["added_per_layer"]["kernels"],
                         "fixed_bytes": r["added_fixed"]["bytes"], "fixed_kernels": r["added_fixed"]["kernels"],
                         "collectives": r["step"]["collectives"]["plan"], "quantized": r["step"]["quantized"]["plan"]}
        out.setdefault(platform, {}).setdefault(mesh, {})[config] = {"before": fig(b), "after": fig(a)}
  return out


if __name__ == "__main__":
  main()
