"""Strict test environment: 8 simulated CPU devices, rank promotion raises."""
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent compilation cache shared by this process and the train.py processes the tests start (they
# inherit the environment): identical programs compile once per machine (ZEROJAX_TEST_CACHE=0: off).
if os.environ.get("ZEROJAX_TEST_CACHE", "1") != "0":
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "zerojax-test-jax-cache"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices("gpu"))
  except RuntimeError:
    return False


SLOW_KINDS = ("e2e", "multiprocess", "gpu_compile")  # each of these is also `slow`: not in the fast suite


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
  for item in items:
    if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
      item.add_marker(pytest.mark.slow)
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU; the same behaviour is covered on CPU")
  for item in items:
    if item.get_closest_marker("gpu"):
      item.add_marker(skip)
