"""The quantization kernels compiled for GPUs on this CPU host: real Triton kernels, no interpreter.

Programs are compiled for compile-only H100s/A100s (`jax.experimental.topologies`, the jax CUDA
plugin; nothing runs). The Pallas kernels must become Triton custom calls, with no instruction of
the Pallas interpreter (an XLA op named below a kernel's name scope) in the optimized program; the
jax-triton kernels must lower without a GPU, with the target's compute capability, to PTX that the
CUDA 12 ptxas of the runtime assembles. Lowering for a platform the kernels do not support raises.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import gpu_aot
from zerojax.quant import kernel_choice, quantization as Q

BLOCK = 64
N, G = 2, 4

CC = {"h100": 90, "a100": 80}  # compute capability of each target (zerojax/gpu_targets/)

PALLAS_TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'
JAX_TRITON = 'custom_call_target="triton_kernel_call"'
KERNEL_OP = re.compile(r'op_name="[^"]*?(zerojax_[a-z_]+)/([^"]*)"')


GPU_AOT_REASON = f"needs the jax CUDA plugin: {gpu_aot.PIP}"
needs_plugin = pytest.mark.skipif(not gpu_aot.plugin_installed(), reason=GPU_AOT_REASON)


def _jax_triton_lowers() -> bool:
  from pallas_kernels import triton_block_quant
  return bool(importlib.util.find_spec("jax_triton")) and triton_block_quant.incompatibility() is None


needs_jax_triton = pytest.mark.skipif(  # jax-triton <= 0.4.1 cannot lower with jax 0.12 (a third-party limit)
    not (gpu_aot.plugin_installed() and _jax_triton_lowers()), reason=f"{GPU_AOT_REASON}, and a jax-triton that lowers "
                                                                      "with this jax")


@functools.cache
def _devices(target: str, topology: str):
  nodes, gpus = (int(v) for v in topology.split("x")[1:])
  return gpu_aot.devices(target, nodes, gpus)


@pytest.fixture(autouse=True)
def _lowering_for_the_target(request):
  """Kernels jitted outside a shard_map lower for the test's target (`gpu_aot.lowering_for`: jax 0.12's Pallas
  reads the GPU from the abstract mesh; no-op before)."""
  params = getattr(getattr(request.node, "callspec", None), "params", {})
  with gpu_aot.lowering_for(params.get("target", "h100")):
    yield


def _on_one_gpu(target, *shapes):
  mesh = Mesh(np.array(_devices(target, "1x1x1")), ("x",))
  return [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P())) for s in shapes]


def kernels_in(hlo: str) -> tuple[collections.Counter, collections.Counter]:
  """(Pallas Triton kernels, instructions of the Pallas interpreter) per zerojax kernel name in an
  optimized program: a kernel compiled through Triton is one custom call named `<kernel>/pallas_call`;
  an interpreted one is XLA instructions (loops over its grid, slices, scatters) named below it."""
  triton, interpreted = collections.Counter(), collections.Counter()
  for line in hlo.splitlines():
    m = KERNEL_OP.search(line)
    if m is None:
      continue
    if m.group(2) == "pallas_call":
      triton[m.group(1)] += PALLAS_TRITON in line
    else:
      interpreted[m.group(1)] += 1
  return triton, interpreted


def _all_ops(x, bits, backend, noise=None):
  """Every kernel once (and the rotated ones rotated), for `bits`."""
  v, s = Q.quantize(x, bits, BLOCK, backend=backend)
  rv, rs = Q.quantize(x, bits, BLOCK, rotate=True, backend=backend)
  qv, qs = Q.reorder_quantize(x, N, G, bits, BLOCK, rotate=True, backend=backend)
  vk, sk = qv.reshape(G, -1), qs.reshape(G, -1)
  nv, ns = Q.dequant_sum_quantize(vk, sk, bits, BLOCK, out_bits=4, noise=noise, backend=backend)
  return (v, s, Q.dequantize(rv, rs, bits, BLOCK, dtype=jnp.bfloat16, rotate=True, backend=backend),
          nv, ns, Q.dequant_sum(vk, sk, bits, BLOCK, rotate=True, backend=backend))


def _program(x, backend, noise=None):
  return [_all_ops(x, bits, backend, noise) for bits in (8, 4)]


def _x():
  return jax.ShapeDtypeStruct((N * G * 4 * BLOCK,), jnp.float32)


# --- Pallas ---------------------------------------------------------------------------------------

@pytest.mark.gpu_compile
@needs_plugin
@pytest.mark.parametrize("target", ["h100", "a100"])
def test_pallas_kernels_compile_to_triton_for_gpus(target):
  """Lowered on this CPU host for a GPU, every Pallas kernel is a Triton kernel (no interpreter),
  rotated ones included, and the qgZ fused step with stochastic rounding too."""
  x, u = _on_one_gpu(target, _x(), jax.ShapeDtypeStruct((N * G * 4 * BLOCK // G,), jnp.float32))
  hlo = jax.jit(lambda x, u: _program(x, "pallas", u)).lower(x, u).compile().as_text()
  triton, interpreted = kernels_in(hlo)
  assert not interpreted, f"Pallas interpreter compiled for {target}: {dict(interpreted)}"
  # Per bit width: quantize twice (plain, rotated), and each other kernel once.
  assert triton == {"zerojax_quantize": 4, "zerojax_dequantize": 2, "zerojax_reorder_quantize": 2,
                    "zerojax_dequant_sum_quantize": 2, "zerojax_dequant_sum": 2}, triton
  assert hlo.count(PALLAS_TRITON) == 12


def test_kernels_in_counts_the_interpreter():
  """The criterion above, on a program that runs the Pallas interpreter (lowered for the CPU)."""
  hlo = jax.jit(lambda x: _all_ops(x, 8, "pallas")).lower(_x()).compile().as_text()
  triton, interpreted = kernels_in(hlo)
  assert not any(triton.values())
  assert set(interpreted) == {"zerojax_quantize", "zerojax_dequantize", "zerojax_reorder_quantize",
                              "zerojax_dequant_sum_quantize", "zerojax_dequant_sum"}


@pytest.mark.parametrize("platform,block,error,match", [
    ("cuda", 48, ValueError, "power-of-two block"),
    ("tpu", 64, NotImplementedError, "no implementation for tpu; use backend='xla'"),
])
def test_pallas_refuses_what_it_cannot_lower(platform, block, error, match):
  """Lowered for a platform it has no kernel for, the Pallas backend raises (never falls back)."""
  f = jax.jit(lambda x: Q.quantize(x, 8, block, backend="pallas"))
  with pytest.raises(error, match=match):
    jax.export.export(f, platforms=[platform])(jax.ShapeDtypeStruct((4 * block,), jnp.float32))


# --- zeropp train step ----------------------------------------------------------------------------

@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("rotate,prefetch", [(False, False), (True, None)])
def test_zeropp_train_step_with_pallas_compiles_triton_kernels_for_h100s(rotate, prefetch):
  """A ZeRO++ step with kernel_backend="pallas" compiled for 2 x 4 H100s runs its quantization in
  Triton kernels, none interpreted: per unit (embed, scanned blocks, head) the qwZ gather quantizes
  and dequantizes, and the qgZ reduction reorders+quantizes, dequantizes-sums-requantizes inside the
  node and dequantizes-sums across nodes. With the per-layer path (prefetch=False) that is one kernel
  of each kind per unit; with the GPU default (prefetch on) the schedule runs one layer of the scanned
  stack outside its loop, so each kind appears once more."""
  import zerojax
  from tests.helpers import TINY, optimizer, tiny_gpt
  mesh = Mesh(np.array(_devices("h100", "1x2x4")).reshape(N, G), ("node", "gpu"))
  plan = zerojax.plan.zeropp(kernel_backend="pallas", rotate=rotate, prefetch=prefetch)
  ex = zerojax.Executor(tiny_gpt(), optimizer(), plan, mesh, accum_steps=1)
  shapes = jax.eval_shape(ex.init, jax.random.key(0))
  state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                       shapes, ex.shardings(shapes))
  batch = jax.ShapeDtypeStruct((1, 16, TINY.seq_len + 1), jnp.int32, sharding=ex.batch_sharding)
  hlo = ex.step_fn().lower(state, batch).compile().as_text()
  triton, interpreted = kernels_in(hlo)
  assert not interpreted, dict(interpreted)
  units = len(ex.param_specs)
  assert ex.plan.schedule.prefetch is (prefetch is None)  # None: on for GPUs
  per_kind = units if prefetch is False else units + 1
  assert triton == {k: per_kind for k in ("zerojax_quantize", "zerojax_dequantize",
                                          "zerojax_reorder_quantize", "zerojax_dequant_sum_quantize",
                                          "zerojax_dequant_sum")}, triton
  assert hlo.count(PALLAS_TRITON) == 5 * per_kind


# --- jax-triton -----------------------------------------------------------------------------------

@pytest.mark.gpu_compile
@needs_jax_triton
@pytest.mark.parametrize("target", ["h100", "a100"])
def test_triton_kernels_compile_for_gpus_without_one(target, monkeypatch, tmp_path):
  """backend='triton' lowers on this CPU host for the target's compute capability, compiles, and
  its PTX (version 8.x, that of CUDA 12) is assembled by the runtime's ptxas for the target's arch."""
  from pallas_kernels import triton_block_quant
  cc = CC[target]
  monkeypatch.setenv(triton_block_quant.CC_ENV, str(cc))
  for k in triton_block_quant.PTXAS_ENV:
    monkeypatch.delenv(k, raising=False)
  [x] = _on_one_gpu(target, _x())
  lowered = jax.jit(functools.partial(_program, backend="triton")).lower(x)
  hlo = lowered.compile().as_text()
  assert hlo.count(JAX_TRITON) == 12  # 6 kernels per bit width (the rotation inside them)
  ptxs = _kernel_ptx().jax_triton_ptx(lowered.compiler_ir("stablehlo"))
  assert len(ptxs) == 12
  arch = f"sm_{cc}" + ("a" if cc >= 90 else "")
  ptxas = triton_block_quant.runtime_ptxas()
  for i, ptx in enumerate(ptxs):
    assert re.search(r"^\.version 8\.\d+$", ptx, re.M), ptx[:200]
    assert re.search(r"^\.target " + arch + r"$", ptx, re.M), ptx[:200]
    path = tmp_path / f"k{i}.ptx"
    path.write_text(ptx)
    run = subprocess.run([ptxas, f"-arch={arch}", str(path), "-o", str(tmp_path / f"k{i}.cubin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.gpu_compile
@needs_jax_triton
def test_triton_without_compute_capability_names_the_fix(monkeypatch):
  from pallas_kernels import triton_block_quant
  monkeypatch.delenv(triton_block_quant.CC_ENV, raising=False)
  [x] = _on_one_gpu("h100", _x())
  with pytest.raises(RuntimeError, match=f"set {triton_block_quant.CC_ENV}=90"):
    jax.jit(lambda x: Q.quantize(x, 8, BLOCK, backend="triton")).lower(x)


@pytest.mark.skipif(not _jax_triton_lowers(), reason="needs a jax-triton that lowers with this jax: pip install -e '.[gpu]'")
def test_triton_lowered_for_cpu_raises():
  with pytest.raises(RuntimeError, match="lowered for cpu; use backend='xla' or 'pallas'"):
    jax.jit(lambda x: Q.quantize(x, 8, BLOCK, backend="triton")).lower(_x())


# --- the default backend per op -------------------------------------------------------------------

def test_gpu_default_is_the_measured_tables_fastest_that_lowers(monkeypatch):
  """Per op the fastest measured backend that can be compiled here; xla where no kernel can."""
  from pallas_kernels import kernel_table
  monkeypatch.delenv("ZEROJAX_TRITON_COMPUTE_CAPABILITY", raising=False)
  assert kernel_table.ranking("quantize", 8, rotate=True)[0] == "pallas"  # 1,282 GB/s against 132 (xla)
  assert kernel_choice.gpu_default("quantize", 4, 256, rotate=True) == "pallas"
  assert kernel_choice.gpu_default("dequantize", 4, 256) == "xla"                     # xla measured fastest
  assert kernel_choice.gpu_default("quantize", 8, 100, rotate=False) == "xla"          # no compiled kernel: not a power of 2
  assert kernel_choice.gpu_default("quantize", 4, 256) == "xla"  # triton measured fastest, but no target capability known
  monkeypatch.setenv("ZEROJAX_TRITON_COMPUTE_CAPABILITY", "90")
  if _jax_triton_lowers():
    assert kernel_choice.gpu_default("quantize", 4, 256) == "triton"
    assert kernel_choice.gpu_default("quantize", 4, 256, noisy=True) == "xla"          # triton has no stochastic rounding
  assert kernel_choice.default_backend() == "xla"                                      # on this CPU host


@pytest.mark.parametrize("jax_triton,jax_version,works", [("0.4.1", "0.12.0.1", False), ("0.3.1", "0.12.0", False),
                                                          ("0.4.1", "0.11.2", True), ("0.4.2", "0.12.0", True)])
def test_a_jax_triton_that_cannot_lower_with_this_jax_is_never_the_default(monkeypatch, jax_triton, jax_version, works):
  """jax-triton 0.4.1 and earlier cannot lower with jax 0.12 (their dead-code rule takes two arguments, jax
  0.12 passes three): the default backend then skips triton and an explicit backend='triton' names the
  versions and the fix in one line."""
  from importlib import metadata
  from pallas_kernels import kernel_table, triton_block_quant
  real = metadata.version
  monkeypatch.setattr(metadata, "version", lambda name: jax_triton if name == "jax-triton" else real(name))
  monkeypatch.setattr(jax, "__version__", jax_version)
  monkeypatch.setenv("ZEROJAX_TRITON_COMPUTE_CAPABILITY", "90")
  assert (triton_block_quant.incompatibility() is None) == works
  assert kernel_table.ranking("quantize", 4, rotate=False)[0] == "triton"
  if importlib.util.find_spec("jax_triton") is None:
    return
  assert (kernel_choice.gpu_default("quantize", 4, 256) == "triton") == works
  if not works:
    with pytest.raises(RuntimeError, match=f"jax-triton {jax_triton} does not lower with jax {jax_version}.*pallas"):
      kernel_choice.resolve_backend("triton")


@pytest.mark.gpu_compile
@pytest.mark.slow
@needs_plugin
def test_default_backend_on_h100s_runs_the_rotated_int4_path_in_kernels():
  """configs/zeropp_int4.gin's settings (int4 weights and gradients, rotated) with no kernel_backend,
  compiled for 2 x 4 H100s: the rotated quantization runs in the Pallas kernels the measured table ranks
  first (not in the butterfly passes of the xla form), and on the CPU mesh the same plan runs xla."""
  import zerojax
  from tests.helpers import TINY, optimizer, tiny_gpt
  mesh = Mesh(np.array(_devices("h100", "1x2x4")).reshape(N, G), ("node", "gpu"))
  plan = zerojax.plan.zeropp(weight_bits=4, grad_bits=4, rotate=True)
  ex = zerojax.Executor(tiny_gpt(), optimizer(), plan, mesh, accum_steps=1)
  assert ex.components.gather.backend == kernel_choice.FASTEST
  shapes = jax.eval_shape(ex.init, jax.random.key(0))
  state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                       shapes, ex.shardings(shapes))
  batch = jax.ShapeDtypeStruct((1, 16, TINY.seq_len + 1), jnp.int32, sharding=ex.batch_sharding)
  triton, interpreted = kernels_in(ex.step_fn().lower(state, batch).compile().as_text())
  assert not interpreted
  assert {"zerojax_quantize", "zerojax_dequantize", "zerojax_reorder_quantize"} <= set(triton), triton
  cpu = zerojax.Executor(tiny_gpt(), optimizer(), plan, zerojax.make_mesh(N, G), accum_steps=1)
  assert cpu.components.gather.backend is None and cpu.components.reduction.backend is None


# --- the instruction mix: no IEEE division per element ---------------------------------------------

EST_BLOCK = 256  # 16 blocks a program, 32 elements a thread: a reciprocal per block is fewer than per element
ARITH = re.compile(r"^\s*(?:@%p\d+\s+)?((?:div|rcp)\.[a-z0-9.]+|cvt\.rni\.f32\.f32)\s", re.M)


def instruction_mix(ptx: str) -> dict[str, collections.Counter]:
  """Per kernel (`.entry` name) of a PTX text: how many fp32 divisions (`div.*`), reciprocals (`rcp.*`)
  and round-to-nearest-integer conversions (`cvt.rni`, one per element a thread quantizes) it holds."""
  out = {}
  for m in re.finditer(r"^\.visible \.entry (\w+)\(", ptx, re.M):
    end = ptx.find("\n}\n", m.end())
    out[m.group(1)] = collections.Counter(ARITH.findall(ptx[m.end():end]))
  return out


def test_instruction_mix_counts_divisions():
  ptx = (".visible .entry k(\n\tdiv.rn.f32 \t%r1, %r2, %r3;\n\t@%p1 rcp.approx.ftz.f32 %r4, %r5;\n"
         "\tcvt.rni.f32.f32 %r6, %r7;\n\tcvt.rni.f32.f32 %r8, %r9;\n}\n")
  assert instruction_mix(ptx) == {"k": {"div.rn.f32": 1, "rcp.approx.ftz.f32": 1, "cvt.rni.f32.f32": 2}}


def _assert_estimates_cost_a_product(mix: dict[str, collections.Counter], quantizing: int):
  """Every kernel that rounds codes (cvt.rni) does it without a division, with reciprocals fewer than half
  its elements (one per block: a reciprocal per element would count as many as cvt.rni); `quantizing`
  such kernels, the others hold neither."""
  rounding = {k: c for k, c in mix.items() if c["cvt.rni.f32.f32"]}
  assert len(rounding) == quantizing, mix
  for name, c in mix.items():
    divisions = {op: n for op, n in c.items() if op.startswith("div.")}
    assert not divisions, (name, c)
    rcp = sum(n for op, n in c.items() if op.startswith("rcp."))
    if name in rounding:
      assert 1 <= rcp and 2 * rcp <= c["cvt.rni.f32.f32"], (name, c)
    else:
      assert rcp == 0, (name, c)


def _estimate_ops(x, bits, backend):
  """The ops that round codes to nearest (no stochastic rounding: that keeps its division)."""
  v, s = Q.quantize(x, bits, EST_BLOCK, backend=backend)
  qv, qs = Q.reorder_quantize(x, N, G, bits, EST_BLOCK, backend=backend)
  out = [v, s, qv, qs, Q.dequant_sum_quantize(qv.reshape(G, -1), qs.reshape(G, -1), bits, EST_BLOCK,
                                              backend=backend)]
  if backend in ("pallas", "triton"):
    out.append(Q.quantize(x, bits, EST_BLOCK, rotate=True, backend=backend))
  return out


def _est_x():
  return jax.ShapeDtypeStruct((N * G * 8 * EST_BLOCK,), jnp.float32)


@pytest.mark.gpu_compile
@needs_plugin
@pytest.mark.parametrize("bits", [8, 4])
def test_pallas_estimates_have_no_division_per_element(bits, tmp_path):
  """The Pallas kernels compiled for an H100 (XLA's PTX of the Triton kernels): no `div` instruction, one
  `rcp.approx` per block; quantize, its rotated form, reorder_quantize and dequant_sum_quantize."""
  [x] = _on_one_gpu("h100", _est_x())
  jax.jit(lambda x: _estimate_ops(x, bits, "pallas")).lower(x).compile(
      compiler_options=_kernel_ptx().dump_options(str(tmp_path)))
  mix = {}
  for path in tmp_path.glob("*.ptx"):
    mix.update({k: c for k, c in instruction_mix(path.read_text()).items() if k.startswith("zerojax_")})
  _assert_estimates_cost_a_product(mix, quantizing=4)


@pytest.mark.gpu_compile
@needs_jax_triton
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_estimates_have_no_division_per_element(bits, monkeypatch):
  """The jax-triton kernels' PTX for an H100: quantize (plain, rotated and reordered) and dequant_sum with
  requantization round codes after one `rcp.approx` per block, with no `div` (the scale's 1 / qmax is a
  constant)."""
  from pallas_kernels import triton_block_quant
  monkeypatch.setenv(triton_block_quant.CC_ENV, "90")
  [x] = _on_one_gpu("h100", _est_x())
  ptxs = _kernel_ptx().jax_triton_ptx(
      jax.jit(lambda x: _estimate_ops(x, bits, "triton")).lower(x).compiler_ir("stablehlo"))
  mix = {f"{k}#{i}": c for i, p in enumerate(ptxs) for k, c in instruction_mix(p).items()}
  _assert_estimates_cost_a_product(mix, quantizing=4)


@pytest.mark.gpu_compile
@needs_plugin
def test_xla_estimates_have_no_ieee_division(tmp_path):
  """The xla backend compiled for an H100: no correctly rounded division (`div.rn`) in any kernel. (XLA
  fuses the per-block reciprocal into the per-element loop, so it counts one `rcp.approx` per row an
  element thread touches: a single instruction, as XLA's own fp32 division was.)"""
  [x] = _on_one_gpu("h100", _est_x())
  jax.jit(lambda x: [_estimate_ops(x, b, "xla") for b in (8, 4)]).lower(x).compile(
      compiler_options=_kernel_ptx().dump_options(str(tmp_path)))
  mix = collections.Counter()
  for path in tmp_path.glob("*.ptx"):
    for c in instruction_mix(path.read_text()).values():
      mix.update(c)
  assert mix["cvt.rni.f32.f32"] > 0 and not any(op.startswith("div.") for op in mix), mix


MOSAIC_PTX = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from zerojax import gpu_aot
from pallas_kernels import mosaic_block_quant as MB
mesh = Mesh(np.array(gpu_aot.devices("h100", 1, 1)), ("x",))
x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
jax.jit(MB.quantize_rows).lower(x).compile()
"""


@pytest.mark.gpu_compile
@needs_plugin
def test_mosaic_estimates_have_no_division_per_element():
  """The Mosaic GPU quantize kernel compiled for an H100 (its PTX printed by the plugin where
  MOSAIC_GPU_DUMP_PTX is set; a separate process, since the plugin reads the variable once)."""
  import os
  import sys
  from pallas_kernels import mosaic_block_quant as MB
  if MB.missing_api() is not None:
    pytest.skip(MB.missing_api())
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTX="1", JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", MOSAIC_PTX], capture_output=True, text=True, env=env,
                       cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent), timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  mix = instruction_mix(run.stdout)
  assert list(mix) == ["zerojax_mosaic_quantize_mosaic_gpu_kernel"], list(mix)
  _assert_estimates_cost_a_product(mix, quantizing=1)


# --- one pass, wide accesses: the rotated and int4 Pallas and Triton kernels ---------------------

@functools.cache
def _kernel_ptx():
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_ptx.py"
  spec = importlib.util.spec_from_file_location("kernel_ptx", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_access_bytes_reads_ptx_widths():
  k = _kernel_ptx()
  assert [k.access_bytes(op) for op in ("ld.global.v4.b32", "st.global.b8", "ld.global.b16", "st.global.v2.b32")] \
      == [16, 1, 2, 8]
  body = "\tmov.u16 %rs1, 0x0; ld.global.b16 { %rs1 }, [ %rd1 + 0 ];\n\t@%p1 st.global.v4.b32 [ %rd2 + 0 ], { %r1 };\n"
  assert k.mix(body) == {"counts": {"instructions": 3, "global_loads": 1, "global_stores": 1},
                         "load_bytes": {"2": 1}, "store_bytes": {"16": 1}}


@pytest.mark.gpu_compile
@needs_plugin
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", ["pallas", pytest.param("triton", marks=needs_jax_triton)])
def test_rotated_and_int4_kernels_are_one_pass_with_wide_accesses(backend, bits, monkeypatch):
  """Compiled for an H100, every op of the Pallas and Triton backends, rotated ones included, is one kernel
  launch (the rotation fused: one pass over memory), and no global load or store of its kernel is narrower
  than 4 bytes (whole tiles, int4 packed in registers: no stride-2 lanes of 1- or 2-byte accesses), with at
  most (K + 1) / 4 global access instructions per element (K = 1, or the slabs a sum reads; the scales
  included). Before: 2 for the rotated and int4 forms (one 1- or 2-byte access per element each way), and
  13 to 25 launches for Triton's rotated ops (XLA's butterfly passes around the kernel)."""
  if backend == "triton":
    from pallas_kernels import triton_block_quant
    monkeypatch.setenv(triton_block_quant.CC_ENV, "90")
  k = _kernel_ptx()
  [sh] = _on_one_gpu("h100", jax.ShapeDtypeStruct((1,), jnp.float32))
  for op in k.OPS:
    r = k.measure(op, bits, backend, 1 << 16, sh.sharding)
    assert r["launches"] == 1 and len(r["kernels"]) == 1, (op, r["thunks"])
    [kern] = r["kernels"]
    widths = [int(w) for w in (*kern["load_bytes"], *kern["store_bytes"])]
    assert min(widths) >= 4, (op, kern["load_bytes"], kern["store_bytes"])
    per = kern["per_element"]
    slabs = k.SLABS if op.startswith("dequant_sum") else 1
    assert per["global_loads"] + per["global_stores"] <= (slabs + 1) / 4, (op, per)
