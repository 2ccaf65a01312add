"""Block-wise quantization: format, error bounds, qgZ fusions, and backend agreement bit for bit."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from zerojax import gpu_aot
from zerojax.quant import kernel_choice, quantization

BLOCK = 64
N, G = 2, 4
KERNELS = ("quantize", "dequantize", "reorder_quantize", "dequant_sum", "dequant_sum_quantize")


@functools.cache
def _jitted(name: str, static_argnums: tuple, static_argnames: tuple):
  return jax.jit(getattr(quantization, name), static_argnums=static_argnums, static_argnames=static_argnames)


class _Kernels:
  """`zerojax.quant.quantization` with each kernel jitted, its non-array arguments static: called eagerly,
  every jnp operation of the xla form and of Pallas's interpreter compiles a program of its own
  (docs/testing.md, "Keeping the fast suite fast"). Errors raised while tracing reach the caller as they are."""

  def __getattr__(self, name):
    if name not in KERNELS:
      return getattr(quantization, name)

    def call(*args, **kw):
      static = tuple(i for i, a in enumerate(args) if not isinstance(a, (jax.Array, np.ndarray)))
      return _jitted(name, static, tuple(sorted(kw)))(*args, **kw)
    return call


Q = _Kernels()


def _bits(a):
  """Raw bit pattern, so that NaN payloads and signed zeros count too."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_same(a, b):
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
  np.testing.assert_array_equal(_bits(a), _bits(b))


def _data(n, dtype=jnp.float32, seed=0, specials=True):
  """Gaussian data with outliers; block 1 all-zero, block 2 holds a NaN, block 3 an Inf."""
  return _data_program(n, dtype, seed, specials)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))  # one program, not one per op
def _data_program(n, dtype, seed, specials):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (n,), jnp.float32)
  x = x * jnp.where(jax.random.uniform(k2, (n,)) < 0.01, 50.0, 1.0)
  if specials:
    x = x.at[BLOCK:2 * BLOCK].set(0.0)
    x = x.at[2 * BLOCK + 5].set(jnp.nan)
    x = x.at[3 * BLOCK + 7].set(-jnp.inf)
  return x.astype(dtype)


def _mesh():
  return Mesh(np.array(jax.devices()[:N * G]).reshape(N, G), ("node", "gpu"))


# --- format ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n", [16 * BLOCK, 16 * BLOCK - 37])
def test_quantize_dequantize_pallas_equals_xla(bits, dtype, n):
  x = _data(n, dtype)

  @functools.partial(jax.jit, static_argnames="backend")  # one program per backend, not one per op
  def ops(x, backend):
    v, s = Q.quantize(x, bits, BLOCK, backend=backend)
    w, t = Q.quantize(x, bits, BLOCK, backend="xla")  # both dequantize the same codes
    return v, s, [Q.dequantize(w, t, bits, BLOCK, dtype=d, size=n, backend=backend) for d in (jnp.float32, dtype)]

  v, s, ys = ops(x, "xla")
  vp, sp, yps = ops(x, "pallas")
  _assert_same(vp, v)
  _assert_same(sp, s)
  n_pad = 16 * BLOCK
  assert v.shape == (n_pad if bits == 8 else n_pad // 2,) and s.shape == (16,)
  assert v.dtype == (jnp.int8 if bits == 8 else jnp.uint8) and s.dtype == jnp.float32
  for out_dtype, y, yp in zip((jnp.float32, dtype), ys, yps):
    _assert_same(yp, y)
    assert y.shape == (n,) and y.dtype == out_dtype
  y = np.asarray(jax.jit(lambda v, s: Q.dequantize(v, s, bits, BLOCK))(v, s)).reshape(16, BLOCK)
  assert s[1] == 0 and np.all(_bits(y[1]) == 0)  # all-zero block: exact +0
  assert not np.isfinite(y[2]).any() and not np.isfinite(y[3]).any()  # NaN / Inf blocks
  assert np.isfinite(y[[0] + list(range(4, 16))]).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [BLOCK, 256])
def test_rotated_ops_pallas_equal_xla(bits, block):
  """Round to nearest after the rotation (no noise): the Pallas kernels rotate whole rows of contiguous
  tiles (`hadamard.fwht_tile`), xla its lanes (`fwht_rows`); the same butterflies, so the same bits, for
  quantize, reorder_quantize, dequantize and dequant_sum, bf16 in and out, NaN/Inf/zero blocks included."""
  x = _data(N * G * 4 * block, jnp.bfloat16)
  ops = lambda backend: jax.jit(functools.partial(_rotated_ops, bits=bits, block=block, backend=backend))(x)
  for a, b in zip(ops("xla"), ops("pallas")):
    _assert_same(b, a)


def _rotated_ops(x, bits, block, backend):
  v, s = Q.quantize(x, bits, block, rotate=True, backend=backend)
  rv, rs = Q.reorder_quantize(x, N, G, bits, block, rotate=True, backend=backend)
  vk, sk = rv.reshape(G, -1), rs.reshape(G, -1)
  return [v, s, Q.dequantize(v, s, bits, block, dtype=jnp.bfloat16, rotate=True, backend=backend), rv, rs,
          Q.dequant_sum(vk, sk, bits, block, dtype=jnp.bfloat16, rotate=True, backend=backend)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "triton"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [BLOCK, 256])
def test_gpu_rotated_ops_equal_xla(backend, bits, block):
  """On a GPU: the Pallas and Triton kernels' rotation (in the kernel) gives xla's bits (xla's butterfly
  passes), bf16 in and out, NaN/Inf/zero blocks included."""
  x = _data(N * G * 4 * block, jnp.bfloat16)
  ref = _rotated_ops(x, bits, block, "xla")
  got = jax.jit(functools.partial(_rotated_ops, bits=bits, block=block, backend=backend))(x)
  for a, b in zip(ref, got):
    _assert_same(b, a)


def test_int4_nibble_order_hand_written_bytes():
  # Block absmax 7 -> scale 1, codes = x. Element 2i is the low nibble, 2i+1 the high nibble.
  x = jnp.array([1, -2, 7, -7, 0, 3, -1, 0], jnp.float32)
  expected = np.array([0xE1, 0x97, 0x30, 0x0F], np.uint8)
  for backend in ("xla", "pallas"):
    v, s = Q.quantize(x, 4, 8, backend=backend)
    np.testing.assert_array_equal(np.asarray(v), expected)
    np.testing.assert_array_equal(np.asarray(s), [1.0])
    back = Q.dequantize(jnp.asarray(expected), jnp.array([2.0]), 4, 8, backend=backend)
    np.testing.assert_array_equal(np.asarray(back), 2 * np.asarray(x))


def test_int8_codes_and_round_half_even():
  # absmax 127 -> scale 1; halves round to even.
  x = jnp.array([127, -127, 0.5, 1.5, 2.5, -0.5, -1.5, 3.49], jnp.float32)
  for backend in ("xla", "pallas"):
    v, s = Q.quantize(x, 8, 8, backend=backend)
    np.testing.assert_array_equal(np.asarray(v), [127, -127, 0, 2, 2, 0, -2, 3])
    assert float(s[0]) == 1.0


def test_bad_arguments():
  with pytest.raises(ValueError, match="bits=3"):
    Q.quantize(jnp.ones(8), 3, 8)
  with pytest.raises(ValueError, match="even"):
    Q.quantize(jnp.ones(8), 4, 7)
  with pytest.raises(ValueError, match="backend='cuda'"):
    Q.quantize(jnp.ones(8), 8, 8, backend="cuda")


def test_default_backend_env(monkeypatch):
  # eager calls: the default backend is read while tracing, and `Q`'s jitted kernels may hold a trace
  monkeypatch.delenv(kernel_choice.ENV_VAR, raising=False)
  assert kernel_choice.default_backend() == "xla"
  monkeypatch.setenv(kernel_choice.ENV_VAR, "pallas")
  assert kernel_choice.default_backend() == "pallas"
  v, s = quantization.quantize(_data(256, specials=False), 8, BLOCK)
  _assert_same(v, quantization.quantize(_data(256, specials=False), 8, BLOCK, backend="xla")[0])


def test_triton_on_cpu_raises_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  with pytest.raises(RuntimeError, match="use backend='xla' or 'pallas'"):
    Q.quantize(jnp.ones(64), 8, 64, backend="triton")


# --- error ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
def test_error_at_most_half_a_step(bits):
  x = _data(64 * BLOCK, specials=False, seed=1)
  v, s, y = jax.jit(lambda x: (lambda v, s: (v, s, Q.dequantize(v, s, bits, BLOCK)))(*Q.quantize(x, bits, BLOCK)))(x)
  err = np.abs(np.asarray(y) - np.asarray(x)).reshape(-1, BLOCK)
  assert np.all(err <= np.asarray(s)[:, None] / 2 * (1 + 2.0 ** -20))
  # Scales: absmax * fp32(1 / qmax) rounded up to 16 significant bits (so code * scale is exact).
  exact = np.max(np.abs(np.asarray(x, np.float64)).reshape(-1, BLOCK), axis=1) / Q.qmax_of(bits)
  assert np.all(_bits(s) & 0xFF == 0)
  assert np.all((s >= exact * (1 - 2.0 ** -23)) & (s <= exact * (1 + 2.0 ** -15)))


@pytest.mark.parametrize("bits", [8, 4])
def test_blockwise_beats_per_tensor_with_outliers(bits):
  x = _data(64 * BLOCK, specials=False, seed=2)
  n = x.shape[0]

  def rel_err(block):
    y = Q.dequantize(*Q.quantize(x, bits, block), bits, block)
    return float(jnp.linalg.norm(y - x) / jnp.linalg.norm(x))

  assert rel_err(BLOCK) < 0.75 * rel_err(n)


# --- qgZ fusions ----------------------------------------------------------------------------------

def _explicit_reorder_quantize(x, nodes, gpus, bits, block, stages):
  c = x.size // (nodes * gpus)
  t = jnp.transpose(x.reshape(nodes, gpus, stages, c // stages), (2, 1, 0, 3))
  v, s = Q.quantize(t, bits, block, backend="xla")
  return (v.reshape(stages, gpus, nodes, -1), s.reshape(stages, gpus, nodes, -1))


@pytest.mark.parametrize("bits", [8, 4])
def test_reorder_quantize_equals_explicit_and_is_stage_invariant(bits):
  c = 4 * BLOCK
  x = _data(N * G * c, jnp.bfloat16, seed=3)
  deq = []
  for stages in (1, 2, 4):
    v, s = Q.reorder_quantize(x, N, G, bits, BLOCK, stages=stages, backend="xla")
    ve, se = _explicit_reorder_quantize(x, N, G, bits, BLOCK, stages)
    _assert_same(v, ve)
    _assert_same(s, se)
    assert v.shape == (stages, G, N, c // stages if bits == 8 else c // (2 * stages))
    assert s.shape == (stages, G, N, c // (stages * BLOCK))
    vp, sp = Q.reorder_quantize(x, N, G, bits, BLOCK, stages=stages, backend="pallas")
    _assert_same(vp, v)
    _assert_same(sp, s)
    y = Q.dequantize(v, s, bits, BLOCK).reshape(stages, G, N, c // stages)
    deq.append(np.asarray(jnp.transpose(y, (1, 2, 0, 3)).reshape(G, N, c)))
  for d in deq[1:]:
    np.testing.assert_array_equal(_bits(d), _bits(deq[0]))


def test_reorder_quantize_rejects_bad_chunk():
  with pytest.raises(ValueError, match="c=96.*stages \\* block = 2 \\* 64"):
    Q.reorder_quantize(jnp.ones(N * G * 96), N, G, 8, 64, stages=2)


def _slabs(k, bits, shape=(3, 2 * BLOCK), seed=4):
  xs = _data(k * int(np.prod(shape)), seed=seed).reshape(k, *shape)
  vs, ss = zip(*[Q.quantize(x, bits, BLOCK) for x in xs])
  bp = shape[-1] if bits == 8 else shape[-1] // 2
  return (jnp.stack(vs).reshape(k, *shape[:-1], bp),
          jnp.stack(ss).reshape(k, *shape[:-1], shape[-1] // BLOCK))


@pytest.mark.parametrize("bits,out_bits", [(8, 8), (4, 4), (4, 8), (8, 4)])
def test_dequant_sum_quantize_equals_unfused(bits, out_bits):
  k = G
  v, s = _slabs(k, bits)
  total = Q.dequantize(v[0], s[0], bits, BLOCK)
  for i in range(1, k):
    total = total + Q.dequantize(v[i], s[i], bits, BLOCK)
  ve, se = Q.quantize(total, out_bits, BLOCK)
  for backend in ("xla", "pallas"):
    vf, sf = Q.dequant_sum_quantize(v, s, bits, BLOCK, out_bits=out_bits, backend=backend)
    assert vf.shape == (3, 2 * BLOCK if out_bits == 8 else BLOCK) and sf.shape == (3, 2)
    _assert_same(vf.reshape(-1), ve)
    _assert_same(sf.reshape(-1), se)
  y = Q.dequantize(ve, se, out_bits, BLOCK).reshape(3, 2 * BLOCK)
  assert not np.isfinite(np.asarray(y[1, :BLOCK])).any()  # a NaN slab block stays non-finite


@pytest.mark.parametrize("bits", [8, 4])
def test_dequant_sum_equals_unfused(bits):
  v, s = _slabs(2, bits, seed=5)
  total = Q.dequantize(v[0], s[0], bits, BLOCK) + Q.dequantize(v[1], s[1], bits, BLOCK)
  for dtype in (jnp.float32, jnp.bfloat16):
    y = Q.dequant_sum(v, s, bits, BLOCK, dtype=dtype, backend="xla")
    assert y.shape == (3, 2 * BLOCK)
    _assert_same(y.reshape(-1), total.astype(dtype))
    _assert_same(Q.dequant_sum(v, s, bits, BLOCK, dtype=dtype, backend="pallas"), y)


def test_pallas_multi_step_grids(monkeypatch):
  """Small tiles: every kernel runs a grid of many steps, exercising its index maps. Eager calls: the tile
  is read while tracing, and `Q`'s jitted kernels may hold a trace of the default tile."""
  from pallas_kernels import block_quant
  monkeypatch.setattr(block_quant, "_INTERPRET_TILE", 2 * BLOCK)
  v, s = _slabs(G, 4, shape=(2, 8 * BLOCK), seed=9)
  x = _data(N * G * 4 * BLOCK, seed=10)
  for backend in ("xla", "pallas"):
    got = (quantization.quantize(x, 4, BLOCK, backend=backend),
           quantization.reorder_quantize(x, N, G, 8, BLOCK, stages=2, backend=backend),
           quantization.dequant_sum_quantize(v, s, 4, BLOCK, out_bits=8, backend=backend),
           quantization.dequant_sum(v, s, 4, BLOCK, backend=backend))
    if backend == "xla":
      ref = got
  chex.assert_trees_all_equal_shapes_and_dtypes(got, ref)
  chex.assert_trees_all_equal(jax.tree.map(_bits, got), jax.tree.map(_bits, ref), strict=True)


def test_pallas_under_jit():
  x = _data(8 * BLOCK, specials=False)
  f = jax.jit(functools.partial(Q.quantize, bits=4, block=BLOCK, backend="pallas"))
  _assert_same(f(x)[0], Q.quantize(x, 4, BLOCK, backend="xla")[0])


# --- inside shard_map: a whole qgZ round on the (node, gpu) mesh ---------------------------------

def _qgz(x, bits, backend, stages=1):
  """Local full gradient [N*G*c] -> this device's reduced slice [c] (sum over all devices)."""
  v, s = Q.reorder_quantize(x, N, G, bits, BLOCK, stages=stages, backend=backend)
  outs = []
  for st in range(stages):
    vg = lax.all_to_all(v[st], "gpu", 0, 0, tiled=True)
    sg = lax.all_to_all(s[st], "gpu", 0, 0, tiled=True)
    vn, sn = Q.dequant_sum_quantize(vg, sg, bits, BLOCK, backend=backend)
    vn = lax.all_to_all(vn, "node", 0, 0, tiled=True)
    sn = lax.all_to_all(sn, "node", 0, 0, tiled=True)
    outs.append(Q.dequant_sum(vn, sn, bits, BLOCK, backend=backend))
  return jnp.concatenate(outs)


@pytest.mark.parametrize("bits", [8, 4])
def test_qgz_round_under_shard_map(bits):
  c = 2 * BLOCK
  w = N * G
  xs = _data(w * w * c, seed=6, specials=False).reshape(w, w * c)
  mesh = _mesh()
  spec = P(("node", "gpu"))
  results = {}
  for backend in ("xla", "pallas"):
    for stages in (1, 2):
      f = jax.shard_map(lambda x: _qgz(x[0], bits, backend, stages), mesh=mesh, in_specs=spec,
                        out_specs=spec, check_vma=False)
      results[backend, stages] = np.asarray(jax.jit(f)(xs))
  _assert_same(results["pallas", 1], results["xla", 1])
  _assert_same(results["pallas", 2], results["xla", 2])
  exact = np.asarray(xs.sum(0))
  rel = np.linalg.norm(results["xla", 1] - exact) / np.linalg.norm(exact)
  assert rel < (0.05 if bits == 8 else 0.4), rel


def test_xla_backend_under_shard_map_with_vma_checks():
  mesh = _mesh()
  xs = _data(N * G * 4 * BLOCK, specials=False)
  f = jax.shard_map(lambda x: Q.dequantize(*Q.quantize(x, 8, BLOCK), 8, BLOCK), mesh=mesh,
                    in_specs=P(("node", "gpu")), out_specs=P(("node", "gpu")))
  ref = Q.dequantize(*Q.quantize(xs, 8, BLOCK), 8, BLOCK)
  _assert_same(jax.jit(f)(xs), ref)


def test_pallas_interpreter_with_vma_checks_names_the_fix():
  if jax.default_backend() != "cpu":
    pytest.skip("compiled Pallas supports check_vma=True")
  f = jax.shard_map(lambda x: Q.quantize(x, 8, BLOCK, backend="pallas")[1], mesh=_mesh(),
                    in_specs=P(("node", "gpu")), out_specs=P(("node", "gpu")))
  with pytest.raises(NotImplementedError, match="check_vma=False"):
    jax.jit(f)(jnp.ones(N * G * BLOCK))


# --- GPU: compiled Pallas and Triton against the reference ---------------------------------------

def _all_ops(backend, bits, dtype):
  x = _data(64 * BLOCK - 3, dtype, seed=7)
  v, s = Q.quantize(x, bits, BLOCK, backend=backend)
  y = Q.dequantize(v, s, bits, BLOCK, dtype=dtype, backend=backend)
  rv, rs = Q.reorder_quantize(x[:N * G * 4 * BLOCK], N, G, bits, BLOCK, stages=2, backend=backend)
  vk, sk = v.reshape(4, -1), s.reshape(4, -1)
  qv, qs = Q.dequant_sum_quantize(vk, sk, bits, BLOCK, backend=backend)
  d = Q.dequant_sum(vk, sk, bits, BLOCK, backend=backend)
  return v, s, y, rv, rs, qv, qs, d


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "triton"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_backend_equals_xla(backend, bits, dtype):
  ref = _all_ops("xla", bits, dtype)
  got = jax.jit(functools.partial(_all_ops, backend, bits, dtype))()
  for a, b in zip(got, ref):
    _assert_same(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "triton"])
@pytest.mark.parametrize("check_vma", [False, True])
def test_gpu_backend_under_shard_map(backend, check_vma):
  devices = jax.devices()
  mesh = Mesh(np.array(devices).reshape(1, len(devices)), ("node", "gpu"))
  spec = P(("node", "gpu"))
  x = _data(len(devices) * 8 * BLOCK, seed=8)

  def local(x, b):
    v, s = Q.reorder_quantize(x, 1, 1, 4, BLOCK, stages=2, backend=b)
    y = Q.dequant_sum(v.reshape(2, -1), s.reshape(2, -1), 4, BLOCK, backend=b)
    qv, qs = Q.dequant_sum_quantize(v.reshape(2, -1), s.reshape(2, -1), 4, BLOCK, out_bits=8,
                                    backend=b)
    return y, Q.dequantize(qv, qs, 8, BLOCK, dtype=jnp.bfloat16, backend=b)

  outs = [jax.jit(jax.shard_map(functools.partial(local, b=b), mesh=mesh, in_specs=spec,
                                out_specs=(spec, spec), check_vma=check_vma))(x)
          for b in ("xla", backend)]
  for a, b in zip(outs[1], outs[0]):
    _assert_same(a, b)


# --- GPU lowering, checked on any machine ---------------------------------------------------------

def test_pallas_kernels_lower_to_triton_for_cuda():
  """Every kernel lowers to a Triton custom call when lowered for CUDA on this CPU host (no GPU)."""
  x = jax.ShapeDtypeStruct((N * G * 2 * BLOCK,), jnp.bfloat16)

  def all_ops(x, bits, out_bits):
    v, s = Q.reorder_quantize(x, N, G, bits, BLOCK, stages=2, backend="pallas")
    v, s = v.reshape(4, -1), s.reshape(4, -1)
    qv, qs = Q.dequant_sum_quantize(v, s, bits, BLOCK, out_bits=out_bits, backend="pallas")
    return (Q.quantize(x, bits, BLOCK, backend="pallas"),
            Q.dequantize(qv, qs, out_bits, BLOCK, dtype=jnp.bfloat16, backend="pallas"),
            Q.dequant_sum(v, s, bits, BLOCK, rotate=True, backend="pallas"))

  target = "__gpu$xla.gpu.triton"
  for bits, out_bits in [(8, 4), (4, 8)]:
    with gpu_aot.lowering_for("h100"):
      exported = jax.export.export(
          jax.jit(functools.partial(all_ops, bits=bits, out_bits=out_bits)), platforms=["cuda"],
          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)])(x)
    assert exported.mlir_module().count(f"@{target}") == 5
