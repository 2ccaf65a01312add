"""Strict test environment: 8 simulated CPU devices (the GPU where a run selects the `gpu` tests,
`tests/platforms.py`), rank promotion raises."""
import os
import tempfile

from tests import platforms  # no jax import
from tests.fast_suite import MOVED

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Kernels run their device kind's default launch configuration in tests (no timing, no cache written on a
# GPU); tests/test_kernel_tuning.py turns tuning on where it tests it.
os.environ.setdefault("ZEROJAX_KERNEL_TUNING", "0")
# A persistent compilation cache, shared by the two workers and the train.py processes the tests start (tests
# build fresh executors whose programs are the same as other tests': without it the whole suite did not finish
# within CI's 90 min). ZEROJAX_TEST_CACHE=0 turns it off.
if os.environ.get("ZEROJAX_TEST_CACHE", "1") == "1":
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "zerojax-test-jax-cache"))

import pytest  # noqa: E402


def pytest_configure(config):
  # Before any backend starts (test modules are imported later); train.py subprocesses inherit it.
  markexpr = config.getoption("markexpr", "")
  os.environ["JAX_PLATFORMS"] = platforms.choose(os.environ, markexpr)
  os.environ["XLA_FLAGS"] = platforms.xla_flags(os.environ, markexpr, os.environ["JAX_PLATFORMS"])
  import jax
  jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
  jax.config.update("jax_numpy_rank_promotion", "raise")


def _has_gpu() -> bool:
  import jax
  try:
    return any(d.platform == "gpu" for d in jax.devices("gpu"))
  except RuntimeError:
    return False


SLOW_KINDS = ("e2e", "multiprocess", "gpu_compile")  # each of these is also `slow`: not in the fast suite


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
  for item in items:
    if any(item.get_closest_marker(kind) for kind in SLOW_KINDS) or item.nodeid in MOVED:
      item.add_marker(pytest.mark.slow)
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU; the same behaviour is covered on CPU")
  for item in items:
    if item.get_closest_marker("gpu"):
      item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
  """At the end of each test module: drop what it compiled (jax's in-memory caches, and the module's own
  caches of executors and reports, a `functools.cache` or a dict named `_cache`), so that a worker's memory
  does not grow with the hundreds of programs a full run compiles (the persistent cache gives them back)."""
  yield
  import gc

  import jax
  for name, value in vars(request.module).items():
    if callable(getattr(value, "cache_clear", None)):
      value.cache_clear()
    elif name.lower() == "_cache" and isinstance(value, dict):
      value.clear()
  jax.clear_caches()
  gc.collect()


CRASH_RERUNS = 1
_crashed: dict[str, int] = {}
_crash_failed: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  """pytest-xdist: a test whose worker died in native code (XLA:CPU has segfaulted a worker in compile and in
  reading a cached program back, in three recent full runs, each time in a different test) runs again,
  once, on the fresh worker; a second crash fails it. The summary lists every test that crashed."""
  _crashed[crashitem] = _crashed.get(crashitem, 0) + 1
  if _crashed[crashitem] <= CRASH_RERUNS and _rescheduled(sched, crashitem):
    report.outcome = "rerun"
  else:
    _crash_failed.add(crashitem)


def _rescheduled(sched, nodeid: str) -> bool:
  """False under a --dist mode that cannot put one test back in the queue (the test stays failed)."""
  try:
    sched.mark_test_pending(nodeid)
  except NotImplementedError:
    return False
  return True


def pytest_terminal_summary(terminalreporter):
  if _crashed:
    terminalreporter.write_sep("=", "tests whose worker crashed (run again once)")
    for nodeid, n in sorted(_crashed.items()):
      terminalreporter.write_line(f"{nodeid}: {n} crash{'es' if n > 1 else ''}"
                                  f"{' (failed)' if nodeid in _crash_failed else ''}")
