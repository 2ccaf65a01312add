"""The planner's memory from the compiled program (`zerojax.planner.compiled`, `cli.plan --compiled_memory`).

The fast tests need no CUDA plugin: the one-line errors, the arguments' checks, and how `check_rows`
puts the compiled peak in place of the formula's "fits". The `gpu_compile` test compiles LLaMA-7B-shaped
steps for 128 x 8 compile-only A100s (AMSP's cluster) and checks the memory model against them.
"""
import importlib.util
import pathlib

import pytest

from zerojax import gpu_aot, planner
from zerojax.planner import compiled

ROOT = pathlib.Path(__file__).resolve().parents[1]
PIP = "pip install -e '.[gpu-aot]'"


@pytest.fixture
def no_plugin(monkeypatch):
  monkeypatch.setattr(gpu_aot, "plugin_installed", lambda: False)


def test_memory_without_the_plugin_names_the_install_in_one_line(no_plugin):
  with pytest.raises(gpu_aot.PluginMissing) as e:
    compiled.memory(planner.Point(1, 1, 8), model=None, seq_len=16, nodes=2, gpus=4, target="a100")
  assert PIP in str(e.value) and "\n" not in str(e.value)


def test_cli_plan_compiled_memory_without_the_plugin_exits_with_one_line(no_plugin):
  from zerojax.cli import plan as plan_cli
  with pytest.raises(SystemExit) as e:
    plan_cli.main(["--gin_file", "configs/zero3.gin", "--compiled_memory", "a100"])
  msg = str(e.value.code)
  assert msg.startswith("error: --compiled_memory a100: ") and PIP in msg and "\n" not in msg


@pytest.mark.parametrize("args, want", [(["--compiled_memory", "tpu"], "invalid choice: 'tpu'"),
                                        (["--compiled_top", "0"], "--compiled_top 0: compile at least one plan")])
def test_cli_plan_refuses_bad_compiled_arguments(args, want, capsys):
  from zerojax.cli import plan as plan_cli
  with pytest.raises(SystemExit) as e:
    plan_cli.main(["--gin_file", "configs/zero3.gin"] + args)
  assert e.value.code == 2 and want in capsys.readouterr().err


@pytest.mark.parametrize("params, want", [([], "bfloat16"), pytest.param(["train.compute_dtype='float32'"], "float32",
                                                                         marks=pytest.mark.slow)])
def test_cli_plan_compiles_for_gpus_in_their_compute_dtype(params, want, monkeypatch, capsys):
  """`--compiled_memory` builds its executor on this host's CPUs (fp32, the CPU's compute dtype) but
  compiles for GPUs: where the config leaves the compute dtype to the platform (configs/base.gin), the GPUs'
  bf16; an explicit `train.compute_dtype` wins (the compile itself is replaced here)."""
  from zerojax.cli import plan as plan_cli
  seen = []
  monkeypatch.setattr(gpu_aot, "compile_only_host", lambda: None)
  monkeypatch.setattr(compiled, "memory", lambda pt, *a, **kw: seen.append(kw["compute_dtype"]) or {"peak": 1.0})
  tiny = ["model_config.seq_len=16", "model_config.d_model=32", "model_config.num_heads=2",
          "model_config.num_layers=2", "train.batch_size=16"]
  argv = ["--gin_file", "configs/zero3.gin", "--compiled_memory", "h100", "--compiled_top", "1",
          "--profile", str(ROOT / "tests" / "golden" / "profile_2x4.json")]
  for p in tiny + params:
    argv += ["--gin_param", p]
  assert plan_cli.main(argv) == 0
  assert seen == [want], seen


def test_memory_refuses_no_micro_batches():
  with pytest.raises(ValueError, match="accum=0, batch_per_device=1: use positive"):
    compiled.memory(planner.Point(1, 1, 8), None, 16, 2, 4, "a100", accum=0)


def test_check_rows_decides_fits_by_the_compiled_peak_for_the_top_rows_only():
  rows = [{"plan": "a", "s_p": 1, "s_g": 1, "s_os": 1, "fits": False},   # ruled out by the formula
          {"plan": "b", "s_p": 1, "s_g": 1, "s_os": 8, "fits": True},    # fits by formula, not compiled
          {"plan": "c", "s_p": 1, "s_g": 8, "s_os": 8, "fits": True},    # fits by both
          {"plan": "d", "s_p": 8, "s_g": 8, "s_os": 8, "fits": True}]    # beyond top: formula
  seen = []

  def memory_of(pt):
    seen.append((pt.s_p, pt.s_g, pt.s_os))
    return {"peak": 7e9 if pt.s_g == 1 else 3e9}

  out = compiled.check_rows(rows, memory_of, cap_bytes=6e9, top=2)
  assert seen == [(1, 1, 8), (1, 8, 8)]
  assert [(r["fits"], r["fits_by"]) for r in out] == [(False, "formula"), (False, "compiled"), (True, "compiled"),
                                                      (True, "formula")]
  assert out[1]["compiled"]["peak"] == 7e9 and rows[1]["fits"] and "fits_by" not in rows[1]
  assert planner.choose(out, 6e9)["plan"] == "c" and planner.choose(rows, 6e9)["plan"] == "b"
  with pytest.raises(ValueError, match="top=0: compile at least one row"):
    compiled.check_rows(rows, memory_of, 6e9, top=0)


def bench():
  spec = importlib.util.spec_from_file_location("bench_amsp_paper", ROOT / "benchmarks" / "bench_amsp_paper.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


# The compiled peak is within this fraction of the formula's bytes per device (model states + the
# activation estimate) for LLaMA-7B at 1024 GPUs; measured 0.87-0.90 of it (benchmarks/gpu/amsp_table4.json).
BOUND = 0.2


@pytest.mark.gpu_compile
@pytest.mark.skipif(not gpu_aot.plugin_installed(), reason=f"compiling for GPUs needs jax's CUDA plugin: {PIP}")
@pytest.mark.parametrize("degrees", [(1, 1, 64), (1, 1, 8)])  # the planner's choice, the paper's Table IV plan
def test_llama7b_compiled_memory_on_amsp_cluster_matches_the_model(degrees):
  import jax
  if not jax.config.jax_platforms:
    jax.config.update("jax_platforms", "cpu")
  from zerojax.models.gpt import gpt

  b = bench()
  work = b.workload("LLaMA-7B", 1024)
  prof = planner.load_profile(b.PROFILE, 128, 8)
  cap = b.CAP_GB * 1e9
  rows = planner.rank(128, 8, work, prof, memory_cap_bytes=cap)
  row = next(r for r in rows if (r["s_p"], r["s_g"], r["s_os"]) == degrees)
  cfg = b.gpt_config("LLaMA-7B")
  mem = compiled.memory(planner.Point(*degrees), gpt(cfg), b.SEQ, 128, 8, "a100", accum=work.accum, remat="dots",
                        reduce_dtype="bfloat16", reduce_via="reduce_scatter")
  # the compiled train state is the fp32 master + AdamW shard over s_os: 12 bytes per parameter / s_os
  assert mem["argument"] == pytest.approx(12 * work.numel / degrees[2], rel=0.02)
  # every model state is alive at some point of the step: the formula's states bound the peak from below
  assert row["model_state_bytes"] * 0.99 <= mem["peak"]
  assert abs(mem["peak"] - row["bytes_per_device"]) <= BOUND * row["bytes_per_device"], (mem, row)
  assert (mem["peak"] <= cap) == row["fits"]
