"""The wire-byte model: bytes a collective sends per device, across nodes, and out of each node.

Every collective is charged as a ring algorithm over its replica group. For a group of `k` devices and a
per-device full buffer of `B` bytes, each device sends

  all-gather          (k-1)/k * B_out   (B_out: the gathered result)
  reduce-scatter      (k-1)/k * B_in    (B_in: the full input)
  all-reduce          2(k-1)/k * B      (reduce-scatter then all-gather)
  all-to-all          (k-1)/k * B       (B: the whole input; 1/k of it stays local)
  collective-permute  B for each device that sends to another device

Two cross-node figures (another coordinate along the node axis):

  * `cross_node_bytes_per_device`, the uniform-peer model: the fraction of a device's peers in its
    group that sit on another node. Exact for all-to-all and collective-permute; for ring collectives
    it is what a ring in a random device order would send.
  * `node_egress_bytes`, the ring-order model: bytes each node sends to other nodes, with every ring
    collective run as one ring in its group's listed order (node-major, as NCCL's and gloo's rings
    are). A group over n nodes crosses a node boundary on n of its k ring edges, each carrying
    (k-1)/k * B (twice for all-reduce), so a flat all-gather of the model over 2 nodes x 4 devices
    costs each node 7/8 M. This is ZeRO++ Table 1's model and what a node's link counters measure.

References:
  ZeRO++: Wang et al. 2023, Table 1 (communication volume per step).
"""
from __future__ import annotations

import collections

from zerojax.analysis.hlo_text import nbytes


def ring_bytes(op, groups, in_arrays, out_arrays, dtype, node_ids) -> tuple[float, float, float]:
  """Bytes sent per device (mean over the mesh), their cross-node part, and bytes leaving a node.

  The last is under the ring-order model (module docstring): a ring collective crosses a node boundary
  on the ring edges between consecutive group members on different nodes; all-to-all and
  collective-permute send every byte straight to its destination.
  """
  n, nodes = len(node_ids), len(set(node_ids.tolist()))
  node_of = lambda i: int(node_ids[i])  # noqa: E731
  total = cross = egress = 0.0
  if op == "collective-permute":
    size = nbytes(in_arrays, dtype)
    for src, dst in groups:
      if src != dst:
        total += size
        if node_of(src) != node_of(dst):
          cross += size
    return float(total / n), float(cross / n), float(cross / nodes)
  size = nbytes(out_arrays if op == "all-gather" else in_arrays, dtype)
  for g in groups:
    k = len(g)
    if k < 2:
      continue
    sent = (2 if op == "all-reduce" else 1) * (k - 1) / k * size
    total += k * sent
    per_node = collections.Counter(node_of(i) for i in g)
    group_cross = sum(sent * c * (k - c) / (k - 1) for c in per_node.values())
    cross += group_cross
    if op == "all-to-all":
      egress += group_cross
    else:
      edges = sum(node_of(g[j]) != node_of(g[(j + 1) % k]) for j in range(k))
      egress += edges * sent
  return float(total / n), float(cross / n), float(egress / nodes)


def summarize(collectives, *, model_bytes: float | None = None) -> dict:
  """Totals bytes per device, per op and per (op, axes), split into intra- and cross-node.

  Each collective counts `count` times (loop trip counts).

  Args:
    collectives: `Collective`s, e.g. from `collectives_from_hlo`.
    model_bytes: the model's size M in bytes; adds `*_over_model` ratios to every entry.

  Returns:
    A JSON-ready dict: `total`, `by_op` (op -> entry), `by_op_axes` (op -> "node,gpu" -> entry) and
    `by_role` (role -> entry, for labelled collectives), each entry with `count`, `bytes_per_device`,
    `intra_node_bytes_per_device`, `cross_node_bytes_per_device` and `node_egress_bytes` (see the
    module docstring); plus `model_bytes` when given.
  """
  def entry():
    return {"count": 0, "bytes_per_device": 0.0, "intra_node_bytes_per_device": 0.0,
            "cross_node_bytes_per_device": 0.0, "node_egress_bytes": 0.0}

  total, by_op, by_op_axes, by_role = entry(), {}, {}, {}
  for c in collectives:
    axes = ",".join(c.axes) or "-"
    entries = [total, by_op.setdefault(c.op, entry()), by_op_axes.setdefault(c.op, {}).setdefault(axes, entry())]
    if c.role:
      entries.append(by_role.setdefault(c.role, entry()))
    for e in entries:
      e["count"] += c.count
      e["bytes_per_device"] += c.count * c.bytes_per_device
      e["cross_node_bytes_per_device"] += c.count * c.cross_node_bytes_per_device
      e["intra_node_bytes_per_device"] += c.count * (c.bytes_per_device - c.cross_node_bytes_per_device)
      e["node_egress_bytes"] += c.count * c.node_egress_bytes
  out = {"total": total, "by_op": by_op, "by_op_axes": by_op_axes, "by_role": by_role}
  if model_bytes:
    entries = [total, *by_op.values(), *(e for d in by_op_axes.values() for e in d.values()), *by_role.values()]
    for e in entries:
      for key in ("bytes_per_device", "intra_node_bytes_per_device", "cross_node_bytes_per_device",
                  "node_egress_bytes"):
        e[key + "_over_model"] = e[key] / model_bytes
    out["model_bytes"] = model_bytes
  return out

