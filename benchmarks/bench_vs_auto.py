"""Step time of the ZeRO-3 plan against jax's automatic sharding (MaxText-style FSDP), side by side.

The automatic baseline keeps the model's own parameter shapes, shards every leaf (and its optimizer
state) over all devices on its largest divisible dimension with `NamedSharding`, and lets `jax.jit`'s
partitioner insert the collectives, as MaxText does for FSDP. Both train the same model on the same
batches with the same optimizer; the two steps are timed alternately in one process, so machine noise
hits both. Prints one JSON object.

  python benchmarks/bench_vs_auto.py [--steps 20] [--layers 4] [--d_model 128]
"""
import argparse
import json
import os
import time

if "XLA_FLAGS" not in os.environ:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models.gpt import GPTConfig, gpt  # noqa: E402
from zerojax.train.optim import make_optimizer  # noqa: E402


def fsdp_spec(shape, n):
  """Shard the largest dimension divisible by n (MaxText's FSDP rule of thumb); else replicate."""
  dims = sorted(range(len(shape)), key=lambda i: -shape[i])
  for i in dims:
    if shape[i] % n == 0:
      return P(*[("node", "gpu") if j == i else None for j in range(len(shape))])
  return P()


def auto_step(model, opt, mesh, accum):
  def loss(p, b):
    return jnp.mean(jax.vmap(lambda t: model.loss(p, t))(b)) if accum > 1 else model.loss(p, b[0])

  def step(params, opt_state, batch):
    def micro(acc, tokens):
      l, g = jax.value_and_grad(model.loss)(params, tokens)
      return jax.tree.map(jnp.add, acc, g), l
    zeros = jax.tree.map(jnp.zeros_like, params)
    g, losses = jax.lax.scan(micro, zeros, batch)
    g = jax.tree.map(lambda x: x / accum, g)
    u, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, u), opt_state, jnp.mean(losses)

  params = jax.jit(model.init)(jax.random.key(0))
  shard = lambda x: NamedSharding(mesh, fsdp_spec(x.shape, mesh.size))
  p_sh = jax.tree.map(shard, params)
  params = jax.device_put(params, p_sh)
  opt_state = jax.jit(opt.init)(params)
  o_sh = jax.tree.map(shard, opt_state)
  opt_state = jax.device_put(opt_state, o_sh)
  b_sh = NamedSharding(mesh, P(None, ("node", "gpu")))
  jitted = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh), out_shardings=(p_sh, o_sh, None),
                   donate_argnums=(0, 1))
  return jitted, params, opt_state, b_sh


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--d_model", type=int, default=128)
  ap.add_argument("--seq_len", type=int, default=128)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--accum", type=int, default=1)
  ap.add_argument("--param_dtype", default="float32")
  args = ap.parse_args()
  cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, num_layers=args.layers)
  model, opt, mesh = gpt(cfg), make_optimizer(total_steps=1000), zerojax.make_mesh(2, 4)
  ex = zerojax.Executor(model, opt, zerojax.zero3(param_dtype=args.param_dtype), mesh, accum_steps=args.accum,
                        pad_multiple=256)
  state, zstep = ex.init(jax.random.key(0)), ex.step_fn()
  astep, params, opt_state, b_sh = auto_step(model, opt, mesh, args.accum)
  rng = np.random.default_rng(0)
  times = {"zero3": [], "auto": []}
  for i in range(args.steps + 2):
    b = rng.integers(0, 256, (args.accum, args.batch, args.seq_len + 1)).astype(np.int32)
    zb, ab = jax.device_put(b, ex.batch_sharding), jax.device_put(b, b_sh)
    t = time.perf_counter()
    state, m = zstep(state, zb)
    jax.block_until_ready(m)
    tz = time.perf_counter() - t
    t = time.perf_counter()
    params, opt_state, loss = astep(params, opt_state, ab)
    jax.block_until_ready(loss)
    ta = time.perf_counter() - t
    if i >= 2:  # warmup: compilation
      times["zero3"].append(tz)
      times["auto"].append(ta)
  med = {k: float(np.median(v)) for k, v in times.items()}
  print(json.dumps({
      "benchmark": "zero3_vs_auto_sharding", "devices": mesh.size, "mesh": dict(mesh.shape),
      "backend": jax.default_backend(), "jax": jax.__version__, "model": vars(args),
      "median_step_s": med, "ratio_zero3_over_auto": med["zero3"] / med["auto"],
      "last_loss": {"zero3": float(m.loss), "auto": float(loss)}}))


if __name__ == "__main__":
  main()
