"""The block format's arithmetic, written so that its value does not depend on how a compiler divides.

One block of B elements x_i with absmax a (NaN counted as +inf):

- scale s = up16(a * R), R = fp32(1 / qmax) (qmax = 127 for int8, 7 for int4): one IEEE multiplication
  by a constant, rounded up to 16 significant bits (`trim_scale`); a scale below 2^-125 (a block with
  absmax below about 3e-36 for int8) is stored as 0 (the block as zeros), so no step below meets a
  subnormal number, which GPUs flush to zero and CPUs keep.
- code k_i = the integer nearest to the real quotient |x_i| / s, ties to even, with x_i's sign, clipped to
  qmax; 0 where s is 0 or +inf.

The code's estimate costs one reciprocal per block and one multiplication per element: k = rint(|x| * r)
with r = 1 / s computed by any reciprocal within a few ulp (`inverse_scale`: `rcp.approx` on GPUs, where
XLA's fp32 division is not correctly rounded either; XLA rewrites a division by a constant into a
multiplication anyway). `nearest_codes` then corrects the estimate with exact comparisons: with 16-bit
scales the midpoints (2k ± 1) * s / 2 are exact fp32 numbers (8 + 16 significant bits, normal since
s >= 2^-125), so |x| < (k - 1/2) s, |x| = (k ± 1/2) s (a tie) and |x| > (k + 1/2) s are decided exactly,
and every backend, compiler and platform arrives at the same code. `code * s` has at most 7 + 16
significant bits: exact, so a fused multiply-add rounds like a separate multiply and add.

Why one correction step suffices (docs/quantization.md has the full argument). Let q = |x| / s (real) and
k* its nearest integer, ties to even. (1) k* <= qmax: |x| <= absmax, and s >= fl(absmax * R) >= absmax /
qmax * (1 - 2^-23), so q < qmax + 1/2. (2) The estimate is within one of k*: r and the product |x| * r each
carry a relative error of a few 2^-24, so |x| * r is within qmax * 2^-21 < 1/2 of q, and rint of it is
k* or, where q lies that close to a midpoint, the neighbour across that midpoint. Clipping the estimate
to [0, qmax] keeps it within one (by (1), and q >= 0). (3) From an estimate k = k* + 1, |x| <= (k - 1/2) s
= lo: |x| < lo steps down; |x| = lo is a tie between k - 1 and k whose even member is k* = k - 1, so k is
odd and steps down. Symmetrically from k = k* - 1 (|x| >= hi: step up), and from k = k* neither test
fires (lo <= |x| <= hi, equality only where k is the even member of the tie). A block's reciprocal is
taken of a normal scale in [2^-125, 2^126) and is normal too, so flushing subnormals changes nothing;
blocks whose scale is 0 or +inf get r = 0 (their codes are 0 whatever the estimate).

Stochastic rounding (`floor(x / s + u)`) keeps the estimate: its codes agree across backends where the
division is correctly rounded (CPU; the Pallas and Triton kernels), and differ by at most one where
x / s + u lies within a few ulp of an integer.

References:
  ZeRO++: Wang et al. 2023, §3.1 (block-based quantization), §4.2 (kernels).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SCALE_BITS = 16           # significant bits of a stored scale
MIN_SCALE = 2.0 ** -125   # smaller scales are stored as 0: every midpoint (2k ± 1) s / 2 is then normal
TRIM_ADD, TRIM_MASK = (1 << (24 - SCALE_BITS)) - 1, 0xFFFFFFFF ^ ((1 << (24 - SCALE_BITS)) - 1)


def qmax_of(bits: int) -> int:
  """Largest code magnitude: 127 for int8, 7 for int4 (symmetric ranges, -128 and -8 unused)."""
  if bits == 8:
    return 127
  if bits == 4:
    return 7
  raise ValueError(f"bits={bits}; only 8 and 4 are supported")


def reciprocal(bits: int) -> float:
  """R = fp32(1 / qmax), the constant every backend multiplies absmax by."""
  return float(np.float32(1.0) / np.float32(qmax_of(bits)))


def trim_scale(scale: jax.Array) -> jax.Array:
  """Rounds non-negative fp32 scales up to `SCALE_BITS` significant bits (+inf and 0 stay as they are)."""
  b = lax.bitcast_convert_type(scale, jnp.uint32)
  b = (b + jnp.uint32(TRIM_ADD)) & jnp.uint32(TRIM_MASK)
  return lax.bitcast_convert_type(b, jnp.float32)


def scale_of(amax: jax.Array, bits: int) -> jax.Array:
  """fp32 absmax (NaN already +inf) -> the block's scale: up16(amax * R), 0 below `MIN_SCALE`."""
  s = trim_scale(amax * reciprocal(bits))  # a Python float: an fp32 constant (it is one exactly)
  return jnp.where(s >= MIN_SCALE, s, 0.0)


def usable(scale: jax.Array) -> jax.Array:
  """Where a block's codes are meaningful: its scale is neither 0 (a zero or tiny block) nor +inf."""
  return (scale > 0) & (scale < jnp.inf)


def inverse_scale(scale: jax.Array, reciprocal: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
  """One reciprocal per block for the estimate `rint(|x| * inverse_scale(s))`: `reciprocal(s)` (default
  `1 / s`; any reciprocal within a few ulp serves, module docstring) where the scale is `usable`, else 0."""
  ok = usable(scale)
  safe = jnp.where(ok, scale, 1.0)
  return jnp.where(ok, (1.0 / safe) if reciprocal is None else reciprocal(safe), 0.0)


def nearest_codes(x: jax.Array, scale: jax.Array, bits: int, estimate: jax.Array) -> jax.Array:
  """The exactly rounded codes (fp32 integers in [-qmax, qmax]) of `x` with `scale` (broadcast to x).

  `estimate` is |x| / scale rounded to an integer by any division, reciprocal and rounding, within one
  of the answer (e.g. `rint(|x| * inverse_scale(scale))`); it is corrected by exact comparisons with the
  midpoints around it (module docstring)."""
  qmax = float(qmax_of(bits))  # Python floats: constants of x's fp32 type (what Pallas' lowering takes)
  a = jnp.abs(x)
  k = jnp.clip(estimate, 0.0, qmax)
  half_s = scale * 0.5
  lo, hi = (k + k - 1.0) * half_s, (k + k + 1.0) * half_s   # exact: 8 + 16 significant bits, normal
  odd = (k.astype(jnp.int32) & 1) == 1
  k = k - ((a < lo) | ((a == lo) & odd)).astype(jnp.float32) + ((a > hi) | ((a == hi) & odd)).astype(jnp.float32)
  k = jnp.clip(k, 0.0, qmax)
  return jnp.where(usable(scale), jnp.where(x < 0, -k, k), 0.0)


def stochastic_codes(y_plus_u_floor: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
  """`floor(x / scale + u)` (computed by the caller) clipped to [-qmax, qmax], 0 where the scale is 0
  or +inf."""
  qmax = float(qmax_of(bits))
  return jnp.where(usable(scale), jnp.clip(y_plus_u_floor, -qmax, qmax), 0.0)
