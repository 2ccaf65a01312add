"""Runs the jax-triton kernels of `pallas_kernels.triton_block_quant` in Triton's interpreter on this CPU.

The Triton kernels lower only for CUDA; Triton's interpreter (TRITON_INTERPRET=1, set before the kernels
are built) runs their Triton-language bodies in numpy instead, with the language's semantics of every
reshape, permute, split and join: what decides whether the fused butterflies pair the elements that
`hadamard.fwht_tile` pairs and whether int4 nibbles land where the format puts them. What it lacks is
filled in here:

- the two PTX instructions the kernels name: `rcp.approx` (the interpreter has no inline assembly) is
  computed as the correctly rounded 1 / s, which serves like any reciprocal within a few ulp
  (`block_format`); libdevice's `rint` (no extern calls) is numpy's rint, round half to even as `cvt.rni`;
- fp32 -> bf16 rounds to nearest even, as the compiled kernels' `cvt.rn.bf16.f32` does (the interpreter
  truncates);
- the launch: `triton_block_quant.launch` is replaced by one that runs the kernel over host numpy arrays
  with the rows per program and grid the compiled launch takes (`tuning.default()`), so that the module's
  public functions, and `zerojax.quant.quantization`'s backend='triton' on eager arrays, run them.

Meant for a fresh process (`python -m tests.triton_interpreter` prints the checks of `checks()` as JSON):
the interpreter is chosen when the kernels are decorated, and the replaced launch is process-wide.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from pallas_kernels import triton_block_quant as T, tuning  # noqa: E402


class _Host:
  """A host array as a kernel argument: its address and its Triton dtype name."""

  def __init__(self, a: np.ndarray):
    self.a = a
    self.dtype = str(a.dtype)

  def data_ptr(self) -> int:
    return self.a.ctypes.data


def _rcp(self, asm, constraints, values, types, is_pure, pack):
  assert asm.startswith("rcp.approx.ftz.f32"), asm
  out = interpreter.TensorHandle((np.float32(1) / values[0].data).astype(np.float32), values[0].dtype.scalar)
  return SimpleNamespace(get_result=lambda i: out)


def _rint(x):
  return tl.tensor(interpreter.TensorHandle(np.rint(x.handle.data), x.handle.dtype.scalar), x.type)


_cast = interpreter.InterpreterBuilder.cast_impl


def _cast_rn(self, src, dst_type):
  if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
    return interpreter.TensorHandle(src.data.astype(ml_dtypes.bfloat16).view(np.uint16), dst_type.scalar)
  return _cast(self, src, dst_type)


def _np_dtype(dtype):
  return ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)


def _launch(kernel, args, *, out, op, m, divisor, row_elements, block, slabs=1, **meta):
  rows = tuning.default().rows(divisor, row_elements)
  ins = [np.ascontiguousarray(np.asarray(a)) for a in args]
  outs = [np.zeros(o.shape, _np_dtype(o.dtype)) for o in out]
  kernel[(m // rows,)](*map(_Host, ins), *map(_Host, outs), ROWS=rows, **meta)
  return tuple(jnp.asarray(o) for o in outs)


def install() -> None:
  """Builds the kernels for the interpreter and routes `triton_block_quant`'s launches to it."""
  assert os.environ.get("TRITON_INTERPRET") == "1"
  interpreter.InterpreterBuilder.create_inline_asm = _rcp
  interpreter.InterpreterBuilder.cast_impl = _cast_rn
  # host arrays already: nothing to copy to or from a device
  interpreter.GridExecutor._init_args_hst = lambda self, args, kwargs: (args, kwargs)
  interpreter.GridExecutor._restore_args_dev = lambda self, *a: None
  T.kernels()
  T.libdevice = SimpleNamespace(rint=_rint)
  T.launch = _launch


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _data(n: int, block: int, dtype, seed: int) -> jax.Array:
  """Gaussian data with outliers; block 1 all zeros, block 2 holds a NaN, block 3 an -inf."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n).astype(np.float32) * np.where(rng.random(n) < 0.01, 50.0, 1.0).astype(np.float32)
  x[block:2 * block] = 0.0
  x[2 * block + 5] = np.nan
  x[3 * block + 7] = -np.inf
  return jnp.asarray(x).astype(dtype)


def _ops(Q, x, bits, block, backend, nodes, gpus):
  """Every op of backend='triton' (rotated and not) on x, named."""
  out = {}
  for rotate in (False, True):
    r = "_rotate" if rotate else ""
    v, s = Q.quantize(x, bits, block, rotate=rotate, backend=backend)
    rv, rs = Q.reorder_quantize(x, nodes, gpus, bits, block, rotate=rotate, backend=backend)
    vk, sk = rv.reshape(gpus, -1), rs.reshape(gpus, -1)
    out.update({f"quantize{r}": (v, s), f"reorder_quantize{r}": (rv, rs),
                f"dequantize{r}": Q.dequantize(v, s, bits, block, dtype=x.dtype, rotate=rotate, backend=backend),
                f"dequant_sum{r}": Q.dequant_sum(vk, sk, bits, block, dtype=x.dtype, rotate=rotate, backend=backend)})
    if not rotate:
      for out_bits in (8, 4):
        out[f"dequant_sum_quantize/{out_bits}"] = Q.dequant_sum_quantize(vk, sk, bits, block, out_bits=out_bits,
                                                                         backend=backend)
  return out


def checks() -> list[dict]:
  """backend='triton' against backend='xla', bit for bit: every op, bits 8 and 4, blocks 64 and 256,
  fp32 and bf16; and quantize against the numpy model of the format on its adversarial blocks."""
  from tests.block_model import adversarial_blocks, model
  from zerojax.quant import quantization as Q
  rows = []
  nodes, gpus = 2, 4
  for bits in (8, 4):
    for block in (64, 256):
      for dtype in (jnp.float32, jnp.bfloat16):
        x = _data(nodes * gpus * 4 * block, block, dtype, seed=bits + block)
        want, got = _ops(Q, x, bits, block, "xla", nodes, gpus), _ops(Q, x, bits, block, "triton", nodes, gpus)
        for name in want:
          same = all(np.array_equal(_bits(a), _bits(b)) and a.shape == b.shape and a.dtype == b.dtype
                     for a, b in zip(jax.tree.leaves(want[name]), jax.tree.leaves(got[name])))
          rows.append(dict(op=name, bits=bits, block=block, dtype=jnp.dtype(dtype).name, same=bool(same)))
    x = adversarial_blocks(bits, seed=bits)
    codes, scales = model(x, bits)
    v, s = T.quantize_rows(jnp.asarray(x), bits)
    v = np.asarray(v).astype(np.int32)
    if bits == 4:
      v = np.stack([((v & 0xF) ^ 8) - 8, (((v >> 4) & 0xF) ^ 8) - 8], axis=-1).reshape(codes.shape)
    rows.append(dict(op="quantize/model", bits=bits, block=x.shape[1], dtype="float32",
                     same=bool(np.array_equal(v, codes) and np.array_equal(_bits(s), _bits(scales)))))
  return rows


if __name__ == "__main__":
  install()
  json.dump(checks(), sys.stdout)
