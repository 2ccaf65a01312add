"""Writes a trained model out: `python -m zerojax.cli.export --workdir W [--step N] --to hf --output DIR`.

`--to hf` (a Llama-family run: `train.architecture='llama'` or `train.init_from`) writes a Hugging Face
folder that `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads: `config.json`, the weights as
`model-0000i-of-0000n.safetensors` (`--dtype`, bfloat16 by default) with `model.safetensors.index.json`, and
the run's tokenizer file (`train.tokenizer`) where it had one. The folder is written under a temporary
name and renamed when complete. `--to npz` writes every parameter of any model as one fp32 `.npz`
(`zerojax.train.export`). The checkpoint (default the latest) is restored onto this process's devices under
ZeRO-3 and gathered leaf by leaf to this host: run it as one process, on a host that holds the model once.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from zerojax.cli import json_command

PROG = "zerojax.cli.export"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True, help="the workdir of a train.py run")
  ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
  ap.add_argument("--to", choices=("hf", "npz"), default="hf", help="a Hugging Face folder, or an .npz file")
  ap.add_argument("--output", required=True, help="the folder (hf) or file (npz) to write; must not exist")
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the tensors' dtype (hf)")
  ap.add_argument("--devices", type=int, default=None, help="CPU devices to restore onto (default as train.py)")
  return json_command.run(PROG, export, ap.parse_args(argv))


def export(args) -> dict:
  if os.path.exists(args.output) and (not os.path.isdir(args.output) or os.listdir(args.output)):
    raise ValueError(f"--output {args.output} exists; pass a new path (nothing is overwritten)")
  from zerojax.cli.train import set_device_count
  set_device_count(args.devices)
  import jax
  import numpy as np
  from zerojax.models import llama_hf
  from zerojax.train import export as export_lib, saved_run
  if jax.process_count() > 1:
    raise ValueError("export runs as one process; start it without a cluster's environment")
  run = saved_run.from_workdir(args.workdir, args.step)
  if args.to == "npz":
    export_lib.export_params(run.executor, run.state, args.output)
    return {"output": os.path.abspath(args.output), "step": run.step, "to": "npz"}
  spec = run.spec
  if spec.architecture != "llama":
    raise ValueError(f"--to hf writes the Llama family; {args.workdir} trained a {spec.architecture} "
                     "(use --to npz)")
  params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), run.executor.logical_params(run.state))
  model_type = spec.model_type or ("qwen2" if spec.config.qkv_bias else "llama")
  llama_hf.write_hf_dir(args.output, params, spec.config, model_type, dtype=args.dtype)
  copied = []
  if run.tokenizer and os.path.exists(run.tokenizer):
    name = "tokenizer.json" if run.tokenizer.endswith(".json") else "tokenizer.model"
    shutil.copyfile(run.tokenizer, os.path.join(args.output, name))
    copied.append(name)
  return {"output": os.path.abspath(args.output), "step": run.step, "to": "hf", "model_type": model_type,
          "dtype": args.dtype, "tokenizer_files": copied}


if __name__ == "__main__":
  sys.exit(main())
