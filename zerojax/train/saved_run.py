"""A trained model back on this process's devices: a workdir's checkpoint, or a Hugging Face folder.

`cli.export` and `cli.evaluate` read a run through here: the model the run recorded (`workdir/model.json`,
`zerojax.train.model_spec`), its optimizer from the run's `config.gin` (a checkpoint holds the optimizer's
state, so restoring needs its structure), under ZeRO-3 over the local devices (a checkpoint restores onto
any plan and mesh: `zerojax.train.state_spec`).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import gin
import jax

from zerojax.executor import Executor
from zerojax.mesh import make_mesh
from zerojax.plan import zero3
from zerojax.train import checkpoint as checkpoint_lib, config as config_lib, model_spec as spec_lib
from zerojax.train import trainer  # noqa: F401  (registers train, the plans and the models with gin)
from zerojax.train.optim import make_optimizer


class Loaded(NamedTuple):
  executor: Executor
  state: object          # the TrainState
  spec: spec_lib.ModelSpec
  tokenizer: str | None  # the run's tokenizer file, where it had one
  step: int | None       # the checkpoint's step (None: a Hugging Face folder)


def executor(spec: spec_lib.ModelSpec, steps: int = 1) -> Executor:
  """ZeRO-3 of `spec`'s model over this process's devices (one node), with gin's optimizer."""
  return Executor(spec.build(), make_optimizer(total_steps=steps), zero3(), make_mesh(1, devices=jax.local_devices()))


def from_workdir(workdir: str, step: int | None = None) -> Loaded:
  """The checkpoint of `step` (default the latest) of a `train.py` workdir.

  Raises:
    ValueError: not a workdir of a run that recorded its model (`model.json`), or no such checkpoint.
  """
  spec, tokenizer = spec_lib.read(workdir)
  config = os.path.join(workdir, "config.gin")
  gin.clear_config()
  config_lib.parse([config], [])
  steps = dict(gin.get_bindings("train")).get("steps", 200)
  ex = executor(spec, steps)
  with checkpoint_lib.Checkpointer(checkpoint_lib.find_checkpoints(workdir), read_only=True) as ckpt:
    state, meta = ckpt.restore(ex, step)
  return Loaded(ex, state, spec, tokenizer, int(meta.get("step", step or 0)))


def from_hf(folder: str, seq_len: int) -> Loaded:
  """The weights of a Hugging Face Llama-family folder (`config.json`, `*.safetensors`)."""
  gin.clear_config()
  gin.parse_config(f"llama_config.seq_len = {seq_len}")
  spec = spec_lib.model_spec("llama", folder)
  ex = executor(spec)
  return Loaded(ex, ex.init_from_params(spec_lib.initial_params(spec)), spec, None, None)
