"""The test configuration's platform: CPU unless a run asks for the `gpu` tests on a machine with a GPU;
the GPU kit's own pytest call is such a run."""
import os
import shlex

import pytest

from tests import platforms

RUN_SH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "run.sh")


@pytest.mark.parametrize("expr,gpu", [("gpu", True), ("gpu or gpu_compile", True), ("not slow", False),
                                      ("gpu_compile", False), ("not gpu", False), ("", False),
                                      ("slow and gpu", True)])
def test_marker_expressions(expr, gpu):
  assert platforms.selects_gpu(expr) is gpu
  assert platforms.choose({}, expr, gpu_present=True) == (platforms.GPU if gpu else platforms.CPU)
  assert platforms.choose({}, expr, gpu_present=False) == platforms.CPU  # no GPU: CPU, the tests skip
  assert platforms.choose({"JAX_PLATFORMS": "cpu"}, expr, gpu_present=True) == "cpu"  # the caller's wins


def _pytest_calls():
  """(environment unset, -m expression) of each pytest call in the kit's script."""
  calls = []
  for line in open(RUN_SH):
    if "-m pytest" not in line or line.lstrip().startswith("#"):
      continue
    words = shlex.split(line.split("|")[0].split("||")[0])
    unset = [words[i + 1] for i, w in enumerate(words) if w == "-u"]
    m = [words[i + 1] for i, w in enumerate(words) if w == "-m" and words[i + 1] != "pytest"]
    calls.append((unset, m[-1]))
  return calls


def test_the_gpu_kit_runs_its_gpu_tests_on_the_gpu():
  calls = _pytest_calls()
  assert calls, "benchmarks/gpu/run.sh calls pytest"
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  chosen = {expr: platforms.choose({k: v for k, v in env.items() if k not in unset}, expr, gpu_present=True)
            for unset, expr in calls}
  assert chosen.get("gpu") == platforms.GPU, chosen  # on a GPU machine the `gpu` tests run on it
  assert all(p == platforms.CPU for e, p in chosen.items() if e != "gpu"), chosen
  assert all("JAX_PLATFORMS" in unset for unset, _ in calls)  # a caller's cpu setting does not leak in


def test_this_cpu_run_is_on_cpu():
  import jax
  assert os.environ["JAX_PLATFORMS"] == "cpu" and jax.default_backend() == "cpu" and jax.device_count() == 8


@pytest.mark.parametrize("environ, markexpr, platforms_, fast", [
    ({}, "not slow", "cpu", True),                                               # the fast suite on CPU
    ({}, "", "cpu", False),                                                      # the full suite: as users compile
    ({}, "not slow", "cuda,cpu", False),                                         # a GPU run
    ({"XLA_FLAGS": "--xla_backend_optimization_level=2"}, "not slow", "cpu", False),  # the caller's level wins
    ({"ZEROJAX_TEST_FAST_COMPILE": "0"}, "not slow", "cpu", False)])
def test_the_fast_suite_alone_compiles_without_llvm_optimizations(environ, markexpr, platforms_, fast):
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", **environ}
  flags = platforms.xla_flags(env, markexpr, platforms_)
  assert (platforms.FAST_COMPILE in flags) == fast
  assert flags.startswith(env["XLA_FLAGS"])  # nothing the caller set is dropped
