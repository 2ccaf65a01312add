"""The GPU kit's two benchmarks on CPU at tiny sizes: bench_kernels.py records (never raises) where a backend
differs from xla and divides by a copy ceiling of several variants; bench_gpu_step.py reports every plan
and the plain jitted step with a ratio, and a system that fails gets its error in its row. The one-session
kit (benchmarks/gpu/device_kit.sh): it parses, each benchmark accepts its command lines, kit_summary.py
reads the goals from the outputs, and its CPU mode (DRY=1) writes kit.json."""
import argparse
import importlib.util
import json
import os
import pathlib
import shlex
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Benchmarks' own checks run the benchmarks, so they belong to the full suite (CI), not the fast one (`slow`);
# the device kit's command-line checks run nothing and stay in the fast suite.


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_bench_gpu_step_records_a_failing_system_and_goes_on(step_run):
  result, _ = step_run
  assert list(result["errors"]) == ["auto/auto/base/no_such_plan"] and "KeyError" in result["errors"]["auto/auto/base/no_such_plan"]
  assert result["systems"]["no_such_plan"] == {"error": result["errors"]["auto/auto/base/no_such_plan"]}


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- benchmarks/gpu/device_kit.sh: the kit of one device session ---------------------------------------

KIT = ROOT / "benchmarks" / "gpu" / "device_kit.sh"
KIT_PARTS = ["step", "offload_cost", "kernels", "tests", "step_remat", "offload_fit"]


def kit_plan(out, **env) -> list[tuple[str, list[str]]]:
  """(part, words of its command line) of each part, as `PLAN=1` prints them (nothing runs)."""
  r = subprocess.run(["bash", str(KIT)], env={**os.environ, "PLAN": "1", "OUT": str(out), **env},
                     capture_output=True, text=True, check=True, timeout=60)
  return [(name, shlex.split(line)) for name, line in (row.split("\t", 1) for row in r.stdout.splitlines())]


class Parsed(Exception):
  """Raised in place of running a benchmark once its argument parser accepted the command line."""


def parsed(script: str, args: list[str], monkeypatch) -> tuple[argparse.Namespace, object]:
  """(the namespace `script`'s own `main` parses from `args`, the module): an argparse error fails the test."""
  original = argparse.ArgumentParser.parse_args

  def parse_then_stop(self, argv=None, namespace=None):
    raise Parsed(original(self, argv, namespace))
  mod = load(pathlib.Path(script).stem)
  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
  with pytest.raises(Parsed) as e:
    mod.main(args)
  monkeypatch.undo()
  return e.value.args[0], mod


def test_device_kit_parses():
  r = subprocess.run(["bash", "-n", str(KIT)], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("dry", ["0", "1"])
def test_device_kit_command_lines_are_accepted_by_their_benchmarks(dry, tmp_path, monkeypatch):
  """Every part's command line (GPU sizes, and DRY=1's tiny sizes appended) passes its benchmark's parser;
  the GPU lines measure what the goals need; the outputs are distinct files under OUT, at most 8 with
  kit.json, kit.log and kernel_tuning.json (what a harness that copies a few files back gets)."""
  from tests import platforms
  plan = kit_plan(tmp_path, DRY=dry)
  assert [name for name, _ in plan] == KIT_PARTS
  outs = {}
  for name, words in plan:
    if name == "tests":
      m = words[words.index("-m", words.index("pytest")) + 1]
      assert platforms.selects_gpu(m) and "-n" in words, words
      continue
    script = next(w for w in words if w.startswith("benchmarks/"))
    ns, mod = parsed(script, words[words.index(script) + 1:], monkeypatch)
    outs[name] = pathlib.Path(ns.out)
    if dry == "1":
      continue
    if name in ("step", "step_remat"):
      assert all(r in ("auto", *mod.REMAT) for r in ns.remat.split(",")) and ns.xla in mod.XLA_SETS
      assert ns.steps is None if name == "step" else (ns.steps, ns.reps) == (4, 2)
    if name == "step":
      assert (ns.plans, ns.remat, ns.attention) == ("dp,zero3,zeropp,mics", "auto", "auto")
    if name == "step_remat":
      assert (ns.plans, ns.remat) == ("zero3", "full,dots,none,offloaded")
    if name == "offload_cost":
      assert (ns.plans, ns.nodes, ns.d_model, ns.layers, ns.dtype) == ("dp", 1, 2048, 8, "bfloat16")
      assert set(ns.updates.split(",")) == {"bulk", "streamed", "streamed_serial", "host"}
    if name == "kernels":
      assert (mod.parse_size(ns.sizes), ns.tuning) == (256 << 20, "1")
    if name == "offload_fit":
      assert ns.fit and ns.probe_timeout * 5 <= 600
  assert all(p.parent == tmp_path for p in outs.values()) and len(set(outs.values())) == len(outs)
  assert len(outs) + 3 <= 8


def test_kit_summary_reads_each_goal_from_the_outputs(tmp_path):
  """Issue 42 holds only where every plan is at >= 400 TF/s and <= 1.02x plain; issue 44 reads the streamed
  row of both fields offloaded; issue 46 compares each op at the largest size with its target."""
  summary = load_kit_summary()
  ok = {"model_tflops": 410.0, "ratio_to_plain": {"median": 1.01}}
  steps = {"plain": {"model_tflops": 405.0, "remat": "none"}, "dp": ok, "zero3": ok}
  assert summary.step_goal(steps)["met"] is True
  assert summary.step_goal({**steps, "mics": {**ok, "ratio_to_plain": {"median": 1.03}}})["met"] is False
  assert summary.step_goal({**steps, "mics": {"error": "OOM"}})["met"] is None
  rows = {"dp offload=none": {"ms_per_step": {"median": 42.0}},
          "dp offload=opt_state,master update=bulk": {"ms_per_step": {"median": 249.0}},
          "dp offload=opt_state,master update=streamed": {"ms_per_step": {"median": 150.0}}}
  assert summary.offload_goal({"rows": rows})["streamed_ms"] == 150.0
  assert summary.offload_goal({"rows": rows})["met"] is False
  best = [{"op": op, "bits": bits, "elements": n, "backend": "pallas", "gbps": 1.0, "ratio_to_reference_copy": r}
          for op, bits, n, r in [("quantize", 8, 256 << 20, 0.86), ("quantize", 4, 256 << 20, 0.69),
                                 ("quantize_rotate", 8, 256 << 20, 0.71), ("quantize", 8, 1 << 20, 0.1)]]
  k = summary.kernel_goal({"sizes": [1 << 20, 256 << 20], "best": best})
  assert [(r["op"], r["bits"], r["target"], r["met"]) for r in k["rows"]] == [
      ("quantize", 8, 0.85, True), ("quantize", 4, 0.70, False), ("quantize_rotate", 8, 0.70, True)]
  assert (k["met"], k["of"]) == (2, 3)
  (tmp_path / "parts.tsv").write_text("step\t100\t150\t97\t0\tok\ntests\t95\t40\t0\t\tskipped\n")
  (tmp_path / "step.json").write_text(json.dumps({"systems": steps}))
  (tmp_path / "tests.log").write_text("FAILED tests/test_x.py::test_y[a] - AssertionError\n1 failed, 31 passed in 9s\n")
  s = summary.main(["--out", str(tmp_path), "--parts", str(tmp_path / "parts.tsv"), "--tests_log",
                    str(tmp_path / "tests.log")])
  assert json.loads((tmp_path / "kit.json").read_text()) == s
  assert [(p["name"], p["rc"], p["status"]) for p in s["parts"]] == [("step", 0, "ok"), ("tests", None, "skipped")]
  assert s["goals"]["issue42_step"]["met"] is True and s["goals"]["issue44_offload"] is None
  assert s["goals"]["gpu_tests"] == {"failed": 1, "passed": 31, "failures": ["tests/test_x.py::test_y[a]"]}


def load_kit_summary():
  spec = importlib.util.spec_from_file_location("kit_summary", ROOT / "benchmarks" / "gpu" / "kit_summary.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.slow
def test_device_kit_dry_run_writes_kit_json(tmp_path):
  """DRY=1 on CPU with two parts, the others left out: each part's status, its output, the goal it reads."""
  env = {**os.environ, "DRY": "1", "OUT": str(tmp_path), "PARTS": "kernels tests", "PYTHON": os.sys.executable}
  env.pop("JAX_PLATFORMS", None)
  r = subprocess.run(["bash", str(KIT)], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  kit = json.loads((tmp_path / "kit.json").read_text())
  assert kit["dry"] is True and [(p["name"], p["status"]) for p in kit["parts"]] == [("kernels", "ok"), ("tests", "ok")]
  assert kit["goals"]["issue46_kernels"]["of"] == 18 and kit["goals"]["issue46_kernels"]["tuning"] is True
  assert kit["goals"]["gpu_tests"]["skipped"] > 0 and "passed" not in kit["goals"]["gpu_tests"]  # no GPU here
  assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.json", "kit.json", "kit.log"]
