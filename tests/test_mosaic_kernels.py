"""The Mosaic GPU (`plgpu`) int8 kernels (`pallas_kernels.mosaic_block_quant`): the xla backend's bits in
the Mosaic GPU interpreter on CPU and on a GPU, compiled as Mosaic GPU kernels (no Triton) for H100s from
a CPU host, and one-line refusals where they cannot run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels import block_format, mosaic_block_quant as MB
from zerojax import gpu_aot
from zerojax.quant import quantization as Q

MOSAIC = 'custom_call_target="mosaic_gpu_v2"'
TRITON = ('custom_call_target="__gpu$xla.gpu.triton"', 'custom_call_target="triton_kernel_call"')

needs_plugin = pytest.mark.skipif(not gpu_aot.plugin_installed(),
                                  reason=f"needs the jax CUDA plugin: {gpu_aot.PIP}")
needs_plgpu = pytest.mark.skipif(MB.missing_api() is not None, reason=str(MB.missing_api()))


def _data(block, n=1024 * 64, seed=0):
  """[n / block, block] fp32: Gaussian rows with 1% outliers, a zero, a NaN, an -inf and a tiny row
  (its scale below 2^-125: stored as 0), and a quarter of the rows on the midpoints (k + 1/2) * s of
  their own scale s or one ulp beside them, where any division's rounding decides the code. The
  caller's row count need not be a multiple of 64."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n // block, block)).astype(np.float32)
  x *= np.where(rng.random(x.shape) < 0.01, 50.0, 1.0).astype(np.float32)
  x[0], x[1, 3], x[2, 5], x[3] = 0.0, np.nan, -np.inf, np.float32(1e-37)
  ties = x[len(x) // 4 * 3:]
  amax = ((rng.random(len(ties)) + 0.5) * 2.0 ** rng.integers(-20, 20, len(ties))).astype(np.float32)
  s = np.asarray(block_format.scale_of(jnp.asarray(amax), 8))  # the format's own scale of that absmax
  k = rng.integers(0, 127, ties.shape)
  t = ((2 * k + 1).astype(np.float32) * (s[:, None] * np.float32(0.5))).astype(np.float32)  # exact midpoints
  nudge = rng.integers(-1, 2, t.shape)
  t = np.where(nudge < 0, np.nextafter(t, np.float32(0)),
               np.where(nudge > 0, np.nextafter(t, np.float32(np.inf)), t))
  ties[:] = np.where(rng.random(t.shape) < 0.5, -t, t)
  ties[:, 0] = amax  # keeps each row's scale s
  return x


def _assert_same_bits(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def _check_against_xla(x, dtype, interpret):
  """quantize_rows and dequantize_rows give the bits of the xla backend (which tests/test_block_format.py
  holds to the numpy model of the format)."""
  x = jnp.asarray(x).astype(dtype)
  m, b = x.shape
  v, s = jax.jit(lambda a: MB.quantize_rows(a, interpret=interpret))(x)
  rv, rs = jax.jit(lambda a: Q.quantize(a, 8, b, backend="xla"))(x)
  _assert_same_bits(v.reshape(-1), rv)
  _assert_same_bits(s, rs)
  y = jax.jit(lambda v, s: MB.dequantize_rows(v, s, 8, dtype, interpret=interpret))(v, s)
  ry = jax.jit(lambda v, s: Q.dequantize(v, s, 8, b, dtype=dtype, backend="xla"))(rv, rs)
  _assert_same_bits(y.reshape(-1), ry)


# --- CPU: the Mosaic GPU interpreter --------------------------------------------------------------

@needs_plgpu
@pytest.mark.parametrize("block,dtype", [(64, jnp.float32), (128, jnp.bfloat16)])
def test_interpreted_kernels_give_the_xla_bits(block, dtype):
  """The kernel bodies, run by the Mosaic GPU interpreter on CPU (tiles, TMA copies, barriers
  simulated), compute the block format bit for bit: ties, NaN, inf, zero and tiny blocks included."""
  _check_against_xla(_data(block, n=1000 * 64), dtype, interpret=True)


@needs_plgpu
def test_lowered_for_the_cpu_without_interpret_refuses():
  x = jnp.ones((64, 64), jnp.float32)
  with pytest.raises(NotImplementedError, match="backend='mosaic' compiles for CUDA GPUs only, not for cpu"):
    jax.jit(MB.quantize_rows).lower(x)


@pytest.mark.parametrize("bits,block,dtype,match", [
    (4, 64, jnp.float32, "int8 kernels only"),
    (8, 16, jnp.float32, "power-of-two block >= 32"),
    (8, 96, jnp.float32, "power-of-two block >= 32"),
    (8, 1024, jnp.float32, "shared memory"),
])
def test_unsupported_settings_name_the_fix(bits, block, dtype, match):
  reason = MB.unsupported(bits, block, dtype)
  assert reason is not None and match in reason and "backend='pallas'" in reason and "\n" not in reason
  with pytest.raises(ValueError, match=match):
    MB.quantize_rows(jnp.ones((64, block), dtype), bits)
  assert MB.unsupported(8, 1024, jnp.bfloat16) is None  # 64 x 1024 x (2 + 1) bytes fit


# --- compile-only H100s ---------------------------------------------------------------------------

@pytest.mark.gpu_compile
@needs_plugin
def test_kernels_compile_to_mosaic_gpu_for_h100():
  """Lowered on this CPU host for a compile-only H100, quantize and dequantize (fp32 and bf16) are four
  Mosaic GPU custom calls named after the kernels, and no Triton kernel."""
  mesh = Mesh(np.array(gpu_aot.devices("h100", 1, 1)), ("x",))
  on_gpu = NamedSharding(mesh, P())
  x = jax.ShapeDtypeStruct((1000, 64), jnp.float32, sharding=on_gpu)  # padded to 1024 rows
  xb = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16, sharding=on_gpu)

  def program(x, xb):
    v, s = MB.quantize_rows(x)
    vb, sb = MB.quantize_rows(xb)
    return MB.dequantize_rows(v, s, 8, jnp.bfloat16), MB.dequantize_rows(vb, sb, 8, jnp.float32)

  hlo = jax.jit(program).lower(x, xb).compile().as_text()
  calls = [line for line in hlo.splitlines() if MOSAIC in line]
  kernels = ("zerojax_mosaic_quantize", "zerojax_mosaic_dequantize")
  names = sorted(n for line in calls for n in kernels if n in line)
  assert names == ["zerojax_mosaic_dequantize"] * 2 + ["zerojax_mosaic_quantize"] * 2, calls
  assert not any(t in hlo for t in TRITON)


# --- a real GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("block", [64, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_kernels_give_the_xla_bits(block, dtype):
  """Compiled and run on the GPU, the Mosaic GPU kernels give the xla backend's bits."""
  cc = str(getattr(jax.devices()[0], "compute_capability", "9.0"))
  if int(cc.split(".")[0]) < 9:
    pytest.skip(f"Mosaic GPU needs sm_90+; this GPU is sm_{cc.replace('.', '')}")
  assert MB.unavailable_reason() is None, MB.unavailable_reason()  # on a Hopper GPU it must run
  _check_against_xla(_data(block), dtype, interpret=False)


def test_the_mosaic_backend_refuses_what_it_does_not_have():
  """backend='mosaic' runs int8 quantize and dequantize; every other op or option is one line naming the fix."""
  from zerojax.quant import quantization as Q
  x = jnp.ones((4, 64), jnp.float32)
  with pytest.raises(ValueError, match="int8 quantize and dequantize only.*use 'pallas' or 'xla'"):
    Q.quantize(x, 4, 64, backend="mosaic")
  with pytest.raises(ValueError, match="not reorder_quantize"):
    Q.reorder_quantize(jnp.ones(2 * 4 * 64), 2, 4, 8, 64, backend="mosaic")
  with pytest.raises(ValueError, match="rotate"):
    Q.quantize(x, 8, 64, rotate=True, backend="mosaic")
  with pytest.raises(ValueError, match="kernel_backend='mosaic'"):
    import zerojax
    zerojax.zeropp(kernel_backend="mosaic")
