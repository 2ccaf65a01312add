"""`bench_offload.py --fit`: the search for the largest GPT the host holds with offload, each try in a
process of its own (the GPU kit's run; tests/test_bench_gpu.py has the cost mode)."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load():
  spec = importlib.util.spec_from_file_location("bench_offload", os.path.join(ROOT, "benchmarks", "bench_offload.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_the_search_starts_at_the_host_limit_and_bisects_to_the_largest_that_trains():
  bench = load()
  tried = []
  ok = lambda n: tried.append(n) or n <= 7
  assert bench.largest(20, ok, 10) == 7
  assert tried[0] == 20 and len(tried) <= 6
  assert bench.largest(20, lambda n: True, 10) == 20  # the host the limit: one try
  assert bench.largest(20, lambda n: False, 10) == 0
  # 128 GB of host, 85% of it for 12 bytes per parameter: 43 layers of d_model 4096 (8.92 G parameters)
  need = {"per_layer": 12 * bench.gpt_params(4096, 1, vocab=0), "fixed": 12 * bench.gpt_params(4096, 0)}
  assert bench.host_layers(128e9, 0.85, need) == 43
  assert bench.gpt_params(4096, 43) * 12 <= 0.85 * 128e9 < bench.gpt_params(4096, 44) * 12
  assert bench.host_layers(128e9, 0.85, {k: 2 * v for k, v in need.items()}) == 21  # the states twice: half


@pytest.mark.slow
def test_fit_runs_each_try_in_its_own_process_and_reports_the_host_limit(tmp_path):
  """A tiny GPT on the CPU, with a host of 125 MB: the host holds 3 layers' states (the need per layer and
  the fixed rest from the step compiled for 1 and 2 layers), 3 train with offload,
  and the same size trains without (CPU memory is not the limit here), in processes of their own."""
  bench = load()
  out = tmp_path / "fit.json"
  result = bench.main(["--fit", "--d_model", "128", "--seq", "16", "--steps", "2", "--host_bytes", "1.25e8",
                       "--out", str(out)])
  assert result["host_limit_layers"] == 3
  assert [r["layers"] for r in result["search"]] == [3] and result["search"][0]["ok"] is True
  assert result["largest"]["limited_by"] == "host" and result["largest"]["layers"] == 3
  runs = result["runs"]
  assert runs["with_offload"]["offload"] == ["opt_state", "master"] and runs["without_offload"]["offload"] == []
  assert runs["with_offload"]["losses"] == runs["without_offload"]["losses"]
  # the host need comes from the compiled step: on the CPU (no host memory counted apart), the offloaded states
  need = result["host_need"]
  layer = bench.gpt_params(128, 1, vocab=0)  # 12 d^2: the layer's matrices; its biases and padding add < 10%
  assert 12 * layer <= need["per_layer"] < 1.1 * 12 * layer, need
  assert result["largest"]["host_bytes_needed"] <= 0.85 * 1.25e8


def test_cost_mode_times_the_update_on_the_host_beside_the_streamed_one(monkeypatch):
  """`--updates streamed,streamed_serial,host` on the test's 8 CPU devices at a tiny size: each offloaded setting
  gets a row per update ("host" and "streamed_serial" only with both fields), each with the losses of the plan
  without offload; the serial row is compiled with the user's XLA_FLAGS at XLA's default of two moves in flight,
  and the flags are as they were afterwards."""
  bench = load()
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  seen = []
  system = bench.system
  monkeypatch.setattr(bench, "system", lambda *a: seen.append(os.environ["XLA_FLAGS"]) or system(*a))
  rows = bench.main(["--plans", "dp", "--d_model", "32", "--layers", "1", "--seq", "16", "--steps", "2", "--reps",
                     "2", "--updates", "streamed,streamed_serial,host"])["rows"]
  assert list(rows) == ["dp offload=none", "dp offload=opt_state update=streamed",
                        "dp offload=opt_state,master update=streamed",
                        "dp offload=opt_state,master update=streamed_serial", "dp offload=opt_state,master update=host"]
  assert [f"--{bench.gpu_aot.ASYNC_MOVES}=2" in f for f in seen] == [False, False, False, True, False], seen
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
  assert rows["dp offload=opt_state,master update=host"]["update"] == "host"
  assert all(r["losses_equal"] is True for k, r in rows.items() if k != "dp offload=none"), rows
