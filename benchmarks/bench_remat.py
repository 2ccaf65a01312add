"""Step time and compiled memory of each plan under each remat mode (`Schedule.remat`), in one process.

Every (plan, remat) pair trains the same GPT on the same batches on 8 simulated CPU devices (a 2 x 4
mesh). Each repetition runs `--steps` steps of every pair in turn (the order rotates between
repetitions, so machine noise hits all pairs); a pair's step time is the median of its repetitions'
medians, with their min and max. Memory is the compiled step's (`memory_analysis`): temporaries (where
saved activations live) and the whole footprint. Prints one JSON object.

  python benchmarks/bench_remat.py [--plans dp,zero2,zero3,zeropp] [--modes full,dots,none] [--reps 3]
      [--steps 5] [--layers 4] [--d_model 128] [--seq_len 128] [--batch 32]
"""
import argparse
import json
import os

if "XLA_FLAGS" not in os.environ:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import numpy as np

import zerojax
from zerojax import gpu_aot
from zerojax.models.gpt import GPTConfig, gpt
from zerojax.train.optim import make_optimizer
from common import interleaved, spread  # benchmarks/, this script's directory


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--plans", default="dp,zero2,zero3,zeropp")
  ap.add_argument("--modes", default="full,dots,none")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--steps", type=int, default=5, help="timed steps per pair and repetition")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--d_model", type=int, default=128)
  ap.add_argument("--seq_len", type=int, default=128)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--param_dtype", default="bfloat16")
  ap.add_argument("--compute_dtype", default="float32")
  args = ap.parse_args(argv)
  if args.reps < 3:
    ap.error(f"--reps {args.reps}: use at least 3 repetitions")
  cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, num_layers=args.layers)
  model, mesh = gpt(cfg), zerojax.make_mesh(2, 4)
  params = jax.jit(model.init)(jax.random.key(0))
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 256, (1, args.batch, args.seq_len + 1)).astype(np.int32) for _ in range(args.steps)]
  pairs = {}
  for name in args.plans.split(","):
    for mode in args.modes.split(","):
      plan = zerojax.PLANS[name](param_dtype=args.param_dtype, compute_dtype=args.compute_dtype, remat=mode,
                                 pad_multiple=256)
      ex = zerojax.Executor(model, make_optimizer(total_steps=1000), plan, mesh)
      state = ex.init_from_params(params)
      lowered = ex.step_fn().lower(state, jax.device_put(batches[0], ex.batch_sharding))
      mem = gpu_aot.memory(lowered.compile())
      step = ex.step_fn()
      state, m = step(state, batches[0])  # compile, warm up
      jax.block_until_ready(m)
      pairs[(name, mode)] = {"step": step, "state": state, "times": [], "first_loss": float(m.loss),
                             "temp_bytes": mem["temp"],
                             "total_bytes": mem["temp"] + mem["argument"] + mem["output"] - mem["alias"]}

  def stepper(p):
    def step(i):
      p["state"], m = p["step"](p["state"], batches[i])
      jax.block_until_ready(m)
    return step
  times = interleaved({key: stepper(p) for key, p in pairs.items()}, args.reps, steps=args.steps, order="rotate")
  for key, p in pairs.items():
    p["times"] = times[key]
  rows = [{"plan": name, "remat": mode, "step_s": spread(p["times"]), "temp_bytes": p["temp_bytes"],
           "total_bytes": p["total_bytes"], "first_loss": p["first_loss"]} for (name, mode), p in pairs.items()]
  print(json.dumps({"benchmark": "remat", "devices": mesh.size, "mesh": {k: int(v) for k, v in mesh.shape.items()},
                    "backend": jax.default_backend(), "jax": jax.__version__, "config": vars(args), "rows": rows},
                   indent=1))


if __name__ == "__main__":
  main()
