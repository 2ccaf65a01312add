"""The jax-triton kernels' values on this CPU: their Triton-language bodies in Triton's interpreter
(`tests/triton_interpreter.py`), against the xla backend and the numpy model of the format, bit for bit.

The Triton kernels lower only for CUDA, so elsewhere (`tests/test_gpu_kernels.py`) they are compiled for
a compile-only H100 and their PTX inspected; this file checks what they compute: that the butterflies fused
into them (`hadamard.fwht_tile`'s stages as reshapes, permutes, splits and joins of a [ROWS, B] tile) pair
the elements the xla form pairs, in its order, and that int4 bytes are split into and joined from the
nibbles the format names.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = {"quantize", "reorder_quantize", "dequantize", "dequant_sum", "quantize_rotate", "reorder_quantize_rotate",
       "dequantize_rotate", "dequant_sum_rotate", "dequant_sum_quantize/8", "dequant_sum_quantize/4"}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton: pip install -e '.[gpu]'")
def test_triton_kernels_interpreted_equal_xla_and_the_model():
  """Every op of backend='triton', rotated and not, bits 8 and 4, blocks 64 and 256, fp32 and bf16 in and
  out (NaN, -inf and zero blocks included) gives xla's bits; quantize gives the numpy model's codes and
  scales on the adversarial blocks (midpoints, ties, the clamp, tiny and huge scales)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  run = subprocess.run([sys.executable, "-m", "tests.triton_interpreter"], capture_output=True, text=True,
                       env=env, cwd=str(ROOT), timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  rows = json.loads(run.stdout)
  assert {r["op"] for r in rows} == OPS | {"quantize/model"}
  assert len(rows) == len(OPS) * 2 * 2 * 2 + 2
  assert [r for r in rows if not r["same"]] == []
