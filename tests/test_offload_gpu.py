"""Host offload in the train step compiled for compile-only H100s (`zerojax.gpu_aot`): on 2 x 4, the offloaded
leaves are host-memory parameters of the program (layout memory space S(5)), XLA's host arguments are
`memory_report`'s host bytes to the byte, and the device's peak is bounded by the streamed update's
construction; on 1 x 1, traced as a GPU's jax types it (`bench_offload.compile_as_on_gpu`), the update writes
the donated host buffers in place: no host temporaries.

Needs jax's CUDA plugin (`pip install -e '.[gpu-aot]'`); nothing runs on a GPU."""
import re

import gin
import pytest

from zerojax import gpu_aot
from zerojax.executor import aot

pytestmark = pytest.mark.gpu_compile
if not gpu_aot.plugin_installed():
  pytest.skip("compiling for GPUs needs jax's CUDA plugin: pip install -e '.[gpu-aot]'", allow_module_level=True)

from zerojax.cli import compile as compile_cli  # noqa: E402

# 8 layers: the three largest chunks the streamed update may hold (three layers) are well below the offloaded bytes
SMALL = ["model_config.d_model=64", "model_config.seq_len=32", "model_config.num_layers=8", "train.batch_size=8"]
PARAM = re.compile(r"= \S+\{[^}]*?(:S\(5\))?\} parameter\(\d+\).*?op_name=\"(state\.[a-z_]+)")


def compiled(config: str, offload: tuple):
  gin.clear_config()
  try:
    name = config.split("/")[-1][:-4]
    built, args, cfg = compile_cli.gin_executor([config], SMALL + [f"{name}.offload={offload!r}"], "h100", 2, 4)
    ex = built.executor
    prog, _ = aot.compile_step(ex, (ex.accum_steps, args["batch_size"], cfg.seq_len + 1))
    return ex, prog
  finally:
    gin.clear_config()


@pytest.mark.parametrize("config, offload", [("configs/zero3.gin", ("opt_state", "master")),
                                             ("configs/mics.gin", ("opt_state",))])
def test_offloaded_leaves_stay_in_host_memory_and_leave_the_device_peak(config, offload):
  ex0, prog0 = compiled(config, ())
  ex, prog = compiled(config, offload)
  # where each argument of the step lives: S(5) is XLA's host memory space
  fields = {"opt_state": "state.opt_state", "master": "state.params"}
  host_fields = {fields[f] for f in offload}
  seen = {}
  for m in PARAM.finditer(prog.as_text()):
    seen.setdefault(m.group(2), set()).add(bool(m.group(1)))
  for field, in_host in seen.items():
    assert in_host == ({True} if field in host_fields else {False}), (field, in_host)
  assert host_fields <= set(seen)
  base, mem = gpu_aot.memory(prog0), gpu_aot.memory(prog)
  expected = compile_cli.memory_report(ex)["expected"]
  host, in_flight, kept = expected["host"], expected["host_in_flight"], expected["forward_kept"]
  assert mem["host"]["argument"] == host > 0 and base["host"]["argument"] == 0
  # what left the device's arguments is what the host holds; with the master weights offloaded (bf16 compute)
  # their bf16 rounding stays on the device between steps
  assert (kept > 0) == ("master" in offload)
  assert mem["argument"] == base["argument"] - host + kept
  # The streamed update's bound by construction: without offload the states are device arguments for the whole
  # step; with it, at most the three largest chunks' states are on the device at once, and the kept rounding.
  # The rest (16-bit parameters, gradients, activations, the update's temporaries) is the same program's.
  assert 0 < in_flight <= 0.5 * host, (in_flight, host)
  assert mem["device_peak"] <= base["device_peak"] - host + in_flight + kept, (base, mem, host, in_flight, kept)


def test_init_writes_offloaded_states_to_host_memory():
  """`Executor.init`'s last program (the optimizer's states from the master weights) writes the offloaded
  fields to host memory as it makes them: its host outputs are `memory_report`'s host bytes."""
  import jax
  from jax.sharding import NamedSharding

  gin.clear_config()
  try:
    ex = compile_cli.gin_executor(["configs/zero3.gin"], SMALL + ["zero3.offload=('opt_state', 'master')"],
                                  "h100", 2, 4)[0].executor
  finally:
    gin.clear_config()
  flat = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(ex.mesh, s)),
                      ex.flat_shapes(), ex.param_specs)
  prog = jax.jit(ex.init_from_flat, out_shardings=ex.shardings()).lower(flat).compile()
  assert gpu_aot.memory(prog)["host"]["output"] == compile_cli.memory_report(ex)["expected"]["host"] > 0


def test_streamed_update_writes_the_donated_host_buffers_in_place(monkeypatch):
  """dp on one H100, the step traced with its inputs in host memory as a GPU's jax types them: XLA's host
  outputs are the donated host arguments (aliased, `memory_report`'s host bytes) and there is no host
  temporary; the stacked layers of the fallback (`offload_stream.in_host_memory` false) are one in host memory."""
  import jax

  import zerojax
  import zerojax.plan as plans
  from zerojax.engine import layout, offload_stream
  from zerojax.executor.memory import memory_report
  from zerojax.models.gpt import GPTConfig, gpt
  from zerojax.train.optim import make_optimizer

  cfg = GPTConfig(vocab_size=256, seq_len=32, d_model=128, num_heads=2, num_layers=6)
  mesh = zerojax.make_mesh(1, 1, devices=gpu_aot.devices("h100", 1, 1))

  def host_memory():
    ex = zerojax.Executor(gpt(cfg), make_optimizer(total_steps=10), plans.dp(offload=("opt_state", "master")), mesh)
    return gpu_aot.memory(aot.compile_step(ex, (1, 1, 33))[0])["host"], ex
  got, ex = host_memory()
  host = memory_report(ex)["expected"]["host"]
  assert got == {"argument": host, "output": host, "alias": host, "temp": 0}, (got, host)
  monkeypatch.setattr(offload_stream, "in_host_memory", lambda tree: False)
  stacked, _ = host_memory()
  blocks = jax.tree.leaves(ex.layout.tree()["blocks"], is_leaf=layout.is_layout)
  assert stacked["temp"] >= 12 * sum(l.padded * l.layers for l in blocks) > 0, stacked  # master 4 + moments 8


def test_cli_compile_reports_the_offloaded_step_a_gpu_compiles(capsys):
  """`cli.compile` on a compile-only H100 (dp, both fields offloaded): the step is compiled with its inputs in
  host memory, as a GPU's jax types them. The in-place update shows it (host outputs are the donated host
  arguments, no host temporaries: the inputs dropped to device memory would stack the layers anew), and the
  device peak is that of the step traced on a CPU device (which has host memory) and compiled for the H100,
  not that of the step traced on the compile-only H100 (its inputs' host memory dropped)."""
  import json

  import jax
  import numpy as np
  from jax._src import compiler
  from jax._src.lib import xla_client as xc

  gin_params = ["model_config.d_model=128", "model_config.seq_len=32", "model_config.num_layers=6",
                "train.batch_size=1", "train.compute_dtype='bfloat16'", "dp.offload=('opt_state', 'master')"]
  gin.clear_config()
  try:
    assert compile_cli.main(["--gin_file=configs/dp.gin", "--mesh=1x1", "--json"]
                            + [f"--gin_param={p}" for p in gin_params]) == 0
    rep = json.loads(capsys.readouterr().out)
    built, _, cfg = compile_cli.gin_executor(["configs/dp.gin"], gin_params, "h100", 1, 1)
    ex = built.executor
  finally:
    gin.clear_config()
  shape = (1, 1, cfg.seq_len + 1)
  host = compile_cli.memory_report(ex)["expected"]["host"]
  assert rep["memory"]["host"] == {"argument": host, "output": host, "alias": host, "temp": 0}, (rep["memory"], host)
  # the reference: traced on a CPU device, lowered for CUDA, compiled for the compile-only H100
  cpu = ex.on_devices(jax.devices("cpu")[:1])
  module = cpu.step_fn().trace(*aot.abstract_inputs(cpu, shape)).lower(lowering_platforms=("cuda",))
  gpu = next(iter(ex.mesh.devices.flat))
  options = compiler.get_compile_options(num_replicas=1, num_partitions=1, device_assignment=np.array([[gpu]]),
                                         env_options_overrides=ex.compiler_options(), backend=gpu.client)
  exe = compiler.backend_compile_and_load(gpu.client, module.compiler_ir("stablehlo"), xc.DeviceList((gpu,)),
                                          options, [])
  want = gpu_aot.memory(type("C", (), {"memory_analysis": lambda self: exe.get_compiled_memory_stats()})())
  assert rep["memory"]["device_peak"] == want["device_peak"] > 0, (rep["memory"], want)
  # the route the report no longer takes: the step traced on the compile-only H100 itself
  dropped = gpu_aot.memory(ex.step_fn().lower(*aot.abstract_inputs(ex, shape)).compile())
  assert dropped["host"]["temp"] > 0 and dropped["device_peak"] != want["device_peak"], dropped


def test_host_update_moves_only_gradients_down_and_16bit_parameters_up():
  """dp on one H100 compiled as on a GPU, the update on the host (`offload_update="host"`): per step the
  program moves the fp32 gradients down (4 bytes per parameter) and the bf16 parameters up (2), and none of the
  12 bytes per parameter of master weights and moments the streamed update fetches and stores."""
  import zerojax
  import zerojax.plan as plans
  from zerojax.analysis.host_moves import host_moves
  from zerojax.models.gpt import GPTConfig, gpt
  from zerojax.train.optim import make_optimizer

  cfg = GPTConfig(vocab_size=256, seq_len=32, d_model=128, num_heads=2, num_layers=4)
  mesh = zerojax.make_mesh(1, 1, devices=gpu_aot.devices("h100", 1, 1))
  moved = {}
  for update in ("host", "streamed"):
    ex = zerojax.Executor(gpt(cfg), make_optimizer(total_steps=10),
                          plans.dp(offload=("opt_state", "master"), offload_update=update, compute_dtype="bfloat16"), mesh)
    moved[update] = host_moves(aot.compile_step(ex, (1, 1, 33))[0].as_text())
  numel = sum(l.padded * (l.layers or 1) for l in ex.layout.leaves)
  assert moved["host"]["device_to_host"] == 4 * numel and moved["host"]["host_to_device"] == 2 * numel, moved["host"]
  # the streamed update: the master weights and moments once each way (12 bytes); its bf16 weights stay on the
  # device, and no layer crosses twice
  assert moved["streamed"]["device_to_host"] == moved["streamed"]["host_to_device"] == 12 * numel, moved["streamed"]


def test_streamed_layers_move_both_directions_at_once(monkeypatch):
  """dp on one H100 compiled as on a GPU, the streamed update over 6 layers: in the scan over the layers, every
  fetch of layer i + 1 and store of layer i - 1 is in flight beside a move of the other direction (bytes, in
  schedule order: `host_moves`' `overlapped`), and the peak holds three layers' states, not more. With XLA's
  default of two async moves in flight (the user's XLA_FLAGS win over `Executor.compiler_options`), the stores
  queue behind the fetches."""
  import zerojax
  import zerojax.plan as plans
  from zerojax.analysis.host_moves import host_moves
  from zerojax.models.gpt import GPTConfig, gpt
  from zerojax.train.optim import make_optimizer

  cfg = GPTConfig(vocab_size=256, seq_len=32, d_model=256, num_heads=2, num_layers=6)
  mesh = zerojax.make_mesh(1, 1, devices=gpu_aot.devices("h100", 1, 1))
  ex = zerojax.Executor(gpt(cfg), make_optimizer(total_steps=10),
                        plans.dp(offload=("opt_state", "master"), compute_dtype="bfloat16"), mesh)
  assert ex.compiler_options()[gpu_aot.ASYNC_MOVES] == ex.placement.offload.moves(ex.shardings()) > 2

  def layer_loop():
    moved = host_moves(aot.compile_step(ex, (1, 1, 33))[0].as_text())
    return next(c for c in moved["per_computation"].values() if c["executions"] == cfg.num_layers - 2)
  loop = layer_loop()
  assert loop["host_to_device"] == loop["device_to_host"] > 0, loop  # one layer's master and states each way
  for d in ("host_to_device", "device_to_host"):
    assert loop["overlapped"][d] >= 0.9 * loop[d], loop
  assert loop["kernels_beside_moves"] >= loop["kernels"] // 2 > 0, loop  # the update runs beside the copies
  monkeypatch.setenv("XLA_FLAGS", f"--{gpu_aot.ASYNC_MOVES}=2")
  assert gpu_aot.ASYNC_MOVES not in ex.compiler_options()
  serial = layer_loop()
  assert serial["overlapped"]["device_to_host"] < 0.5 * serial["device_to_host"], serial
