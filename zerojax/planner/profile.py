"""The collective profiler: times every collective the plan space uses, over every group it uses.

  python -m zerojax.planner.profile --out=profile.json [--devices=4 --coordinator=HOST:PORT
      --num_processes=N --process_id=I] [--sizes=65536,524288,2097152] [--reps=3]

Run it on the cluster to plan for, every process at once like `train.py` (on the emulated cluster:
`sudo python benchmarks/cluster.py --profile=profile.json`). For every group the plan space needs (k
devices, stride s: a partition group has stride 1, the replicas of a degree-d shard stride d) and every
op (all-gather, reduce-scatter, all-reduce, all-to-all) it times messages of `--sizes` bytes (the full
buffer: the gathered result, the reduce-scatter input, the all-reduce buffer), median of `--reps` runs
after a warm-up, and fits t = α + β v by least squares. Process 0 writes the JSON profile: the mesh
shape, one fit (and its points) per group and op, the date, and whether the backend widens 16-bit
reductions to fp32 on the wire (read from a compiled bf16 all-reduce).

References:
  AMSP: Chen et al. 2023, §IV-C (profiling-based communication model), Fig. 3.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import mesh as mesh_lib
from zerojax.planner.cost import OPS, group_key, groups_needed
from zerojax.planner.space import plan_space


def group_mesh(mesh, k: int, stride: int):
  """The mesh factored so that groups of k devices with stride `stride` are a set of axes; returns
  (mesh, those axes)."""
  nodes, gpus = mesh_lib.base_shape(mesh)
  cuts = [c for c in (stride, stride * k) if 1 < c < nodes * gpus]
  mesh = mesh_lib.factor(mesh, cuts)
  outer, inner = mesh_lib.group_axes(mesh, stride * k), mesh_lib.group_axes(mesh, stride)
  return mesh, tuple(a for a in outer if a not in inner)


def _collective(op: str, axes: tuple[str, ...]):
  if op == "all_gather":
    return lambda x: lax.all_gather(x, axes, axis=0, tiled=True)
  if op == "reduce_scatter":
    return lambda x: lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
  if op == "all_reduce":
    return lambda x: lax.psum(x, axes)
  return lambda x: lax.all_to_all(x, axes, 0, 0, tiled=True)


def time_collective(mesh, axes, op: str, nbytes: int, reps: int) -> float:
  """Median seconds of one collective whose full buffer is `nbytes`, over the whole mesh at once."""
  k = mesh_lib.group_size(mesh, axes)
  n = max(k, nbytes // 4 // k * k)
  local = n // k if op == "all_gather" else n
  spec = P(tuple(mesh.axis_names))
  fn = jax.jit(jax.shard_map(_collective(op, axes), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  x = jax.device_put(jnp.ones((local * mesh.size,), jnp.float32), NamedSharding(mesh, spec))
  fn(x).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def widens_16bit_reductions(mesh) -> bool:
  """Whether this backend moves a bfloat16 all-reduce as fp32 words: compiles one over the mesh and reads
  the compiled program's all-reduce type (XLA:CPU widens 16-bit reductions; GPUs reduce bf16 natively).
  The cost model then charges a 16-bit psum / psum_scatter 4 bytes per element here."""
  axes = tuple(mesh.axis_names)
  spec = P(axes)
  fn = jax.jit(jax.shard_map(lambda x: lax.psum(x, axes), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  text = fn.lower(jax.ShapeDtypeStruct((8 * mesh.size,), jnp.bfloat16,
                                       sharding=NamedSharding(mesh, spec))).compile().as_text()
  ops = [line for line in text.splitlines() if " all-reduce(" in line or " all-reduce-start(" in line]
  return bool(ops) and not any("bf16[" in line.split("=")[1].split("all-reduce")[0] for line in ops)


def fit(points: list[tuple[float, float]]) -> dict:
  """Least-squares α + β v with α, β ≥ 0."""
  v = np.array([p[0] for p in points], float)
  t = np.array([p[1] for p in points], float)
  beta, alpha = np.polyfit(v, t, 1) if len(points) > 1 else (t[0] / v[0], 0.0)
  if alpha < 0:
    alpha, beta = 0.0, float(np.dot(v, t) / np.dot(v, v))
  if beta < 0:
    alpha, beta = float(t.mean()), 0.0
  return {"alpha": float(alpha), "beta": float(beta), "points": [[float(a), float(b)] for a, b in points]}


def profile(mesh, sizes: list[int], reps: int = 3, log=None) -> dict:
  """Profiles every (op, group) that a point of the plan space runs on `mesh`."""
  nodes, gpus = mesh_lib.base_shape(mesh)
  world = nodes * gpus
  needed = sorted({(k, s) for pt in plan_space(nodes, gpus, techniques=True, lossy=True)
                   for _, k, s in groups_needed(pt, world, gpus)})
  out = {"mesh": {"nodes": nodes, "gpus": gpus}, "sizes": sizes, "reps": reps,
         "date": datetime.date.today().isoformat(), "backend": jax.default_backend(),
         "widens_16bit_reductions": widens_16bit_reductions(mesh), "groups": {}}
  for i, (k, stride) in enumerate(needed):
    gmesh, axes = group_mesh(mesh, k, stride)
    entry = {"axes": list(axes)}
    for op in OPS:
      entry[op] = fit([(float(v), time_collective(gmesh, axes, op, v, reps)) for v in sizes])
    out["groups"][group_key(k, stride)] = entry
    if log:
      log(f"profile: [{i + 1}/{len(needed)}] {k} devices, stride {stride} over {axes}: all-gather "
          f"α={entry['all_gather']['alpha'] * 1e3:.2f} ms, {1 / max(entry['all_gather']['beta'], 1e-15) / 1e6:.1f} MB/s")
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="where process 0 writes the JSON profile")
  ap.add_argument("--sizes", default="65536,524288,2097152", help="full-buffer bytes, comma-separated")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (multi-host)")
  ap.add_argument("--num_processes", type=int, default=None)
  ap.add_argument("--process_id", type=int, default=None)
  ap.add_argument("--devices", type=int, default=None, help="CPU devices in this process (default 8 on CPU)")
  ap.add_argument("--nodes", type=int, default=None, help="nodes of a single-process mesh (default 2 on CPU)")
  args = ap.parse_args(argv)
  try:
    sizes = [int(s) for s in args.sizes.split(",") if s]
  except ValueError:
    ap.error(f"--sizes {args.sizes!r} must be comma-separated byte counts, e.g. 65536,524288")
  if args.devices or jax.config.jax_platforms in (None, "", "cpu"):
    mesh_lib.request_cpu_devices(args.devices or 8)
  if args.coordinator:
    mesh_lib.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
  nodes = args.nodes or (jax.process_count() if jax.process_count() > 1 else 2)
  mesh = mesh_lib.make_mesh(nodes)
  lead = jax.process_index() == 0
  out = profile(mesh, sizes, args.reps, log=(lambda m: print(m, file=sys.stderr, flush=True)) if lead else None)
  if lead:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=2)
    print(json.dumps({"profile": args.out, "mesh": out["mesh"], "groups": len(out["groups"])}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
