"""How long the training loop is blocked per checkpoint: asynchronous save against a synchronous one.

Trains the default model of `configs/base.gin` (4-layer GPT, d_model 128, adamw) under ZeRO-3 on 2 nodes x
4 devices, and saves a checkpoint every `--every` steps, `--saves` times with `asynchronous=True` and
`--saves` times with `asynchronous=False`, alternately so machine noise hits both. Blocked time is the
wall time of `Checkpointer.save` (the logical copy, the device-to-host transfer and, when synchronous,
the writes); the asynchronous writes overlap the following steps, whose time is also reported. One
warm-up save of each kind (compilation of the conversion, folder creation) is not counted. Prints one
JSON object.

  python benchmarks/bench_checkpoint.py [--saves 5] [--every 3] [--dir /tmp/zerojax_bench_ckpt]
"""
import argparse
import json
import os
import shutil
import tempfile
import time

if "XLA_FLAGS" not in os.environ:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zerojax  # noqa: E402
from zerojax.train import checkpoint  # noqa: E402
from zerojax.models.gpt import GPTConfig, gpt  # noqa: E402
from zerojax.train.optim import make_optimizer  # noqa: E402


def folder_bytes(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--saves", type=int, default=5, help="timed saves of each kind")
  ap.add_argument("--every", type=int, default=3, help="train steps between saves")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--dir", default=None, help="where to write (default a fresh temporary folder)")
  args = ap.parse_args()
  cfg = GPTConfig()  # the defaults of configs/base.gin
  mesh = zerojax.make_mesh(2, 4)
  ex = zerojax.Executor(gpt(cfg), make_optimizer(total_steps=1000), zerojax.zero3(param_dtype="float32", pad_multiple=256),
                        mesh)
  state, step = ex.init(jax.random.key(0)), ex.step_fn()
  rng = np.random.default_rng(0)
  batch = lambda: jax.device_put(rng.integers(0, 256, (1, args.batch, cfg.seq_len + 1)).astype(np.int32),
                                 ex.batch_sharding)
  root = args.dir or tempfile.mkdtemp(prefix="zerojax_bench_ckpt_")
  shutil.rmtree(root, ignore_errors=True)
  ckpts = {"async": checkpoint.Checkpointer(os.path.join(root, "async"), max_to_keep=2, asynchronous=True),
           "sync": checkpoint.Checkpointer(os.path.join(root, "sync"), max_to_keep=2, asynchronous=False)}
  blocked = {k: [] for k in ckpts}
  steps_after = {k: [] for k in ckpts}  # step times while (async) writes run in the background
  plain_steps = []

  def train(n, into):
    nonlocal state
    for _ in range(n):
      b = batch()
      t = time.perf_counter()
      state, m = step(state, b)
      jax.block_until_ready(m)
      into.append(time.perf_counter() - t)

  train(2, [])  # compilation
  for i in range(args.saves + 1):
    for kind, c in ckpts.items():
      train(args.every, plain_steps if kind == "sync" else [])
      jax.block_until_ready(state)
      t = time.perf_counter()
      c.save(ex, state)
      dt = time.perf_counter() - t
      after = []
      train(args.every, after)
      c.wait()
      if i > 0:  # the first save of each kind compiles the conversion and creates the folder
        blocked[kind].append(dt)
        steps_after[kind].append(float(np.median(after)))
  for c in ckpts.values():
    c.close()
  size = folder_bytes(os.path.join(root, "sync", str(ckpts["sync"].latest_step())))
  med = {k: float(np.median(v)) for k, v in blocked.items()}
  print(json.dumps({
      "benchmark": "checkpoint_blocking_time", "backend": jax.default_backend(), "jax": jax.__version__,
      "devices": mesh.size, "mesh": dict(mesh.shape), "plan": "zero3",
      "model": {"d_model": cfg.d_model, "num_layers": cfg.num_layers, "seq_len": cfg.seq_len,
                "params": sum(l.size * (l.layers or 1) for l in ex.layout.leaves)},
      "checkpoint_bytes": size, "saves_timed": args.saves,
      "blocked_s_median": med, "blocked_s_all": blocked, "speedup_sync_over_async": med["sync"] / med["async"],
      "step_s_median": float(np.median(plain_steps)),
      "step_s_median_right_after_save": {k: float(np.median(v)) for k, v in steps_after.items()},
      "folder": root}))
  if args.dir is None:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
