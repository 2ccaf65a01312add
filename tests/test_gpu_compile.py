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

pytestmark = pytest.mark.gpu_compile
if not gpu_aot.plugin_installed():
  pytest.skip("compiling for GPUs needs jax's CUDA plugin: pip install -e '.[gpu-aot]'", allow_module_level=True)

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
      ex, args, cfg = compile_cli.gin_executor([config], (SMALL if small else []) + list(params), "h100", 2, 4)
      prog, seconds = gpu_aot.compile_step(ex, (ex.accum_steps, args["batch_size"], cfg.seq_len + 1))
      _cache[key] = {"report": compile_cli.report(ex, prog, seconds), "text": prog.as_text(), "ex": ex}
    finally:
      gin.clear_config()
  return _cache[key]


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_every_plan_config_compiles_for_h100s(config):
  rep = compiled(config)["report"]
  assert rep["device_kind"] == "NVIDIA H100 80GB HBM3"
  assert rep["mesh"] == {"node": 2, "gpu": 4} or sum(rep["mesh"].values()) > 0
  assert rep["collectives"], "a sharded step without collectives"
  assert all(c["async"] for c in rep["collectives"] if c["role"] in LAYER_ROLES), rep["collectives"]
  assert any(k.startswith("fusion __triton") for k in rep["kernels"]), rep["kernels"]
  assert rep["memory"]["argument"] > 0 and rep["memory"]["temp"] > 0


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
