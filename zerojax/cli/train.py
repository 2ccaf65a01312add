"""Train the GPT model with a zerojax plan.

  python train.py --gin_file=configs/zero3.gin --gin_param='train.steps=200' --workdir=DIR

Resumes from the latest checkpoint in DIR/checkpoints; --restore_from=OTHER starts from another run's.

Multi-host: run the same command on every host with --coordinator=HOST:PORT --num_processes=N
--process_id=I (detected automatically under SLURM / Open MPI when omitted).
"""
import argparse
import json
import os
import sys

import gin

# The repository root: `configs/` and includes such as `configs/base.gin` resolve against it too.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
  ap.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. train.steps=100")
  ap.add_argument("--workdir", required=True, help="output folder (metrics.jsonl, summary.json)")
  ap.add_argument("--data", default=None, help="text file or folder (default: Python stdlib sources)")
  ap.add_argument("--restore_from", default=None,
                  help="workdir or checkpoint folder to start from when --workdir has no checkpoint yet "
                       "(any mesh, process count or plan; same model and optimizer)")
  ap.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (multi-host)")
  ap.add_argument("--num_processes", type=int, default=None)
  ap.add_argument("--process_id", type=int, default=None)
  ap.add_argument("--devices", type=int, default=None,
                  help="simulated CPU devices in this process (default 8 on a CPU-only machine)")
  args = ap.parse_args(argv)
  if args.data is not None and not os.path.exists(args.data):
    ap.error(f"--data path {args.data!r} does not exist; pass a text file or a folder of text files")
  if args.restore_from is not None and not os.path.isdir(args.restore_from):
    ap.error(f"--restore_from folder {args.restore_from!r} does not exist; pass the workdir of a run that "
             "saved checkpoints, or its checkpoints/ folder")
  for f in args.gin_file:
    if not os.path.exists(f):
      ap.error(f"--gin_file {f!r} does not exist (configs are in configs/)")

  import jax
  if args.devices or not _has_accelerator():
    jax.config.update("jax_num_cpu_devices", args.devices or 8)
  from zerojax import mesh as mesh_lib
  from zerojax.train import trainer

  launcher = any(v in os.environ for v in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
  if args.coordinator or launcher:
    mesh_lib.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
  gin.add_config_file_search_path(REPO_ROOT)
  gin.parse_config_files_and_bindings(args.gin_file, args.gin_param)
  summary = trainer.train(args.workdir, args.data, restore_from=args.restore_from)
  if jax.process_index() == 0:
    print(json.dumps(summary))
  return 0


def _has_accelerator() -> bool:
  import importlib.util
  return os.environ.get("JAX_PLATFORMS", "") not in ("", "cpu") or importlib.util.find_spec("jax_cuda13_plugin") is not None \
      or importlib.util.find_spec("jax_cuda12_plugin") is not None


if __name__ == "__main__":
  sys.exit(main())
