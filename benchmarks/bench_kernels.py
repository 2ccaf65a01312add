"""Throughput of the quantization kernels, per op, backend, bit width and size, next to a device copy.

For every op (quantize, dequantize, their rotated forms, reorder_quantize, dequant_sum_quantize,
dequant_sum), bits 8 and 4, every size and every backend this device runs (xla and pallas
everywhere, pallas interpreted on CPU; triton on CUDA GPUs with jax-triton), reports the median time
over several runs after a warmup, the bandwidth in GB/s of the bytes the op must read and write, and
`ratio_to_copy`: the op's GB/s over that of a device copy moving the same bytes (a jitted `b + 1` over
uint8 data, half of them read and half written; 1.0 = as fast as a copy). Every backend's results
must equal xla's bit for bit: the benchmark stops with an error otherwise. The qgZ intra-node step
(dequant_sum_quantize) is also timed against the same steps unfused (dequantize the K slabs, sum,
quantize: three separately compiled calls whose intermediates go through memory), at the largest size.
Prints one JSON object; `--out FILE` also writes it (the GPU kit writes benchmarks/gpu/kernels.json).

  python benchmarks/bench_kernels.py [--sizes 1M,16M,256M] [--backends xla,pallas,triton]
      [--block 256] [--slabs 4] [--reps 5] [--out benchmarks/gpu/kernels.json]

Defaults: on a GPU sizes 1M, 4M, 16M, 64M, 256M elements and every backend it runs; on CPU 1M
elements, xla and pallas.

References:
  ZeRO++: Wang et al. 2023, §4.2 (kernels that saturate memory bandwidth; fusion cuts qgZ's memory
  traffic), Table 3 (kernel optimizations).
"""
import argparse
import functools
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from zerojax import quantization as Q  # noqa: E402

NODES, GPUS = 2, 4
GPU_SIZES = "1M,4M,16M,64M,256M"
CPU_SIZES = "1M"


def parse_size(text: str) -> int:
  """'16M' -> 16 * 2**20, '64K' -> 64 * 2**10, '1000' -> 1000."""
  text = text.strip().upper()
  scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
  digits = text[:-1] if scale > 1 else text
  if not digits.isdigit():
    raise ValueError(f"size {text!r}; expected elements such as 1048576, 64K or 16M")
  return int(digits) * scale


def timed(fn, *args, reps):
  """(median wall time in ms of fn(*args) after one warmup run, the warmup's result)."""
  out = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times)), out


def available_backends() -> list[str]:
  names = ["xla", "pallas"]
  if jax.default_backend() == "gpu":
    from pallas_kernels import triton_block_quant
    try:
      triton_block_quant.require_jax_triton()
      names.append("triton")
    except RuntimeError as e:
      print(f"triton not run: {e}", file=sys.stderr)
  return names


def same_bits(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
      a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


class Copy:
  """GB/s of a device copy per byte count (cached): `b + 1` over uint8, half read, half written."""

  def __init__(self, reps):
    self.reps, self.cache = max(reps, 10), {}
    self.fn = jax.jit(lambda b: b + jnp.uint8(1))

  def gbps(self, nbytes: int) -> float:
    half = max(1, nbytes // 2)
    if half not in self.cache:
      buf = jnp.zeros((half,), jnp.uint8)
      ms, _ = timed(self.fn, buf, reps=self.reps)
      self.cache[half] = 2 * half / ms / 1e6
      del buf
    return self.cache[half]


def cases(n, block, k, bits):
  """{op: (function of backend -> callable, args, bytes read + written)} for n elements per slab."""
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  vb, sb = (n if bits == 8 else n // 2), 4 * (n // block)
  v, s = Q.quantize(x, bits, block)
  rv, rs = Q.quantize(x, bits, block, rotate=True)
  slabs = [Q.quantize(jnp.roll(x, 7 * i), bits, block) for i in range(k)]
  vk, sk = jnp.stack([a for a, _ in slabs]), jnp.stack([b for _, b in slabs])
  del slabs
  return {
      "quantize": (lambda be: lambda x: Q.quantize(x, bits, block, backend=be), (x,), 4 * n + vb + sb),
      "quantize_rotate": (lambda be: lambda x: Q.quantize(x, bits, block, rotate=True, backend=be),
                          (x,), 4 * n + vb + sb),
      "dequantize": (lambda be: lambda v, s: Q.dequantize(v, s, bits, block, backend=be), (v, s),
                     vb + sb + 4 * n),
      "dequantize_rotate": (lambda be: lambda v, s: Q.dequantize(v, s, bits, block, rotate=True,
                                                                 backend=be), (rv, rs), vb + sb + 4 * n),
      "reorder_quantize": (lambda be: lambda x: Q.reorder_quantize(x, NODES, GPUS, bits, block,
                                                                   backend=be), (x,), 4 * n + vb + sb),
      "dequant_sum_quantize": (lambda be: lambda v, s: Q.dequant_sum_quantize(v, s, bits, block,
                                                                              backend=be),
                               (vk, sk), k * (vb + sb) + vb + sb),
      "dequant_sum": (lambda be: lambda v, s: Q.dequant_sum(v, s, bits, block, backend=be), (vk, sk),
                      k * (vb + sb) + 4 * n),
  }


def bench_ops(n, block, k, backends, reps, copy):
  """Rows of {op, backend, bits, elements, bytes, ms, gbps, copy_gbps, ratio_to_copy}; raises unless
  every backend's results equal xla's bit for bit."""
  rows = []
  for bits in (8, 4):
    for op, (make, args, nbytes) in cases(n, block, k, bits).items():
      ref = None
      for backend in backends:
        ms, out = timed(jax.jit(make(backend)), *args, reps=reps)
        if ref is None:
          ref = out
        elif not all(same_bits(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref))):
          raise AssertionError(f"{op} int{bits} at {n} elements: backend {backend!r} differs from "
                               f"{backends[0]!r}")
        gbps = nbytes / ms / 1e6
        copy_gbps = copy.gbps(nbytes)
        rows.append(dict(op=op, backend=backend, bits=bits, elements=n, bytes=nbytes, ms=round(ms, 4),
                         gbps=round(gbps, 2), copy_gbps=round(copy_gbps, 2),
                         ratio_to_copy=round(gbps / copy_gbps, 3)))
      del ref, out
  return rows


def bench_fusion(n, block, k, backend, reps):
  """The qgZ intra-node step fused vs unfused (dequantize K slabs -> sum -> quantize)."""
  x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
  out = []
  for bits in (8, 4):
    vs, ss = zip(*[Q.quantize(jnp.roll(x, 7 * i), bits, block) for i in range(k)])
    vk, sk = jnp.stack(vs), jnp.stack(ss)
    del vs, ss
    fused = jax.jit(lambda v, s, b=bits: Q.dequant_sum_quantize(v, s, b, block, backend=backend))
    deq = jax.jit(lambda v, s, b=bits: Q.dequantize(v, s, b, block,
                                                     backend=backend).reshape(k, n))
    # Slab 0 first, like the fused kernels (XLA's CPU reduce over a leading axis is far slower).
    add = jax.jit(lambda y: functools.reduce(jnp.add, list(y)))
    quant = jax.jit(lambda t, b=bits: Q.quantize(t, b, block, backend=backend))

    def unfused(v, s, deq=deq, add=add, quant=quant):
      return quant(add(deq(v, s)))

    vb, sb = (n if bits == 8 else n // 2), 4 * (n // block)
    fused_bytes = k * (vb + sb) + vb + sb
    # dequantize writes K fp32 slabs, the sum reads them and writes one, quantize reads that.
    unfused_bytes = k * (vb + sb) + 4 * k * n + 4 * k * n + 4 * n + 4 * n + vb + sb
    f_ms, f_out = timed(fused, vk, sk, reps=reps)
    u_ms, u_out = timed(unfused, vk, sk, reps=reps)
    if not all(same_bits(a, b) for a, b in zip(f_out, u_out)):
      raise AssertionError(f"fused and unfused qgZ steps differ ({backend}, int{bits})")
    out.append(dict(backend=backend, bits=bits, slabs=k, elements=n, fused_ms=round(f_ms, 4),
                    unfused_ms=round(u_ms, 4), speedup=round(u_ms / f_ms, 2),
                    fused_bytes=fused_bytes, unfused_bytes=unfused_bytes,
                    traffic_ratio=round(unfused_bytes / fused_bytes, 2)))
  return out


def main():
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
  ap.add_argument("--no_fusion", action="store_true", help="skip the fused-vs-unfused comparison")
  ap.add_argument("--out", default=None, help="also write the JSON to this file")
  args = ap.parse_args()
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
  notes = ["bytes = what the op must read plus write; gbps = bytes / median time",
           "copy: jitted b + 1 over uint8 moving the same bytes (half read, half written);"
           " ratio_to_copy = gbps / copy_gbps",
           "every backend's outputs equal xla's bit for bit (checked on every row)"]
  if not on_gpu:
    notes.append("pallas runs in the Pallas interpreter on CPU (XLA ops per tile): it shows "
                 "correctness, not GPU speed; triton needs a CUDA GPU: not run")
  copy = Copy(args.reps)
  rows, fusion = [], []
  for n in sizes:
    rows += bench_ops(n, args.block, args.slabs, backends, args.reps, copy)
  if not args.no_fusion:
    for backend in backends:
      fusion += bench_fusion(sizes[-1], args.block, args.slabs, backend, args.reps)
  result = dict(
      device=str(jax.devices()[0].device_kind), platform=jax.default_backend(), jax=jax.__version__,
      block=args.block, slabs=args.slabs, reps=args.reps, sizes=sizes, backends=backends,
      rows=rows, qgz_intra_node_fused_vs_unfused=fusion, notes=notes)
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


if __name__ == "__main__":
  main()
