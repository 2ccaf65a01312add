"""A train step's communication as ZeRO++ Table 1: compile the step, list its collectives, total them.

References:
  ZeRO++: Wang et al. 2023, Table 1 (forward gather, backward gather, gradient reduction per step).
"""
from __future__ import annotations

import dataclasses

from zerojax.executor import aot
from zerojax.analysis.collectives import Collective, collectives_from_hlo
from zerojax.analysis.wire_model import summarize


TABLE1_ROLES = ("forward all-gather", "backward all-gather", "gradient reduction")


def step_hlo(executor, batch_shape: tuple[int, int, int] | None = None, phase: str | None = None) -> str:
  """Lowers and compiles `executor.step_fn()` for abstract inputs; returns the optimized HLO text.

  Args:
    executor: a `zerojax.Executor`.
    batch_shape: `[accum_steps, global_batch, seq_len + 1]`; default one 1-token sequence per device.
      The collectives of a data-parallel step do not depend on it; pass the real shape to compile
      exactly the program that trains.
    phase: with Radius, which step's program: "dense", "select" or "sparse" (None: "sparse").
  """
  batch_shape = tuple(batch_shape or (executor.accum_steps, executor.world, 2))
  return aot.compile_step(executor, batch_shape, phase)[0].as_text()


def step_collectives(executor, batch_shape: tuple[int, int, int] | None = None, *,
                     hlo_text: str | None = None) -> list[Collective]:
  """The collectives of one compiled train step of `executor`, with roles (see `step_hlo`).

  Args:
    executor: a `zerojax.Executor`.
    batch_shape: see `step_hlo`.
    hlo_text: the step's optimized HLO when already compiled (skips compiling).

  Returns:
    One `Collective` per collective instruction; `count` is executions per optimizer step.
  """
  return collectives_from_hlo(hlo_text or step_hlo(executor, batch_shape), executor.mesh)


def model_parameters(executor) -> int:
  """Number of model parameters (without the layout's padding)."""
  return sum(leaf.size * (leaf.layers or 1) for leaf in executor.layout.leaves)


def step_report(executor, collectives: list[Collective]) -> dict:
  """JSON-ready accounting of one train step, relative to M = model parameters x 2 bytes.

  Returns:
    `model_parameters`, `model_bytes` (M), `nodes`, `gpus_per_node`; `collectives` (each also with
    `step_*` figures: per execution x `count`); `summary` (`summarize`, with `by_role`); `table1`:
    ZeRO++ Table 1's columns (forward all-gather, backward all-gather, gradient reduction) and the
    step's total, each as bytes a node sends to other nodes per step (`node_egress_bytes`, ring-order
    model), as a multiple of M (`over_model`), and under the uniform-peer model per device; and
    `cross_node_bytes_per_node`: the step's total `node_egress_bytes`, the figure a node's link
    counters measure.
  """
  sizes = dict(zip(executor.mesh.axis_names, executor.mesh.devices.shape))
  m = 2.0 * model_parameters(executor)
  listed = []
  for c in collectives:
    d = dataclasses.asdict(c)
    d["step_bytes_per_device"] = c.count * c.bytes_per_device
    d["step_cross_node_bytes_per_device"] = c.count * c.cross_node_bytes_per_device
    d["step_node_egress_bytes"] = c.count * c.node_egress_bytes
    listed.append(d)
  summary = summarize(collectives, model_bytes=m)
  table = {}
  for role in TABLE1_ROLES + ("total",):
    e = summary["total"] if role == "total" else summary["by_role"].get(role, {})
    egress = e.get("node_egress_bytes", 0.0)
    table[role] = {"count": e.get("count", 0), "node_egress_bytes": egress, "over_model": egress / m,
                   "cross_node_bytes_per_device": e.get("cross_node_bytes_per_device", 0.0)}
  return {
      "model_parameters": model_parameters(executor), "model_bytes": m,
      "nodes": sizes.get("node", 1), "gpus_per_node": sizes.get("gpu", 1),
      "collectives": listed, "summary": summary, "table1": table,
      "cross_node_bytes_per_node": summary["total"]["node_egress_bytes"],
  }


def _ops_of(collectives: list[dict], role: str) -> str:
  ops = sorted({f"{c['op']} {c['dtype']} over {','.join(c['axes']) or '-'}" for c in collectives
                if c["role"] == role})
  return "; ".join(ops)


def render_table(report: dict) -> str:
  """`step_report` as ZeRO++ Table 1, for people: one row per role, intra-node vs cross-node traffic.

  Columns: collectives run per step; bytes each device sends to devices of its own node; bytes each
  node sends to other nodes (ring-order model, what a node's link counters measure), in MB and in
  units of M = parameters x 2 bytes; and what the collectives are.
  """
  m = report["model_bytes"]
  by_role = report["summary"]["by_role"]
  cfg = report.get("config", {})
  step = f" ({cfg['phase']} step)" if cfg.get("phase", "dense") != "dense" else ""
  head = (f"plan {cfg.get('plan', '?')}{step}  mesh {report['nodes']} nodes x {report['gpus_per_node']} gpus  "
          f"M = {report['model_parameters']:,} params x 2 B = {m / 1e6:.2f} MB")
  rows = [("role", "per step", "intra-node MB/dev", "cross-node MB/node", "cross-node /M", "collectives")]
  roles = list(TABLE1_ROLES) + [r for r in by_role if r not in TABLE1_ROLES]
  for role in roles + ["total"]:
    e = report["summary"]["total"] if role == "total" else by_role.get(role, {})
    rows.append((role, str(e.get("count", 0)), f"{e.get('intra_node_bytes_per_device', 0.0) / 1e6:.3f}",
                 f"{e.get('node_egress_bytes', 0.0) / 1e6:.3f}", f"{e.get('node_egress_bytes', 0.0) / m:.3f}",
                 "" if role == "total" else _ops_of(report["collectives"], role)))
  widths = [max(len(r[i]) for r in rows) for i in range(5)]
  lines = [head, ""]
  for j, r in enumerate(rows):
    lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 + "  " + r[5])
    if j == 0 or j == len(rows) - 2:
      lines.append("-" * (sum(widths) + 2 * len(widths) + 11))
  return "\n".join(lines)


def render_collectives(collectives: list[Collective]) -> str:
  """One line per collective: op, dtype, result shapes, axes, executions, bytes per device."""
  lines = [f"{'op':<19}{'dtype':<8}{'axes':<12}{'x':>4}  {'MB/dev':>9}  {'cross MB/dev':>12}  result"]
  for c in collectives:
    lines.append(f"{c.op:<19}{c.dtype:<8}{','.join(c.axes) or '-':<12}{c.count:>4}  "
                 f"{c.bytes_per_device / 1e6:>9.3f}  {c.cross_node_bytes_per_device / 1e6:>12.3f}  "
                 f"{list(c.result_shapes)}")
  return "\n".join(lines)
