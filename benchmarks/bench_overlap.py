"""Does XLA:CPU overlap a collective with independent compute? And what does `Schedule.prefetch` change?

On 8 simulated CPU devices in one process, timed in interleaved repetitions (medians and min–max):
  (a) an all-gather of ~`--mb` MB (each device holds 1/8 of an f32 array) alone,
  (b) a per-device matmul sized to take about as long as (a) alone,
  (c) both in one jitted program with no data dependence between them,
each with and without `--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED` (one child
process per setting, since XLA reads its flags once). If (c) ≈ max(a, b) the runtime overlaps them;
if (c) ≈ a + b it does not. Then train steps of the GPT with prefetch=False and True for zero3 and
zeropp, interleaved. In one process a collective is a memory copy between devices' buffers: these are
CPU figures, not a GPU speedup. `--trace DIR` writes a jax.profiler trace of (c).

  python benchmarks/bench_overlap.py [--mb 3] [--reps 7] [--train_steps 5] [--trace /tmp/overlap]
"""
import argparse
import json
import os
import subprocess
import sys
import time

from common import interleaved  # benchmarks/, this script's directory

FLAG = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"


def stats(xs):
  xs = sorted(xs)
  return {"median_s": xs[len(xs) // 2], "min_s": xs[0], "max_s": xs[-1], "reps": len(xs)}


def child(args):
  """Runs in a process whose XLA_FLAGS are already set; prints one JSON object."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import zerojax
  from zerojax.models.gpt import GPTConfig, gpt
  from zerojax.train.optim import make_optimizer

  mesh = zerojax.make_mesh(2, 4)
  axes = ("node", "gpu")
  n = int(args.mb * 2**20 / 4) // 8 * 8
  shard = jax.device_put(jnp.ones((n,), jnp.float32), NamedSharding(mesh, P(axes)))

  def run(fn):
    def go(*xs):
      t = time.perf_counter()
      jax.block_until_ready(fn(*xs))
      return time.perf_counter() - t
    return go

  smap = lambda f, ins, outs: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs, check_vma=False))
  gather = smap(lambda x: jax.lax.all_gather(x, axes, tiled=True), P(axes), P(axes))
  t_gather = min(run(gather)(shard) for _ in range(5))

  def mats(k):
    return jax.device_put(jnp.ones((8 * k, k), jnp.float32) / k, NamedSharding(mesh, P(axes)))
  sizes, k = {}, 64
  while k <= 2048:  # the per-device matmul [k, k] @ [k, k] closest in time to the gather
    mm = smap(lambda a: a @ a, P(axes), P(axes))
    m = mats(k)
    run(mm)(m)
    sizes[k] = min(run(mm)(m) for _ in range(5))
    if sizes[k] > t_gather:
      break
    k = int(k * 1.25) // 8 * 8
  k = min(sizes, key=lambda s: abs(sizes[s] - t_gather))
  mat = mats(k)
  matmul = smap(lambda a: a @ a, P(axes), P(axes))
  both = smap(lambda x, a: (jax.lax.all_gather(x, axes, tiled=True), a @ a), (P(axes), P(axes)), (P(axes), P(axes)))
  cases = {"a_all_gather": (gather, (shard,)), "b_matmul": (matmul, (mat,)), "c_both": (both, (shard, mat))}
  times = interleaved({c: (lambda i, f=f, xs=xs: jax.block_until_ready(f(*xs))) for c, (f, xs) in cases.items()},
                      args.reps, warmup=1, order="fixed")
  out = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "gather_mb": n * 4 / 2**20, "matmul_k": k,
         **{c: stats(t) for c, t in times.items()}}
  a, b, c = (out[x]["median_s"] for x in cases)
  out["c_over_max_ab"] = c / max(a, b)
  out["c_over_sum_ab"] = c / (a + b)
  if args.trace:
    with jax.profiler.trace(os.path.join(args.trace, "concurrency" if FLAG in out["xla_flags"] else "default")):
      for _ in range(3):
        run(both)(shard, mat)

  if args.train_steps:
    cfg = GPTConfig(d_model=args.d_model, num_layers=args.layers)
    runs = {}
    for name in ("zero3", "zeropp"):
      for pf in (False, True):
        plan = zerojax.PLANS[name](param_dtype="float32", prefetch=pf, pad_multiple=256)
        ex = zerojax.Executor(gpt(cfg), make_optimizer(), plan, mesh)
        runs[f"{name}/prefetch={pf}"] = [ex, ex.init(jax.random.key(0)), ex.step_fn(), []]
    from bench_plans import time_steps  # after this process's XLA_FLAGS are set
    time_steps(runs, args.train_steps, args.batch, cfg.seq_len)
    out["train_step"] = {k: stats(r[3]) for k, r in runs.items()}
    out["train_config"] = {"d_model": args.d_model, "layers": args.layers, "batch": args.batch}
  print(json.dumps(out))


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--mb", type=float, default=3.0, help="size of the gathered array (MB)")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--rounds", type=int, default=1, help="child processes per flag setting, alternated")
  ap.add_argument("--train_steps", type=int, default=5, help="0: skip the train-step comparison")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--d_model", type=int, default=128)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--trace", default=None, help="directory for jax.profiler traces of (c)")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    return child(args)
  base = "--xla_force_host_platform_device_count=8"
  results = []
  for r in range(args.rounds):
    for flags in (base, f"{base} {FLAG}"):
      env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
      cmd = [sys.executable, __file__, "--child"] + sys.argv[1:]
      proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
      if proc.returncode:
        results.append({"xla_flags": flags, "error": proc.stderr.strip().splitlines()[-1:]})
        continue
      results.append({"round": r, **json.loads(proc.stdout.strip().splitlines()[-1])})
  print(json.dumps({"benchmark": "overlap", "results": results}, indent=1))


if __name__ == "__main__":
  main()
