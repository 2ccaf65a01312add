"""Block-wise symmetric quantization for ZeRO++ communication (qwZ and qgZ).

Format (docs/quantization.md; the arithmetic in `pallas_kernels.block_format`): the input is flattened in
C order, zero-padded to a multiple of `block`, and cut into blocks of `block` contiguous elements. Each
block has one fp32 scale `absmax * fp32(1 / qmax)` (qmax = 127 for int8, 7 for int4) rounded up to 16
significant bits (0 below 2^-125), and codes: the integer nearest to the real quotient `x / scale`, ties
to even, clipped to qmax. int8 codes are stored as `int8`; int4 codes are two's-complement nibbles packed
two per `uint8`, element 2i in the LOW nibble and element 2i+1 in the HIGH nibble. Dequantization is
`code * scale` in fp32 (exact: at most 7 + 16 significant bits), cast to the requested dtype.

The value does not depend on how a compiler divides: the scale is one IEEE multiplication, and a code
is any division's estimate corrected by exact comparisons with the midpoints `(2k +- 1) * scale / 2`
(exact fp32 numbers with 16-bit scales). So every backend gives the same bits, on CPUs and on GPUs
(where XLA's fp32 division is not correctly rounded). Compilers contract `acc + code * scale` into a
fused multiply-add where they like; with an exact product the FMA rounds like a separate multiply and
add, so sums of dequantized slabs (fp32, slab 0 first) are the same bits in every backend too.

Non-finite inputs: a block holding NaN or +-Inf gets scale = +inf and codes 0, so it dequantizes to
NaN (0 * inf) and the step's non-finite check catches it; an all-zero block gets scale 0 and codes 0
and dequantizes to exact zeros. Codes are 0 wherever the scale is 0 or not finite.

Two options (off by default, and then nothing changes): `rotate` multiplies each block by a Hadamard
matrix before quantizing and back after dequantizing (`pallas_kernels.hadamard`: fixed butterflies,
the same bits everywhere; inside the Pallas and Triton kernels; the mosaic kernels refuse it); `noise` (uniform in
(0, 1), shaped like the input) rounds stochastically, `floor(x / scale + u)`, unbiased (xla and
Pallas; the triton and mosaic kernels refuse it).

Four backends compute the same arithmetic and agree bit for bit: "xla" (plain jnp,
`pallas_kernels.xla_rows`, the reference), "pallas" (`pallas_kernels.block_quant`, interpreted on CPU),
"triton" (`pallas_kernels.triton_block_quant`, GPU only) and "mosaic" (`pallas_kernels.mosaic_block_quant`,
int8 quantize and dequantize on sm_90+ GPUs). `zerojax.quant.kernel_choice` picks one per op:
`backend=kernel_choice.FASTEST` runs each op with the fastest backend of the measured GPU table that can
be compiled for it (`kernel_choice.gpu_default`, `pallas_kernels.kernel_table`): what the components
pass on a mesh of GPUs (`zerojax.engine.components`), and what `backend=None` (the default) means where jax's
default backend is a GPU; elsewhere None means "xla". A call's `backend=`, a plan's `kernel_backend`,
or for the process the environment variable ZEROJAX_KERNEL_BACKEND name one backend for every op instead.

References:
  ZeRO++: Wang et al. 2023, §3.1 (block-based quantization), §3.3 (qgZ), §4.1.2 Algorithm 2
  (generalized tensor slice reordering), §4.2 (fused kernels: reorder+quantize and
  dequantize+reduce+quantize).
  SDP4Bit: Jia et al. 2024, §3.2 (Hadamard rotation before 4-bit quantization).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import hadamard, xla_rows
from pallas_kernels.block_format import qmax_of, trim_scale  # noqa: F401  (the format's public names)
from zerojax.quant import kernel_choice
from zerojax.quant.kernel_choice import Backend

def packed_len(elements: int, bits: int) -> int:
  """Length of the stored value axis for `elements` codes."""
  return elements if bits == 8 else elements // 2


def _check(bits: int, block: int, rotate: bool = False, name: str = "xla", noise=None) -> None:
  qmax_of(bits)
  if rotate:
    hadamard.check_block(block)
  if noise is not None and name == "triton":
    raise ValueError("stochastic rounding is not in the triton kernels; use backend='pallas' or 'xla'")
  if not isinstance(block, int) or block <= 0:
    raise ValueError(f"block={block!r}; expected a positive int")
  if bits == 4 and block % 2:
    raise ValueError(f"block={block} must be even for int4 (two codes per byte)")


def _opt(**kw) -> dict:
  """Keyword arguments for a kernel, without those left at their defaults (not every kernel has both)."""
  return {k: v for k, v in kw.items() if v is not None and v is not False}


def _kernel(name: str, op: str, *args, rotate: bool = False, noise=None, dtype=None):
  """`op` of backend `name`'s kernels (not xla) on `args`, and `dtype` for an op that dequantizes. The pallas
  and triton kernels rotate inside the kernel (one pass over memory), the pallas ones also round
  stochastically; the others' refusals come first (`_check`: noise on triton; `kernel_choice.resolve_backend`:
  rotation and noise on mosaic)."""
  fn = getattr(kernel_choice.kernels(name), op)
  kw = _opt(rotate=rotate, noise=noise)
  return fn(*args, **kw) if dtype is None else fn(*args, dtype, **kw)


# --- public API -----------------------------------------------------------------------------------

FLOAT8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_float8(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """`x` (flat, a multiple of `block`) as float8_e4m3fn codes with one fp32 scale per block, max |x| /
  448 (FP8-LM, Peng et al. 2023, §2.1): `(uint8 codes [n], scales [n / block])`, a zero block scaled by 1."""
  blocks = x.astype(jnp.float32).reshape(-1, block)
  scale = jnp.max(jnp.abs(blocks), axis=1, keepdims=True) / FLOAT8_MAX
  scale = jnp.where(scale > 0, scale, 1.0)
  codes = jax.lax.bitcast_convert_type((blocks / scale).astype(jnp.float8_e4m3fn), jnp.uint8)
  return codes.reshape(-1), scale.reshape(-1)


def dequantize_float8(codes: jax.Array, scales: jax.Array, block: int, dtype) -> jax.Array:
  """Inverse of `quantize_float8` over the last axis: `[..., n]` codes and `[..., n / block]` scales."""
  v = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
  v = v.reshape(*codes.shape[:-1], -1, block) * scales[..., None]
  return v.reshape(codes.shape).astype(dtype)


def quantize(x: jax.Array, bits: int, block: int, *, rotate: bool = False, noise: jax.Array | None = None,
             backend: Backend | None = None) -> tuple[jax.Array, jax.Array]:
  """Quantizes `x` block-wise.

  Args:
    x: array of any shape, fp32 or bf16; flattened in C order, zero-padded to a multiple of
      `block`.
    bits: 8 or 4.
    block: elements per block (even for int4; a power of two for the GPU backends and `rotate`).
    rotate: quantize each block times the Hadamard matrix (`pallas_kernels.hadamard`); undo it with
      `dequantize(..., rotate=True)` or `dequant_sum(..., rotate=True)`.
    noise: uniform noise in (0, 1) shaped like `x` (`hadamard.uniform`): stochastic rounding
      `floor(x / scale + noise)`, unbiased; None rounds to nearest.
    backend: "xla", "pallas", "triton", or None: chosen per platform (module docstring).

  Returns:
    (values, scales): int8 [n_pad] or packed uint8 [n_pad // 2], and fp32 [n_pad // block].

  References:
    ZeRO++ §3.1 (block-based quantization), §4.2 (quantization kernels). SDP4Bit §3.2 (rotation).
  """
  _check(bits, block, rotate, backend or "xla", noise)
  return kernel_choice.run("quantize", lambda a, name: _quantize(*a, bits, block, rotate, name), (x, noise), bits=bits,
              block=block, rotate=rotate, noisy=noise is not None, backend=backend)


def _quantize(x, noise, bits, block, rotate, name):
  flat = jnp.ravel(x)
  n_pad = -(-flat.shape[0] // block) * block
  if n_pad != flat.shape[0]:
    flat = jnp.pad(flat, (0, n_pad - flat.shape[0]))
  x_MxB = flat.reshape(n_pad // block, block)
  u_MxB = None
  if noise is not None:
    u = jnp.ravel(noise).astype(jnp.float32)
    u_MxB = jnp.pad(u, (0, n_pad - u.shape[0]), constant_values=0.5).reshape(x_MxB.shape)
  if name == "xla":
    codes, s_M = xla_rows.quantize_rows(x_MxB, bits, rotate, u_MxB)
    v_MxBp = xla_rows.pack(codes, bits)
  else:
    v_MxBp, s_M = _kernel(name, "quantize_rows", x_MxB, bits, rotate=rotate, noise=u_MxB)
  return v_MxBp.reshape(-1), s_M


def dequantize(values: jax.Array, scales: jax.Array, bits: int, block: int, *,
               dtype=jnp.float32, size: int | None = None, rotate: bool = False,
               backend: Backend | None = None) -> jax.Array:
  """Inverse of `quantize`: a flat array of length `size` (default n_pad) = code * scale (rotated
  back with `rotate`, as quantized).

  `values` and `scales` may carry any leading shape; both are flattened in C order.

  References:
    ZeRO++ §3.1, §4.2 (dequantization kernels).
  """
  _check(bits, block, rotate)
  return kernel_choice.run("dequantize", lambda a, name: _dequantize(*a, bits, block, dtype, size, rotate, name),
              (values, scales), bits=bits, block=block, rotate=rotate, backend=backend)


def _dequantize(values, scales, bits, block, dtype, size, rotate, name):
  bp = packed_len(block, bits)
  v_MxBp = jnp.ravel(values).reshape(-1, bp)
  s_M = jnp.ravel(scales)
  if s_M.shape[0] != v_MxBp.shape[0]:
    raise ValueError(f"{s_M.shape[0]} scales for {v_MxBp.shape[0]} blocks of {block}")
  if name == "xla":
    out = xla_rows.unrotate(xla_rows.dequantize_rows(v_MxBp, s_M, bits), rotate).astype(dtype)
  else:
    out = _kernel(name, "dequantize_rows", v_MxBp, s_M, bits, rotate=rotate, dtype=dtype)
  out = out.reshape(-1)
  return out if size is None else out[:size]


def reorder_quantize(x: jax.Array, nodes: int, gpus: int, bits: int, block: int, *,
                     stages: int = 1, rotate: bool = False, noise: jax.Array | None = None,
                     backend: Backend | None = None) -> tuple[jax.Array, jax.Array]:
  """qgZ tensor-slice reordering fused with quantization.

  `x` is this device's full flat gradient [nodes * gpus * c]; owner (n, g) holds slice n * gpus + g.
  The result is `x.reshape(nodes, gpus, stages, c / stages)` transposed to
  (stages, gpus, nodes, c / stages) and quantized per block along the last axis, so that an
  all-to-all over `gpu` splitting axis 1 (per stage) sends each GPU the slices it reduces intra-node
  and, after the inter-node all-to-all, every owner ends with its own slice (paper eq. 1 -> 2).

  `rotate` and `noise` (shaped like `x`, in its order) are as in `quantize`.

  Returns:
    values [stages, gpus, nodes, c / stages] int8 (or [..., c / (2 * stages)] uint8 for int4) and
    scales [stages, gpus, nodes, c / (stages * block)] fp32.

  References:
    ZeRO++ §3.3.3 (tensor slice reordering), §4.1.2 Algorithm 2 (generalized to pipeline stages),
    §4.2 (reordering fused into the quantization kernel).
  """
  _check(bits, block, rotate, backend or "xla", noise)
  return kernel_choice.run("reorder_quantize",
              lambda a, name: _reorder_quantize(*a, nodes, gpus, bits, block, stages, rotate, name), (x, noise),
              bits=bits, block=block, rotate=rotate, noisy=noise is not None, backend=backend)


def _reorder_quantize(x, noise, nodes, gpus, bits, block, stages, rotate, name):
  w = nodes * gpus
  total = math.prod(x.shape)
  if nodes <= 0 or gpus <= 0 or stages <= 0 or total % w:
    raise ValueError(f"x of {total} elements does not split over nodes={nodes} x gpus={gpus}"
                     f" (stages={stages})")
  c = total // w
  if c % (stages * block):
    raise ValueError(f"owner chunk c={c} is not a multiple of stages * block = {stages} * {block}"
                     f" = {stages * block}")
  cs = c // stages
  x_NxGxSxC = jnp.reshape(x, (nodes, gpus, stages, cs))
  u_NxGxSxC = None if noise is None else jnp.reshape(noise.astype(jnp.float32), x_NxGxSxC.shape)
  if name == "xla":
    to_rows = lambda a: jnp.transpose(a, (2, 1, 0, 3)).reshape(-1, block)
    codes, s_M = xla_rows.quantize_rows(to_rows(x_NxGxSxC), bits, rotate,
                                None if noise is None else to_rows(u_NxGxSxC))
    v = xla_rows.pack(codes, bits).reshape(stages, gpus, nodes, packed_len(cs, bits))
    return v, s_M.reshape(stages, gpus, nodes, cs // block)
  return _kernel(name, "reorder_quantize", x_NxGxSxC, bits, block, rotate=rotate, noise=u_NxGxSxC)


def _slabs(values: jax.Array, scales: jax.Array, bits: int, block: int):
  if values.ndim < 2 or scales.ndim != values.ndim:
    raise ValueError(f"expected a leading slab axis on values {values.shape} and scales"
                     f" {scales.shape}")
  bp = packed_len(block, bits)
  if values.shape[-1] % bp or scales.shape[:-1] != values.shape[:-1] \
      or scales.shape[-1] != values.shape[-1] // bp:
    raise ValueError(f"values {values.shape} and scales {scales.shape} disagree for"
                     f" bits={bits}, block={block}")
  k = values.shape[0]
  return values.reshape(k, -1, bp), scales.reshape(k, -1)


def dequant_sum_quantize(values: jax.Array, scales: jax.Array, bits: int, block: int, *,
                         out_bits: int | None = None, noise: jax.Array | None = None,
                         backend: Backend | None = None) -> tuple[jax.Array, jax.Array]:
  """Fused intra-node step of qgZ: dequantize K slabs, sum in fp32, requantize the sum.

  Args:
    values: [K, ..., Lp] stored values (leading axis: the slabs received from the K peers).
    scales: [K, ..., Lp_elements / block] fp32.
    bits: bits of the input codes.
    block: elements per block, for input and output.
    out_bits: bits of the output codes (default `bits`).
    noise: stochastic rounding of the output (see `quantize`), shaped like one slab, unpacked.
      The slabs stay in whatever domain they were quantized in (rotated or not): sums are linear.
    backend: see `quantize`.

  Returns:
    (values, scales) with the leading K axis removed; the last axes follow `out_bits`.

  References:
    ZeRO++ §3.3.2 (hierarchical all-to-all), §4.2 (dequantization, reduction and quantization
    fused in one kernel, 9x less memory traffic in qgZ).
  """
  out_bits = bits if out_bits is None else out_bits
  _check(bits, block)
  _check(out_bits, block, name=backend or "xla", noise=noise)
  return kernel_choice.run("dequant_sum_quantize",
                           lambda a, name: _dequant_sum_quantize(*a, bits, block, out_bits, name),
              (values, scales, noise), bits=out_bits, block=block, noisy=noise is not None, backend=backend)


def _dequant_sum_quantize(values, scales, noise, bits, block, out_bits, name):
  v_KxMxBp, s_KxM = _slabs(values, scales, bits, block)
  rows = lambda a: None if a is None else jnp.reshape(a.astype(jnp.float32), (-1, block))
  if name == "xla":
    codes, s_M = xla_rows.quantize_rows(xla_rows.sum_rows(v_KxMxBp, s_KxM, bits), out_bits, noise=rows(noise))
    v_M = xla_rows.pack(codes, out_bits)
  else:
    v_M, s_M = _kernel(name, "dequant_sum_quantize_rows", v_KxMxBp, s_KxM, bits, out_bits, noise=rows(noise))
  lead = values.shape[1:-1]
  elements = values.shape[-1] // packed_len(block, bits) * block
  return (v_M.reshape(*lead, packed_len(elements, out_bits)),
          s_M.reshape(*lead, elements // block))


def dequant_sum(values: jax.Array, scales: jax.Array, bits: int, block: int, *,
                dtype=jnp.float32, rotate: bool = False, backend: Backend | None = None) -> jax.Array:
  """Dequantizes K slabs and sums them in fp32: shape values.shape[1:] with the last axis unpacked.

  This is the last step of qgZ (after the inter-node all-to-all); `rotate` rotates the sum back.

  References:
    ZeRO++ §3.3.2, §4.2.
  """
  _check(bits, block, rotate)
  return kernel_choice.run("dequant_sum", lambda a, name: _dequant_sum(*a, bits, block, dtype, rotate, name),
              (values, scales), bits=bits, block=block, rotate=rotate, backend=backend)


def _dequant_sum(values, scales, bits, block, dtype, rotate, name):
  v_KxMxBp, s_KxM = _slabs(values, scales, bits, block)
  if name == "xla":
    out = xla_rows.unrotate(xla_rows.sum_rows(v_KxMxBp, s_KxM, bits), rotate).astype(dtype)
  else:
    out = _kernel(name, "dequant_sum_rows", v_KxMxBp, s_KxM, bits, rotate=rotate, dtype=dtype)
  elements = values.shape[-1] // packed_len(block, bits) * block
  return out.reshape(*values.shape[1:-1], elements)
