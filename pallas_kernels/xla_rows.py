"""The reference ("xla") backend of the block quantizers: plain jnp on `[rows, block]` tiles, the
arithmetic of `pallas_kernels.block_format` (docs/quantization.md). `zerojax.quant.quantization` runs it for
backend "xla"; the Pallas, triton and Mosaic GPU kernels compute the same bits.

References:
  ZeRO++: Wang et al. 2023, §3.1 (block-based quantization). SDP4Bit: Jia et al. 2024, §3.2 (rotation).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import block_format, hadamard


def quantize_rows(x_MxB: jax.Array, bits: int, rotate: bool = False,
                   noise: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """[M, B] floats -> (codes int32 [M, B], scales fp32 [M]); rows rotated first with `rotate`,
  rounded stochastically (`floor(x / scale + u)`) with `noise` u [M, B] in (0, 1)."""
  x = x_MxB.astype(jnp.float32)
  if rotate:
    x = hadamard.fwht_rows(x, hadamard.scales(x.shape[1])[0])
  # NaN -> inf so that the block's absmax (and scale) is inf whatever max does with NaN.
  amax_M = jnp.max(jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x)), axis=1)
  scale_M = block_format.scale_of(amax_M, bits)
  s = scale_M[:, None]
  if noise is None:
    inv = block_format.inverse_scale(scale_M)[:, None]  # one reciprocal per block, a product per element
    q = block_format.nearest_codes(x, s, bits, estimate=jnp.round(jnp.abs(x) * inv))
  else:
    q = block_format.stochastic_codes(jnp.floor(x / s + noise), s, bits)
  return q.astype(jnp.int32), scale_M


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """int32 codes [..., L] -> stored values [..., L] int8 or [..., L/2] uint8 (even element low)."""
  if bits == 8:
    return codes.astype(jnp.int8)
  pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2) & 0xF
  return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def unpack(values: jax.Array, bits: int) -> jax.Array:
  """Stored values [..., Lp] -> int32 codes [..., L]."""
  if bits == 8:
    return values.astype(jnp.int32)
  # Each byte repeated twice, then element e keeps nibble e % 2, sign-extended by shifting it to the
  # top of the int32 and back (an elementwise form XLA fuses well; no interleaving concatenate).
  b = values.astype(jnp.int32)
  b = jnp.broadcast_to(b[..., None], (*b.shape, 2)).reshape(*b.shape[:-1], 2 * b.shape[-1])
  shift = 28 - 4 * (lax.broadcasted_iota(jnp.int32, b.shape, b.ndim - 1) & 1)
  return (b << shift) >> 28


def dequantize_rows(v_MxBp: jax.Array, s_M: jax.Array, bits: int) -> jax.Array:
  """[M, Bp] stored values, [M] scales -> fp32 [M, B]."""
  return unpack(v_MxBp, bits).astype(jnp.float32) * s_M.astype(jnp.float32)[:, None]


def unrotate(y_MxB: jax.Array, rotate: bool) -> jax.Array:
  return hadamard.fwht_rows(y_MxB, hadamard.scales(y_MxB.shape[1])[1]) if rotate else y_MxB


def sum_rows(v_KxMxBp: jax.Array, s_KxM: jax.Array, bits: int) -> jax.Array:
  """Dequantizes K slabs and sums them in fp32, slab 0 first (a fixed order every backend uses)."""
  acc = dequantize_rows(v_KxMxBp[0], s_KxM[0], bits)
  for k in range(1, v_KxMxBp.shape[0]):
    acc = acc + dequantize_rows(v_KxMxBp[k], s_KxM[k], bits)
  return acc
