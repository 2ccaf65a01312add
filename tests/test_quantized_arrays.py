"""`analysis.quantized_arrays`: the rule behind "no quantized array" in a program that quantizes nothing.

A bf16 step on a GPU calls cuDNN's fused attention (and, on a real GPU, cuBLAS gemms), and XLA gives each
call its workspace as a 1-D u8 / s8 element of the call's result: scratch memory, not quantized data. The
rule leaves out exactly those workspaces; everything else of an 8- or 4-bit integer or float8 type counts:
a collective's operands or results, a convert, a fusion's or a kernel's result. The programs here are
written by hand (the forms XLA prints) and compiled on CPU devices (a real int8 and uint8 wire); the
compile-only H100 programs of the shipped configs are checked in tests/test_gpu_compile.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.analysis import QUANTIZED_TYPES, collectives_from_hlo, quantized_arrays

# cuDNN's fused attention forward and backward and a cuBLAS gemm as XLA:GPU prints them (from a bf16 step
# compiled for a compile-only H100, and the cuBLAS form XLA writes after autotuning on a device)
LIBRARY_CALLS = """\
HloModule step, entry_computation_layout={(bf16[8,32,4,16]{3,2,1,0})->bf16[8,4,32,16]{3,1,2,0}}

ENTRY %main.1 (p.1: bf16[8,32,4,16]) -> bf16[8,4,32,16] {
  %p.1 = bf16[8,32,4,16]{3,2,1,0} parameter(0)
  %dot_product_attention_fwd.0 = (bf16[8,4,32,16]{3,1,2,0}, f32[8,4,32]{2,1,0}, u8[0]{0}) custom-call(%p.1, %p.1, %p.1), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[8,32,4,16]{3,2,1,0}, bf16[8,32,4,16]{3,2,1,0}, bf16[8,32,4,16]{3,2,1,0}}, api_version=API_VERSION_STATUS_RETURNING
  %dot_product_attention_bwd.0 = (bf16[8,4,32,16]{3,1,2,0}, bf16[8,4,32,16]{3,1,2,0}, bf16[8,4,32,16]{3,1,2,0}, u8[33554432]{0}) custom-call(%p.1, %p.1, %p.1, /*index=3*/%p.1), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  %ws.0 = u8[33554432]{0} get-tuple-element(%dot_product_attention_bwd.0), index=3
  %gemm.0 = (bf16[256,256]{1,0}, s8[4194304]{0}) custom-call(%p.1, %p.1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1}}
  %cudnn_fusion.0 = (bf16[256,256]{1,0}, s8[1048576]{0}) fusion(%p.1, %p.1), kind=kCustom, calls=%fused_gemm, backend_config={"fusion_backend_config":{"kind":"__cudnn$fusion"}}
  ROOT %out.0 = bf16[8,4,32,16]{3,1,2,0} get-tuple-element(%dot_product_attention_fwd.0), index=0
}
"""


def _with(line: str) -> str:
  """`LIBRARY_CALLS` with one more instruction in its entry computation."""
  return LIBRARY_CALLS.replace("  ROOT", f"  {line}\n  ROOT")


def test_library_workspaces_are_not_quantized_data():
  assert quantized_arrays(LIBRARY_CALLS) == []


@pytest.mark.parametrize("line,name,dtype", [
    # a quantized wire: the collective's result (and operand) is int8 / uint8
    ("%all-gather-start.1 = (s8[4,64]{1,0}, s8[32,64]{1,0}) all-gather-start(%q.1), dimensions={0}", "all-gather-start.1", "s8"),
    ("%all-to-all.2 = u8[8,64]{1,0} all-to-all(%q.1), dimensions={0}", "all-to-all.2", "u8"),
    ("%all-gather.3 = bf16[32,64]{1,0} all-gather(s8[4,64]{1,0} %q.1), dimensions={0}", "all-gather.3", "s8"),
    # quantizing: a convert or a fusion of int8 / float8 result, a kernel that writes codes
    ("%convert.4 = s8[64]{0} convert(%x.1)", "convert.4", "s8"),
    ("%fusion.5 = f8e4m3fn[64]{0} fusion(%x.1), kind=kLoop, calls=%fused_quantize", "fusion.5", "f8e4m3fn"),
    ("%triton.6 = (u8[64]{0}, f32[1]{0}) custom-call(%x.1), custom_call_target=\"__gpu$xla.gpu.triton\"", "triton.6", "u8"),
    # a library call's output (not its workspace) in int8, and a u8 workspace of no library call
    ("%gemm.7 = (s8[256,256]{1,0}, s8[4194304]{0}) custom-call(%x.1, %x.1), custom_call_target=\"__cublas$lt$matmul\"", "gemm.7", "s8"),
    ("%call.8 = (bf16[64]{0}, u8[1024]{0}) custom-call(%x.1), custom_call_target=\"my_kernel\"", "call.8", "u8"),
    # the workspace read as data by another instruction than its get-tuple-element
    ("%copy.9 = u8[33554432]{0} copy(%ws.0)", "copy.9", "u8"),
    ("%gte.10 = u8[0]{0} get-tuple-element(%p.1), index=2", "gte.10", "u8"),
])
def test_quantized_data_is_found_beside_library_workspaces(line, name, dtype):
  found = quantized_arrays(_with(line))
  assert [(q.name, q.dtypes) for q in found] == [(name, (dtype,))], found


def test_a_quantizing_computation_is_found_by_its_signature_and_body():
  text = LIBRARY_CALLS + """
%fused_quantize (param_0.1: f32[64]) -> s4[64] {
  %param_0.1 = f32[64]{0} parameter(0)
  ROOT %convert.11 = s4[64]{0} convert(%param_0.1)
}
"""
  found = {(q.opcode, q.name) for q in quantized_arrays(text)}
  assert found == {("signature", "fused_quantize"), ("convert", "convert.11")}, found


def _mesh():
  return jax.make_mesh((8,), ("d",), devices=jax.devices()[:8])


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8])
def test_a_compiled_8bit_collective_is_found(dtype):
  """A real 8-bit wire, compiled: codes gathered and exchanged across 8 CPU devices. Every collective of an
  8-bit type that `collectives_from_hlo` reads is among the arrays the rule reports, and the convert
  that makes the codes is too. Fails if the rule misses a quantized collective."""
  mesh = _mesh()

  def body(x):
    codes = jnp.clip(jnp.round(x * 100), 0, 127).astype(dtype)
    gathered = jax.lax.all_gather(codes, "d", tiled=True)
    swapped = jax.lax.all_to_all(codes.reshape(8, -1), "d", 0, 0, tiled=True)
    return gathered.astype(jnp.float32).sum() + swapped.astype(jnp.float32).sum() + x

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  x = jax.device_put(np.linspace(0, 1, 8 * 64, dtype=np.float32), NamedSharding(mesh, P("d")))
  text = f.lower(x).compile().as_text()
  want = {"s8" if dtype == jnp.int8 else "u8"}
  wire = [c for c in collectives_from_hlo(text, mesh) if set(c.hlo_dtype.split(",")) & set(QUANTIZED_TYPES)]
  assert {c.op for c in wire} == {"all-gather", "all-to-all"}, [(c.op, c.hlo_dtype) for c in wire]
  found = quantized_arrays(text)
  names = {q.name for q in found}
  assert all(c.name in names for c in wire), ([c.name for c in wire], sorted(names))
  assert any(q.opcode in ("convert", "fusion") and set(q.dtypes) == want for q in found), found
  # without the codes nothing is found: the same program in fp32
  def plain(x):
    return jax.lax.all_gather(x, "d", tiled=True).sum() + x

  g = jax.jit(jax.shard_map(plain, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  assert quantized_arrays(g.lower(x).compile().as_text()) == []
