"""Pallas kernels for block-wise quantization (interpreted on CPU, compiled through Triton on GPU).

Which of the two is chosen by the platform the program is lowered for (`per_platform.choose`), not
by the host's default device: a program compiled on a CPU host for GPUs gets Triton kernels.

Every kernel works on a tile of R blocks, i.e. a [R, B] slice of the [M, B] view of the data, and
computes the format of `pallas_kernels.block_format` with its functions, so that results agree bit for
bit with the xla backend: scale = absmax * fp32(1 / qmax) rounded up to 16 significant bits, codes the
exactly rounded |x| / scale (an estimate corrected by exact comparisons), value = code *
scale, fp32 sums in slab order. Tiles are loaded and stored whole (contiguous, so Triton vectorizes
them); int4 codes are split into their even and odd elements (the low and high nibbles) in registers
just before packing and joined just after unpacking. The rotation runs on whole rows
(`hadamard.fwht_tile`), fused into the kernel: one pass over memory (docs/quantization.md, "Where the
time goes").

The estimate of a code is rint(|x| * r) with one reciprocal r per block (`rcp.approx` on GPUs, any
reciprocal within a few ulp serves: `block_format`) and a multiplication per element; its rounding is
PTX `cvt.rni` on GPUs (Pallas has no Triton lowering for `round`). Stochastic rounding's
`floor(x / scale + u)` keeps a correctly rounded division per element (`div.rn`), which makes it match
the CPU. Products `code * scale` are exact (16-bit scales), so FMA
contraction of the fp32 sums cannot change a bit.

References:
  ZeRO++: Wang et al. 2023, §4.2 (quantization kernels; reorder+quantize fusion; dequantize +
  reduce + quantize fusion), §4.1.2 Algorithm 2 (tensor slice reordering).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import block_format, hadamard
from pallas_kernels import per_platform, tuning

# Elements per grid step in interpret mode: as many as memory allows (each step is an iteration of an
# XLA while loop that carries whole buffers; one step compiles to ordinary fused XLA). Compiled, the
# tile, warps and stages are a `tuning.Config`: tuned on the GPU, else the device kind's default.
_INTERPRET_TILE = 1 << 22


# --- scalar arithmetic, IEEE round-to-nearest on every backend ------------------------------------

def _asm(op: str, *args: jax.Array) -> jax.Array:
  from jax.experimental.pallas import triton as plgpu
  ins = ", ".join(f"${i + 1}" for i in range(len(args)))
  [out] = plgpu.elementwise_inline_asm(
      f"{op} $0, {ins};", args=list(args), constraints=",".join(["=f"] + ["f"] * len(args)),
      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
  return out


class _Ops:
  """fp32 division, reciprocal and rounding; `gpu` selects explicit PTX instructions."""

  def __init__(self, gpu: bool):
    self.gpu = gpu

  def div(self, a, b):
    return _asm("div.rn.f32", a, b) if self.gpu else a / b

  def rcp(self, a):
    """A reciprocal within one ulp (`rcp.approx` on GPUs: one instruction); taken once per block."""
    return _asm("rcp.approx.ftz.f32", a) if self.gpu else 1.0 / a

  def rint(self, a):
    return _asm("cvt.rni.f32.f32", a) if self.gpu else jnp.round(a)

  def floor(self, a):
    return _asm("cvt.rmi.f32.f32", a) if self.gpu else jnp.floor(a)


# --- tile helpers: whole [R, B] tiles, loaded and stored contiguously -----------------------------
# int4 pairs elements (2j, 2j+1) in a byte (low, high nibble): the codes are split into their even and
# odd elements in registers just before packing, and joined back just after unpacking, so that every
# global load and store of a kernel is of a contiguous tile (vectorized by Triton), never a stride-2 lane.

def _even_odd(x):
  """[R, L] -> its even and odd elements, [R, L/2] each (a split of a trailing pair: in registers)."""
  r, l = x.shape
  a, b = lax.split(x.reshape(r, l // 2, 2), (1, 1), axis=2)
  return a.reshape(r, l // 2), b.reshape(r, l // 2)


def _interleave(even, odd):
  """Inverse of `_even_odd`."""
  r, h = even.shape
  return jnp.stack([even, odd], axis=-1).reshape(r, 2 * h)


def _load_codes(v_ref, bits: int):
  """Stored values [R, Bp] -> int32 codes [R, B]."""
  b = v_ref[...].astype(jnp.int32)
  if bits == 8:
    return b
  return _interleave(((b & 0xF) ^ 8) - 8, (((b >> 4) & 0xF) ^ 8) - 8)


def _store_codes(v_ref, codes, bits: int) -> None:
  if bits == 8:
    v_ref[...] = codes.astype(jnp.int8)
  else:
    lo, hi = _even_odd(codes)
    v_ref[...] = ((lo & 0xF) | ((hi & 0xF) << 4)).astype(jnp.uint8)


def _dequant(codes, scale_R):
  return codes.astype(jnp.float32) * scale_R.astype(jnp.float32)[:, None]


def _quant(x, bits: int, ops: _Ops, u=None):
  """fp32 [R, B] -> (int32 codes [R, B], scales [R]); `u`: noise [R, B], stochastic rounding."""
  amax = jnp.max(jnp.where(x != x, jnp.inf, jnp.abs(x)), axis=1)
  scale = block_format.scale_of(amax, bits)
  s = scale[:, None]
  if u is None:  # the estimate: a product per element, corrected exactly (block_format)
    inv = block_format.inverse_scale(scale, ops.rcp)[:, None]
    q = block_format.nearest_codes(x, s, bits, ops.rint(jnp.abs(x) * inv))
  else:
    q = block_format.stochastic_codes(ops.floor(ops.div(x, jnp.broadcast_to(s, x.shape)) + u), s, bits)
  return q.astype(jnp.int32), scale


# --- kernels --------------------------------------------------------------------------------------

def _rotated(x, rotate: bool, which: int):
  """The tile's rows times the block's Hadamard matrix (`which`: 0 forward, 1 inverse scale), or as they are."""
  if not rotate:
    return x
  return hadamard.fwht_tile(x, hadamard.scales(x.shape[-1])[which])


def _quantize_kernel(x_ref, *refs, bits, ops, rotate, noisy):
  u_ref, v_ref, s_ref = refs if noisy else (None, *refs)
  x = _rotated(x_ref[...].astype(jnp.float32), rotate, 0)
  codes, scale = _quant(x, bits, ops, u_ref[...] if noisy else None)
  _store_codes(v_ref, codes, bits)
  s_ref[...] = scale


def _dequantize_kernel(v_ref, s_ref, o_ref, *, bits, rotate):
  y = _rotated(_dequant(_load_codes(v_ref, bits), s_ref[...]), rotate, 1)
  o_ref[...] = y.astype(o_ref.dtype)


def _sum_slabs(refs, bits):
  """refs = K value tiles, then K scale tiles (one per received slab); fp32 sum, slab 0 first."""
  k = len(refs) // 2
  acc = None
  for v_ref, s_ref in zip(refs[:k], refs[k:]):
    y = _dequant(_load_codes(v_ref, bits), s_ref[...])
    acc = y if acc is None else acc + y
  return acc


def _dequant_sum_quantize_kernel(*refs, bits, out_bits, ops, noisy):
  *ins, ov_ref, os_ref = refs
  u_ref, ins = (ins[-1], ins[:-1]) if noisy else (None, ins)
  codes, scale = _quant(_sum_slabs(ins, bits), out_bits, ops, u_ref[...] if noisy else None)
  _store_codes(ov_ref, codes, out_bits)
  os_ref[...] = scale


def _dequant_sum_kernel(*refs, bits, rotate):
  *ins, o_ref = refs
  o_ref[...] = _rotated(_sum_slabs(ins, bits), rotate, 1).astype(o_ref.dtype)


# --- launch helpers -------------------------------------------------------------------------------

def _rows_per_tile(m: int, block: int, interpret: bool, cfg: tuning.Config | None = None) -> int:
  """Rows per grid step: a divisor of m within the tile budget (compiled: `cfg.rows`, a power of two)."""
  if not interpret:
    return (cfg or tuning.default()).rows(m, block)
  budget = max(1, _INTERPRET_TILE // block)
  best = 1
  for d in range(1, int(m ** 0.5) + 1):
    if m % d == 0:
      for cand in (d, m // d):
        if cand <= budget and cand > best:
          best = cand
  return best


def _mat(*arrays):
  """The manual-axis type of the kernel's outputs: that of its most varying input."""
  return max((jax.typeof(a).manual_axis_type for a in arrays), key=lambda t: len(t.varying))


def _pallas(kernel, interpret: bool, name: str, cfg: tuning.Config | None = None, **specs):
  """pallas_call in interpret mode, or through the Triton lowering with `cfg`'s warps and stages.

  Triton compiler params select the Triton lowering (up to jax 0.11.1 the default was Mosaic GPU; from 0.11.2
  pallas_call lowers for GPUs through Triton only: docs/mosaic_gpu.md).
  """
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton
    cfg = cfg or tuning.default()
    params = pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  return pl.pallas_call(kernel, interpret=interpret, compiler_params=params, name=name, **specs)


def _run(launch, args, *, block: int, mat, op: str, elements: int, slabs: int = 1):
  """The kernel for the platform the program is lowered for: `launch(interpret, cfg, mat)` is a
  pallas_call (with its tiles and arithmetic for that mode), interpreted on cpu, compiled through
  Triton on cuda with the launch configuration `tuning.config` picks for `op` (timed on this GPU the
  first time, where tuning is on); where one cannot be built, lowering there raises an error naming
  the fix."""
  if mat.varying:
    cpu = per_platform.Refusal(
        "the Pallas interpreter cannot run inside jax.shard_map(check_vma=True) on this jax"
        " version (it drops the manual-axis types of the kernel's blocks); use check_vma=False,"
        " as zerojax's executor does, or backend='xla'")
  else:
    cpu = launch(True)
  if block & (block - 1):
    cuda = per_platform.Refusal(
        f"block={block}: the compiled Pallas kernels need a power-of-two block", ValueError)
  else:
    cfg = tuning.config("pallas", op, elements=elements, block=block, slabs=slabs, dtype=args[0].dtype,
                        make=lambda c: lambda *a: launch(False, c, _mat(*a))(*a), avals=args)
    cuda = launch(False, cfg)
  return per_platform.choose(*args, cpu=cpu, cuda=cuda, like=launch(True))


def _op(name: str, bits: int, rotate: bool = False, noisy: bool = False, dtype=None) -> str:
  """The op's name in tuning keys: the kernel, bits, rotation, noise and output dtype it is built for."""
  return "/".join([name, f"int{bits}"] + ["rotate"] * rotate + ["noise"] * noisy +
                  ([jnp.dtype(dtype).name] if dtype is not None else []))


def _out(shape, dtype, mat):
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def _value_dtype(bits):
  return jnp.int8 if bits == 8 else jnp.uint8


def _packed(elements: int, bits: int) -> int:
  return elements if bits == 8 else elements // 2


def _rows(r):
  return pl.BlockSpec((r,), lambda i: (i,))


def _tiles(r, width):
  return pl.BlockSpec((r, width), lambda i: (i, 0))


def _slab_specs(k: int, r: int, bp: int):
  """One block spec per slab over the same [K, M, Bp] and [K, M] arrays.

  Each slab is its own kernel operand (the same buffer, no copy), so kernels never index a leading
  slab axis: Triton's lowering and the interpreter disagree on mixing that with strided slices.
  """
  sq = pl.squeezed
  return ([pl.BlockSpec((sq, r, bp), functools.partial(lambda kk, i: (kk, i, 0), kk))
           for kk in range(k)] +
          [pl.BlockSpec((sq, r), functools.partial(lambda kk, i: (kk, i), kk)) for kk in range(k)])


def quantize_rows(x_MxB: jax.Array, bits: int, rotate: bool = False,
                  noise: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """[M, B] fp32/bf16 -> (values [M, B] int8 or [M, B/2] uint8, scales [M] fp32).

  `rotate`: each row times the Hadamard matrix first; `noise` [M, B]: stochastic rounding."""
  m, b = x_MxB.shape
  args = [x_MxB] + ([noise] if noise is not None else [])
  mat = _mat(*args)
  bp = _packed(b, bits)

  def launch(interpret, cfg=None, mat=mat):
    r = _rows_per_tile(m, b, interpret, cfg)
    kernel = functools.partial(_quantize_kernel, bits=bits, ops=_Ops(gpu=not interpret),
                               rotate=rotate, noisy=len(args) == 2)
    out = (_out((m, bp), _value_dtype(bits), mat), _out((m,), jnp.float32, mat))
    return _pallas(kernel, interpret, "zerojax_quantize", cfg, out_shape=out, grid=(m // r,),
                   in_specs=[_tiles(r, b)] * len(args), out_specs=(_tiles(r, bp), _rows(r)))

  return _run(launch, args, block=b, mat=mat, op=_op("quantize", bits, rotate, len(args) == 2), elements=m * b)


def reorder_quantize(x_NxGxSxC: jax.Array, bits: int, block: int, rotate: bool = False,
                     noise: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """[N, G, S, C] -> quantized [S, G, N, C]: the transpose is done by the grid's index maps.

  `rotate` and `noise` (shaped like the input) as in `quantize_rows`.

  Returns values [S, G, N, C or C/2] and scales [S, G, N, C / block].
  """
  n, g, s, c = x_NxGxSxC.shape
  nb = c // block
  bp = _packed(block, bits)
  sq = pl.squeezed
  args = [a.reshape(n, g, s, nb, block)
          for a in [x_NxGxSxC] + ([noise] if noise is not None else [])]
  mat = _mat(*args)

  def launch(interpret, cfg=None, mat=mat):
    r = _rows_per_tile(nb, block, interpret, cfg)
    kernel = functools.partial(_quantize_kernel, bits=bits, ops=_Ops(gpu=not interpret),
                               rotate=rotate, noisy=len(args) == 2)
    out = (_out((s, g, n, nb, bp), _value_dtype(bits), mat), _out((s, g, n, nb), jnp.float32, mat))
    return _pallas(
        kernel, interpret, "zerojax_reorder_quantize", cfg, out_shape=out, grid=(s, g, n, nb // r),
        in_specs=[pl.BlockSpec((sq, sq, sq, r, block),
                               lambda si, gi, ni, j: (ni, gi, si, j, 0))] * len(args),
        out_specs=(pl.BlockSpec((sq, sq, sq, r, bp), lambda si, gi, ni, j: (si, gi, ni, j, 0)),
                   pl.BlockSpec((sq, sq, sq, r), lambda si, gi, ni, j: (si, gi, ni, j))))

  v, sc = _run(launch, args, block=block, mat=mat, op=_op("reorder_quantize", bits, rotate, len(args) == 2),
               elements=n * g * s * c)
  return v.reshape(s, g, n, nb * bp), sc


def dequantize_rows(v_MxBp: jax.Array, s_M: jax.Array, bits: int, dtype, rotate: bool = False) -> jax.Array:
  """[M, Bp] values, [M] scales -> [M, B] in `dtype` (rotated back with `rotate`)."""
  m, bp = v_MxBp.shape
  b = bp if bits == 8 else 2 * bp
  args = [v_MxBp, s_M.astype(jnp.float32)]
  mat = _mat(*args)

  def launch(interpret, cfg=None, mat=mat):
    r = _rows_per_tile(m, b, interpret, cfg)
    return _pallas(functools.partial(_dequantize_kernel, bits=bits, rotate=rotate), interpret,
                   "zerojax_dequantize", cfg, out_shape=_out((m, b), dtype, mat), grid=(m // r,),
                   in_specs=[_tiles(r, bp), _rows(r)], out_specs=_tiles(r, b))

  return _run(launch, args, block=b, mat=mat, op=_op("dequantize", bits, rotate, dtype=dtype), elements=m * b)


def dequant_sum_quantize_rows(v_KxMxBp: jax.Array, s_KxM: jax.Array, bits: int, out_bits: int,
                              noise: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """K slabs [K, M, Bp] -> requantized sum (values [M, Bp'], scales [M]), one pass over memory;
  `noise` [M, B]: stochastic rounding of the sum."""
  k, m, bp = v_KxMxBp.shape
  b = bp if bits == 8 else 2 * bp
  obp = _packed(b, out_bits)
  noisy = noise is not None
  args = [v_KxMxBp] * k + [s_KxM.astype(jnp.float32)] * k + ([noise] if noisy else [])
  mat = _mat(*args)

  def launch(interpret, cfg=None, mat=mat):
    r = _rows_per_tile(m, b * k, interpret, cfg)
    kernel = functools.partial(_dequant_sum_quantize_kernel, bits=bits, out_bits=out_bits,
                               ops=_Ops(gpu=not interpret), noisy=noisy)
    out = (_out((m, obp), _value_dtype(out_bits), mat), _out((m,), jnp.float32, mat))
    return _pallas(kernel, interpret, "zerojax_dequant_sum_quantize", cfg, out_shape=out,
                   grid=(m // r,), in_specs=_slab_specs(k, r, bp) + ([_tiles(r, b)] if noisy else []),
                   out_specs=(_tiles(r, obp), _rows(r)))

  return _run(launch, args, block=b, mat=mat, op=_op(f"dequant_sum_quantize/{out_bits}", bits, noisy=noisy),
              elements=m * b, slabs=k)


def dequant_sum_rows(v_KxMxBp: jax.Array, s_KxM: jax.Array, bits: int, dtype, rotate: bool = False) -> jax.Array:
  """K slabs [K, M, Bp] -> fp32 sum of their dequantized values (rotated back with `rotate`), cast to
  `dtype`: [M, B]."""
  k, m, bp = v_KxMxBp.shape
  b = bp if bits == 8 else 2 * bp
  args = [v_KxMxBp] * k + [s_KxM.astype(jnp.float32)] * k
  mat = _mat(*args)

  def launch(interpret, cfg=None, mat=mat):
    r = _rows_per_tile(m, b * k, interpret, cfg)
    return _pallas(functools.partial(_dequant_sum_kernel, bits=bits, rotate=rotate), interpret,
                   "zerojax_dequant_sum", cfg, out_shape=_out((m, b), dtype, mat), grid=(m // r,),
                   in_specs=_slab_specs(k, r, bp), out_specs=_tiles(r, b))

  return _run(launch, args, block=b, mat=mat, op=_op("dequant_sum", bits, rotate, dtype=dtype), elements=m * b,
              slabs=k)
