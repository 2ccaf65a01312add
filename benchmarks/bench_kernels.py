"""Throughput of the quantization kernels, per op and backend, next to a plain device copy.

For every op (quantize, dequantize, reorder_quantize, dequant_sum_quantize, dequant_sum), bits 8
and 4, and every backend this device runs (xla everywhere; pallas interpreted on CPU at a smaller
size, compiled on GPU; triton on GPU), reports the median time over several runs after warmup and the
bandwidth in GB/s of the bytes each op must read and write. A jitted `x + 0` over fp32 data of the
same element count is the bandwidth limit. The qgZ intra-node step (dequant_sum_quantize) is also
timed against the same steps unfused (dequantize the K slabs, sum, quantize: three separately
compiled calls whose intermediates go through memory). Prints one JSON object.

  python benchmarks/bench_kernels.py [--size 16777216] [--block 256] [--slabs 4] [--reps 5]

References:
  ZeRO++: Wang et al. 2023, §4.2 (kernels that saturate memory bandwidth; fusion cuts qgZ's memory
  traffic), Table 3 (kernel optimizations).
"""
import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from zerojax import quantization as Q  # noqa: E402

NODES, GPUS = 2, 4


def timed(fn, *args, reps):
  """Median wall time in ms of fn(*args) after one warmup (compilation) run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def vbytes(n, bits):
  return n if bits == 8 else n // 2


def backends():
  names = ["xla", "pallas"]
  if jax.default_backend() == "gpu":
    try:
      Q.resolve_backend("triton")
      names.append("triton")
    except RuntimeError:
      pass
  return names


def bench_ops(n, block, k, backend, reps):
  """Rows of {op, bits, backend, elements, bytes, ms, gbps} for n elements (per slab for K ops)."""
  key = jax.random.key(0)
  x = jax.random.normal(key, (n,), jnp.float32)
  rows = []
  for bits in (8, 4):
    vb, sb = vbytes(n, bits), 4 * (n // block)
    v, s = Q.quantize(x, bits, block)
    vk = jnp.stack([v] * k)
    sk = jnp.stack([s] * k)
    cases = {
        "quantize": (lambda x, b=bits: Q.quantize(x, b, block, backend=backend), (x,),
                     4 * n + vb + sb),
        "dequantize": (lambda v, s, b=bits: Q.dequantize(v, s, b, block, backend=backend), (v, s),
                       vb + sb + 4 * n),
        "reorder_quantize": (lambda x, b=bits: Q.reorder_quantize(x, NODES, GPUS, b, block,
                                                                  backend=backend), (x,),
                             4 * n + vb + sb),
        "dequant_sum_quantize": (lambda v, s, b=bits: Q.dequant_sum_quantize(v, s, b, block,
                                                                             backend=backend),
                                 (vk, sk), k * (vb + sb) + vb + sb),
        "dequant_sum": (lambda v, s, b=bits: Q.dequant_sum(v, s, b, block, backend=backend),
                        (vk, sk), k * (vb + sb) + 4 * n),
    }
    for op, (fn, args, nbytes) in cases.items():
      ms = timed(jax.jit(fn), *args, reps=reps)
      rows.append(dict(op=op, bits=bits, backend=backend, elements=n, bytes=nbytes, ms=round(ms, 3),
                       gbps=round(nbytes / ms / 1e6, 2)))
  return rows


def bench_fusion(n, block, k, backend, reps):
  """The qgZ intra-node step fused vs unfused (dequantize K slabs -> sum -> quantize)."""
  x = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
  out = []
  for bits in (8, 4):
    vs, ss = zip(*[Q.quantize(xi, bits, block) for xi in x])
    vk, sk = jnp.stack(vs), jnp.stack(ss)
    fused = jax.jit(lambda v, s, b=bits: Q.dequant_sum_quantize(v, s, b, block, backend=backend))
    deq = jax.jit(lambda v, s, b=bits: Q.dequantize(v, s, b, block,
                                                     backend=backend).reshape(k, n))
    # Slab 0 first, like the fused kernels (XLA's CPU reduce over a leading axis is far slower).
    add = jax.jit(lambda y: functools.reduce(jnp.add, list(y)))
    quant = jax.jit(lambda t, b=bits: Q.quantize(t, b, block, backend=backend))

    def unfused(v, s, deq=deq, add=add, quant=quant):
      return quant(add(deq(v, s)))

    vb, sb = vbytes(n, bits), 4 * (n // block)
    fused_bytes = k * (vb + sb) + vb + sb
    # dequantize writes K fp32 slabs, the sum reads them and writes one, quantize reads that.
    unfused_bytes = k * (vb + sb) + 4 * k * n + 4 * k * n + 4 * n + 4 * n + vb + sb
    f_ms = timed(fused, vk, sk, reps=reps)
    u_ms = timed(unfused, vk, sk, reps=reps)
    out.append(dict(backend=backend, bits=bits, slabs=k, elements=n, fused_ms=round(f_ms, 3),
                    unfused_ms=round(u_ms, 3), speedup=round(u_ms / f_ms, 2),
                    fused_bytes=fused_bytes, unfused_bytes=unfused_bytes,
                    traffic_ratio=round(unfused_bytes / fused_bytes, 2)))
  return out


def bench_copy(n, reps):
  x = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
  ms = timed(jax.jit(lambda x: x + 0), x, reps=reps)
  return dict(elements=n, bytes=8 * n, ms=round(ms, 3), gbps=round(8 * n / ms / 1e6, 2))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--size", type=int, default=1 << 24, help="elements (per slab for K-slab ops)")
  ap.add_argument("--pallas_size", type=int, default=None,
                  help="elements for the interpreted Pallas backend on CPU (default size / 16)")
  ap.add_argument("--block", type=int, default=256)
  ap.add_argument("--slabs", type=int, default=GPUS, help="K slabs summed by the intra-node step")
  ap.add_argument("--reps", type=int, default=5)
  args = ap.parse_args()
  unit = NODES * GPUS * args.block
  size = max(unit, args.size // unit * unit)
  on_cpu = jax.default_backend() == "cpu"
  notes = ["bytes = what the op must read plus write; gbps = bytes / median time",
           "copy: jitted x + 0 over fp32 data (read + write), the bandwidth limit"]
  sizes = {b: size for b in backends()}
  if on_cpu:
    ps = args.pallas_size or size // 16
    sizes["pallas"] = max(unit, ps // unit * unit)
    notes.append(f"pallas runs in the Pallas interpreter on CPU (a loop of XLA ops per tile), "
                 f"measured at {sizes['pallas']} elements; it shows correctness, not GPU speed")
    notes.append("triton needs a CUDA GPU: not run")
  copies = {n: bench_copy(n, args.reps) for n in sorted(set(sizes.values()))}
  rows, fusion = [], []
  for backend, n in sizes.items():
    for r in bench_ops(n, args.block, args.slabs, backend, args.reps):
      r["vs_copy"] = round(r["gbps"] / copies[n]["gbps"], 2)
      rows.append(r)
    fusion += bench_fusion(n, args.block, args.slabs, backend, args.reps)
  print(json.dumps(dict(
      device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
      jax=jax.__version__, block=args.block, slabs=args.slabs, reps=args.reps,
      copy=list(copies.values()), ops=rows, qgz_intra_node_fused_vs_unfused=fusion, notes=notes),
      indent=1))


if __name__ == "__main__":
  main()
