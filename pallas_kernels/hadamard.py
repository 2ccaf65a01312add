"""Block Walsh–Hadamard transform and stochastic-rounding noise, shared by every kernel backend.

The transform is a fixed sequence of butterflies along a row: stage h = 1, 2, 4, ..., B/2 pairs element
i with i + h inside each group of 2h (a + b to the lower, a - b to the upper). Every backend runs
exactly these additions in this order, so rotated results agree bit for bit. (Seen on the two lanes of
a row, its even and odd elements: stage 1 is the pair (even, odd), and stage 2h is stage h inside each
lane; `fwht_lanes` computes it that way, `fwht_tile` on whole rows, with the same bits.) Each butterfly stage is an involution up to a factor 2,
so applying the unnormalised transform twice multiplies by B; the forward and inverse scales are
powers of two whose product is 1 / B (exact), and for B = 4^k each is 1 / sqrt(B): the orthonormal
Hadamard matrix H / sqrt(B).

Rotating a block spreads an outlier over all its elements before the absmax scale is taken, so the
block's int4 grid fits its values much better (SDP4Bit §3.2; QuaRot). Rotation is linear, so qgZ's
sums can stay in the rotated domain from the first quantization to the last dequantization.

References:
  SDP4Bit: Jia et al. 2024, §3.2 (Hadamard smoothing of 4-bit gradients).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def check_block(block: int) -> None:
  """Raises unless `block` is a power of two >= 2 (the transform's butterflies need one)."""
  if block < 2 or block & (block - 1):
    raise ValueError(f"rotate=True needs a power-of-two quantization block, got block={block}; use e.g. 256")


def scales(block: int) -> tuple[float, float]:
  """(forward, inverse) powers of two with forward * inverse = 1 / block."""
  k = block.bit_length() - 1
  return 2.0 ** -(k // 2), 2.0 ** -(k - k // 2)


def _lane_fwht(x: jax.Array) -> jax.Array:
  """Unnormalised Walsh–Hadamard transform along the last axis of [R, L] (L a power of two).

  Stage h pairs element i with i + h inside each group of 2h: an equal split of the group, then the
  sums and differences interleaved back (stack on a new last axis and a transpose), which are the
  data movements Pallas' Triton lowering supports (it has no slicing).
  """
  r, n = x.shape
  h = 1
  while h < n:
    a, b = lax.split(x.reshape(r, n // (2 * h), 2 * h), (h, h), axis=2)
    x = jnp.swapaxes(jnp.stack([a + b, a - b], axis=-1), 2, 3).reshape(r, n)
    h *= 2
  return x


def fwht_tile(x_RxB: jax.Array, scale: float) -> jax.Array:
  """[R, B] fp32 -> each row times H_B, times `scale`: the butterflies on whole rows, as the compiled
  kernels run them (contiguous tiles: no strided loads, no lane split before the rotation)."""
  return _lane_fwht(x_RxB) * jnp.float32(scale)


def fwht_lanes(even: jax.Array, odd: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
  """Rows of a [R, B] fp32 tile given as lanes [R, B/2] -> the lanes of (H_B row) * scale."""
  e, o = _lane_fwht(even + odd), _lane_fwht(even - odd)
  return e * jnp.float32(scale), o * jnp.float32(scale)


def fwht_rows(x_MxB: jax.Array, scale: float) -> jax.Array:
  """[M, B] fp32 -> each row times H_B, times `scale` (the same bits as `fwht_lanes`)."""
  m, b = x_MxB.shape
  e, o = fwht_lanes(x_MxB[:, 0::2], x_MxB[:, 1::2], scale)
  return jnp.stack([e, o], axis=-1).reshape(m, b)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform noise in (0, 1) on a grid of 2**-23, mean exactly 1/2, for stochastic rounding.

  `floor(x / scale + u)` is then an unbiased rounding of x / scale (up to the 2**-24 grid).
  """
  bits = jax.random.bits(key, shape, jnp.uint32) >> 9
  return (bits.astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -23)
