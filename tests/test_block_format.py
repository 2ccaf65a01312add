"""The block format against a numpy model built from IEEE float32 operations (and exact quotients):
every backend, on every platform, gives the model's bits, ties and near-ties included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_format
from zerojax import quantization as Q

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


def former_model_scales(x, bits):
  """The former format's scales: correctly rounded absmax / qmax, up to 17 bits (for the record)."""
  x = np.asarray(x, np.float32).reshape(-1, BLOCK)
  s = (np.max(np.abs(x), axis=1) / np.float32(block_format.qmax_of(bits))).astype(np.float32)
  return (((s.view(np.uint32).astype(np.uint64) + 0x7F) & 0xFFFFFF80).astype(np.uint32)).view(np.float32)


def hard_data(seed: int, n_blocks: int = 4096) -> np.ndarray:
  """Gaussian blocks with outliers, plus blocks built on midpoints: x = (k + 1/2) * s exactly and its
  fp32 neighbours, where any division's rounding error decides the code."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n_blocks, BLOCK)).astype(np.float32)
  x *= np.where(rng.random((n_blocks, BLOCK)) < 0.01, 50.0, 1.0).astype(np.float32)
  x[0] = 0.0
  x[1, 3] = np.nan
  x[2, 5] = -np.inf
  x[3] = np.float32(1e-37)  # a scale below 2^-125: stored as a zero block
  return x


def tie_blocks(bits: int, seed: int, n_blocks: int = 256) -> np.ndarray:
  """Blocks whose elements sit on the midpoints (k + 1/2) * s of their own scale, or one ulp away."""
  rng = np.random.default_rng(seed)
  qmax = block_format.qmax_of(bits)
  amax = (rng.random(n_blocks).astype(np.float32) + np.float32(0.5)) * np.float32(2.0) ** rng.integers(-20, 20, n_blocks)
  _, s = model(np.tile(amax[:, None], (1, BLOCK)), bits)
  k = rng.integers(0, qmax, (n_blocks, BLOCK))
  x = ((2 * k + 1).astype(np.float32) * (s[:, None] * np.float32(0.5))).astype(np.float32)  # exact midpoints
  nudge = rng.integers(-1, 2, x.shape)
  x = np.where(nudge < 0, np.nextafter(x, np.float32(0)), np.where(nudge > 0, np.nextafter(x, np.float32(np.inf)), x))
  x = np.where(rng.random(x.shape) < 0.5, -x, x).astype(np.float32)
  x[:, 0] = amax  # keeps each block's scale s
  return x


def _check(backend, bits, x, dtype=jnp.float32):
  x = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))  # the values the backend sees
  codes, s = model(x, bits)
  v, sc = jax.jit(lambda a: Q.quantize(a, bits, BLOCK, backend=backend))(jnp.asarray(x).astype(dtype))
  np.testing.assert_array_equal(np.asarray(sc).view(np.uint32), s.view(np.uint32))
  v = np.asarray(v)
  if bits == 8:
    got = v.astype(np.int32).reshape(-1, BLOCK)
  else:  # element 2i in the low nibble, two's complement
    nib = np.stack([v & 0xF, v >> 4], axis=-1).astype(np.int32).reshape(-1, BLOCK)
    got = np.where(nib >= 8, nib - 16, nib)
  np.testing.assert_array_equal(got, codes)


BACKENDS_HERE = ["xla", "pallas"]  # on the CPU: the reference and the interpreted Pallas kernels


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backends_equal_the_numpy_model(backend, bits, seed):
  _check(backend, bits, hard_data(seed, 4096 if backend == "xla" else 512))
  _check(backend, bits, tie_blocks(bits, seed))


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_inputs_equal_the_model(bits):
  _check("xla", bits, hard_data(5, 512), jnp.bfloat16)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_former_format_depended_on_the_compiler(bits):
  """The record of why the format changed: XLA turns `amax / qmax` into a multiplication by the
  reciprocal, so correctly rounded quotients were not what the xla backend computed."""
  x = hard_data(0)
  amax = jnp.max(jnp.abs(jnp.asarray(x)), axis=1)
  former = jax.jit(lambda a: jax.lax.bitcast_convert_type(  # absmax / qmax, up to 17 bits, as XLA computes it
      (jax.lax.bitcast_convert_type(a / jnp.float32(block_format.qmax_of(bits)), jnp.uint32) + 0x7F)
      & jnp.uint32(0xFFFFFF80), jnp.float32))(amax)
  ok = np.isfinite(np.asarray(former))
  assert np.sum(np.asarray(former)[ok] != former_model_scales(x, bits)[ok]) > 0


def test_midpoints_are_exact_numbers():
  """(2k + 1) * s / 2 is an fp32 number for every code and any 16-bit scale >= 2^-125: the comparisons
  that correct a division's estimate are exact."""
  rng = np.random.default_rng(0)
  s = rng.random(10000).astype(np.float32) * np.float32(2.0) ** rng.integers(-124, 100, 10000)
  s = ((s.view(np.uint32).astype(np.uint64) + 0xFF) & 0xFFFFFF00).astype(np.uint32).view(np.float32)
  for k in (0, 1, 6, 7, 126, 127):
    m32 = (np.float32(2 * k + 1) * (s * np.float32(0.5))).astype(np.float64)
    np.testing.assert_array_equal(m32, (2 * k + 1) * s.astype(np.float64) / 2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["xla", "pallas", "triton"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_backends_equal_the_numpy_model(backend, bits, dtype):
  for seed in (0, 1):
    _check(backend, bits, hard_data(seed), dtype)
    _check(backend, bits, tie_blocks(bits, seed), dtype)
