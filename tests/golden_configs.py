"""The shipped configs as the golden values run them (tests/test_golden.py), shared with
benchmarks/hlo_fingerprint.py: a tiny model, three steps of two micro-batches, a fixed link profile; and
the configs whose golden values also cover the prefetch call order (`PREFETCH`)."""
from __future__ import annotations

import dataclasses
import importlib
import pathlib

import gin

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.gin") if p.stem != "base")  # base: no plan
# The prefetch call order (`zerojax.engine.prefetch.PREFETCH`: the GPU default for sharded parameters, a plan's
# `prefetch=True` elsewhere) wherever it orders collectives: every config whose units gather parameters or
# reduce gradients per unit. Not dp / zero1 (no collective inside the layer loops: the order changes
# nothing but the loops' shape) nor auto (the planner builds its own plan). Stored in tests/golden/prefetch/.
PREFETCH = [c for c in CONFIGS if c not in ("auto", "dp", "zero1")]
OVERRIDES = (
    "model_config.seq_len = 16", "model_config.d_model = 32", "model_config.num_heads = 2",
    "model_config.num_layers = 2", "train.steps = 3", "train.batch_size = 16", "train.accum_steps = 2",
    "radius.dense_steps = 1", "radius.period = 2",
    f"auto.profile = '{GOLDEN / 'profile_2x4.json'}'",  # a fixed 2 x 4 link profile: a fixed choice
    "auto.trials = 0",  # trials time plans on this machine: the choice would follow its load
)


def plans() -> dict:
  """`{config: the plan value train.py's gin builds for it}` of every shipped config (`auto`'s is `Auto`),
  each parsed alone as `train.py` parses it; gin is cleared after."""
  from zerojax.train import config as config_lib
  importlib.import_module("zerojax.train.trainer")  # registers the configurables train.py's configs bind
  out = {}
  for name in CONFIGS:
    gin.clear_config()
    config_lib.parse([str(ROOT / "configs" / f"{name}.gin")], [])
    out[name] = gin.get_bindings("train")["plan"]
  gin.clear_config()
  return out


def build(config: str, prefetch: bool = False):
  """`configs/<config>.gin` with `OVERRIDES` parsed as `train.py` parses it (gin stays parsed): the
  executor `train` builds and `train`'s arguments. `prefetch=True`: the config's plan with
  `prefetch=True` (the call order `zerojax.engine.prefetch.PREFETCH`, the GPU default) instead of the CPU's
  default (one call per layer); not for `auto`, whose plan the planner picks."""
  from zerojax.cli.account import build_executor, gin_train_args
  from zerojax.train import trainer
  gin.clear_config()
  args = gin_train_args([str(ROOT / "configs" / f"{config}.gin")], list(OVERRIDES))
  if prefetch:
    args["plan"] = dataclasses.replace(args["plan"], prefetch=True)
  ex = build_executor(args, trainer.default_num_nodes())[0].executor
  return ex, args
