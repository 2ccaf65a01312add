"""The mean next-token loss of a model on a token file: `python -m zerojax.cli.evaluate`.

  python -m zerojax.cli.evaluate --workdir W [--step N] --data FILE --seq_len L --batch_size B
  python -m zerojax.cli.evaluate --init_from HF_FOLDER --data FILE --seq_len L --batch_size B

Scores every window `tokens[i*L : i*L + L + 1]` (i = 0, 1, ... while it fits) of `--data` (a token file or
folder, `zerojax.train.data`): the inputs are its first L ids, the targets its last L. Prints one JSON line,
`{"loss": mean over every target, "tokens": targets scored, "windows": ...}`: the number a user gets from
transformers' loss on the same windows. Works for the GPT and the Llama family; the model runs under
ZeRO-3 over this process's devices.
"""
from __future__ import annotations

import argparse
import sys

from zerojax.cli import json_command

PROG = "zerojax.cli.evaluate"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="the workdir of a train.py run (its latest checkpoint, or --step)")
  src.add_argument("--init_from", help="a Hugging Face Llama-family folder (config.json, *.safetensors)")
  ap.add_argument("--step", type=int, default=None)
  ap.add_argument("--data", required=True, help="a token file (.bin, .npy) or a folder of them")
  ap.add_argument("--seq_len", type=int, required=True, help="L: targets per window")
  ap.add_argument("--batch_size", type=int, default=8, help="windows per batch (a multiple of the devices)")
  ap.add_argument("--data_dtype", default=None, help="dtype of a .bin without a sidecar (uint16, uint32)")
  ap.add_argument("--devices", type=int, default=None, help="CPU devices (default as train.py)")
  return json_command.run(PROG, evaluate, ap.parse_args(argv))


def evaluate(args) -> dict:
  if args.seq_len < 1 or args.batch_size < 1:
    raise ValueError(f"--seq_len={args.seq_len} and --batch_size={args.batch_size} must be positive")
  from zerojax.cli.train import set_device_count
  set_device_count(args.devices)
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from zerojax.train import data as data_lib, saved_run
  run = (saved_run.from_workdir(args.workdir, args.step) if args.workdir
         else saved_run.from_hf(args.init_from, args.seq_len))
  cfg, ex = run.spec.config, run.executor
  if run.spec.architecture == "gpt" and args.seq_len > cfg.seq_len:
    raise ValueError(f"--seq_len={args.seq_len} is longer than the GPT's learned positions ({cfg.seq_len})")
  devices = ex.mesh.size
  if args.batch_size % devices:
    raise ValueError(f"--batch_size={args.batch_size} is not a multiple of the {devices} devices; use "
                     f"{max(devices, args.batch_size // devices * devices)}")
  parts, kind, _, where = data_lib.sources(args.data, args.data_dtype)
  if kind != "tokens":
    raise ValueError(f"--data {args.data} is text; tokenize it first with python -m zerojax.cli.tokenize")
  corpus, L = data_lib.Corpus.of(parts), args.seq_len
  n = (len(corpus) - 1) // L
  if n < 1:
    raise ValueError(f"--data {args.data} has {len(corpus)} ids, fewer than one window of {L + 1}")
  window = lambda i: corpus.read(i * L, L + 1)
  eval_fn, sharding = ex.eval_fn(), NamedSharding(ex.mesh, P(ex.batch_axes))
  loss_of = lambda out: float(out[0] if ex.model.has_aux else out)
  params, mutable = run.state.params, run.state.mutable
  total = 0.0
  for start in range(0, n - n % args.batch_size, args.batch_size):  # full batches: each a mean of B windows
    rows = np.stack([window(i) for i in range(start, start + args.batch_size)])
    _check(rows, cfg.vocab_size, args.data)
    total += loss_of(eval_fn(params, jax.device_put(rows, sharding), mutable)) * args.batch_size
  for i in range(n - n % args.batch_size, n):  # the rest one by one, each copied to every device
    rows = np.repeat(window(i)[None], devices, axis=0)
    _check(rows, cfg.vocab_size, args.data)
    total += loss_of(eval_fn(params, jax.device_put(rows, sharding), mutable))
  return {"loss": total / n, "tokens": n * L, "windows": n, "seq_len": L, "data": where,
          "model": args.workdir or args.init_from, "step": run.step}


def _check(rows, vocab: int, path: str) -> None:
  if int(rows.max()) >= vocab:
    raise ValueError(f"--data {path} holds id {int(rows.max())}, not below the model's vocab_size={vocab}; it was "
                     "tokenized with another tokenizer")


if __name__ == "__main__":
  sys.exit(main())
