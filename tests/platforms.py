"""Which JAX platforms a test run uses (no jax import: read before jax initializes its backends).

CPU (8 simulated devices) is the default; a run that selects the `gpu` tests (`-m gpu`, `-m "gpu or ..."`)
runs on the GPU, with the CPU beside it for host-side references; a JAX_PLATFORMS the caller set wins.
`benchmarks/gpu/run.sh` runs its `gpu` tests so (tests/test_platforms.py checks the kit's own call).
"""
from __future__ import annotations

import os
import re

GPU = "cuda,cpu"
CPU = "cpu"


def selects_gpu(markexpr: str) -> bool:
  """Whether a `-m` expression selects the `gpu` marker positively (`gpu_compile` and `not gpu` do not)."""
  return re.search(r"(?<!not )(?<![\w])gpu(?![\w])", markexpr or "") is not None


def has_nvidia_driver() -> bool:
  """An NVIDIA driver's device node (no jax backend started to find out)."""
  return os.path.exists("/dev/nvidiactl")


def choose(environ: dict, markexpr: str, gpu_present: bool | None = None) -> str:
  """JAX_PLATFORMS for a pytest run with `-m markexpr` under `environ`: the GPU only where the run asks
  for `gpu` tests and a GPU is present (elsewhere they skip, on CPU)."""
  if environ.get("JAX_PLATFORMS"):
    return environ["JAX_PLATFORMS"]
  present = has_nvidia_driver() if gpu_present is None else gpu_present
  return GPU if selects_gpu(markexpr) and present else CPU


# The fast suite's CPU programs are compiled with LLVM's optimizations off: XLA's own passes (fusion, sharding,
# collective scheduling, the programs the tests read) are unchanged, and the cold suite fell from 512 s to 395 s
# with it (docs/testing.md, "Keeping the fast suite fast"). The full suite (`-m ""`, what CI runs) compiles as
# users do, which the bitwise golden values need (`tests/test_golden.py` records the level in its environment).
FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(environ: dict, markexpr: str, platforms: str) -> str:
  """XLA_FLAGS for a pytest run: `FAST_COMPILE` added for the fast suite (`-m "not slow"`, pyproject's default)
  on CPU, unless the flags already set a level or ZEROJAX_TEST_FAST_COMPILE=0."""
  flags = environ.get("XLA_FLAGS", "")
  if (markexpr == "not slow" and platforms == CPU and "optimization_level" not in flags
      and environ.get("ZEROJAX_TEST_FAST_COMPILE", "1") == "1"):
    return f"{flags} {FAST_COMPILE}".strip()
  return flags
