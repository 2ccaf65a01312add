"""The GPU kit's two benchmarks on CPU at tiny sizes: bench_kernels.py records (never raises) where a backend
differs from xla and divides by a copy ceiling of several variants; bench_gpu_step.py reports every plan
and the plain jitted step with a ratio, and a system that fails gets its error in its row."""
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Benchmarks' own checks: they run the benchmarks, so they belong to the full suite (CI), not the fast one.
pytestmark = pytest.mark.slow


def load(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def kernels():
  return load("bench_kernels")


@pytest.fixture(scope="module")
def step():
  return load("bench_gpu_step")


def test_bench_kernels_records_mismatches_and_a_ceiling_of_several_copies(kernels, tmp_path):
  out = tmp_path / "kernels.json"
  result = kernels.main(["--sizes", "2K", "--reps", "2", "--copy_size", "1M", "--out", str(out)])
  assert json.loads(out.read_text()) == result
  assert result["platform"] == "cpu" and result["jax"] == jax.__version__ and result["device"]
  ceiling = result["copy_ceiling"]
  assert len(ceiling["variants"]) >= 3 and ceiling["buffer_bytes"] == 1 << 20
  assert ceiling["gbps"] == max(v["gbps"] for v in ceiling["variants"].values()) > 0
  assert {r["backend"] for r in result["rows"]} == {"xla", "pallas"} and len(result["rows"]) == 36
  for r in result["rows"]:
    assert "error" not in r, r
    assert r["copy_gbps"] == ceiling["gbps"] and r["ratio_to_copy"] == pytest.approx(r["gbps"] / ceiling["gbps"], rel=1e-2)
    assert r["ms_min"] <= r["ms"] <= r["ms_max"]
    m = r["mismatched_bytes_vs_xla"]
    if r["backend"] == "xla":
      assert m is None
    else:
      assert all(isinstance(c, int) and c >= 0 for c in m)
      assert len(m) == (1 if r["op"].startswith("dequant") and r["op"] != "dequant_sum_quantize" else 2), r
  assert result["summary"]["rows_compared_with_xla"] == 18 and result["summary"]["errors"] == []
  assert [f["backend"] for f in result["qgz_intra_node_fused_vs_unfused"]] == ["xla", "xla", "pallas", "pallas"]
  assert all(len(f["mismatched_bytes_fused_vs_unfused"]) == 2 for f in result["qgz_intra_node_fused_vs_unfused"])


def test_mismatched_bytes_counts_each_output(kernels):
  a = np.arange(8, dtype=np.int8)
  b = a.copy()
  b[[1, 5]] += 1
  s = np.ones(4, np.float32)
  assert kernels.mismatched_bytes((a, s), (a, s)) == [0, 0]
  assert kernels.mismatched_bytes((b, s), (a, s)) == [2, 0]
  assert kernels.mismatched_bytes((a, s * 2), (a, s)) == [0, 8]  # 1.0 -> 2.0: 0x3F800000 -> 0x40000000
  assert kernels.mismatched_bytes((a[:4], s), (a, s)) == [8, 0]  # another shape: all its bytes
  assert kernels.mismatched_bytes((a.view(np.uint8), s), (a, s)) == [8, 0]
  assert kernels.mismatched_bytes((a,), (a, s)) == [0, 16]
  assert kernels.mismatched_bytes((b, s * 2), (a, s), piece_bytes=3) == [2, 8]  # counted in pieces


def test_a_differing_or_failing_backend_is_recorded_not_raised(kernels):
  def cases(n, block, k, bits):
    out = {}
    for op, (make, args, nbytes) in kernels.cases(n, block, k, bits).items():
      def by_backend(be, make=make):
        if be == "broken":
          def fail(*a):
            raise RuntimeError("this backend is broken")
          return fail
        f = make("xla")
        if be == "off":  # xla's result with its first three elements changed
          return lambda *a: jax.tree.map(lambda y: y.at[:3].add(jnp.ones((), y.dtype)), f(*a))
        return f
      out[op] = (by_backend, args, nbytes)
    return out
  rows = kernels.bench_ops(2048, 256, 2, ["xla", "off", "broken"], reps=1, ceiling_gbps=1.0, case_fn=cases)
  assert len(rows) == 2 * 9 * 3
  for r in rows:
    if r["backend"] == "off":
      assert len(r["mismatched_bytes_vs_xla"]) in (1, 2) and all(c > 0 for c in r["mismatched_bytes_vs_xla"]), r
      assert r["gbps"] > 0
    elif r["backend"] == "broken":
      assert "this backend is broken" in r["error"] and "gbps" not in r
  summary = kernels.summarize(rows, [], {"gbps": 1.0, "best": "uint32 x+1"})
  assert summary["rows_differing_from_xla"] == 18 and len(summary["errors"]) == 18


@pytest.fixture(scope="module")
def step_run(step, tmp_path_factory):
  """One run of bench_gpu_step.py at a tiny size on 2 CPU devices, with a plan that does not exist."""
  out = tmp_path_factory.mktemp("step") / "step.json"
  result = step.main(["--d_model", "32", "--layers", "1", "--heads", "2", "--vocab", "64", "--seq", "16",
                      "--steps", "2", "--reps", "2", "--devices", "2", "--out", str(out),
                      "--plans", "dp,zero3,no_such_plan,zeropp,mics"])
  return result, json.loads(out.read_text())


def test_bench_gpu_step_reports_every_system_against_plain(step_run):
  result, written = step_run
  assert written == result
  assert result["platform"] == "cpu" and result["jax"] == jax.__version__ and result["devices"] == 2
  assert list(result["systems"]) == ["plain", "dp", "zero3", "no_such_plan", "zeropp", "mics"]
  assert result["model"]["params"] > 0
  for name, r in result["systems"].items():
    if name == "no_such_plan":
      continue
    assert r["ms_per_step"]["min"] <= r["ms_per_step"]["median"] <= r["ms_per_step"]["max"], name
    assert r["ratio_to_plain"]["median"] > 0 and r["compile_s"] > 0 and r["memory"]["temp_bytes"] >= 0
    assert abs(r["first_loss_diff_vs_plain"]) < 1e-3, (name, r)  # zeropp quantizes: not exactly plain's
  assert result["systems"]["plain"]["ratio_to_plain"]["median"] == 1.0


def test_bench_gpu_step_records_a_failing_system_and_goes_on(step_run):
  result, _ = step_run
  assert list(result["errors"]) == ["auto/auto/base/no_such_plan"] and "KeyError" in result["errors"]["auto/auto/base/no_such_plan"]
  assert result["systems"]["no_such_plan"] == {"error": result["errors"]["auto/auto/base/no_such_plan"]}


def test_bench_gpu_step_sweeps_remat_and_attention_with_plain_on_the_same_settings(step):
  """Every combination of --remat and --attention is a block of its own; under remat auto plain runs the
  mode zero3's auto picks (on CPU: the rule, "full"), and under a named mode every system runs it."""
  result = step.main(["--d_model", "32", "--layers", "1", "--heads", "2", "--vocab", "64", "--seq", "16",
                      "--steps", "1", "--reps", "1", "--devices", "2", "--plans", "zero3",
                      "--remat", "auto,none", "--attention", "auto,einsum"])
  assert [(b["remat"], b["attention"], b["xla"]) for b in result["sweep"]] == [
      ("auto", "auto", "base"), ("auto", "einsum", "base"), ("none", "auto", "base"), ("none", "einsum", "base")]
  for b in result["sweep"]:
    assert list(b["systems"]) == ["plain", "zero3"] and not result["errors"]
    want = "full" if b["remat"] == "auto" else b["remat"]
    assert b["systems"]["plain"]["remat"] == b["systems"]["zero3"]["remat"] == want
    assert b["systems"]["zero3"]["ratio_to_plain"]["median"] > 0
    assert b["systems"]["plain"]["mfu"] is None  # a CPU has no peak in the table
  assert result["systems"] == result["sweep"][0]["systems"]


def test_bench_offload_reports_each_setting_against_none_with_equal_losses(tmp_path):
  """The offload benchmark at a tiny size on the test's 8 CPU devices: every setting of each plan has a
  step time, a ratio to the plan without offload, and the same losses; a plan that does not exist is an
  error in its rows."""
  bench = load("bench_offload")
  out = tmp_path / "offload.json"
  result = bench.main(["--plans", "zero3,no_such_plan", "--d_model", "32", "--layers", "1", "--seq", "16",
                       "--steps", "2", "--reps", "2", "--out", str(out)])
  assert json.loads(out.read_text()) == result and result["mesh"] == {"node": 2, "gpu": 4}
  rows = result["rows"]
  assert [k for k in rows if k.startswith("zero3")] == ["zero3 offload=none", "zero3 offload=opt_state",
                                                       "zero3 offload=opt_state,master"]
  for key in ("zero3 offload=opt_state", "zero3 offload=opt_state,master"):
    r = rows[key]
    assert r["losses_equal"] is True and r["ratio_to_no_offload"]["median"] > 0
    assert r["ms_per_step"]["min"] <= r["ms_per_step"]["median"] <= r["ms_per_step"]["max"]
  assert all("error" in r for k, r in rows.items() if k.startswith("no_such_plan"))
