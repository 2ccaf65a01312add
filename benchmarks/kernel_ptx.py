"""The quantization kernels compiled for a compile-only H100: per op, bits and backend, what runs and what it
costs per element, read from the PTX (no GPU needed; nothing is timed).

For each op (quantize, dequantize, their rotated forms, reorder_quantize with and without rotation,
dequant_sum_quantize, dequant_sum with and without rotation), bits 8 and 4, and backend (pallas; triton
where jax-triton imports; xla), the op is compiled for one H100 (`zerojax.gpu_aot`, bf16 input and output,
`--elements` elements, block 256, K = 4 slabs), and the script records:

- `launches`: the program's thunks that launch work on the GPU (kernels, custom calls, copies), i.e. the
  passes over HBM the op makes (one is the least: every kernel reads its inputs and writes its outputs);
- per kernel: grid, threads, elements per thread (`elements / (grid * threads)`, elements of the op's
  [M, B] rows; straight-line Triton code, so static counts are what each thread executes), and per
  element: PTX instructions, global loads and stores, shared-memory loads and stores, `bar.sync`
  barriers, warp shuffles, divisions and reciprocals; the widths (bytes) of its global loads and stores
  (`ld.global.v4.b32` moves 16 bytes, `st.global.b8` one).

The PTX of a Pallas kernel and of XLA's fusions comes from XLA's dump (`xla_dump_to`); that of a
jax-triton kernel from its custom call (zlib-compressed protos in the backend config). XLA's own
fusions may loop: their static count is a lower bound.

  JAX_PLATFORMS=cpu python benchmarks/kernel_ptx.py [--label after] [--elements 1M] [--out FILE]

With `--out` the result is merged into FILE under `--label` (default "after"), so a "before" and an
"after" (and later runs under their own labels) sit side by side; `summary` lists each row under every label.

References:
  ZeRO++: Wang et al. 2023, §4.2 (kernels at memory bandwidth). SDP4Bit: Jia et al. 2024, §3.2 (rotation).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import sys
import tempfile
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("ZEROJAX_TRITON_COMPUTE_CAPABILITY", "90")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from pallas_kernels import tuning  # noqa: E402
from zerojax import gpu_aot  # noqa: E402
from zerojax.quant import quantization as Q  # noqa: E402

BLOCK, SLABS, NODES, GPUS = 256, 4, 2, 4
OPS = ("quantize", "quantize_rotate", "dequantize", "dequantize_rotate", "reorder_quantize",
       "reorder_quantize_rotate", "dequant_sum_quantize", "dequant_sum", "dequant_sum_rotate")
THUNK = re.compile(r"^\d+: (k\w+)\s+\[[^\]]*\]\s+(\S+)(?: grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\])?",
                   re.M)
ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.M)
OPCODE = re.compile(r"^(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)")
WIDTH = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "b32": 4, "u32": 4, "s32": 4,
         "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def instructions(body: str) -> list[str]:
  """The opcodes of a PTX function body, one per instruction (inline asm may put several on a line)."""
  out = []
  for line in body.splitlines():
    line = line.split("//")[0].strip()
    if not line or line[0] in ".${}" or line.endswith(":"):
      continue
    for stmt in line.split(";"):
      m = OPCODE.match(stmt.strip().lstrip("{").strip())
      if m and not m.group(1).startswith("."):
        out.append(m.group(1))
  return out


def access_bytes(opcode: str) -> int:
  """Bytes one ld/st instruction moves per thread: ld.global.v4.b32 -> 16, st.global.b8 -> 1."""
  parts = opcode.split(".")
  vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
  return vec * next((WIDTH[p] for p in reversed(parts) if p in WIDTH), 0)


def mix(body: str) -> dict:
  """Counts of a kernel body: instructions, global/shared loads and stores (with widths), barriers,
  shuffles, divisions, reciprocals."""
  ops = instructions(body)
  c = collections.Counter()
  widths = {"load": collections.Counter(), "store": collections.Counter()}
  for op in ops:
    c["instructions"] += 1
    if op.startswith(("ld.global", "st.global")):
      kind = "load" if op.startswith("ld") else "store"
      c[f"global_{kind}s"] += 1
      widths[kind][access_bytes(op)] += 1
    elif op.startswith("ld.shared"):
      c["shared_loads"] += 1
    elif op.startswith("st.shared"):
      c["shared_stores"] += 1
    elif op.startswith(("bar.sync", "barrier.sync")):
      c["barriers"] += 1
    elif op.startswith("shfl"):
      c["shuffles"] += 1
    elif op.startswith("div."):
      c["divisions"] += 1
    elif op.startswith("rcp."):
      c["reciprocals"] += 1
  return dict(counts=dict(c), load_bytes={str(k): v for k, v in sorted(widths["load"].items())},
              store_bytes={str(k): v for k, v in sorted(widths["store"].items())})


def kernels_of_ptx(text: str) -> dict[str, str]:
  """{entry name: body} of a PTX module."""
  out = {}
  for m in ENTRY.finditer(text):
    end = text.find("\n}\n", m.end())
    out[m.group(1)] = text[m.end():end]
    threads = re.search(r"\.(?:maxntid|reqntid) (\d+)(?:, (\d+), (\d+))?", text[m.end():end])
    if threads:
      out[m.group(1) + "#threads"] = str(int(threads.group(1)) * int(threads.group(2) or 1) * int(threads.group(3) or 1))
  return out


def _varint(buf, i):
  shift = value = 0
  while True:
    b = buf[i]
    value |= (b & 0x7F) << shift
    i += 1
    shift += 7
    if b < 0x80:
      return value, i


def _fields(buf):
  """Length-delimited fields of a protobuf message, recursively."""
  i = 0
  while i < len(buf):
    key, i = _varint(buf, i)
    kind = key & 7
    if kind == 0:
      _, i = _varint(buf, i)
    elif kind == 2:
      n, i = _varint(buf, i)
      yield buf[i:i + n]
      if not buf[i:i + n].startswith(b"//"):
        yield from _fields(buf[i:i + n])
      i += n
    elif kind in (1, 5):
      i += 8 if kind == 1 else 4
    else:
      return


def _walk(op):
  for region in op.regions:
    for block in region.blocks:
      for o in block.operations:
        yield o
        yield from _walk(o)


def jax_triton_ptx(stablehlo) -> list[str]:
  """The PTX of every jax-triton kernel (`triton_kernel_call`) in a lowered module."""
  out = []
  for op in _walk(stablehlo.operation):
    if op.name == "stablehlo.custom_call" and "triton_kernel_call" in str(op.attributes["call_target_name"]):
      raw = zlib.decompress(op.attributes["backend_config"].value_bytes)
      out += [f.decode() for f in _fields(raw) if f.startswith(b"//") and b".version" in f]
  return out


def op_fn(op: str, bits: int, backend: str):
  """(function, input shapes) of `op` on `elements` elements: bf16 in and out."""
  rotate = op.endswith("_rotate")
  base = op[:-len("_rotate")] if rotate else op
  kw = dict(backend=backend)
  if base == "quantize":
    return lambda x: Q.quantize(x, bits, BLOCK, rotate=rotate, **kw), "x"
  if base == "reorder_quantize":
    return lambda x: Q.reorder_quantize(x, NODES, GPUS, bits, BLOCK, rotate=rotate, **kw), "x"
  if base == "dequantize":
    return lambda v, s: Q.dequantize(v, s, bits, BLOCK, dtype=jnp.bfloat16, rotate=rotate, **kw), "q"
  if base == "dequant_sum_quantize":
    return lambda v, s: Q.dequant_sum_quantize(v, s, bits, BLOCK, **kw), "qk"
  if base == "dequant_sum":
    return lambda v, s: Q.dequant_sum(v, s, bits, BLOCK, dtype=jnp.bfloat16, rotate=rotate, **kw), "qk"
  raise ValueError(op)


def inputs(kind: str, n: int, bits: int, sharding):
  vb = n if bits == 8 else n // 2
  vdt = jnp.int8 if bits == 8 else jnp.uint8
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
  if kind == "x":
    return [s((n,), jnp.bfloat16)]
  if kind == "q":
    return [s((vb,), vdt), s((n // BLOCK,), jnp.float32)]
  return [s((SLABS, vb), vdt), s((SLABS, n // BLOCK), jnp.float32)]


def dump_options(path: str) -> dict:
  """XLA options that write a compiled GPU program's thunks and PTX to `path`. jax 0.11 and later emit the
  Pallas kernels as custom kernels (`kCustomKernel` thunks), whose PTX is written only with the LLVM IR dump
  and every emitter's (`xla_gpu_dump_llvmir`, `xla_dump_emitter_re`); jax 0.10.2 writes it either way."""
  return {"xla_dump_to": path, "xla_gpu_dump_llvmir": True, "xla_dump_emitter_re": ".*"}


def measure(op: str, bits: int, backend: str, n: int, sharding) -> dict:
  """Compiles `op` for the H100 and reads its thunks and PTX (module docstring)."""
  fn, kind = op_fn(op, bits, backend)
  args = inputs(kind, n, bits, sharding)
  with tempfile.TemporaryDirectory() as d:
    lowered = jax.jit(fn).lower(*args)
    lowered.compile(compiler_options=dump_options(d))
    thunks = "".join(p.read_text() for p in pathlib.Path(d).glob("*thunk_sequence.txt"))
    bodies = {}
    for p in pathlib.Path(d).glob("*.ptx"):
      bodies.update(kernels_of_ptx(p.read_text()))
  triton_ptx = jax_triton_ptx(lowered.compiler_ir("stablehlo")) if backend == "triton" else []
  launches, kernels = [], []
  for m in THUNK.finditer(thunks):
    kind_, name = m.group(1), m.group(2)
    launches.append(f"{kind_}:{name}")
    if m.group(3) and name in bodies:
      grid = int(m.group(3)) * int(m.group(4)) * int(m.group(5))
      threads = int(m.group(6)) * int(m.group(7)) * int(m.group(8))
      kernels.append(_kernel_row(name, bodies[name], grid, threads, n))
  for i, text in enumerate(triton_ptx):  # jax-triton: the grid is the default configuration's
    for name, body in kernels_of_ptx(text).items():
      if name.endswith("#threads"):
        continue
      threads = int(kernels_of_ptx(text)[name + "#threads"])
      rows = tuning.default().rows(n // BLOCK, BLOCK)
      kernels.append(_kernel_row(f"triton:{name}", body, n // BLOCK // rows, threads, n))
  return dict(op=op, bits=bits, backend=backend, elements=n, launches=len(launches), thunks=launches,
              kernels=kernels)


def _kernel_row(name, body, grid, threads, n) -> dict:
  m = mix(body)
  per_thread = n / (grid * threads)
  per_element = {k: round(v / per_thread, 3) for k, v in m["counts"].items()}
  return dict(name=name, grid=grid, threads=threads, elements_per_thread=per_thread,
              per_element=per_element, load_bytes=m["load_bytes"], store_bytes=m["store_bytes"])


def backends() -> list[str]:
  out = ["pallas"]
  try:
    from pallas_kernels import triton_block_quant
    triton_block_quant.require_jax_triton()
    out.append("triton")
  except Exception as e:  # noqa: BLE001 - jax-triton missing: the triton rows are left out
    print(f"triton left out: {e}", file=sys.stderr)
  return out + ["xla"]


def summary(result: dict) -> list[dict]:
  """Per op, bits and backend: launches and the kernels' instructions per element under every label (in
  the order the runs were added: "before", "after", ...)."""
  rows = {}
  for label in (k for k, v in result.items() if isinstance(v, dict) and "rows" in v):
    for r in result[label]["rows"]:
      key = (r["op"], r["bits"], r["backend"])
      instr = round(sum(k["per_element"].get("instructions", 0) for k in r.get("kernels", [])), 2)
      rows.setdefault(key, {})[label] = dict(launches=r.get("launches"), instructions_per_element=instr,
                                             error=r.get("error"))
  return [dict(op=o, bits=b, backend=be, **v) for (o, b, be), v in rows.items()]


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--elements", default="1M", help="elements of the op (K = 4 slabs each for the sums)")
  ap.add_argument("--ops", default=",".join(OPS))
  ap.add_argument("--backends", default=None, help="default: pallas, triton (where it imports), xla")
  ap.add_argument("--label", default="after")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  gpu_aot.compile_only_host()
  n = int(args.elements[:-1]) * {"K": 1 << 10, "M": 1 << 20}[args.elements[-1]] \
      if args.elements[-1] in "KM" else int(args.elements)
  sharding = NamedSharding(Mesh(np.array(gpu_aot.devices("h100", 1, 1)), ("x",)), P())
  rows = []
  for op in args.ops.split(","):
    for bits in (8, 4):
      for backend in (args.backends.split(",") if args.backends else backends()):
        try:
          rows.append(measure(op, bits, backend, n, sharding))
        except Exception as e:  # noqa: BLE001 - recorded in the row
          rows.append(dict(op=op, bits=bits, backend=backend, elements=n, error=f"{type(e).__name__}: {e}"[:400]))
        r = rows[-1]
        print(f"{op:24} {bits} {backend:7} launches {r.get('launches')} "
              + "; ".join(f"{k['name']}: {k['per_element'].get('instructions')}/el, ld {k['load_bytes']} "
                          f"st {k['store_bytes']}" for k in r.get("kernels", []) if "fusion" not in k["name"])
              + (f" ERROR {r['error'][:100]}" if "error" in r else ""), file=sys.stderr)
  section = dict(jax=jax.__version__, device="compile-only NVIDIA H100 80GB HBM3 (sm_90)", block=BLOCK,
                 slabs=SLABS, elements=n, config=tuning.default().text, rows=rows)
  result = {}
  if args.out and pathlib.Path(args.out).exists():
    result = json.loads(pathlib.Path(args.out).read_text())
  result[args.label] = section
  result["summary"] = summary(result)
  result["notes"] = [
      "per_element: a kernel's static PTX counts times its grid and threads over the op's elements (M x B)",
      "launches: thunks of the compiled program (kernels, custom calls, copies): the op's passes over HBM",
      "load_bytes / store_bytes: {bytes one global ld/st instruction moves per thread: instructions in the "
      "kernel body}"]
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
  return result


if __name__ == "__main__":
  main()
