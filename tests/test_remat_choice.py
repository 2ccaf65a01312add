"""remat "auto" (`zerojax.planner.remat.choose`): the fastest mode whose compiled step fits the device,
measured on CPU with a given capacity (CPUs report none and are not priced) and on compile-only H100s; the GPU compiler
options give way to the user's XLA_FLAGS."""
import dataclasses

import numpy as np
import optax
import pytest

import zerojax
from zerojax import gpu_aot
from zerojax.analysis.hlo_text import Collective
from zerojax.analysis.schedule import Scheduled
from zerojax.executor import aot
from zerojax.models.gpt import GPTConfig, gpt
from zerojax.planner import remat as remat_choice
from zerojax.planner.links import NCCL_RING_SIMPLE_US

CFG = GPTConfig(seq_len=32, d_model=64, num_heads=4, num_layers=2)
BATCH = (1, 8, CFG.seq_len + 1)


def fake_measure(peaks: dict, seconds: dict | None = None, exposed: dict | None = None):
  """A `measure` from given peaks and (when given) estimated seconds and exposed collective seconds."""
  calls = []

  def measure(ex, batch_shape):
    mode = ex.components.remat
    calls.append(mode)
    assert batch_shape == BATCH
    out = {"device_peak": peaks[mode], "tflops": 1.0}
    if seconds is not None:
      out.update(seconds=seconds[mode], exposed_s=exposed[mode])
    return out
  return measure, calls


@pytest.mark.parametrize("capacity,expect,tried", [(100, "none", ["none"]), (60, "dots", ["none", "dots"]),
                                                   (30, "full", ["none", "dots", "full"]),
                                                   (15, "offloaded", ["none", "dots", "full", "offloaded"])])
def test_unpriced_auto_takes_the_first_mode_that_fits_least_recompute_first(capacity, expect, tried):
  """A device without a known peak or links: memory alone decides, as before pricing."""
  measure, calls = fake_measure({"none": 90, "dots": 50, "full": 20, "offloaded": 12})
  plan, report = remat_choice.choose(gpt(CFG), optax.adam(1e-3), zerojax.zero3(), zerojax.make_mesh(2), BATCH,
                                     capacity=capacity, measure=measure)
  assert plan.schedule.remat == expect and report["remat"] == expect and calls == tried
  assert [r["fits"] for r in report["rows"]] == [False] * (len(tried) - 1) + [True]
  assert expect in report["why"] and (len(tried) == 1 or "did not fit" in report["why"])


@pytest.mark.parametrize("full_s,expect", [(8.0, "full"), (12.0, "none")])
def test_priced_auto_takes_the_fastest_mode_that_fits(full_s, expect):
  """"none" fits but leaves 3 s of collectives exposed: every mode is compiled and priced; "full" (more
  matmuls, nothing exposed) is taken only where its price is lower; "dots" ties with "none" and loses."""
  measure, calls = fake_measure({"none": 90, "dots": 50, "full": 20, "offloaded": 12},
                                seconds={"none": 10.0, "dots": 10.0, "full": full_s},
                                exposed={"none": 3.0, "dots": 3.0, "full": 0.0})
  plan, report = remat_choice.choose(gpt(CFG), optax.adam(1e-3), zerojax.zero3(), zerojax.make_mesh(2), BATCH,
                                     capacity=100, measure=measure)
  assert calls == ["none", "dots", "full"] and plan.schedule.remat == expect, report
  assert "faster than" in report["why"] and f"{min(10.0, full_s) * 1e3:.3g} ms a step" in report["why"]


def test_priced_auto_stops_at_a_mode_with_nothing_exposed():
  measure, calls = fake_measure({"none": 90, "dots": 50, "full": 20, "offloaded": 12},
                                seconds={"none": 10.0, "dots": 10.0, "full": 8.0},
                                exposed={"none": 0.0, "dots": 0.0, "full": 0.0})
  plan, _ = remat_choice.choose(gpt(CFG), optax.adam(1e-3), zerojax.zero3(), zerojax.make_mesh(2), BATCH,
                                capacity=95, measure=measure)
  assert plan.schedule.remat == "none" and calls == ["none"]


def test_when_nothing_fits_auto_says_so_and_takes_the_smallest():
  measure, _ = fake_measure({"none": 90, "dots": 50, "full": 20, "offloaded": 12})
  plan, report = remat_choice.choose(gpt(CFG), optax.adam(1e-3), zerojax.zero3(), zerojax.make_mesh(2), BATCH,
                                     capacity=10, measure=measure)
  assert plan.schedule.remat == "offloaded" and not any(r["fits"] for r in report["rows"])
  assert "no mode fits" in report["why"] and "shrink the batch" in report["why"]


def test_a_plan_that_names_its_remat_and_a_device_without_memory_keep_the_plan():
  measure, calls = fake_measure({})
  plan = zerojax.zero3(remat="dots")
  assert remat_choice.choose(gpt(CFG), optax.adam(1e-3), plan, zerojax.make_mesh(2), BATCH, capacity=1,
                             measure=measure)[0] is plan
  auto = zerojax.zero3()
  same, report = remat_choice.choose(gpt(CFG), optax.adam(1e-3), auto, zerojax.make_mesh(2), BATCH, measure=measure)
  assert same is auto and calls == [] and report["remat"] == "full" and report["capacity"] is None
  assert gpu_aot.device_memory(zerojax.make_mesh(2)) is None  # CPUs report no memory to fit


def test_an_exposed_collective_is_priced_by_the_alpha_beta_model():
  """MiCS's replica all-reduce over 2 nodes of 4: 2 ring steps, both between nodes; 1 MB leaves each node
  (4 devices x 256 KB) over 400 GB/s; 7 executions."""
  mesh = zerojax.make_mesh(2)
  c = Collective(op="all-reduce", dtype="bf16", operand_shapes=(), result_shapes=(), replica_groups=((0, 4),),
                 axes=("node",), computation="body", bytes_per_device=2.5e5, cross_node_bytes_per_device=2.5e5,
                 count=7, node_egress_bytes=1e6)
  s = Scheduled(c, is_async=True, in_layer_loop=True, loops=1, matmuls=0, kernels=0)
  lat = NCCL_RING_SIMPLE_US
  alpha = (lat["base"] + 2 * lat["inter"]) * 1e-6
  assert remat_choice.exposed_seconds(s, mesh, (450e9, 400e9)) == pytest.approx(7 * (alpha + 1e6 / 400e9))


def test_auto_on_compiled_cpu_programs_keeps_activations_where_they_fit():
  """The real measure (compiled device peaks on the CPU devices): more activation memory, less recompute."""
  cfg = dataclasses.replace(CFG, seq_len=128)  # activations (the scores: 1 MB a layer) outweigh the state
  model, opt, mesh, batch = gpt(cfg), optax.adam(1e-3), zerojax.make_mesh(2), (1, 16, 129)
  big, report = remat_choice.choose(model, opt, zerojax.zero3(), mesh, batch, capacity=1 << 40)
  assert big.schedule.remat == "none" and len(report["rows"]) == 1
  peaks = {}
  for mode in remat_choice.ORDER:
    compiled, _ = aot.compile_step(zerojax.Executor(model, opt, zerojax.zero3(remat=mode), mesh), batch)
    peaks[mode] = gpu_aot.memory(compiled)["device_peak"]
  assert peaks["none"] > 1.5 * peaks["full"], peaks
  plan, report = remat_choice.choose(model, opt, zerojax.zero3(), mesh, batch, capacity=peaks["none"] - 1)
  assert plan.schedule.remat in ("dots", "full") and report["rows"][0]["device_peak"] == peaks["none"]
  assert not report["rows"][0]["fits"] and report["rows"][0]["seconds"] is None  # CPUs: not priced


def test_the_users_xla_flags_win_over_zerojaxs_gpu_options(monkeypatch):
  mesh = zerojax.make_mesh(2)
  monkeypatch.setattr(gpu_aot, "is_gpu", lambda m: True)
  name = next(iter(gpu_aot.GPU_COMPILER_OPTIONS))
  assert gpu_aot.compiler_options(mesh, env={}) == gpu_aot.GPU_COMPILER_OPTIONS
  env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=8 --{name}=1"}
  assert name not in gpu_aot.compiler_options(mesh, env=env)
  assert gpu_aot.options_report(mesh, env=env)["user"] == {name: "1"}
  # with offloaded state: every move of its arrays may be in flight (`HostOffload.moves`), unless the user says
  assert gpu_aot.compiler_options(mesh, env={}, host_moves=40)[gpu_aot.ASYNC_MOVES] == 40
  assert gpu_aot.ASYNC_MOVES not in gpu_aot.compiler_options(mesh, env={}, host_moves=0)
  env = {"XLA_FLAGS": f"--{gpu_aot.ASYNC_MOVES}=2"}
  assert gpu_aot.ASYNC_MOVES not in gpu_aot.compiler_options(mesh, env=env, host_moves=40)
  assert gpu_aot.options_report(mesh, env=env)["user"] == {gpu_aot.ASYNC_MOVES: "2"}


def test_the_trainer_reports_its_choice(tmp_path):
  from zerojax.train import trainer
  built = trainer.build(zerojax.zero3(), 2, steps=2, batch_size=8)
  assert built.remat["remat"] == "full" and built.remat["capacity"] is None
  assert built.executor.components.remat == "full" and built.planner_rows is None


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("nodes,gpus", [(1, 1), (2, 4)])
def test_auto_picks_none_for_the_default_gpt_on_compile_only_h100s(nodes, gpus):
  gpu_aot.compile_only_host()
  mesh = zerojax.make_mesh(nodes, devices=gpu_aot.devices("h100", nodes, gpus))
  capacity = gpu_aot.device_memory(mesh, env={})
  assert capacity == int(0.75 * 84929347584)
  cfg = dataclasses.replace(GPTConfig(), seq_len=256)
  plan, report = remat_choice.choose(gpt(cfg), optax.adam(1e-3), zerojax.zero3(), mesh, (1, 8 * nodes * gpus, 257))
  assert plan.schedule.remat == "none" and report["rows"][0]["fits"], report
  assert 0 < report["rows"][0]["device_peak"] < capacity
  assert np.isfinite(report["rows"][0]["device_peak"])


@pytest.mark.gpu_compile
def test_offloaded_remat_keeps_the_layers_inputs_in_host_memory_on_compile_only_h100s():
  """remat "offloaded" compiled for an H100: "full"'s recompute with each layer's input in host memory
  between the forward and the backward: the device peak is lower by about the inputs of the layers, and
  the program moves values to the host memory space (`S(5)`) and back, where "full" moves none."""
  gpu_aot.compile_only_host()
  mesh = zerojax.make_mesh(1, devices=gpu_aot.devices("h100", 1, 1))
  cfg = GPTConfig(seq_len=256, d_model=512, num_heads=4, num_layers=16)  # the inputs outweigh the rest
  batch, memory, hlo = (1, 32, cfg.seq_len + 1), {}, {}
  for mode in ("full", "offloaded"):
    ex = zerojax.Executor(gpt(cfg), optax.adam(1e-3), zerojax.zero3(remat=mode), mesh)
    compiled, _ = aot.compile_step(ex, batch)
    memory[mode], hlo[mode] = gpu_aot.memory(compiled), compiled.as_text()
  inputs = cfg.num_layers * batch[1] * cfg.seq_len * cfg.d_model * 2  # the layers' bf16 inputs
  assert memory["offloaded"]["host"]["temp"] == inputs and memory["full"]["host"]["temp"] == 0, memory
  assert memory["full"]["device_peak"] - memory["offloaded"]["device_peak"] >= 0.5 * inputs, memory
  assert "S(5)" in hlo["offloaded"] and "S(5)" not in hlo["full"]
