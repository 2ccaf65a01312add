"""The train step compiled for 2 x 4 compile-only H100s (`zerojax.gpu_aot`): what the GPU program does.

Needs jax's CUDA plugin (`pip install -e '.[gpu-aot]'`); without it every test here is skipped for that
reason alone. Nothing runs: each test reads the scheduled H100 program and its memory analysis, compiled
once per config (module-scoped) for a small GPT.
"""
import glob
import os

import gin
import pytest

from zerojax import gpu_aot
from zerojax.executor import aot

pytestmark = pytest.mark.gpu_compile
if not gpu_aot.plugin_installed():
  pytest.skip("compiling for GPUs needs jax's CUDA plugin: pip install -e '.[gpu-aot]'", allow_module_level=True)

from zerojax.analysis import QUANTIZED_TYPES, quantized_arrays  # noqa: E402
from zerojax.analysis.schedule import LAYER_ROLES  # noqa: E402
from zerojax.cli import compile as compile_cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "*.gin"))
                 if not p.endswith(("base.gin", "auto.gin")))  # auto.gin measures this machine to pick a plan
SMALL = ["model_config.d_model=64", "model_config.seq_len=32", "model_config.num_layers=4",
         "train.batch_size=8"]
_cache = {}


def compiled(config: str, params=(), small: bool = True) -> dict:
  """The report of `config`'s step compiled for 2 x 4 H100s (cached for the module); `small`: a smaller
  GPT than the config's, else the config's own (base.gin's 4-layer GPT, 20-40 s to compile here)."""
  key = (config, tuple(params), small)
  if key not in _cache:
    gin.clear_config()
    try:
      built, args, cfg = compile_cli.gin_executor([config], (SMALL if small else []) + list(params), "h100", 2, 4)
      ex = built.executor
      prog, seconds = aot.compile_step(ex, (ex.accum_steps, args["batch_size"], cfg.seq_len + 1))
      _cache[key] = {"report": compile_cli.report(ex, prog, seconds, built.remat), "text": prog.as_text(), "ex": ex}
    finally:
      gin.clear_config()
  return _cache[key]


@pytest.mark.parametrize("params,want", [((), "bfloat16"), (("train.compute_dtype='float32'",), "float32")])
def test_the_gpu_computes_in_bf16_unless_the_config_says_otherwise(params, want):
  """configs/base.gin leaves the compute dtype to the platform: a shipped config built for GPUs computes
  in bf16, its weights on the wire bf16 and its gradient reductions fp32 as before;
  `train.compute_dtype='float32'` wins."""
  gin.clear_config()
  try:
    ex = compile_cli.gin_executor(["configs/zero3.gin"], SMALL + ["zero3.remat='full'", *params], "h100", 2,
                                  4)[0].executor
  finally:
    gin.clear_config()
  s = ex.plan.settings()
  assert (s["compute_dtype"], s["param_dtype"], s["reduce_dtype"]) == (want, "bfloat16", "float32")


@pytest.mark.parametrize("config", ["configs/zero3.gin", "configs/zeropp.gin", "configs/mics.gin"])
def test_every_layer_loop_collective_overlaps_a_matmul(config):
  """Forward gather, backward gather and gradient reduction inside the layer loops each have a matmul
  (of another layer: nothing between start and done can use the collective's result) scheduled
  between start and done (ZeRO §7's overlap). The shipped configs' own model: the schedule follows XLA's
  cost model, and for a much smaller GPT (d_model 64) qgZ's cross-node hop is left without a matmul."""
  rep = compiled(config, small=False)["report"]
  assert rep["prefetch"] is True
  loop = [c for c in rep["collectives"] if c["in_layer_loop"] and c["role"] in LAYER_ROLES]
  assert {c["role"] for c in loop} == set(LAYER_ROLES), loop
  lonely = [(c["role"], c["op"], c["matmuls_between"]) for c in loop if c["matmuls_between"] < 1]
  assert not lonely, f"layer-loop collectives with no matmul in flight: {lonely}"


@pytest.mark.parametrize("via", ["auto", "reduce_scatter"])
def test_bf16_gradient_reductions_stay_bf16_on_gpu(via):
  """16-bit gradients are reduced in 16 bits in the GPU program: by default as qgZ's 2-hop all-to-all of
  the raw bf16 words (u16 on the wire), or as one bf16 reduce-scatter, which XLA:GPU does not widen."""
  rep = compiled("configs/zero3_bf16grad.gin", [f"zero3.reduce_via='{via}'"])["report"]
  grads = [(c["op"], c["dtype"]) for c in rep["collectives"] if c["role"] == "gradient reduction"]
  assert grads
  want = {("all-to-all", "u16")} if via == "auto" else {("reduce-scatter", "bf16")}
  assert set(grads) == want, grads


def test_head_gathers_in_its_own_backward():
  """No backward gather is scheduled before the forward's layer loop has run (the head's re-gather was
  merged with the embedding's forward gather at the step's start, keeping its weights through the
  forward)."""
  rep = compiled("configs/zero3.gin", small=False)["report"]
  assert rep["backward_gathers_in_forward"] == []


def test_at_most_two_gathered_layers_alive_in_the_layer_loops():
  """While the forward's and the backward's layer loops run (prefetch carries the next layer), at most two
  layers' gathered weights are alive and nothing gathered outside them: not the head's merged re-gather
  (which kept the head's weights through the forward), not the head's forward gather (kept through the
  backward while XLA computed the loss, an output only, at the step's end); read from the live ranges
  of the gathered arrays in the scheduled program."""
  rep = compiled("configs/zero3.gin", small=False)["report"]
  layer = max(2 * c["result_shapes"][0][0] * c["result_shapes"][0][1] for c in rep["collectives"]
              if c["in_layer_loop"] and c["op"] == "all-gather")  # u16 words of one layer
  loops = rep["gathered_alive"]["layer_loops"]
  assert {e["direction"] for e in loops} == {"forward", "backward"}, loops
  for e in loops:
    assert e["outside_bytes"] == 0, e
    assert 0 < e["bytes"] <= 2 * layer, (e, layer)


def test_prefetch_with_qgz_state():
  """Prefetch, a schedule of the unit's one engine, is on by default with qgZ's error feedback and
  stochastic rounding: each layer loop's gathers and reductions stay asynchronous, and no gathered
  weights are alive outside the layer loops while they run."""
  rep = compiled("configs/zeropp.gin", ("zeropp.grad_error_feedback=True", "zeropp.stochastic_rounding=True"))["report"]
  assert rep["prefetch"] is True
  loop = [c for c in rep["collectives"] if c["in_layer_loop"] and c["role"] in LAYER_ROLES]
  assert {c["role"] for c in loop} == set(LAYER_ROLES) and all(c["async"] for c in loop), loop
  loops = rep["gathered_alive"]["layer_loops"]
  assert {e["direction"] for e in loops} == {"forward", "backward"}, loops
  assert all(e["outside_bytes"] == 0 for e in loops), loops


@pytest.mark.parametrize("plan,remat", [("zero3", "dots"), ("zeropp", "none")])
def test_prefetch_is_the_gpu_default_in_every_remat_mode(plan, remat):
  """With remat "dots" / "none" the default prefetch is on for GPUs: every layer-loop collective is
  asynchronous with a matmul between its start and done, and nothing gathered outside the layer loops
  (the head's weights) is alive while they run."""
  rep = compiled(f"configs/{plan}.gin", (f"{plan}.remat='{remat}'",))["report"]
  assert rep["prefetch"] is True
  loop = [c for c in rep["collectives"] if c["in_layer_loop"] and c["role"] in LAYER_ROLES]
  assert {c["role"] for c in loop} == set(LAYER_ROLES) and all(c["async"] for c in loop), loop
  assert all(e["overlapped"] == e["in_loop"] for e in rep["overlap"].values()), rep["overlap"]
  loops = rep["gathered_alive"]["layer_loops"]
  assert {e["direction"] for e in loops} == {"forward", "backward"}, loops
  assert all(e["outside_bytes"] == 0 for e in loops), loops


SYNC_IN_BACKWARD = ("configs/mics.gin", "configs/mics_qwz.gin")  # replicas all-reduced in each layer's backward


@pytest.mark.parametrize("config", CONFIGS)
def test_every_collective_has_a_role_and_every_layer_collective_compute_in_flight(config):
  """Every shipped config on its own 4-layer GPT compiles for H100s, with Triton fusions, every layer
  collective async and a device memory analysis; no collective is "other" (one XLA combined from several
  takes its parts' role: MiCS's in-backward replica all-reduce is "replica sync", the gradient norm's
  partial sums "metrics"); every collective of the layer loops has a kernel in flight between its start
  and done, and the overlap table counts each of them under its role. MiCS's replica all-reduce, on
  the slow cross-node link, has a matmul in flight (layer i's backward: layer i+1's reduce-scatter,
  whose result it sums, runs beside layer i's recomputed forward); before, it followed the
  reduce-scatter with only the loop's slice updates between its start and done. Each config computes in
  the GPUs' bf16 with cuDNN's fused attention, and holds quantized arrays (`analysis.quantized_arrays`)
  exactly where its plan quantizes, every collective of an 8- or 4-bit type among them."""
  from collections import Counter

  # remat "auto" (the default) prices each mode: MiCS's in-backward replica all-reduce has no matmul beside
  # it under "none" and the recomputed forward under "full", which it therefore takes (`planner.remat`).
  got = compiled(config, small=False)
  rep = got["report"]
  if config in SYNC_IN_BACKWARD:
    assert rep["remat"]["remat"] == "full" and "faster than 'none'" in rep["remat"]["why"], rep["remat"]
  assert rep["device_kind"] == "NVIDIA H100 80GB HBM3"
  assert rep["mesh"] == {"node": 2, "gpu": 4} or sum(rep["mesh"].values()) > 0
  assert rep["collectives"], "a sharded step without collectives"
  assert all(c["async"] for c in rep["collectives"] if c["role"] in LAYER_ROLES), rep["collectives"]
  assert any(k.startswith("fusion __triton") for k in rep["kernels"]), rep["kernels"]
  assert rep["memory"]["argument"] > 0 and rep["memory"]["temp"] > 0
  other = [(c["op"], c["axes"], c["result_shapes"]) for c in rep["collectives"] if c["role"] == "other"]
  assert not other, f"collectives without a role: {other}"
  loop = [c for c in rep["collectives"] if c["in_layer_loop"]]
  idle = [(c["role"], c["op"], c["axes"]) for c in loop if c["kernels_between"] < 1]
  assert not idle, f"layer-loop collectives with nothing in flight: {idle}"
  assert {r: e["in_loop"] for r, e in rep["overlap"].items()} == Counter(c["role"] for c in loop)
  sync = [c for c in loop if c["role"] == "replica sync"]
  assert bool(sync) == (config in SYNC_IN_BACKWARD), sync
  assert all(c["matmuls_between"] >= 1 and c["axes"] == ["node"] for c in sync), sync
  # quantized data where the plan quantizes, and only there: every collective of an 8-/4-bit type is among
  # the quantized arrays; a plan without qwZ / qgZ has none, though its bf16 step calls cuDNN (u8 workspaces)
  settings, found = got["ex"].plan.settings(), quantized_arrays(got["text"])
  wire = [c["name"] for c in rep["collectives"] if set(c["dtype"].split(",")) & set(QUANTIZED_TYPES)]
  assert settings["compute_dtype"] == "bfloat16" and "__cudnn$fmha" in got["text"]  # the GPU's defaults
  if any(settings[k] for k in ("weight_bits", "grad_bits", "weight_format", "grad_format")):
    assert wire and set(wire) <= {q.name for q in found}, (wire, found[:10])
  else:
    assert not wire and not found, (wire, found[:10])


def _plain_bytes(ex, cfg, optimizer, batch: int) -> tuple[float, str]:
  """(bytes accessed, optimized text) of the plain step of `ex`'s GPT on one device of its kind: fp32
  master weights cast to the plan's param and compute dtypes, `jax.value_and_grad` of the same loss with
  each unit under `jax.checkpoint` (remat "full"), the same optax update (benchmarks/bench_added_work.py
  compares every plan so)."""
  import jax
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import SingleDeviceSharding

  from zerojax.models.gpt import Block, embed_tokens, gpt, head_loss

  assert ex.components.remat == "full"
  block, g = Block(cfg), ex.components.gather
  layer = jax.checkpoint(lambda p, x: block.apply({"params": p}, x))
  embed, head = jax.checkpoint(embed_tokens), jax.checkpoint(head_loss)

  def loss(p, tokens):
    x = lax.scan(lambda c, lp: (layer(lp, c), None), embed(p["embed"], tokens[:, :-1]), p["blocks"])[0]
    return head(p["head"], x, tokens[:, 1:])

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(loss)(jax.tree.map(lambda m: m.astype(g.dtype).astype(g.compute_dtype), params),
                                            tokens)
    updates, opt_state = optimizer.update(jax.tree.map(lambda x: x.astype(np.float32), grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  one = SingleDeviceSharding(next(iter(ex.mesh.devices.flat)))
  abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), t)
  params = jax.eval_shape(gpt(cfg).init, jax.random.key(0))
  plain = jax.jit(step, donate_argnums=(0, 1)).lower(
      abstract(params), abstract(jax.eval_shape(optimizer.init, params)),
      jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), np.int32, sharding=one)).compile()
  return _bytes_accessed(plain), plain.as_text()


def _bytes_accessed(compiled) -> float:
  """XLA's cost analysis of a compiled program: a compile-only GPU has none, so XLA's `HloCostAnalysis`
  of the same optimized program runs through the host's client."""
  import jax
  from jaxlib import _hlo, _jax

  cost = compiled.cost_analysis()
  if not cost:
    cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, _hlo.hlo_module_from_text(compiled.as_text()))
  return float(cost["bytes accessed"])


@pytest.mark.parametrize("plan", ["zero3", "zeropp", "mics"])
def test_one_h100_runs_no_collective_no_quantization_and_the_plain_steps_bytes(plan):
  """On one compile-only H100 (mesh 1 x 1) the plan moves nothing and quantizes nothing: its program has
  no collective, no int8/int4/float8 array (`analysis.quantized_arrays`: the u8 workspaces of cuDNN's fused
  attention, which the platform's bf16 compute calls, are not data) and no quantization kernel, and
  prefetch is off (nothing to fetch ahead); XLA's bytes accessed are within 5% of a plain
  `jax.jit(value_and_grad)` + optax step of the same model, dtypes and remat (docs/gpu.md, "Work a device
  does not need")."""
  import re

  from zerojax.train.optim import make_optimizer

  gin.clear_config()
  try:
    # the plain step below is remat "full"'s; "auto" would pick "none" on an H100
    built, args, cfg = compile_cli.gin_executor([f"configs/{plan}.gin"], SMALL + [f"{plan}.remat='full'"], "h100", 1, 1)
    ex = built.executor
    prog, _ = aot.compile_step(ex, (ex.accum_steps, args["batch_size"], cfg.seq_len + 1))
    plain, plain_text = _plain_bytes(ex, cfg, make_optimizer(total_steps=args["steps"]), args["batch_size"])
  finally:
    gin.clear_config()
  text = prog.as_text()
  assert not re.findall(r"\b(?:all-gather|reduce-scatter|all-to-all|all-reduce|collective-permute)(?:-start)?\(", text)
  assert not quantized_arrays(text), quantized_arrays(text)  # cuDNN's u8 workspaces are scratch, not data
  assert ex.plan.settings()["compute_dtype"] == "bfloat16" and "__cudnn$fmhaSoftmax" in text  # the GPU's defaults
  assert "__gpu$xla.gpu.triton" not in text and "mosaic" not in text.lower()  # no Pallas / Triton / Mosaic kernel
  assert ex.components.prefetch is False
  ratio = _bytes_accessed(prog) / plain
  assert abs(ratio - 1) <= 0.05, f"bytes accessed {ratio:.3f} x the plain step's"


@pytest.mark.slow
def test_overlapped_outer_gradient_crosses_nodes_while_the_inner_step_computes():
  """Streaming DiLoCo's overlap (`diloco(overlap=True)`, τ = 1): the outer gradient's all-reduce between
  nodes waits on nothing the step computes, so the H100 schedule runs some of the inner step's matmuls
  while it is in flight; without overlap it waits on the update and nothing overlaps it. Same bytes either
  way. How many matmuls XLA's latency estimate puts under it depends on the program (α = 0 makes the
  inner update of the synced weights dead code). Read through `bench_gpu_compile.py --diloco_overlap`."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("bench_gpu_compile", os.path.join(ROOT, "benchmarks", "bench_gpu_compile.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)

  rows = bench.diloco_overlap()["rows"]
  assert [r["gin_params"] for r in rows] == [[], ["diloco.overlap=True", "diloco.mix=0.5"],
                                             ["diloco.overlap=True", "diloco.mix=0.0"]]
  found = []
  for r in rows:
    (cross,) = r["cross_node"]
    assert cross["op"] == "all-reduce" and cross["async"], cross
    found.append(cross)
  plain, *overlapped = found
  assert plain["matmuls_between"] == 0, plain
  assert all(c["matmuls_between"] >= 1 for c in overlapped), found
  assert {c["cross_node_bytes_per_device"] for c in found} == {plain["cross_node_bytes_per_device"]}
