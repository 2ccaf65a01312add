"""Triton kernels for block-wise quantization, called through jax-triton (CUDA GPUs only).

The same operations and the same arithmetic as `pallas_kernels.block_quant` and the reference in
`zerojax.quant.quantization` (the format of `pallas_kernels.block_format`, written again in Triton): scale =
absmax * fp32(1 / qmax) rounded up to 16 significant bits, codes the exactly rounded |x| / scale
(the estimate rint(|x| * r), one `rcp.approx` r per block and a multiplication per element, corrected
by exact comparisons), value = code * scale (exact), fp32 sums in slab order. Each program
handles ROWS blocks of B elements as a [ROWS, B] tile, loaded and stored whole (16-byte accesses); int4
codes are split into their even and odd elements (the low and high nibbles) in registers just before
packing and joined just after unpacking. The reordering of qgZ is a row map: output row (s, g, n, j) reads
input row (n, g, s, j), so the fused kernel costs what a plain quantization of contiguous data costs.
The Hadamard rotation runs inside the kernels (one pass over memory): `hadamard.fwht_tile`'s stages,
each a reshape, permute, split and join of the tile, the same additions in the same order, so the bits
are xla's (docs/quantization.md, "Where the time goes").

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
  dequantize + reduce + quantize fusion), §4.1.2 Algorithm 2. SDP4Bit: Jia et al. 2024, §3.2 (Hadamard
  rotation of 4-bit blocks).
"""
from __future__ import annotations

import functools
import inspect
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp

from pallas_kernels import block_format, hadamard, per_platform, tuning

CC_ENV = "ZEROJAX_TRITON_COMPUTE_CAPABILITY"
PTXAS_ENV = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")

# Bound by `kernels()` once triton is importable.
tl = libdevice = None
_abs_or_inf = _scale = _inverse = _codes = _butterflies = _fwht = _load_codes = _store_codes = _quantize_store = None


# The last jax-triton that registers its kernel call's dead-code rule with two arguments: jax 0.12 calls
# such rules with three (`TypeError: _triton_kernel_call_dce_rule() takes 2 positional arguments`).
JAX_TRITON_BEFORE_JAX_0_12 = (0, 4, 1)


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def incompatibility() -> str | None:
  """Why the installed jax-triton cannot lower kernels with this jax, or None (also where it is missing:
  `require_jax_triton` says so)."""
  from importlib import metadata
  try:
    installed = metadata.version("jax-triton")
  except metadata.PackageNotFoundError:
    return None
  if _version(installed) <= JAX_TRITON_BEFORE_JAX_0_12 and _version(jax.__version__) >= (0, 12):
    return (f"jax-triton {installed} does not lower with jax {jax.__version__} (its dead-code rule predates "
            "jax 0.12); install jax<0.12, or use backend='xla' or 'pallas'")
  return None


def require_jax_triton() -> None:
  """Raises unless jax-triton and triton import and jax-triton lowers with this jax (no GPU is needed to
  lower the kernels)."""
  try:
    import jax_triton  # noqa: F401
    import triton  # noqa: F401
  except ImportError as e:
    raise RuntimeError(
        f"backend='triton' needs the jax-triton package ({e}); install zerojax[gpu], or use "
        "backend='xla' or 'pallas'") from e
  why = incompatibility()
  if why:
    raise RuntimeError(f"backend='triton': {why}")


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


def launch(kernel, args, *, out, op, m, divisor, row_elements, block, slabs=1, **meta):
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
def kernels():
  """Builds the @triton.jit kernels (only callable where triton imports).

  Triton resolves the names a kernel uses in its module's globals, so the lazily imported modules
  and the helper kernels are bound there.
  """
  global tl, libdevice, TRIM_ADD, TRIM_MASK, MIN_SCALE, R8, R4, _abs_or_inf, _scale, _inverse, _codes
  global _butterflies, _fwht, _load_codes, _store_codes, _quantize_store
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
  def _butterflies(x, ROWS: tl.constexpr, B: tl.constexpr, H: tl.constexpr):
    # One stage of hadamard.fwht_tile: element i paired with i + H inside each group of 2H (a + b to the
    # lower, a - b to the upper).
    lower, upper = tl.split(tl.permute(tl.reshape(x, (ROWS, B // (2 * H), 2, H)), (0, 1, 3, 2)))
    return tl.reshape(tl.permute(tl.join(lower + upper, lower - upper), (0, 1, 3, 2)), (ROWS, B))

  @triton.jit
  def _fwht(x, ROWS: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr, SCALE: tl.constexpr):
    # hadamard.fwht_tile on a [ROWS, B] fp32 tile: stages H = 1, 2, ..., B/2, then times SCALE (a power of two).
    for st in tl.static_range(LOG_B):
      x = _butterflies(x, ROWS, B, 1 << st)
    return x * SCALE

  @triton.jit
  def _load_codes(v_ptr, row, ROWS: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr):
    # Stored values of rows `row` -> int32 codes [ROWS, B]: whole rows loaded; int4 bytes split into
    # their low and high nibbles (elements 2j, 2j + 1) in registers.
    if BITS == 8:
      return tl.load(v_ptr + row[:, None] * B + tl.arange(0, B)[None, :]).to(tl.int32)
    b = tl.load(v_ptr + row[:, None] * (B // 2) + tl.arange(0, B // 2)[None, :]).to(tl.int32)
    return tl.reshape(tl.join(((b & 0xF) ^ 8) - 8, (((b >> 4) & 0xF) ^ 8) - 8), (ROWS, B))

  @triton.jit
  def _store_codes(v_ptr, row, q, ROWS: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr):
    # int32 codes [ROWS, B] -> whole stored rows; int4: elements (2j, 2j + 1) joined into byte j in registers.
    if BITS == 8:
      tl.store(v_ptr + row[:, None] * B + tl.arange(0, B)[None, :], q.to(tl.int8))
    else:
      lo, hi = tl.split(tl.reshape(q, (ROWS, B // 2, 2)))
      tl.store(v_ptr + row[:, None] * (B // 2) + tl.arange(0, B // 2)[None, :],
               ((lo & 0xF) | ((hi & 0xF) << 4)).to(tl.uint8))

  @triton.jit
  def _quantize_store(v_ptr, s_ptr, row, y, ROWS: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr):
    # Rows [ROWS, B] of fp32 elements quantized to BITS: codes and scales stored.
    QMAX: tl.constexpr = 7.0 if BITS == 4 else 127.0
    scale = _scale(tl.max(_abs_or_inf(y), axis=1), QMAX)
    ok = (scale > 0) & (scale < float("inf"))
    _store_codes(v_ptr, row, _codes(y, scale, _inverse(scale, ok), ok, QMAX), ROWS, B, BITS)
    tl.store(s_ptr + row, scale)

  @triton.jit
  def quantize(x_ptr, v_ptr, s_ptr, N: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
               NB: tl.constexpr, ROWS: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr,
               LOG_B: tl.constexpr, ROTATE: tl.constexpr, FORWARD: tl.constexpr):
    # Output rows are ordered (s, g, n, j); input rows (n, g, s, j). N = G = S = 1: plain quantize.
    # ROTATE = 1: each row times H_B * FORWARD first (hadamard.fwht_tile).
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    j = r % NB
    t = r // NB
    n = t % N
    t = t // N
    g = t % G
    s = t // G
    src = ((n * G + g) * S + s) * NB + j
    x = tl.load(x_ptr + src[:, None] * B + tl.arange(0, B)[None, :]).to(tl.float32)
    if ROTATE == 1:
      x = _fwht(x, ROWS, B, LOG_B, FORWARD)
    _quantize_store(v_ptr, s_ptr, r, x, ROWS, B, BITS)

  @triton.jit
  def dequant_sum(v_ptr, s_ptr, o_ptr, os_ptr, K: tl.constexpr, M: tl.constexpr,
                  ROWS: tl.constexpr, B: tl.constexpr, BITS: tl.constexpr,
                  OUT_BITS: tl.constexpr, REQUANT: tl.constexpr, LOG_B: tl.constexpr,
                  ROTATE: tl.constexpr, INVERSE: tl.constexpr):
    # K = 1 and REQUANT = 0: plain dequantize. REQUANT = 1: o_ptr/os_ptr get values/scales. ROTATE = 1
    # (REQUANT = 0): the fp32 sum times H_B * INVERSE before the cast (hadamard.fwht_tile).
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    acc = tl.zeros((ROWS, B), tl.float32)
    for k in tl.static_range(K):
      row = k * M + r
      y = _load_codes(v_ptr, row, ROWS, B, BITS).to(tl.float32) * tl.load(s_ptr + row)[:, None]
      if k == 0:
        acc = y
      else:
        acc = acc + y
    if REQUANT == 1:
      _quantize_store(o_ptr, os_ptr, r, acc, ROWS, B, OUT_BITS)
    else:
      if ROTATE == 1:
        acc = _fwht(acc, ROWS, B, LOG_B, INVERSE)
      tl.store(o_ptr + r[:, None] * B + tl.arange(0, B)[None, :], acc.to(o_ptr.dtype.element_ty))

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


def _op(name: str, bits: int, rotate: bool, dtype=None) -> str:
  """The op's name in tuning keys, as `block_quant` names its kernels'."""
  return "/".join([name, f"int{bits}"] + ["rotate"] * rotate + ([jnp.dtype(dtype).name] if dtype is not None else []))


def _rotation(block: int, rotate: bool, which: int) -> dict:
  """The kernels' rotation parameters: the butterflies' stages and the scale (`which`: 0 forward,
  1 inverse) of `hadamard.scales`."""
  if rotate:
    hadamard.check_block(block)
  scale = hadamard.scales(block)[which] if rotate else 1.0
  return dict(LOG_B=block.bit_length() - 1, ROTATE=int(rotate), **{("FORWARD", "INVERSE")[which]: scale})


def quantize_rows(x_MxB: jax.Array, bits: int, rotate: bool = False) -> tuple[jax.Array, jax.Array]:
  """[M, B] -> (values [M, Bp], scales [M]); see `pallas_kernels.block_quant.quantize_rows` (`rotate`:
  each row times the Hadamard matrix first, in the kernel)."""
  m, b = x_MxB.shape
  quantize, _ = kernels()
  out = (jax.ShapeDtypeStruct((m, _packed(b, bits)), _vdtype(bits)),
         jax.ShapeDtypeStruct((m,), jnp.float32))
  return launch(quantize, [x_MxB], out=out, op=_op("quantize", bits, rotate), m=m, divisor=m,
                 row_elements=b, block=b, N=1, G=1, S=1, NB=m, B=b, BITS=bits, **_rotation(b, rotate, 0))


def reorder_quantize(x_NxGxSxC: jax.Array, bits: int, block: int,
                     rotate: bool = False) -> tuple[jax.Array, jax.Array]:
  """[N, G, S, C] -> values [S, G, N, Cp], scales [S, G, N, C / block] (`rotate` as in `quantize_rows`)."""
  n, g, s, c = x_NxGxSxC.shape
  nb = c // block
  quantize, _ = kernels()
  m = n * g * s * nb
  out = (jax.ShapeDtypeStruct((m, _packed(block, bits)), _vdtype(bits)),
         jax.ShapeDtypeStruct((m,), jnp.float32))
  v, sc = launch(quantize, [x_NxGxSxC.reshape(m, block)], out=out, op=_op("reorder_quantize", bits, rotate),
                  m=m, divisor=nb, row_elements=block, block=block, N=n, G=g, S=s, NB=nb, B=block, BITS=bits,
                  **_rotation(block, rotate, 0))
  return v.reshape(s, g, n, nb * _packed(block, bits)), sc.reshape(s, g, n, nb)


def dequantize_rows(v_MxBp: jax.Array, s_M: jax.Array, bits: int, dtype, rotate: bool = False) -> jax.Array:
  """[M, Bp], [M] -> [M, B] in `dtype` (rotated back with `rotate`, in the kernel)."""
  m, bp = v_MxBp.shape
  b = bp if bits == 8 else 2 * bp
  _, dequant_sum = kernels()
  out = (jax.ShapeDtypeStruct((m, b), dtype), jax.ShapeDtypeStruct((1,), jnp.float32))
  y, _ = launch(dequant_sum, [v_MxBp, s_M.astype(jnp.float32)], out=out,
                 op=_op("dequantize", bits, rotate, dtype), m=m, divisor=m, row_elements=b, block=b,
                 K=1, M=m, B=b, BITS=bits, OUT_BITS=bits, REQUANT=0, **_rotation(b, rotate, 1))
  return y


def dequant_sum_quantize_rows(v_KxMxBp: jax.Array, s_KxM: jax.Array, bits: int,
                              out_bits: int) -> tuple[jax.Array, jax.Array]:
  """[K, M, Bp], [K, M] -> requantized sum (values [M, Bp'], scales [M])."""
  k, m, bp = v_KxMxBp.shape
  b = bp if bits == 8 else 2 * bp
  _, dequant_sum = kernels()
  out = (jax.ShapeDtypeStruct((m, _packed(b, out_bits)), _vdtype(out_bits)),
         jax.ShapeDtypeStruct((m,), jnp.float32))
  return launch(dequant_sum, [v_KxMxBp, s_KxM.astype(jnp.float32)], out=out,
                 op=f"dequant_sum_quantize/{out_bits}/int{bits}", m=m, divisor=m, row_elements=b, block=b,
                 slabs=k, K=k, M=m, B=b, BITS=bits, OUT_BITS=out_bits, REQUANT=1, **_rotation(b, False, 1))


def dequant_sum_rows(v_KxMxBp: jax.Array, s_KxM: jax.Array, bits: int, dtype, rotate: bool = False) -> jax.Array:
  """[K, M, Bp], [K, M] -> fp32 sum (rotated back with `rotate`, in the kernel) cast to `dtype`: [M, B]."""
  k, m, bp = v_KxMxBp.shape
  b = bp if bits == 8 else 2 * bp
  _, dequant_sum = kernels()
  out = (jax.ShapeDtypeStruct((m, b), dtype), jax.ShapeDtypeStruct((1,), jnp.float32))
  y, _ = launch(dequant_sum, [v_KxMxBp, s_KxM.astype(jnp.float32)], out=out,
                 op=_op("dequant_sum", bits, rotate, dtype), m=m, divisor=m, row_elements=b,
                 block=b, slabs=k, K=k, M=m, B=b, BITS=bits, OUT_BITS=bits, REQUANT=0, **_rotation(b, rotate, 1))
  return y
