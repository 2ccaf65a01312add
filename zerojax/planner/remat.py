"""Remat chosen by memory: `Schedule.remat="auto"` (the default) becomes the cheapest remat mode whose
compiled train step fits the device.

The modes, least recompute first: "none" (every residual kept: no forward runs twice), "dots" (the weight
matmuls' outputs and the attention's output kept, the rest recomputed), "full" (only each unit's inputs
kept, its whole forward recomputed), "offloaded" ("full" with the kept inputs in host memory: the same
recompute plus each layer's input over the host link each way; taken only where "full" does not fit).
`choose` compiles the step of each in that order for the batch the run trains on (`aot.compile_step`:
lowered and compiled, nothing runs; with offloaded state on compile-only GPUs, as a GPU's jax types its
host-memory inputs) and keeps the first whose device peak (`gpu_aot.memory`'s `device_peak`: state, batch,
temporaries) is within the device's memory; where none fits, the one of smallest peak. Its report (`rows`,
`why`) is what `train.py` logs and writes to `summary.json`, and what `python -m zerojax.cli.compile`
prints.

The device's memory: on a GPU the allocator's limit (`memory_stats()["bytes_limit"]`: jax preallocates
`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 by default, of the card); on a compile-only GPU the target's
`device_memory_size` times that fraction (`gpu_aot.device_memory`). A platform that reports neither (a
CPU) has no bound to fit, and "auto" keeps the rule that needs no compile (`Plan.remat_mode`: "none"
without sharded parameters, else "full").

A run with "auto" compiles up to four candidate steps once before it trains (seconds for the built-in
GPT, ~10-30 s each for a 1B model on a GPU); the first that fits ends the search.

References:
  Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (recompute traded for memory).
  ZeRO: Rajbhandari et al. 2020, §6.1 (activation checkpointing alongside partitioned parameters).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import optax
from jax.sharding import Mesh

from zerojax import gpu_aot
from zerojax.executor import aot
from zerojax.executor import Executor
from zerojax.engine.model import Model
from zerojax.plan import Plan

ORDER = ("none", "dots", "full", "offloaded")  # least recompute (and host traffic) first


def choose(model: Model, optimizer: optax.GradientTransformation, plan: Plan, mesh: Mesh, batch_shape: tuple,
           *, accum_steps: int = 1, capacity: int | None = None,
           peak_of: Callable[[Executor, tuple], int] | None = None) -> tuple[Plan, dict]:
  """`(plan with its remat mode set, report)`: a plan whose remat is "auto" (or None) gets the first mode
  of `ORDER` whose compiled device peak for `batch_shape` (`[accum, global_batch, seq + 1]` tokens) is at
  most `capacity` bytes (default: the device's, `gpu_aot.device_memory`); another plan, or any plan where
  no capacity is known, is returned as it is. `peak_of(executor, batch_shape)` measures a candidate (default: its compiled `device_peak`)."""
  remat = plan.schedule.remat
  if remat not in (None, "auto"):
    return plan, {"remat": remat, "why": f"remat={remat!r} set by the plan"}
  capacity = capacity if capacity is not None else gpu_aot.device_memory(mesh)
  if capacity is None:  # the plan as it is: its executor resolves the rule (`Plan.remat_mode`)
    return plan, {"remat": plan.remat_mode, "capacity": None,
                  "why": f"remat auto: {plan.remat_mode!r}, the rule without a compile (the devices report no "
                         "memory to fit)"}
  peak_of = peak_of or _compiled_peak
  rows = []
  for mode in ORDER:
    candidate = dataclasses.replace(plan, remat=mode)
    peak = int(peak_of(Executor(model, optimizer, candidate, mesh, accum_steps=accum_steps), batch_shape))
    rows.append({"remat": mode, "device_peak": peak, "fits": peak <= capacity})
    if peak <= capacity:
      ruled_out = ", ".join(f"{r['remat']!r} {r['device_peak'] / 1e9:.2f} GB" for r in rows[:-1])
      why = (f"remat auto: {mode!r}, compiled device peak {peak / 1e9:.2f} GB within {capacity / 1e9:.2f} GB"
             + (f" ({ruled_out} did not fit)" if ruled_out else ""))
      return candidate, {"remat": mode, "capacity": capacity, "rows": rows, "why": why}
  smallest = min(rows, key=lambda r: r["device_peak"])
  return dataclasses.replace(plan, remat=smallest["remat"]), {
      "remat": smallest["remat"], "capacity": capacity, "rows": rows,
      "why": (f"remat auto: {smallest['remat']!r}; no mode fits {capacity / 1e9:.2f} GB (smallest peak "
              f"{smallest['device_peak'] / 1e9:.2f} GB): expect an out-of-memory error; shrink the batch or "
              "shard more (e.g. zero3, offload)")}


def _compiled_peak(ex: Executor, batch_shape: tuple) -> int:
  compiled, _ = aot.compile_step(ex, batch_shape)
  return gpu_aot.memory(compiled)["device_peak"]
