"""Which kernel backend runs a quantization op: the one a caller, a plan or the environment names, else
per platform ("xla" on CPUs; on GPUs, per op, the fastest of the measured table that compiles there).

Backends ("xla", "pallas", "triton", and "mosaic" for int8 quantize/dequantize) compute the same
arithmetic (`pallas_kernels.block_format`); see `zerojax.quant.quantization` and docs/quantization.md.

References:
  ZeRO++: Wang et al. 2023, §4.2 (fused quantization kernels).
"""
from __future__ import annotations

import os
from typing import Literal

import jax

from pallas_kernels import kernel_table

Backend = Literal["xla", "pallas", "triton", "mosaic"]
BACKENDS: tuple[str, ...] = ("xla", "pallas", "triton")  # a plan's kernel_backend: every op
MOSAIC = "mosaic"  # Mosaic GPU (`pallas_kernels.mosaic_block_quant`): int8 quantize and dequantize only
ENV_VAR = "ZEROJAX_KERNEL_BACKEND"
FASTEST = "fastest"  # per op, the fastest backend of the measured GPU table (`gpu_default`)


def default_backend() -> str:
  """The backend named for the process: $ZEROJAX_KERNEL_BACKEND, else "xla" on a CPU and `FASTEST` where
  jax's default backend is a GPU."""
  name = os.environ.get(ENV_VAR, "").strip().lower() or (FASTEST if jax.default_backend() == "gpu" else "xla")
  if name not in (*BACKENDS, FASTEST):
    raise ValueError(f"{ENV_VAR}={name!r}; expected one of {BACKENDS}")
  return name


def resolve_backend(backend: str | None, op: str = "", bits: int = 8, rotate: bool = False, noisy: bool = False) -> str:
  name = default_backend() if backend is None else backend
  if name == MOSAIC:
    if op not in ("quantize", "dequantize") or bits != 8 or rotate or noisy:
      raise ValueError(f"backend='mosaic' has int8 quantize and dequantize only (not {op}, bits={bits}"
                       f"{', rotate' if rotate else ''}{', noise' if noisy else ''}); use 'pallas' or 'xla'")
    return name
  if name not in BACKENDS:
    raise ValueError(f"backend={name!r}; expected one of {BACKENDS}")
  if name == "triton":
    from pallas_kernels import triton_block_quant
    triton_block_quant.require_jax_triton()
  return name


def lowers(name: str, block: int, noisy: bool) -> bool:
  """Whether backend `name` can be compiled for a GPU with these settings on this host."""
  if name == "xla":
    return True
  if block & (block - 1):
    return False  # the compiled kernels need a power-of-two block
  if name == "pallas":
    return True
  if noisy:
    return False  # no stochastic rounding in the triton kernels
  import importlib.util
  if importlib.util.find_spec("jax_triton") is None or importlib.util.find_spec("triton") is None:
    return False
  from pallas_kernels import triton_block_quant
  return triton_block_quant.incompatibility() is None and triton_block_quant.compute_capability() is not None


def gpu_default(op: str, bits: int, block: int, rotate: bool = False, noisy: bool = False) -> str:
  """The backend `op` runs where it is lowered for a GPU with `backend=None`: the fastest of the measured
  table (`pallas_kernels.kernel_table`) that can be compiled with these settings."""
  return next(b for b in kernel_table.ranking(op, bits, rotate) if lowers(b, block, noisy))


def run(op: str, impl, arrays: tuple, *, bits: int, block: int, rotate: bool = False, noisy: bool = False,
         backend: str | None = None):
  """`impl(arrays, name)` with the backend asked for (`FASTEST`: `gpu_default`'s choice for this op)."""
  name = default_backend() if backend is None else backend
  if name == FASTEST:
    return impl(arrays, gpu_default(op, bits, block, rotate, noisy))
  return impl(arrays, resolve_backend(name, op, bits, rotate, noisy))


def kernels(name: str):
  if name == MOSAIC:
    from pallas_kernels import mosaic_block_quant
    return mosaic_block_quant
  if name == "pallas":
    from pallas_kernels import block_quant
    return block_quant
  from pallas_kernels import triton_block_quant
  return triton_block_quant
