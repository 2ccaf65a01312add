"""Step time of several plans side by side in one process (no network: the compute cost of each plan).

Each plan trains the default model on the same batches; steps are timed round-robin so machine noise
hits all plans alike. On one host the collectives are memory copies, so this isolates the extra work of
quantization (qwZ, qgZ) from the bytes it saves on a slow link (see benchmarks/cluster.py for that).

  python benchmarks/bench_plans.py [--plans zero3,zeropp,qwz,hpz,qgz] [--steps 10]
"""
import argparse
import json
import os

if "XLA_FLAGS" not in os.environ:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zerojax  # noqa: E402
from zerojax import plan as plans  # noqa: E402
from zerojax.models.gpt import GPTConfig, gpt  # noqa: E402
from zerojax.train.optim import make_optimizer  # noqa: E402
from common import interleaved  # noqa: E402  (benchmarks/, this script's directory)

VARIANTS = {
    "zero3": lambda **kw: plans.zero3(**kw),
    "zeropp": lambda **kw: plans.zeropp(**kw),
    "qwz": lambda **kw: plans.zeropp(secondary_axes=None, grad_bits=None, **kw),
    "hpz": lambda **kw: plans.zeropp(weight_bits=None, grad_bits=None, **kw),
    "qgz": lambda **kw: plans.zeropp(weight_bits=None, secondary_axes=None, **kw),
    "mics": lambda **kw: plans.mics(**kw),
    "dp": lambda **kw: plans.dp(**kw),
}


def time_steps(runs: dict, steps: int, batch: int, seq_len: int) -> None:
  """Interleaved step times (`common.interleaved`, one step per repetition, always in the same order): each
  `runs[name] = [executor, state, step_fn, times]` takes one step on the same random byte batch in turn
  (a new batch each repetition, its device_put timed with the step); step 0 compiles and is not timed.
  Appends to `times` in place."""
  rng = np.random.default_rng(0)
  current = []

  def draw(i):
    current[:] = [rng.integers(0, 256, (1, batch, seq_len + 1)).astype(np.int32)]

  def stepper(r):
    def step(i):
      r[1], m = r[2](r[1], jax.device_put(current[0], r[0].batch_sharding))
      jax.block_until_ready(m)
    return step
  times = interleaved({name: stepper(r) for name, r in runs.items()}, steps, warmup=1, order="fixed", before=draw)
  for name, r in runs.items():
    r[3].extend(times[name])


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--plans", default="zero3,zeropp,qwz,hpz,qgz")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--d_model", type=int, default=128)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--backend", default=None, help="quantization kernel backend")
  args = ap.parse_args()
  cfg = GPTConfig(d_model=args.d_model, num_layers=args.layers)
  mesh = zerojax.make_mesh(2, 4)
  runs = {}
  for name in args.plans.split(","):
    ex = zerojax.Executor(gpt(cfg), make_optimizer(), VARIANTS[name](param_dtype="float32",
                          kernel_backend=args.backend, pad_multiple=256), mesh)
    runs[name] = [ex, ex.init(jax.random.key(0)), ex.step_fn(), []]
  time_steps(runs, args.steps, args.batch, cfg.seq_len)
  med = {n: float(np.median(r[3])) for n, r in runs.items()}
  base = med.get("zero3")
  print(json.dumps({"benchmark": "plans_step_time_one_host", "mesh": dict(mesh.shape), "model": vars(args),
                    "median_step_s": med, "relative_to_zero3": {n: t / base for n, t in med.items()} if base else None}))


if __name__ == "__main__":
  main()
