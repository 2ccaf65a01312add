"""Train a model with a zerojax plan: `python train.py --gin_file=configs/zero3.gin --workdir=DIR`.

The command lives in `zerojax.cli.train` (`python -m zerojax.cli.train --help`).
"""
import sys

from zerojax.cli.train import main

if __name__ == "__main__":
  sys.exit(main())
