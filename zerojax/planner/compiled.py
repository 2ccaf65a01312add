"""A plan's per-device memory read from its compiled train step, for GPUs this machine does not have.

AMSP's memory model (§IV-D) counts model states, b Φ/s_p + r Φ/s_g + (4 + o) Φ/s_os, and leaves the
activations and temporaries to an estimate (`planner.cost.model_state_bytes`). Here the planner's
point is built as the executor runs it (`space.Point.plan`) for a model (e.g. the GPT of a given shape,
`zerojax.models.gpt.gpt(cfg)`: only its shapes are traced) on `nodes` x `gpus` compile-only GPUs of a
target kind (`zerojax.gpu_aot`: "a100" is also AMSP's A800), one train step is compiled for abstract
inputs (nothing runs, no weights exist; a point with offload as a GPU's jax types its host-memory inputs,
`aot.compile_as_on_gpu`) and XLA's per-device figures are read: arguments (the train
state and the batch), outputs, aliased (the state donated back), temporaries and the peak.
`check_rows` puts the compiled peak in place of the formula's "fits" for the top rows of a ranking
(`planner.rank`), so the choice (`planner.choose`) rests on the program that would run.

Needs jax's CUDA plugin (`pip install -e '.[gpu-aot]'`); without it `gpu_aot.PluginMissing` is raised
with that command.

References:
  AMSP: Chen et al. 2023, §IV-D (memory model), §V-B (the solver's memory constraint).
"""
from __future__ import annotations

import optax

from zerojax import gpu_aot, mesh as mesh_lib
from zerojax.executor import aot
from zerojax.executor import Executor
from zerojax.engine.model import Model
from zerojax.executor.memory import memory_report
from zerojax.planner.solve import point_of
from zerojax.planner.space import Point

PAD_MULTIPLE = 256  # train.py's default leaf padding


def executor(point: Point, model: Model, nodes: int, gpus: int, target: str, *, accum: int = 1,
             optimizer: optax.GradientTransformation | None = None, **plan_fields) -> Executor:
  """The executor of `point` for `model` on `nodes` x `gpus` compile-only `target` GPUs;
  `plan_fields` set the plan's other fields (e.g. `remat`, `reduce_dtype`, `compute_dtype`); the
  optimizer is AdamW (fp32 moments) unless given."""
  mesh = mesh_lib.make_mesh(nodes, devices=gpu_aot.devices(target, nodes, gpus))  # checks the plugin
  plan = point.plan(nodes, gpus, **{"pad_multiple": PAD_MULTIPLE, **plan_fields})
  return Executor(model, optimizer or optax.adamw(1e-4), plan, mesh, accum_steps=accum)


def memory(point: Point, model: Model, seq_len: int, nodes: int, gpus: int, target: str, *, accum: int = 1,
           batch_per_device: int = 1, optimizer: optax.GradientTransformation | None = None,
           **plan_fields) -> dict:
  """Per-device bytes of `point`'s compiled train step: argument, output, alias, temp, peak
  (`gpu_aot.memory`), the model states the executor lays out (`model_states`, `zerojax.executor.memory`), the
  plan's name and the seconds to compile. A step is `accum` micro-batches of `batch_per_device`
  sequences of `seq_len` tokens per device."""
  if accum < 1 or batch_per_device < 1:
    raise ValueError(f"accum={accum}, batch_per_device={batch_per_device}: use positive micro-batch counts")
  ex = executor(point, model, nodes, gpus, target, accum=accum, optimizer=optimizer, **plan_fields)
  compiled, seconds = aot.compile_step(ex, (accum, batch_per_device * ex.world, seq_len + 1))
  out = gpu_aot.memory(compiled)
  out.update(plan=ex.plan.name, remat=ex.components.remat, prefetch=ex.components.prefetch,
             model_states=memory_report(ex)["expected"]["total"], compile_s=seconds)
  return out


def check_rows(rows: list[dict], memory_of, cap_bytes: float | None, top: int = 3) -> list[dict]:
  """`rows` (a `planner.rank` table, fastest first) with the memory of the first `top` rows the formula
  lets fit compiled: `memory_of(point)` gives `memory`'s dict for a point; each of those rows gets
  `compiled` (that dict) and `fits` from the compiled peak (`fits_by = "compiled"`); the others keep the
  formula's `fits` (`fits_by = "formula"`: a row it rules out is not compiled). Returns new rows;
  `rows` is not changed. `planner.choose` on the result takes the fastest row that fits by the compiled
  peak among the compiled ones, else the next the formula lets fit."""
  if top < 1:
    raise ValueError(f"top={top}: compile at least one row (e.g. top=3)")
  out, done = [], 0
  for row in rows:
    row = dict(row, fits_by="formula")
    if row["fits"] and done < top:
      mem = memory_of(point_of(row))
      row.update(compiled=mem, fits=cap_bytes is None or mem["peak"] <= cap_bytes, fits_by="compiled")
      done += 1
    out.append(row)
  return out
