"""Commands: `zerojax.cli.train` (behind `train.py`) and `zerojax.cli.account` (a step's communication)."""
