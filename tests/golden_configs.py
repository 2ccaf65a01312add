"""The shipped configs as the golden values run them (tests/test_golden.py), shared with
benchmarks/hlo_fingerprint.py: a tiny model, three steps of two micro-batches, a fixed link profile."""
from __future__ import annotations

import pathlib

import gin

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.gin") if p.stem != "base")  # base: no plan
OVERRIDES = (
    "model_config.seq_len = 16", "model_config.d_model = 32", "model_config.num_heads = 2",
    "model_config.num_layers = 2", "train.steps = 3", "train.batch_size = 16", "train.accum_steps = 2",
    "radius.dense_steps = 1", "radius.period = 2",
    f"auto.profile = '{GOLDEN / 'profile_2x4.json'}'",  # a fixed 2 x 4 link profile: a fixed choice
    "auto.trials = 0",  # trials time plans on this machine: the choice would follow its load
)


def build(config: str):
  """`configs/<config>.gin` with `OVERRIDES` parsed as `train.py` parses it (gin stays parsed): the
  executor `train` builds and `train`'s arguments."""
  from zerojax.cli.account import gin_executor
  from zerojax.train import trainer
  gin.clear_config()
  ex, args, _ = gin_executor([str(ROOT / "configs" / f"{config}.gin")], list(OVERRIDES), trainer.default_num_nodes())
  return ex, args
