"""The numpy model of the block format (docs/quantization.md) and blocks built to break a cheap estimate of
its codes: shared by the format's tests and the Triton interpreter's checks."""
import numpy as np

from pallas_kernels import block_format

BLOCK = 64


def model(x: np.ndarray, bits: int, block: int = BLOCK):
  """(codes int32 [M, B], scales fp32 [M]) of the documented format (docs/quantization.md).

  Scale: the fp32 product absmax * fp32(1 / qmax) (numpy's float32 multiplication is IEEE), rounded up
  to 16 significant bits on its bit pattern, 0 below 2^-125. Codes: the integer nearest to the real
  quotient |x| / scale, ties to even. The float64 quotient of a 24-bit by a 16-bit number is never
  rounded onto a midpoint k + 1/2 unless it is one (their distance is at least 2^-41 of the scale), so
  np.rint of it is the exact answer."""
  qmax = block_format.qmax_of(bits)
  x = np.asarray(x, np.float32).reshape(-1, block)
  amax = np.max(np.where(np.isnan(x), np.float32(np.inf), np.abs(x)), axis=1)
  r = np.float32(1.0) / np.float32(qmax)
  with np.errstate(over="ignore"):
    s = (amax * r).astype(np.float32)
  b = (s.view(np.uint32).astype(np.uint64) + 0xFF) & 0xFFFFFF00
  s = b.astype(np.uint32).view(np.float32)
  s = np.where(s >= np.float32(2.0 ** -125), s, np.float32(0.0)).astype(np.float32)
  ok = (s > 0) & np.isfinite(s)
  with np.errstate(divide="ignore", invalid="ignore"):
    k = np.rint(np.abs(x.astype(np.float64)) / s.astype(np.float64)[:, None])
  k = np.clip(np.nan_to_num(k), 0, qmax)
  codes = np.where(ok[:, None], np.where(x < 0, -k, k), 0).astype(np.int32)
  return codes, s


def adversarial_blocks(bits: int, seed: int = 0) -> np.ndarray:
  """[M, BLOCK] fp32 blocks where a cheap estimate of |x| / s is most likely off: every element exactly
  on a midpoint (k + 1/2) s or one ulp beside it, over all k; blocks of +-absmax only (|x| / s a hair
  above qmax where fl(absmax * R) rounded down onto a 16-bit number, the clamp); scales at 2^-125 and
  just below it (stored as 0), subnormal elements beside a normal absmax; absmax near the largest fp32;
  zero, -0, NaN and inf blocks."""
  rng = np.random.default_rng(seed)
  qmax = block_format.qmax_of(bits)
  f32 = np.float32
  rows = []

  def on_midpoints(amax, nudge):
    _, s = model(np.full((1, BLOCK), amax, f32), bits)
    k = np.arange(BLOCK - 1) % qmax
    x = ((2 * k + 1).astype(f32) * (s[0] * f32(0.5))).astype(f32)
    if nudge:
      x = np.nextafter(x, f32(np.inf) if nudge > 0 else f32(0))
    x = np.where(np.arange(BLOCK - 1) % 2 == 1, -x, x)
    return np.concatenate([[f32(amax)], x]).astype(f32)

  for amax in [f32(1.0), f32(qmax), f32(3.0e38), f32(2.0 ** -125 * qmax * 1.01),
               *(rng.random(24).astype(f32) + f32(0.5)) * f32(2.0) ** rng.integers(-100, 100, 24).astype(f32)]:
    rows += [on_midpoints(amax, nudge) for nudge in (-1, 0, 1)]
  # +-absmax blocks: absmax = qmax * m * 2^e (m of 16 bits) and up to 3 ulp above, so that fl(absmax * R)
  # lands on or beside a 16-bit number; kept: 32 where |x| / s > qmax (int8 only: 127 R = 1 - 2^-28 < 1,
  # while 7 R > 1 keeps int4's quotients <= 7), and 32 others.
  m = rng.integers(1 << 15, 1 << 16, 20000).astype(np.float64) * 2.0 ** rng.integers(-60, 60, 20000)
  a = np.stack([(m * qmax).astype(f32)] * 4)
  for i in range(1, 4):
    a[i] = np.nextafter(a[i - 1], f32(np.inf))
  a = a.reshape(-1)
  _, s = model(np.repeat(a[:, None], BLOCK, axis=1), bits)
  above = a.astype(np.float64) / s > qmax
  for v in np.concatenate([a[above][:32], a[~above][:32]]):
    rows.append(np.where(rng.random(BLOCK) < 0.5, -v, v).astype(f32))
  tiny = f32(2.0 ** -125 * qmax)
  rows.append(np.full(BLOCK, tiny * f32(1 - 2.0 ** -12), f32))        # scale just below 2^-125: stored as 0
  rows.append(np.full(BLOCK, np.nextafter(tiny, f32(0)), f32))         # rounded up to 2^-125: kept
  rows.append(np.linspace(-tiny, tiny, BLOCK).astype(f32))             # scale 2^-125 (the smallest kept)
  sub = np.full(BLOCK, f32(1e-40), f32)                                # subnormal elements ...
  sub[::3] = -f32(3e-42)
  sub[0] = f32(2.0 ** -118)                                            # ... beside a normal absmax
  rows.append(sub)
  rows.append(np.zeros(BLOCK, f32))
  rows.append(np.full(BLOCK, f32(-0.0), f32))
  rows.append(np.full(BLOCK, f32(1e-45), f32))                         # the smallest subnormal
  nan, inf = np.full(BLOCK, f32(1.0), f32), np.full(BLOCK, f32(1.0), f32)
  nan[7], inf[9] = np.nan, -np.inf
  rows += [nan, inf]
  return np.stack(rows).astype(f32)
