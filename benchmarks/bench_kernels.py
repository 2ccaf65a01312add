"""Throughput of the quantization kernels, per op, backend, bit width and size, next to a device copy.

For every op (quantize, dequantize, reorder_quantize and dequant_sum, each also rotated;
dequant_sum_quantize), bits 8 and 4, every size and every backend this device runs (xla and pallas
everywhere, pallas interpreted on CPU; triton on CUDA GPUs with jax-triton), reports the time of one
call over interleaved repetitions after a warmup (median, min and max; the backends of a row group
alternate their order from one repetition to the next), the bandwidth in GB/s of the bytes the op must
read and write at the median, and `ratio_to_copy`: that over the device's copy ceiling.

The copy ceiling is the best median GB/s (bytes read + written) of several jitted device copies of
4-byte words over one `--copy_size` buffer (default 1 GiB on a GPU, 16 MiB on CPU): uint32 `x + 1`,
float32 `x + 1`, float32 `x * 2`, uint32 `jnp.copy` and uint32 `x * 1` (a variant whose output aliases
its input is no copy and is left out). Every variant's figures are in the JSON (`copy_ceiling`).

Outputs are compared with the xla backend's, never asserted: each row's `mismatched_bytes_vs_xla` holds
the bytes of each output that differ from xla's (`[values, scales]` for the ops returning a quantized
pair, `[output]` for dequantize and dequant_sum; null for xla itself), and the summary printed after
the JSON (on stderr) lists them. A backend that raises gets its error in its row; the run goes on (exit
status 1 at the end). The qgZ intra-node step (dequant_sum_quantize) is also timed against the same
steps unfused (dequantize the K slabs, sum, quantize: three separately compiled calls whose
intermediates go through memory), at the largest size, with the bytes where the two differ.
Each row of a Pallas or Triton kernel records its launch configuration (`launch_config`: per kernel
the tuning key, the configuration and whether it was timed now, read from the cache, or the device
kind's default; `pallas_kernels/tuning.py`). On a GPU, tuning is on by default: the first run times
each kernel's candidates in its warmup call (minutes at 256M elements; not in the timed figures) and
caches the winners, so later runs only read them (`--tuning 0` uses the defaults table instead).
`best` lists, per op, bits and size, the fastest backend whose outputs equal xla's, its GB/s, its ratio
to the reference copy ceiling (`--reference_copy`, default 3,009 GB/s: PyTorch's `copy_` on an H100
SXM, docs/quantization.md) and to this run's own copy ceiling, and its launch configuration.
Prints one JSON object (device kind, jax version, rows, ceiling, best, summary); `--out FILE` also
writes it (the GPU kit writes OUT_DIR/kernels.json).

  python benchmarks/bench_kernels.py [--sizes 1M,16M,256M] [--backends xla,pallas,triton]
      [--block 256] [--slabs 4] [--reps 5] [--copy_size 1G] [--no_fusion] [--tuning 0|1]
      [--reference_copy 3009] [--out kernels.json]

Defaults: on a GPU sizes 1M, 4M, 16M, 64M, 256M elements and every backend it runs; on CPU 1M
elements, xla and pallas.

References:
  ZeRO++: Wang et al. 2023, §4.2 (kernels that saturate memory bandwidth; fusion cuts qgZ's memory
  traffic), Table 3 (kernel optimizations).
"""
import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import tuning  # noqa: E402
from zerojax.quant import quantization as Q  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: the other benchmarks' helpers
from common import error_text, interleaved, print_and_save, spread  # noqa: E402

NODES, GPUS = 2, 4
GPU_SIZES = "1M,4M,16M,64M,256M"
CPU_SIZES = "1M"
GPU_COPY, CPU_COPY = "1G", "16M"  # bytes of the copy ceiling's buffer
REFERENCE_COPY_GBPS = 3009.0  # PyTorch's copy_ on an H100 SXM 80GB (the second GPU run, 2026-11-26)


def parse_size(text: str) -> int:
  """'16M' -> 16 * 2**20, '64K' -> 64 * 2**10, '1G' -> 2**30, '1000' -> 1000."""
  text = text.strip().upper()
  scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
  digits = text[:-1] if scale > 1 else text
  if not digits.isdigit():
    raise ValueError(f"size {text!r}; expected a count such as 1048576, 64K, 16M or 1G")
  return int(digits) * scale


def sig(x: float, digits: int = 4) -> float:
  """x rounded to `digits` significant digits (GB/s from 0.01 on a CPU to thousands on a GPU)."""
  return float(f"{x:.{digits - 1}e}")


def call_ms(calls: dict, reps: int, errors: dict) -> dict:
  """{name: [ms of one call, per repetition]}: `calls[name] = (fn, args)`, already warm, timed by
  `common.interleaved` (one call per repetition, the order alternating). A call that raises puts its error
  in `errors[name]` and drops that name from the result."""
  def failed(name, e):
    errors[name] = error_text(e, 500)
  fns = {name: (lambda i, fn=fn, args=args: jax.block_until_ready(fn(*args))) for name, (fn, args) in calls.items()}
  times = interleaved(fns, reps, on_error=failed)
  return {name: [1e3 * t for t in ts] for name, ts in times.items() if name not in errors}


def available_backends() -> list[str]:
  names = ["xla", "pallas"]
  if jax.default_backend() == "gpu":
    try:
      from pallas_kernels import triton_block_quant
      triton_block_quant.require_jax_triton()
      names.append("triton")
    except Exception as e:  # noqa: BLE001 - a missing or changed triton module only drops the backend
      print(f"triton not run: {type(e).__name__}: {e}", file=sys.stderr)
    from pallas_kernels import mosaic_block_quant
    why = mosaic_block_quant.unavailable_reason()
    if why is None:
      names.append("mosaic")  # int8 quantize and dequantize only; its other rows record the refusal
    else:
      print(f"mosaic not run: {why}", file=sys.stderr)
  return names


@jax.jit
def _differing_bytes(a, b):
  """Bytes where a and b (same shape and dtype) differ, counted on the device."""
  as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)  # [..., itemsize] or [...]
  return jnp.count_nonzero(as_bytes(a) != as_bytes(b))


def mismatched_bytes(out, ref, piece_bytes: int = 1 << 30) -> list[int]:
  """Bytes of each output leaf that differ from the reference's (a leaf of another shape or dtype, or
  one missing on either side, counts all its bytes). Compared on the device, in pieces of at most
  `piece_bytes` (the count is int32)."""
  outs, refs = jax.tree.leaves(out), jax.tree.leaves(ref)
  counts = []
  for i in range(max(len(outs), len(refs))):
    a = jnp.asarray(outs[i]) if i < len(outs) else None
    b = jnp.asarray(refs[i]) if i < len(refs) else None
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
      counts.append(int(max(x.nbytes for x in (a, b) if x is not None)))
      continue
    a, b = a.reshape(-1), b.reshape(-1)
    step = max(1, piece_bytes // a.dtype.itemsize)
    counts.append(sum(int(_differing_bytes(a[j:j + step], b[j:j + step])) for j in range(0, a.size, step))
                  if a.size > step else int(_differing_bytes(a, b)))
  return counts


def copy_ceiling(nbytes: int, reps: int) -> dict:
  """The device's copy ceiling: the best median GB/s (read + write) of several jitted copies of 4-byte
  words over one buffer of `nbytes`, each variant's spread beside it."""
  words = max(1, nbytes // 4)
  u32 = jnp.arange(words, dtype=jnp.uint32)
  f32 = jax.lax.bitcast_convert_type(u32 & jnp.uint32(0x3FFFFFFF), jnp.float32)  # finite values
  variants = {
      "uint32 x+1": (jax.jit(lambda x: x + jnp.uint32(1)), u32),
      "float32 x+1": (jax.jit(lambda x: x + jnp.float32(1)), f32),
      "float32 x*2": (jax.jit(lambda x: x * jnp.float32(2)), f32),
      "uint32 jnp.copy": (jax.jit(jnp.copy), u32),
      "uint32 x*1": (jax.jit(lambda x: x * jnp.uint32(1)), u32),
  }
  calls, aliased, errors = {}, [], {}
  for name, (fn, x) in variants.items():
    try:
      out = jax.block_until_ready(fn(x))
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded, the other variants go on
      errors[name] = error_text(e, 500)
      continue
    try:
      same = out.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - a platform without buffer pointers: trust the program
      same = False
    if same or out is x:
      aliased.append(name)
    else:
      calls[name] = (fn, (x,))
    del out
  moved = 2 * 4 * words
  times = call_ms(calls, max(reps, 10), errors)
  del calls, u32, f32
  table = {}
  for name, ms in times.items():
    s = spread(ms)
    table[name] = {"gbps": sig(moved / s["median"] / 1e6), "gbps_min": sig(moved / s["max"] / 1e6),
                   "gbps_max": sig(moved / s["min"] / 1e6), "ms": {k: sig(v) for k, v in s.items()}}
  best = max(table, key=lambda k: table[k]["gbps"]) if table else None
  return {"gbps": table[best]["gbps"] if best else None, "best": best, "buffer_bytes": 4 * words,
          "bytes_moved": moved, "reps": max(reps, 10), "variants": table, "left_out_aliased": aliased,
          "errors": errors}


def cases(n, block, k, bits):
  """{op: (function of backend -> callable, args, bytes read + written)} for n elements per slab."""
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  v, s = Q.quantize(x, bits, block)
  rv, rs = Q.quantize(x, bits, block, rotate=True)
  slabs = [Q.quantize(jnp.roll(x, 7 * i), bits, block) for i in range(k)]
  vk, sk = jnp.stack([a for a, _ in slabs]), jnp.stack([b for _, b in slabs])
  del slabs
  q, rq, xb = v.nbytes + s.nbytes, rv.nbytes + rs.nbytes, x.nbytes
  return {
      "quantize": (lambda be: lambda x: Q.quantize(x, bits, block, backend=be), (x,), xb + q),
      "quantize_rotate": (lambda be: lambda x: Q.quantize(x, bits, block, rotate=True, backend=be),
                          (x,), xb + rq),
      "dequantize": (lambda be: lambda v, s: Q.dequantize(v, s, bits, block, backend=be), (v, s), q + xb),
      "dequantize_rotate": (lambda be: lambda v, s: Q.dequantize(v, s, bits, block, rotate=True,
                                                                 backend=be), (rv, rs), rq + xb),
      "reorder_quantize": (lambda be: lambda x: Q.reorder_quantize(x, NODES, GPUS, bits, block,
                                                                   backend=be), (x,), xb + q),
      "reorder_quantize_rotate": (lambda be: lambda x: Q.reorder_quantize(x, NODES, GPUS, bits, block, rotate=True,
                                                                          backend=be), (x,), xb + rq),
      "dequant_sum_quantize": (lambda be: lambda v, s: Q.dequant_sum_quantize(v, s, bits, block,
                                                                              backend=be),
                               (vk, sk), k * q + q),
      "dequant_sum": (lambda be: lambda v, s: Q.dequant_sum(v, s, bits, block, backend=be), (vk, sk),
                      k * q + xb),
      "dequant_sum_rotate": (lambda be: lambda v, s: Q.dequant_sum(v, s, bits, block, rotate=True, backend=be),
                             (vk, sk), k * q + xb),
  }


def bench_ops(n, block, k, backends, reps, ceiling_gbps, case_fn=None):
  """Rows of {op, backend, bits, elements, bytes, ms, ms_min, ms_max, gbps, copy_gbps, ratio_to_copy,
  mismatched_bytes_vs_xla} (or `error`); the first backend (xla) is the reference the others are
  compared with. Never raises for a backend that differs or fails."""
  rows = []
  for bits in (8, 4):
    for op, (make, args, nbytes) in (case_fn or cases)(n, block, k, bits).items():
      ref, calls, info = None, {}, {}
      for i, backend in enumerate(backends):
        base = dict(op=op, backend=backend, bits=bits, elements=n, bytes=int(nbytes))
        tuning.CHOSEN.clear()
        try:
          fn = jax.jit(make(backend))
          out = jax.block_until_ready(fn(*args))  # traces the kernels: their launch configurations
        except Exception as e:  # noqa: BLE001 - recorded in the row
          info[backend] = dict(base, error=error_text(e, 500))
          continue
        finally:
          if backend in ("pallas", "triton"):
            base["launch_config"] = {k: {"config": c, "source": src} for k, c, src in tuning.CHOSEN}
        if i == 0:
          ref, mismatch = out, None
        else:
          mismatch = None if ref is None else mismatched_bytes(out, ref)
        calls[backend] = (fn, args)
        info[backend] = dict(base, mismatched_bytes_vs_xla=mismatch)
        del out
      errors = {}
      times = call_ms(calls, reps, errors)
      for backend in backends:
        row = info[backend]
        if backend in errors:
          row["error"] = errors[backend]
        if backend in times:
          s = spread(times[backend])
          gbps = nbytes / s["median"] / 1e6
          row.update(ms=sig(s["median"]), ms_min=sig(s["min"]), ms_max=sig(s["max"]),
                     gbps=sig(gbps), copy_gbps=ceiling_gbps,
                     ratio_to_copy=sig(gbps / ceiling_gbps, 3) if ceiling_gbps else None)
          row["mismatched_bytes_vs_xla"] = row.pop("mismatched_bytes_vs_xla")  # last, as in the notes
        rows.append(row)
      del ref, calls
  return rows


def bench_fusion(n, block, k, backend, reps):
  """The qgZ intra-node step fused vs unfused (dequantize K slabs -> sum -> quantize), interleaved."""
  x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
  out = []
  for bits in (8, 4):
    row = dict(backend=backend, bits=bits, slabs=k, elements=n)
    try:
      vs, ss = zip(*[Q.quantize(jnp.roll(x, 7 * i), bits, block) for i in range(k)])
      vk, sk = jnp.stack(vs), jnp.stack(ss)
      vb, sb = vs[0].nbytes, ss[0].nbytes
      del vs, ss
      fused = jax.jit(lambda v, s, b=bits: Q.dequant_sum_quantize(v, s, b, block, backend=backend))
      deq = jax.jit(lambda v, s, b=bits: Q.dequantize(v, s, b, block, backend=backend).reshape(k, n))
      # Slab 0 first, like the fused kernels (XLA's CPU reduce over a leading axis is far slower).
      add = jax.jit(lambda y: functools.reduce(jnp.add, list(y)))
      quant = jax.jit(lambda t, b=bits: Q.quantize(t, b, block, backend=backend))

      def unfused(v, s, deq=deq, add=add, quant=quant):
        return quant(add(deq(v, s)))

      fused_bytes = k * (vb + sb) + vb + sb
      # dequantize writes K fp32 slabs, the sum reads them and writes one, quantize reads that.
      unfused_bytes = k * (vb + sb) + 4 * k * n + 4 * k * n + 4 * n + 4 * n + vb + sb
      f_out = jax.block_until_ready(fused(vk, sk))
      u_out = jax.block_until_ready(unfused(vk, sk))
      mismatch = mismatched_bytes(f_out, u_out)
      del f_out, u_out
      errors = {}
      times = call_ms({"fused": (fused, (vk, sk)), "unfused": (unfused, (vk, sk))}, reps, errors)
      if errors:
        raise RuntimeError("; ".join(f"{k}: {v}" for k, v in errors.items()))
      f, u = spread(times["fused"]), spread(times["unfused"])
      row.update(fused_ms=sig(f["median"]), fused_ms_min=sig(f["min"]), fused_ms_max=sig(f["max"]),
                 unfused_ms=sig(u["median"]), unfused_ms_min=sig(u["min"]),
                 unfused_ms_max=sig(u["max"]), speedup=round(u["median"] / f["median"], 2),
                 fused_bytes=fused_bytes, unfused_bytes=unfused_bytes,
                 traffic_ratio=round(unfused_bytes / fused_bytes, 2), mismatched_bytes_fused_vs_unfused=mismatch)
    except Exception as e:  # noqa: BLE001 - recorded in the row
      row["error"] = error_text(e, 500)
    out.append(row)
  return out


def best_per_op(rows, ceiling_gbps, reference_gbps) -> list[dict]:
  """Per (op, bits, elements): the fastest backend whose outputs equal xla's (xla itself included),
  with its ratios to the reference and to the measured copy ceiling and its launch configuration."""
  groups = {}
  for r in rows:
    if "gbps" in r and not any(r.get("mismatched_bytes_vs_xla") or []):
      g = groups.setdefault((r["op"], r["bits"], r["elements"]), [])
      g.append(r)
  out = []
  for (op, bits, n), g in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0], -kv[0][1])):
    b = max(g, key=lambda r: r["gbps"])
    out.append(dict(op=op, bits=bits, elements=n, backend=b["backend"], gbps=b["gbps"],
                    ratio_to_reference_copy=sig(b["gbps"] / reference_gbps, 3),
                    ratio_to_measured_copy=sig(b["gbps"] / ceiling_gbps, 3) if ceiling_gbps else None,
                    launch_config=sorted({v["config"] for v in b.get("launch_config", {}).values()}),
                    others={r["backend"]: r["gbps"] for r in g if r is not b}))
  return out


def summarize(rows, fusion, ceiling) -> dict:
  """What the summary prints: the ceiling, per non-xla row its mismatched bytes, and every error."""
  mism = [dict(op=r["op"], bits=r["bits"], elements=r["elements"], backend=r["backend"],
               mismatched_bytes_vs_xla=r["mismatched_bytes_vs_xla"])
          for r in rows if r.get("mismatched_bytes_vs_xla") and any(r["mismatched_bytes_vs_xla"])]
  errors = [dict(op=r["op"], bits=r["bits"], elements=r["elements"], backend=r["backend"], error=r["error"])
            for r in rows if "error" in r]
  errors += [dict(op="fused_vs_unfused", bits=f["bits"], elements=f["elements"], backend=f["backend"],
                  error=f["error"]) for f in fusion if "error" in f]
  errors += [dict(op="copy_ceiling", variant=k, error=v) for k, v in ceiling.get("errors", {}).items()]
  compared = [r for r in rows if r.get("mismatched_bytes_vs_xla") is not None]
  return dict(copy_ceiling_gbps=ceiling["gbps"], copy_ceiling_variant=ceiling["best"],
              rows_compared_with_xla=len(compared), rows_differing_from_xla=len(mism),
              differing=mism, errors=errors,
              fused_vs_unfused_differing=[dict(backend=f["backend"], bits=f["bits"],
                                               mismatched_bytes=f["mismatched_bytes_fused_vs_unfused"])
                                          for f in fusion if any(f.get("mismatched_bytes_fused_vs_unfused") or [])])


def summary_text(result) -> str:
  """A table: op, bits, elements, backend, GB/s, ratio to the copy ceiling, mismatched bytes vs xla."""
  c = result["copy_ceiling"]
  lines = [f"copy ceiling {c['gbps']} GB/s ({c['best']}, {c['buffer_bytes']} bytes; "
           + ", ".join(f"{k} {v['gbps']}" for k, v in c["variants"].items())
           + "".join(f"; {k}: ERROR {v[:80]}" for k, v in c["errors"].items()) + ")",
           f"{'op':22} {'bits':>4} {'elements':>10} {'backend':8} {'GB/s':>9} {'/copy':>6}  mismatched bytes vs xla"]
  for r in result["rows"]:
    if "error" in r:
      lines.append(f"{r['op']:22} {r['bits']:>4} {r['elements']:>10} {r['backend']:8} ERROR {r['error'][:80]}")
      continue
    m = r["mismatched_bytes_vs_xla"]
    lines.append(f"{r['op']:22} {r['bits']:>4} {r['elements']:>10} {r['backend']:8} {r['gbps']:>9.2f} "
                 f"{r['ratio_to_copy'] if r['ratio_to_copy'] is not None else '':>6}  "
                 f"{'(reference)' if m is None else m}")
  for f in result["qgz_intra_node_fused_vs_unfused"]:
    if "error" in f:
      lines.append(f"fused vs unfused {f['backend']} int{f['bits']}: ERROR {f['error'][:80]}")
    else:
      lines.append(f"fused vs unfused {f['backend']} int{f['bits']}: {f['speedup']}x, mismatched bytes "
                   f"{f['mismatched_bytes_fused_vs_unfused']}")
  ref = result["reference_copy_gbps"]
  lines.append(f"best backend per op (equal to xla), against the reference copy {ref:g} GB/s and the measured "
               f"{c['gbps']} GB/s:")
  lines.append(f"{'op':22} {'bits':>4} {'elements':>10} {'backend':8} {'GB/s':>9} {'/ref':>6} {'/copy':>6}  config")
  for b in result["best"]:
    lines.append(f"{b['op']:22} {b['bits']:>4} {b['elements']:>10} {b['backend']:8} {b['gbps']:>9.2f} "
                 f"{b['ratio_to_reference_copy']:>6} {b['ratio_to_measured_copy'] or '':>6}  "
                 f"{'; '.join(b['launch_config']) or '-'}")
  s = result["summary"]
  lines.append(f"{s['rows_differing_from_xla']} of {s['rows_compared_with_xla']} compared rows differ from xla; "
               f"{len(s['errors'])} errors")
  return "\n".join(lines)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--sizes", default=None,
                  help=f"elements per run (per slab for K-slab ops), comma-separated, e.g. 1M,64M "
                       f"(default {GPU_SIZES} on GPU, {CPU_SIZES} on CPU)")
  ap.add_argument("--backends", default=None,
                  help="comma-separated subset of xla,pallas,triton (default: all this device runs;"
                       " xla, the reference, always runs first)")
  ap.add_argument("--block", type=int, default=256)
  ap.add_argument("--slabs", type=int, default=GPUS, help="K slabs summed by the intra-node step")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--copy_size", default=None,
                  help=f"bytes of the copy ceiling's buffer (default {GPU_COPY} on GPU, {CPU_COPY} on CPU)")
  ap.add_argument("--no_fusion", action="store_true", help="skip the fused-vs-unfused comparison")
  ap.add_argument("--tuning", choices=["0", "1"], default=None,
                  help=f"time the kernels' launch configurations (1) or use the defaults table (0); default "
                       f"${tuning.ENV}, else on where the device is a GPU")
  ap.add_argument("--reference_copy", type=float, default=REFERENCE_COPY_GBPS,
                  help="the copy ceiling (GB/s) the best backends are compared with (default: PyTorch's copy_ "
                       "on an H100 SXM)")
  ap.add_argument("--out", default=None, help="also write the JSON to this file")
  args = ap.parse_args(argv)
  if args.tuning is not None:
    os.environ[tuning.ENV] = args.tuning
  on_gpu = jax.default_backend() == "gpu"
  unit = NODES * GPUS * args.block
  sizes = sorted({max(unit, parse_size(s) // unit * unit)
                  for s in (args.sizes or (GPU_SIZES if on_gpu else CPU_SIZES)).split(",")})
  backends = available_backends()
  if args.backends:
    wanted = [b.strip() for b in args.backends.split(",")]
    bad = [b for b in wanted if b not in backends]
    if bad:
      raise SystemExit(f"--backends: {bad} cannot run here (this device runs {backends})")
    backends = ["xla"] + [b for b in wanted if b != "xla"]
  notes = ["bytes = what the op must read plus write; gbps = bytes / median time of one call",
           "ms, ms_min, ms_max: median, min and max over --reps interleaved repetitions (the backends' "
           "order alternates); the warmup call is not timed",
           "copy_gbps = the copy ceiling (copy_ceiling.gbps): the best median of the 4-byte-word copy "
           "variants over one buffer; ratio_to_copy = gbps / copy_gbps",
           "mismatched_bytes_vs_xla: bytes of each output differing from xla's ([values, scales] or "
           "[output]); recorded, never a failure; null for xla, the reference",
           "launch_config: per kernel traced for the row, its tuning key, configuration and source (tuned "
           "now in the warmup call, cached, or the device kind's default)",
           "best: per op, bits and size the fastest backend equal to xla; ratio_to_reference_copy = gbps / "
           "reference_copy_gbps, ratio_to_measured_copy = gbps / copy_ceiling.gbps"]
  if not on_gpu:
    notes.append("pallas runs in the Pallas interpreter on CPU (XLA ops per tile): it shows "
                 "correctness, not GPU speed; triton needs a CUDA GPU: not run")
  ceiling = copy_ceiling(parse_size(args.copy_size or (GPU_COPY if on_gpu else CPU_COPY)), args.reps)
  rows, fusion = [], []
  for n in sizes:
    rows += bench_ops(n, args.block, args.slabs, backends, args.reps, ceiling["gbps"])
  if not args.no_fusion:
    for backend in backends:
      fusion += bench_fusion(sizes[-1], args.block, args.slabs, backend, args.reps)
  result = dict(
      device=str(jax.devices()[0].device_kind), platform=jax.default_backend(), jax=jax.__version__,
      block=args.block, slabs=args.slabs, reps=args.reps, sizes=sizes, backends=backends,
      copy_ceiling=ceiling, reference_copy_gbps=args.reference_copy,
      tuning=dict(enabled=tuning.enabled(), gpu=tuning.gpu_here(), cache=str(tuning.cache_path()),
                  defaults={k: v.text for k, v in tuning.DEFAULTS.items()}),
      best=best_per_op(rows, ceiling["gbps"], args.reference_copy),
      rows=rows, qgz_intra_node_fused_vs_unfused=fusion,
      summary=summarize(rows, fusion, ceiling), notes=notes)
  print_and_save(result, summary_text, args.out)
  return result


if __name__ == "__main__":
  sys.exit(1 if main()["summary"]["errors"] else 0)
