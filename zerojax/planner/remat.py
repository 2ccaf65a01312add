"""Remat chosen by memory and speed: `Schedule.remat="auto"` (the default) becomes the fastest remat mode
whose compiled train step fits the device.

The modes, least recompute first: "none" (every residual kept: no forward runs twice), "dots" (the weight
matmuls' outputs and the attention's output kept, the rest recomputed), "full" (only each unit's inputs
kept, its whole forward recomputed), "offloaded" ("full" with the kept inputs in host memory: the same
recompute plus each layer's input over the host link each way; taken only where no other mode fits).

`choose` compiles the step of "none", "dots" and "full" for the batch the run trains on
(`aot.compile_step`: lowered and compiled, nothing runs) and reads three things from each program:
  * its device peak (`gpu_aot.memory`'s `device_peak`: state, batch, temporaries): it fits when that is
    within the device's memory;
  * its matmul FLOPs (`analysis.flops.matmul_flops`: a recomputed forward adds its matmuls);
  * its exposed collectives: those of the layer loops with no matmul scheduled between start and done
    (`analysis.schedule`), each priced by the planner's α-β model over the node's links (`exposed_seconds`).
    Recompute gives the scheduler matmuls to hide a collective behind: MiCS's in-backward replica
    all-reduce, on the slow cross-node link, has none beside it under "none" and the recomputed forward
    under "full" (docs/gpu.md).
Among the modes that fit it takes the one of least `flops / peak + exposed seconds` (the device kind's
dense peak and links, `zerojax.hardware`), the least recompute on a tie. Both terms are at the hardware's
nominal rates, which a step reaches neither of; the choice compares them, and `summary.json` gives each
mode's figures (`rows`) and the reason (`why`). A mode that fits with no collective exposed ends the
search: more recompute only adds work. Where no mode fits, "offloaded" is compiled; where it does not fit
either, the mode of smallest peak is taken with a warning.

The device's memory: on a GPU the allocator's limit (`memory_stats()["bytes_limit"]`: jax preallocates
`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 by default, of the card); on a compile-only GPU the target's
`device_memory_size` times that fraction (`gpu_aot.device_memory`). A platform that reports neither (a
CPU) has no bound to fit, and "auto" keeps the rule that needs no compile (`Plan.remat_mode`: "none"
without sharded parameters, else "full"). A device kind without known peak or links (`hardware`) is
priced by memory alone: the first mode that fits.

A run with "auto" compiles one to three candidate steps before it trains (seconds for the built-in GPT,
~10-30 s each for a 1B model on a GPU).

References:
  Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (recompute traded for memory).
  ZeRO: Rajbhandari et al. 2020, §6.1 (activation checkpointing alongside partitioned parameters).
  AMSP: Chen et al. 2023, §IV-A (the α-β model of a collective over the cluster's links).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import optax
from jax.sharding import Mesh

from zerojax import gpu_aot, hardware
from zerojax.analysis.flops import matmul_flops
from zerojax.analysis.schedule import Scheduled, schedule_from_hlo
from zerojax.executor import aot
from zerojax.executor import Executor
from zerojax.engine.model import Model
from zerojax.plan import Plan
from zerojax.planner.links import group_fit

ORDER = ("none", "dots", "full", "offloaded")  # least recompute (and host traffic) first
PRICED = ORDER[:3]  # compared by speed; "offloaded" only where none of them fits


def choose(model: Model, optimizer: optax.GradientTransformation, plan: Plan, mesh: Mesh, batch_shape: tuple,
           *, accum_steps: int = 1, capacity: int | None = None,
           measure: Callable[[Executor, tuple], dict] | None = None) -> tuple[Plan, dict]:
  """`(plan with its remat mode set, report)`: a plan whose remat is "auto" (or None) gets the fastest mode
  that fits `capacity` bytes (default: the device's, `gpu_aot.device_memory`) for `batch_shape`
  (`[accum, global_batch, seq + 1]` tokens); another plan, or any plan where no capacity is known, is
  returned as it is. `measure(executor, batch_shape)` gives a candidate's `device_peak` and, where it can
  be priced, `seconds` (default: `measure_compiled`)."""
  remat = plan.schedule.remat
  if remat not in (None, "auto"):
    return plan, {"remat": remat, "why": f"remat={remat!r} set by the plan"}
  capacity = capacity if capacity is not None else gpu_aot.device_memory(mesh)
  if capacity is None:  # the plan as it is: its executor resolves the rule (`Plan.remat_mode`)
    return plan, {"remat": plan.remat_mode, "capacity": None,
                  "why": f"remat auto: {plan.remat_mode!r}, the rule without a compile (the devices report no "
                         "memory to fit)"}
  measure = measure or measure_compiled
  rows = []

  def row_of(mode: str) -> dict:
    row = {"remat": mode, **measure(Executor(model, optimizer, dataclasses.replace(plan, remat=mode), mesh,
                                             accum_steps=accum_steps), batch_shape)}
    row["fits"] = row["device_peak"] <= capacity
    rows.append(row)
    return row

  for mode in PRICED:
    row = row_of(mode)
    if row["fits"] and not row.get("exposed_s"):  # nothing left to hide (or no price): more recompute only adds
      break
  fits = [r for r in rows if r["fits"]] or [r for r in [row_of("offloaded")] if r["fits"]]
  if not fits:
    smallest = min(rows, key=lambda r: r["device_peak"])
    return dataclasses.replace(plan, remat=smallest["remat"]), {
        "remat": smallest["remat"], "capacity": capacity, "rows": rows,
        "why": (f"remat auto: {smallest['remat']!r}; no mode fits {capacity / 1e9:.2f} GB (smallest peak "
                f"{smallest['device_peak'] / 1e9:.2f} GB): expect an out-of-memory error; shrink the batch or "
                "shard more (e.g. zero3, offload)")}
  priced = all(r.get("seconds") is not None for r in fits)
  best = min(fits, key=lambda r: r["seconds"]) if priced else fits[0]
  return dataclasses.replace(plan, remat=best["remat"]), {
      "remat": best["remat"], "capacity": capacity, "rows": rows, "why": _why(best, rows, capacity, priced)}


def _why(best: dict, rows: list[dict], capacity: int, priced: bool) -> str:
  out = (f"remat auto: {best['remat']!r}, compiled device peak {best['device_peak'] / 1e9:.2f} GB within "
         f"{capacity / 1e9:.2f} GB")
  too_big = [f"{r['remat']!r} {r['device_peak'] / 1e9:.2f} GB" for r in rows if not r["fits"]]
  if too_big:
    out += f" ({', '.join(too_big)} did not fit)"
  if priced and best.get("seconds") is not None:
    out += (f"; estimated {best['seconds'] * 1e3:.3g} ms a step ({best['tflops']:.3g} TFLOP of matmuls, "
            f"{best['exposed_s'] * 1e3:.3g} ms of layer collectives with no matmul beside them)")
    slower = [f"{r['remat']!r} {r['seconds'] * 1e3:.3g} ms" for r in rows if r["fits"] and r is not best]
    if slower:
      out += f", faster than {', '.join(slower)}"
  return out


def measure_compiled(ex: Executor, batch_shape: tuple) -> dict:
  """A candidate's compiled `device_peak`, matmul `tflops`, `exposed_s` (the layer loops' collectives with
  no matmul in flight, priced) and `seconds` (`flops / peak + exposed_s`; None where the device kind's peak
  or links are not known)."""
  compiled, _ = aot.compile_step(ex, batch_shape)
  text = compiled.as_text()
  out = {"device_peak": gpu_aot.memory(compiled)["device_peak"], "tflops": matmul_flops(text) / 1e12}
  kind = next(iter(ex.mesh.devices.flat)).device_kind
  peak, links = hardware.peak_flops(kind), hardware.node_links(kind)
  if peak is None or links is None:
    return {**out, "exposed_s": None, "seconds": None}
  exposed = [s for s in schedule_from_hlo(text, ex.mesh) if s.in_layer_loop and s.matmuls < 1]
  out["exposed_s"] = sum(exposed_seconds(s, ex.mesh, links) for s in exposed)
  out["seconds"] = out["tflops"] * 1e12 / peak + out["exposed_s"]
  return out


def exposed_seconds(s: Scheduled, mesh: Mesh, links: tuple[float, float]) -> float:
  """A collective's time over all its executions by the planner's α-β model of a group over the node's
  links (`planner.links.group_fit`: NCCL's ring latency, the slower of the in-node and the node's links),
  for the full buffer its ring sends `bytes_per_device` of."""
  c = s.collective
  group = sorted(c.replica_groups[0]) if c.replica_groups else []
  k = len(group)
  if k < 2:
    return 0.0
  fit = group_fit(c.op.replace("-", "_"), k, group[1] - group[0], mesh.shape.get("gpu", 1), *links)
  buffer = c.bytes_per_device * k / (k - 1) / (2 if c.op == "all-reduce" else 1)
  return c.count * (fit["alpha"] + fit["beta"] * buffer)
