"""The block format against a numpy model built from IEEE float32 operations (and exact quotients):
every backend, on every platform, gives the model's bits, ties and near-ties included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_format
from tests.block_model import BLOCK, adversarial_blocks, model
from zerojax.quant import quantization as Q

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
    _check(backend, bits, adversarial_blocks(bits, seed), dtype)


# --- the estimate: one reciprocal per block, a product per element, an exact correction -------------

def _quotients(x, bits):
  """|x| / s in float64 (exact enough to tell midpoints) and the model's codes, per element."""
  codes, s = model(x, bits)
  with np.errstate(divide="ignore", invalid="ignore"):
    q = np.abs(x.astype(np.float64)) / s.astype(np.float64)[:, None]
  return q, codes, s


@pytest.mark.parametrize("bits", [8, 4])
def test_adversarial_blocks_hit_what_they_aim_at(bits):
  """The data below is adversarial: midpoints, the clamp (|x| / s > qmax) and zero scales all occur."""
  x = adversarial_blocks(bits)
  q, codes, s = _quotients(x, bits)
  ok = (s > 0) & np.isfinite(s)
  qk = q[ok]
  assert np.sum(qk % 1 == 0.5) > 100                         # exact ties
  above = np.sum(qk > block_format.qmax_of(bits))            # the nearest code is qmax all the same
  assert above >= 32 * BLOCK if bits == 8 else above == 0
  assert np.sum(s == 0) == 4 and np.sum(s == np.inf) == 2
  assert np.sum(s == np.float32(2.0 ** -125)) == 2


@pytest.mark.parametrize("bits", [8, 4])
def test_the_correction_accepts_an_estimate_off_by_one(bits):
  """`nearest_codes` turns any estimate within one of the answer (clipped or not: -1 and qmax + 1 too)
  into the model's code; an estimate off by two it does not (so one step is all it takes, and all it
  gives: the estimate's error bound is what makes the codes exact)."""
  x = np.concatenate([adversarial_blocks(bits), tie_blocks(bits, 3), hard_data(4, 256)])
  _, codes, s = _quotients(x, bits)
  k = np.abs(codes).astype(np.float32)
  f = jax.jit(lambda x, s, e: block_format.nearest_codes(x, s[:, None], bits, e))
  for off in (-1, 0, 1):
    got = np.asarray(f(x, s, jnp.asarray(k + np.float32(off)))).astype(np.int32)
    np.testing.assert_array_equal(got, codes, err_msg=f"estimate off by {off}")
  for off in (-2, 2):
    got = np.asarray(f(x, s, jnp.asarray(k + np.float32(off)))).astype(np.int32)
    assert np.sum(got != codes) > 0


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("ulps", [-2, -1, 1, 2])
def test_any_reciprocal_within_a_few_ulp_gives_the_model(bits, ulps):
  """The estimate rint(|x| * r) with r = 1 / s moved by `ulps` (what `rcp.approx`, within one ulp, may
  return on a GPU), then corrected: the model's codes. Some estimates are off (the correction works)."""
  x = np.concatenate([adversarial_blocks(bits), tie_blocks(bits, 1)])
  _, codes, _ = _quotients(x, bits)

  def moved(s):
    r = 1.0 / s
    for _ in range(abs(ulps)):
      r = jnp.nextafter(r, jnp.float32(np.inf) if ulps > 0 else jnp.float32(0))
    return r

  @jax.jit
  def run(x):
    amax = jnp.max(jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x)), axis=1)
    s = block_format.scale_of(amax, bits)
    estimate = jnp.round(jnp.abs(x) * block_format.inverse_scale(s, moved)[:, None])
    return block_format.nearest_codes(x, s[:, None], bits, estimate), estimate

  got, estimate = (np.asarray(a) for a in run(x))
  np.testing.assert_array_equal(got.astype(np.int32), codes)
  assert np.sum(np.minimum(estimate, block_format.qmax_of(bits)) != np.abs(codes)) > 0


def test_inverse_scale_is_zero_where_the_scale_is_not_usable():
  s = jnp.asarray([0.0, np.inf, 2.0 ** -125, 0.5, 2.0 ** 125], jnp.float32)
  r = np.asarray(block_format.inverse_scale(s))
  np.testing.assert_array_equal(r, np.float32([0.0, 0.0, 2.0 ** 125, 2.0, 2.0 ** -125]))


CPU_KERNELS = ["xla", "pallas", "mosaic"]  # mosaic: the Mosaic GPU interpreter, int8


@pytest.mark.parametrize("backend,bits", [(b, bits) for b in CPU_KERNELS for bits in (8, 4)
                                          if b != "mosaic" or bits == 8])  # the Mosaic kernels are int8 only
def test_adversarial_blocks_equal_the_model_in_every_backend_here(backend, bits):
  x = adversarial_blocks(bits, seed=bits)
  if backend != "mosaic":
    _check(backend, bits, x)
    return
  from pallas_kernels import mosaic_block_quant as MB
  if MB.missing_api() is not None:  # a jax without Mosaic GPU's API (tests/test_mosaic_kernels.py: needs_plgpu)
    pytest.skip(MB.missing_api())
  codes, s = model(x, bits)
  v, sc = jax.jit(lambda a: MB.quantize_rows(a, interpret=True))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(sc).view(np.uint32), s.view(np.uint32))
  np.testing.assert_array_equal(np.asarray(v).astype(np.int32), codes)
