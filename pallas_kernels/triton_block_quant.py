"""Triton kernels for block-wise quantization, called through jax-triton (CUDA GPUs only).

The same operations and the same arithmetic as `pallas_kernels.block_quant` and the reference in
`zerojax.quant.quantization` (the format of `pallas_kernels.block_format`, written again in Triton): scale =
absmax * fp32(1 / qmax) rounded up to 16 significant bits, codes the exactly rounded |x| / scale
(the estimate rint(|x| * r), one `rcp.approx` r per block and a multiplication per element, corrected
by exact comparisons), value = code * scale (exact), fp32 sums in slab order. Each program
handles ROWS blocks of B elements; int4 tiles are handled as even/odd lanes (the low/high nibbles).
The reordering of qgZ is a row map: output row (s, g, n, j) reads input row (n, g, s, j), so the
fused kernel costs what a plain quantization of contiguous data costs.

`triton` and `jax_triton` are optional (zerojax[gpu]): they are imported inside functions, and
`require_jax_triton` raises a clear error where they are missing. The kernels lower for the platform
the program is lowered for (`per_platform.choose`), so a CPU host compiles them for compile-only GPUs:
lowered for the CPU they raise. Lowering needs two facts about the target that jax-triton would
otherwise ask a local GPU for:
- its compute capability: $ZEROJAX_TRITON_COMPUTE_CAPABILITY (90 for H100, 80 for A100), else that of
  the first local CUDA device;
- the PTX version, which Triton sizes from the ptxas it finds: the PTX must be accepted by the CUDA 12
  ptxas that jaxlib assembles it with at run time, so Triton is pointed at that ptxas (the
  nvidia-cuda-nvcc-cu12 wheel's, else the one on PATH) unless TRITON_PTXAS_PATH /
  TRITON_PTXAS_BLACKWELL_PATH are set. (Triton 3.9's own ptxas for sm_90+ is CUDA 13's, which makes
  it emit PTX `.version 9.x`; CUDA 12's ptxas rejects that.)

References:
  ZeRO++: Wang et al. 2023, §4.2 (vectorized quantization kernels; reorder+quantize fusion;
  dequantize + reduce + quantize fusion), §4.1.2 Algorithm 2.
"""
from __future__ import annotations

import functools
import inspect
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp

from pallas_kernels import block_format, per_platform, tuning

CC_ENV = "ZEROJAX_TRITON_COMPUTE_CAPABILITY"
PTXAS_ENV = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")

# Bound by `_kernels()` once triton is importable.
tl = libdevice = None
_abs_or_inf = _scale = _inverse = _codes = _load_lane = _store_lane = _store_codes = _quantize_store = None


def require_jax_triton() -> None:
  """Raises unless jax-triton and triton import (no GPU is needed to lower the kernels)."""
  try:
    import jax_triton  # noqa: F401
    import triton  # noqa: F401
  except ImportError as e:
    raise RuntimeError(
        f"backend='triton' needs the jax-triton package ({e}); install zerojax[gpu], or use "
        "backend='xla' or 'pallas'") from e


def compute_capability() -> int | None:
  """The target GPU's compute capability as jax-triton counts it (90 = sm_90): $ZEROJAX_TRITON_
  COMPUTE_CAPABILITY, else the first local CUDA device's, else None (unknown)."""
  env = os.environ.get(CC_ENV, "").strip()
  if env:
    if not env.isdigit():
      raise ValueError(f"{CC_ENV}={env!r}; expected an integer such as 90 (H100) or 80 (A100)")
    return int(env)
  if jax.default_backend() != "gpu":
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None:
    return None
  major, minor = str(cc).split(".")
  return 10 * int(major) + int(minor)


def runtime_ptxas() -> str | None:
  """The CUDA 12 ptxas that assembles the kernels' PTX at run time: the nvidia-cuda-nvcc-cu12
  wheel's (what jax[cuda12] installs), else the one on PATH."""
  try:
    import nvidia.cuda_nvcc
    for root in nvidia.cuda_nvcc.__path__:
      path = pathlib.Path(root) / "bin" / "ptxas"
      if path.is_file():
        return str(path)
  except ImportError:
    pass
  return shutil.which("ptxas")


def configure_ptxas() -> None:
  """Points Triton at `runtime_ptxas()` (for every arch), unless TRITON_PTXAS_PATH or
  TRITON_PTXAS_BLACKWELL_PATH is set; raises where there is none."""
  if any(os.environ.get(k) for k in PTXAS_ENV):
    return
  path = runtime_ptxas()
  if path is None:
    raise RuntimeError(
        "backend='triton' needs CUDA 12's ptxas to size the kernels' PTX for the runtime: "
        "pip install nvidia-cuda-nvcc-cu12, or set TRITON_PTXAS_BLACKWELL_PATH and TRITON_PTXAS_PATH")
  for k in PTXAS_ENV:
    os.environ[k] = path


def _launch(kernel, args, *, out, op, m, divisor, row_elements, block, slabs=1, **meta):
  """The kernel for the platform the program is lowered for: through jax-triton on cuda (with the
  target's compute capability), refused elsewhere. Its m rows run in m // ROWS programs of ROWS rows,
  ROWS = `cfg.rows(divisor, row_elements)` with the launch configuration `tuning.config` picks (timed
  on this GPU the first time, where tuning is on)."""
  if block & (block - 1):
    raise ValueError(f"block={block}: the Triton kernels need a power-of-two block")

  def call(cfg, *a, **kw):
    r = cfg.rows(divisor, row_elements)
    return _call(kernel, *a, out=out, grid=(m // r,), ROWS=r, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages, **meta, **kw)

  cc = compute_capability()
  cpu = per_platform.Refusal(
      "backend='triton' compiles only for CUDA GPUs, and this program is lowered for {platform};"
      " use backend='xla' or 'pallas'", RuntimeError)
  if cc is None:
    cuda = per_platform.Refusal(
        "backend='triton' lowers its kernels for the target GPU's compute capability, and no CUDA"
        f" device is here to ask: set {CC_ENV}=90 (H100) or 80 (A100)", RuntimeError)
  else:
    configure_ptxas()
    cfg = tuning.config("triton", op, elements=m * row_elements, block=block, slabs=slabs,
                        dtype=args[0].dtype, avals=args,
                        make=lambda c: functools.partial(call, c, compute_capability=cc))
    cuda = functools.partial(call, cfg, compute_capability=cc)
  like = functools.partial(call, tuning.default())
  return per_platform.choose(*args, cpu=cpu, cuda=cuda, like=like)


@functools.cache
def _kernels():
  """Builds the @triton.jit kernels (only callable where triton imports).

  Triton resolves the names a kernel uses in its module's globals, so the lazily imported modules
  and the helper kernels are bound there.
  """
  global tl, libdevice, TRIM_ADD, TRIM_MASK, MIN_SCALE, R8, R4, _abs_or_inf, _scale, _inverse, _codes
  global _load_lane, _store_lane, _store_codes, _quantize_store
  import triton
  import triton.language as tl
  try:
    from triton.language.extra import libdevice
  except ImportError:
    from triton.language.extra.cuda import libdevice
  TRIM_ADD, TRIM_MASK = tl.constexpr(block_format.TRIM_ADD), tl.constexpr(block_format.TRIM_MASK)
  MIN_SCALE = tl.constexpr(block_format.MIN_SCALE)
  R8, R4 = tl.constexpr(block_format.reciprocal(8)), tl.constexpr(block_format.reciprocal(4))

  @triton.jit
  def _abs_or_inf(x):
    return tl.where(x != x, float("inf"), tl.abs(x))

  @triton.jit
  def _scale(amax, QMAX: tl.constexpr):
    # block_format.scale_of: up16(amax * fp32(1 / qmax)), 0 below 2^-125 (R8, R4: fp32 constants, exact).
    r = R4 if QMAX == 7.0 else R8
    b = ((amax * r).to(tl.uint32, bitcast=True) + TRIM_ADD) & TRIM_MASK
    s = b.to(tl.float32, bitcast=True)
    return tl.where(s >= MIN_SCALE, s, 0.0)

  @triton.jit
  def _inverse(scale, ok):
    # block_format.inverse_scale: one rcp.approx (within one ulp) per block, 0 where the scale is not usable.
    r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [tl.where(ok, scale, 1.0)],
                                  dtype=tl.float32, is_pure=True, pack=1)
    return tl.where(ok, r, 0.0)

  @triton.jit
  def _codes(x, scale, inv, ok, QMAX: tl.constexpr):
    # block_format.nearest_codes: the estimate rint(|x| * r) corrected by exact midpoint comparisons.
    s = scale[:, None]
    a = tl.abs(x)
    k = tl.minimum(tl.maximum(libdevice.rint(a * inv[:, None]), 0.0), QMAX)
    half = s * 0.5
    lo = (k + k - 1.0) * half
    hi = (k + k + 1.0) * half
    odd = (k.to(tl.int32) & 1) == 1
    k = k - ((a < lo) | ((a == lo) & odd)).to(tl.float32) + ((a > hi) | ((a == hi) & odd)).to(tl.float32)
    k = tl.minimum(tl.maximum(k, 0.0), QMAX)
    q = tl.where(x < 0, -k, k)
    return tl.where(ok[:, None], q, 0.0).to(tl.int32)

  @triton.jit
  def _load_lane(v_ptr, row, cols, LANE: tl.constexpr, BITS: tl.constexpr, BP: tl.constexpr,
                 TWO: tl.constexpr):
    # Codes of elements (TWO * col + LANE), or of element col when TWO == 1.
    if BITS == 8:
      q = tl.load(v_ptr + row[:, None] * BP + TWO * cols[None, :] + LANE).to(tl.int32)
    else:
      b = tl.load(v_ptr + row[:, None] * BP + cols[None, :]).to(tl.int32)
      q = (((b >> (4 * LANE)) & 0xF) ^ 8) - 8
    return q

  @triton.jit
  def _store_lane(o_ptr, row, cols, y, LANE: tl.constexpr, B: tl.constexpr, TWO: tl.constexpr):
    tl.store(o_ptr + row[:, None] * B + TWO * cols[None, :] + LANE, y.to(o_ptr.dtype.element_ty))

  @triton.jit
  def _store_codes(v_ptr, row, cols, q0, q1, OUT_BITS: tl.constexpr, OBP: tl.constexpr,
                   TWO: tl.constexpr):
    base = v_ptr + row[:, None] * OBP
    if OUT_BITS == 4:
      tl.store(base + cols[None, :], ((q0 & 0xF) | ((q1 & 0xF) << 4)).to(tl.uint8))
    else:
      tl.store(base + TWO * cols[None, :], q0.to(tl.int8))
      if TWO == 2:
        tl.store(base + TWO * cols[None, :] + 1, q1.to(tl.int8))

  @triton.jit
  def _quantize_store(v_ptr, s_ptr, row, cols, y0, y1, amax, B: tl.constexpr, BITS: tl.constexpr,
                      TWO: tl.constexpr):
    # Rows of B fp32 elements (lanes y0 and, when TWO == 2, y1; absmax amax) quantized to BITS: codes and
    # scales stored.
    QMAX: tl.constexpr = 7.0 if BITS == 4 else 127.0
    BP: tl.constexpr = B // 2 if BITS == 4 else B
    scale = _scale(amax, QMAX)
    ok = (scale > 0) & (scale < float("inf"))
    inv = _inverse(scale, ok)
    q0 = _codes(y0, scale, inv, ok, QMAX)
    q1 = q0
    if TWO == 2:
      q1 = _codes(y1, scale, inv, ok, QMAX)
    _store_codes(v_ptr, row, cols, q0, q1, BITS, BP, TWO)
    tl.store(s_ptr + row, scale)

  @triton.jit
  def quantize(x_ptr, v_ptr, s_ptr, N: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
               NB: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr):
    # Output rows are ordered (s, g, n, j); input rows (n, g, s, j). N = G = S = 1: plain quantize.
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    j = r % NB
    t = r // NB
    n = t % N
    t = t // N
    g = t % G
    s = t // G
    src = ((n * G + g) * S + s) * NB + j
    TWO: tl.constexpr = 2 if BITS == 4 else 1
    cols = tl.arange(0, B // TWO)
    x0 = tl.load(x_ptr + src[:, None] * B + TWO * cols[None, :]).to(tl.float32)
    x1 = x0
    amax = tl.max(_abs_or_inf(x0), axis=1)
    if TWO == 2:
      x1 = tl.load(x_ptr + src[:, None] * B + TWO * cols[None, :] + 1).to(tl.float32)
      amax = tl.maximum(amax, tl.max(_abs_or_inf(x1), axis=1))
    _quantize_store(v_ptr, s_ptr, r, cols, x0, x1, amax, B, BITS, TWO)

  @triton.jit
  def dequant_sum(v_ptr, s_ptr, o_ptr, os_ptr, K: tl.constexpr, M: tl.constexpr,
                  ROWS: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr,
                  OUT_BITS: tl.constexpr, REQUANT: tl.constexpr):
    # K = 1 and REQUANT = 0: plain dequantize. REQUANT = 1: o_ptr/os_ptr get values/scales.
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    TWO: tl.constexpr = 2 if (BITS == 4 or (REQUANT == 1 and OUT_BITS == 4)) else 1
    BP: tl.constexpr = B // 2 if BITS == 4 else B
    cols = tl.arange(0, B // TWO)
    acc0 = tl.zeros((ROWS, B // TWO), tl.float32)
    acc1 = tl.zeros((ROWS, B // TWO), tl.float32)
    for k in tl.static_range(K):
      row = k * M + r
      sc = tl.load(s_ptr + row)[:, None]
      y0 = _load_lane(v_ptr, row, cols, 0, BITS, BP, TWO).to(tl.float32) * sc
      if k == 0:
        acc0 = y0
      else:
        acc0 = acc0 + y0
      if TWO == 2:
        y1 = _load_lane(v_ptr, row, cols, 1, BITS, BP, TWO).to(tl.float32) * sc
        if k == 0:
          acc1 = y1
        else:
          acc1 = acc1 + y1
    if REQUANT == 1:
      amax = tl.max(_abs_or_inf(acc0), axis=1)
      if TWO == 2:
        amax = tl.maximum(amax, tl.max(_abs_or_inf(acc1), axis=1))
      _quantize_store(o_ptr, os_ptr, r, cols, acc0, acc1, amax, B, OUT_BITS, TWO)
    else:
      _store_lane(o_ptr, r, cols, acc0, 0, B, TWO)
      if TWO == 2:
        _store_lane(o_ptr, r, cols, acc1, 1, B, TWO)

  return quantize, dequant_sum


def _call(kernel, *args, out, grid, **meta):
  """jax_triton.triton_call across its API versions (`out_type`, formerly `out_shape`)."""
  import jax_triton as jt
  kw = dict(kernel=kernel, grid=grid, **meta)
  new_api = "out_type" in inspect.signature(jt.triton_call).parameters
  kw["out_type" if new_api else "out_shape"] = out
  return jt.triton_call(*args, **kw)


def _vdtype(bits):
  return jnp.int8 if bits == 8 else jnp.uint8


def _packed(b, bits):
  return b if bits == 8 else b // 2


def quantize_rows(x_MxB: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
  """[M, B] -> (values [M, Bp], scales [M]); see `pallas_kernels.block_quant.quantize_rows`."""
  m, b = x_MxB.shape
  quantize, _ = _kernels()
  out = (jax.ShapeDtypeStruct((m, _packed(b, bits)), _vdtype(bits)),
         jax.ShapeDtypeStruct((m,), jnp.float32))
  return _launch(quantize, [x_MxB], out=out, op=f"quantize/int{bits}", m=m, divisor=m, row_elements=b,
                 block=b, N=1, G=1, S=1, NB=m, B=b, BITS=bits)


def reorder_quantize(x_NxGxSxC: jax.Array, bits: int, block: int) -> tuple[jax.Array, jax.Array]:
  """[N, G, S, C] -> values [S, G, N, Cp], scales [S, G, N, C / block]."""
  n, g, s, c = x_NxGxSxC.shape
  nb = c // block
  quantize, _ = _kernels()
  m = n * g * s * nb
  out = (jax.ShapeDtypeStruct((m, _packed(block, bits)), _vdtype(bits)),
         jax.ShapeDtypeStruct((m,), jnp.float32))
  v, sc = _launch(quantize, [x_NxGxSxC.reshape(m, block)], out=out, op=f"reorder_quantize/int{bits}", m=m,
                  divisor=nb, row_elements=block, block=block, N=n, G=g, S=s, NB=nb, B=block, BITS=bits)
  return v.reshape(s, g, n, nb * _packed(block, bits)), sc.reshape(s, g, n, nb)


def dequantize_rows(v_MxBp: jax.Array, s_M: jax.Array, bits: int, dtype) -> jax.Array:
  """[M, Bp], [M] -> [M, B] in `dtype`."""
  m, bp = v_MxBp.shape
  b = bp if bits == 8 else 2 * bp
  _, dequant_sum = _kernels()
  out = (jax.ShapeDtypeStruct((m, b), dtype), jax.ShapeDtypeStruct((1,), jnp.float32))
  y, _ = _launch(dequant_sum, [v_MxBp, s_M.astype(jnp.float32)], out=out,
                 op=f"dequantize/int{bits}/{jnp.dtype(dtype).name}", m=m, divisor=m, row_elements=b, block=b,
                 K=1, M=m, B=b, BITS=bits, OUT_BITS=bits, REQUANT=0)
  return y


def dequant_sum_quantize_rows(v_KxMxBp: jax.Array, s_KxM: jax.Array, bits: int,
                              out_bits: int) -> tuple[jax.Array, jax.Array]:
  """[K, M, Bp], [K, M] -> requantized sum (values [M, Bp'], scales [M])."""
  k, m, bp = v_KxMxBp.shape
  b = bp if bits == 8 else 2 * bp
  _, dequant_sum = _kernels()
  out = (jax.ShapeDtypeStruct((m, _packed(b, out_bits)), _vdtype(out_bits)),
         jax.ShapeDtypeStruct((m,), jnp.float32))
  return _launch(dequant_sum, [v_KxMxBp, s_KxM.astype(jnp.float32)], out=out,
                 op=f"dequant_sum_quantize/{out_bits}/int{bits}", m=m, divisor=m, row_elements=b, block=b,
                 slabs=k, K=k, M=m, B=b, BITS=bits, OUT_BITS=out_bits, REQUANT=1)


def dequant_sum_rows(v_KxMxBp: jax.Array, s_KxM: jax.Array, bits: int, dtype) -> jax.Array:
  """[K, M, Bp], [K, M] -> fp32 sum cast to `dtype`: [M, B]."""
  k, m, bp = v_KxMxBp.shape
  b = bp if bits == 8 else 2 * bp
  _, dequant_sum = _kernels()
  out = (jax.ShapeDtypeStruct((m, b), dtype), jax.ShapeDtypeStruct((1,), jnp.float32))
  y, _ = _launch(dequant_sum, [v_KxMxBp, s_KxM.astype(jnp.float32)], out=out,
                 op=f"dequant_sum/int{bits}/{jnp.dtype(dtype).name}", m=m, divisor=m, row_elements=b,
                 block=b, slabs=k, K=k, M=m, B=b, BITS=bits, OUT_BITS=bits, REQUANT=0)
  return y
