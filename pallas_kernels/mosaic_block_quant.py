"""Mosaic GPU kernels (Pallas `plgpu`) for the int8 block format: quantize and dequantize rows.

The successor of the Pallas Triton lowering that jax 0.11 deprecates (docs/mosaic_gpu.md). The same
format and arithmetic as `pallas_kernels.block_format` (its functions, traced into the kernel): scale =
up16(absmax * fp32(1 / 127)), 0 below 2^-125; codes = the estimate rint(|x| / s) corrected by exact
midpoint comparisons. The estimate is rint(|x| * r) with one reciprocal r per row (Mosaic GPU divides
with `div.full.f32`, not correctly rounded, once per row); the correction makes the codes exact all the
same, so the bits equal the xla backend's.

Shape of the kernels: `plgpu.kernel` (the API of jax 0.10.2 to 0.12; `pl.pallas_call` has no Mosaic GPU
lowering from jax 0.11.2 on), one CTA of one warpgroup per 64 rows (blocks), lowered with Lane
semantics. A CTA copies its [64, B] tile into shared memory with TMA (tiled and swizzled so that
WGMMA-layout register loads and stores are bank-conflict free), takes the rows' absmax and then the codes
64 columns at a time (the WGMMA layout keeps each row in one warp, so the row reduction needs no shared
memory), and copies the int8 tile and the 64 scales back with TMA. Row counts that are not a multiple of
64 are padded with zero rows (sliced off). Needs an sm_90+ GPU (H100) and the jax CUDA plugin, which
carries the Mosaic GPU bindings (`_mosaic_gpu_ext`).

The module imports on any machine: `jax.experimental.pallas.mosaic_gpu` is imported when a kernel is
built. Like `triton_block_quant`, the kernels follow the platform the program is lowered for
(`per_platform.choose`): compiled for CUDA (also from a CPU host, for compile-only GPUs), refused with a
one-line error naming the fix for other platforms and where Mosaic GPU is unavailable (no CUDA plugin, a
local GPU before sm_90). `interpret=True` runs the same kernel bodies in the Mosaic GPU interpreter
(`InterpretGPUParams`) on any platform, for CPU tests; it is never a per-platform branch, because its
callbacks are ordered effects that `lax.platform_dependent` would then ask of the compiled branch too.

References:
  ZeRO++: Wang et al. 2023, §4.2 (quantization kernels).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import block_format, per_platform

ROWS = 64          # blocks per CTA: the row tile of the WGMMA register layout (one warpgroup)
CHUNK = 64         # columns per register pass: 32 fp32 registers a thread (B=256 fp32: 154 registers)
MIN_BLOCK = 32     # an int8 row of 32 bytes: the narrowest TMA swizzle
SMEM_BYTES = 200 * 1024  # of the 227 KiB a CTA may use on an H100
FIX = "use backend='pallas', 'triton' or 'xla'"
NEEDS = "jax>=0.10.2 with the CUDA plugin (pip install 'jax[cuda12]' or 'jax[cuda13]') and an sm_90+ GPU"


def _plgpu():
  """(pl, plgpu), or a one-line RuntimeError where this jax has no Mosaic GPU `plgpu.kernel`."""
  try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
  except ImportError as e:
    raise RuntimeError(
        f"backend='mosaic' needs jax.experimental.pallas.mosaic_gpu ({e}): {NEEDS}; or {FIX}") from e
  missing = [n for n in ("kernel", "CompilerParams", "LoweringSemantics", "Layout", "SMEM", "Barrier",
                         "TilingTransform", "SwizzleTransform", "copy_gmem_to_smem", "copy_smem_to_gmem",
                         "barrier_wait", "commit_smem", "wait_smem_to_gmem", "layout_cast")
             if not hasattr(plgpu, n)]
  if missing:
    raise RuntimeError(f"backend='mosaic': this jax {jax.__version__} lacks plgpu.{', plgpu.'.join(missing)}: "
                       f"{NEEDS}; or {FIX}")
  return pl, plgpu


def missing_api() -> str | None:
  """Why this jax cannot build the kernels at all (not even for the interpreter), in one line (None: it
  can)."""
  try:
    _plgpu()
  except RuntimeError as e:
    return str(e)
  return None


def unavailable_reason() -> str | None:
  """Why the Mosaic GPU kernels cannot be compiled for a GPU from here, in one line (None: they can)."""
  missing = missing_api()
  if missing:
    return missing
  try:
    from jax._src.lib import mosaic_gpu  # noqa: F401  (the CUDA plugin's _mosaic_gpu_ext)
  except ImportError:
    return f"backend='mosaic' needs the Mosaic GPU bindings of the jax CUDA plugin: {NEEDS}; or {FIX}"
  if jax.default_backend() == "gpu":
    cc = str(getattr(jax.devices()[0], "compute_capability", "9.0"))
    if int(cc.split(".")[0]) < 9:
      return (f"backend='mosaic' needs an sm_90+ GPU (H100 or newer); {jax.devices()[0].device_kind} is "
              f"sm_{cc.replace('.', '')}: {FIX}")
  return None


def unsupported(bits: int, block: int, dtype=jnp.float32) -> str | None:
  """Why these settings have no Mosaic GPU kernel, in one line (None: they have)."""
  if bits != 8:
    return f"backend='mosaic' has int8 kernels only (bits={bits}); {FIX}"
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize > 4:
    return f"backend='mosaic' takes fp32, bf16 or fp16 values, not {jnp.dtype(dtype).name}; {FIX}"
  if block < MIN_BLOCK or block & (block - 1):
    return f"backend='mosaic' needs a power-of-two block >= {MIN_BLOCK} (block={block}); {FIX}"
  need = ROWS * block * (jnp.dtype(dtype).itemsize + 1) + ROWS * 4
  if need > SMEM_BYTES:
    return (f"backend='mosaic': block={block} of {jnp.dtype(dtype).name} needs {need} bytes of shared memory"
            f" a CTA (> {SMEM_BYTES}); use a smaller block, or {FIX}")
  return None


def _check(bits, block, dtype):
  reason = unsupported(bits, block, dtype)
  if reason:
    raise ValueError(reason)


# --- kernel bodies --------------------------------------------------------------------------------

def _smem(plgpu, shape, dtype):
  """Shared memory for a [ROWS, B] tile, tiled (8, w) and swizzled (w * itemsize bytes, at most 128) so
  that loads and stores of CHUNK-column slices in the WGMMA layout are bank-conflict free."""
  if len(shape) == 1:
    return plgpu.SMEM(shape, dtype)
  item = jnp.dtype(dtype).itemsize
  swizzle = min(128, min(shape[1], CHUNK) * item)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // item)),
                                              plgpu.SwizzleTransform(swizzle)))


def _columns(pl, width):
  return [pl.ds(c, min(width, CHUNK)) for c in range(0, width, CHUNK)]


def _quantize_body(x_gmem, v_gmem, s_gmem, x_smem, v_smem, s_smem, barrier, *, bits, pl, plgpu):
  rows = pl.ds(lax.axis_index("blocks") * ROWS, ROWS)
  plgpu.copy_gmem_to_smem(x_gmem.at[rows], x_smem, barrier)
  plgpu.barrier_wait(barrier)
  columns = _columns(pl, x_smem.shape[1])
  amax = None
  for cols in columns:  # NaN counts as +inf
    x = x_smem[:, cols].astype(jnp.float32)
    m = jnp.max(jnp.where(x != x, jnp.inf, jnp.abs(x)), axis=1)
    amax = m if amax is None else jnp.maximum(amax, m)
  scale = block_format.scale_of(amax, bits)
  inv = block_format.inverse_scale(scale)  # one reciprocal per row; a product per element below
  for cols in columns:
    x = x_smem[:, cols].astype(jnp.float32)
    s = lax.broadcast_in_dim(scale, x.shape, (0,))
    estimate = jnp.round(jnp.abs(x) * lax.broadcast_in_dim(inv, x.shape, (0,)))
    codes = block_format.nearest_codes(x, s, bits, estimate=estimate)
    v_smem[:, cols] = codes.astype(jnp.int8)
  s_smem[...] = scale
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(v_smem, v_gmem.at[rows])
  plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[rows])
  plgpu.wait_smem_to_gmem(0)


def _dequantize_body(v_gmem, s_gmem, o_gmem, v_smem, s_smem, o_smem, barrier, *, interpret, pl, plgpu):
  rows = pl.ds(lax.axis_index("blocks") * ROWS, ROWS)
  plgpu.copy_gmem_to_smem(v_gmem.at[rows], v_smem, barrier)
  plgpu.copy_gmem_to_smem(s_gmem.at[rows], s_smem, barrier)
  plgpu.barrier_wait(barrier)
  scale = s_smem[...]
  if not interpret:  # one scale per row of the WGMMA layout (a layout changes no value)
    scale = plgpu.layout_cast(scale, plgpu.Layout.WGMMA.reduce(1))
  for cols in _columns(pl, v_smem.shape[1]):
    codes = v_smem[:, cols].astype(jnp.float32)
    o_smem[:, cols] = (codes * lax.broadcast_in_dim(scale, codes.shape, (0,))).astype(o_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows])
  plgpu.wait_smem_to_gmem(0)


# --- launch ---------------------------------------------------------------------------------------

def _interpret_params(plgpu):
  cls = getattr(plgpu, "InterpretGPUParams", None)  # public from jax 0.11
  if cls is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
  return cls()


def _kernel(body, name, args, out_type, scratch, copies_in, interpret):
  """`plgpu.kernel` of `body` over one CTA per ROWS rows: `scratch` the SMEM tiles (ShapeDtypeStructs),
  then one barrier for the `copies_in` TMA copies into them."""
  pl, plgpu = _plgpu()
  tiles = args[0].shape[0] // ROWS
  return plgpu.kernel(
      functools.partial(body, pl=pl, plgpu=plgpu), out_type=out_type,
      scratch_types=[*(_smem(plgpu, s.shape, s.dtype) for s in scratch), plgpu.Barrier(num_arrivals=copies_in)],
      grid=(tiles,), grid_names=("blocks",), kernel_name=name,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      interpret=_interpret_params(plgpu) if interpret else None)(*args)


CPU = per_platform.Refusal(
    "backend='mosaic' compiles for CUDA GPUs only, not for {platform} (interpret=True runs the Mosaic GPU"
    " interpreter); " + FIX)


def _run(launch, args, interpret):
  """`launch(interpret)(*args)`: with `interpret`, the Mosaic GPU interpreter (any platform); else the
  compiled kernel where the program is lowered for cuda, a refusal naming the fix elsewhere (and on cuda
  where Mosaic GPU is unavailable)."""
  if interpret:
    return launch(True)(*args)
  reason = unavailable_reason()
  cuda = per_platform.Refusal(reason, RuntimeError) if reason else launch(False)
  return per_platform.choose(*args, cpu=CPU, cuda=cuda, like=launch(False))


def _padded(a, m_pad):
  return a if a.shape[0] == m_pad else jnp.pad(a, [(0, m_pad - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def quantize_rows(x_MxB: jax.Array, bits: int = 8, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """[M, B] fp32/bf16 -> (int8 codes [M, B], fp32 scales [M]): one block per row, B a power of two;
  `interpret`: run the Mosaic GPU interpreter (CPU tests) instead of compiling for a GPU."""
  m, b = x_MxB.shape
  _check(bits, b, x_MxB.dtype)
  m_pad = -(-m // ROWS) * ROWS
  out = (jax.ShapeDtypeStruct((m_pad, b), jnp.int8), jax.ShapeDtypeStruct((m_pad,), jnp.float32))
  scratch = (jax.ShapeDtypeStruct((ROWS, b), x_MxB.dtype), jax.ShapeDtypeStruct((ROWS, b), jnp.int8),
             jax.ShapeDtypeStruct((ROWS,), jnp.float32))

  def launch(interpret):
    body = functools.partial(_quantize_body, bits=bits)
    return lambda x: _kernel(body, "zerojax_mosaic_quantize", (x,), out, scratch, 1, interpret)

  v, s = _run(launch, (_padded(x_MxB, m_pad),), interpret)
  return (v, s) if m_pad == m else (v[:m], s[:m])


def dequantize_rows(v_MxB: jax.Array, s_M: jax.Array, bits: int = 8, dtype=jnp.float32, *,
                    interpret: bool = False) -> jax.Array:
  """int8 codes [M, B], fp32 scales [M] -> code * scale [M, B] in `dtype` (`interpret` as in
  `quantize_rows`)."""
  m, b = v_MxB.shape
  _check(bits, b, dtype)
  m_pad = -(-m // ROWS) * ROWS
  out = jax.ShapeDtypeStruct((m_pad, b), dtype)
  scratch = (jax.ShapeDtypeStruct((ROWS, b), jnp.int8), jax.ShapeDtypeStruct((ROWS,), jnp.float32),
             jax.ShapeDtypeStruct((ROWS, b), dtype))

  def launch(interpret):
    body = functools.partial(_dequantize_body, interpret=interpret)
    return lambda v, s: _kernel(body, "zerojax_mosaic_dequantize", (v, s), out, scratch, 2, interpret)

  y = _run(launch, (_padded(v_MxB, m_pad), _padded(s_M.astype(jnp.float32), m_pad)), interpret)
  return y if m_pad == m else y[:m]
