"""A collective profile written from a cluster's published link figures, for a cluster one cannot run on.

`python -m zerojax.planner.profile` measures the α-β fit of every collective over every group the plan
space uses; this module writes the same JSON from link speeds instead (AMSP §IV-A's α-β model, with
NCCL's ring latencies). For a group of k devices at stride s on N nodes x G devices, d of its members
share a node and it spans m = k / d nodes; every device runs the collective at once (as the profiler
times it), so G / d groups share each node's network links. With v the full buffer in bytes:

  β v  = max((k-1)/k · v / B_gpu,  (G/d) · (m-1)/m · v / B_node)    all-gather, reduce-scatter
         2x that                                                    all-reduce (reduce-scatter + gather)
         max((k-1)/k · v / B_gpu,  G · (m-1)/m · v / B_node)        all-to-all (no data is shared)
  α    = base + (n - n_inter) α_intra + n_inter α_inter             NCCL's ring latency, n = k-1 steps
                                                                    (2(k-1) for all-reduce), n_inter =
                                                                    m-1 (2(m-1)) of them between nodes

B_gpu is a device's in-node bandwidth one way, B_node a node's network bandwidth one way.

`amsp_a800()` is AMSP's cluster (§VI-A): 128 nodes x 8 A800 80 GB, NVLink (A800: 400 GB/s both ways,
200 GB/s one way), 4 x HDR InfiniBand 200 Gb/s per node (100 GB/s one way), no SHARP. The intra/inter
ratio is 2, as the paper reports of its test-bed. NCCL Ring/Simple latencies: base 8.4 µs, NVLink 3.4 µs
and network 14 µs per step (NCCL `src/graph/tuning.cc`).

References:
  AMSP: Chen et al. 2023, §IV-A (α-β model), §VI-A (cluster), Fig. 3.
"""
from __future__ import annotations

from zerojax.planner.cost import OPS, group_key, groups_needed
from zerojax.planner.space import plan_space

NCCL_RING_SIMPLE_US = {"base": 8.4, "intra": 3.4, "inter": 14.0}


def group_fit(op: str, k: int, stride: int, gpus: int, b_gpu: float, b_node: float,
              lat_us: dict = NCCL_RING_SIMPLE_US) -> dict:
  """α (s) and β (s/byte) of `op` over groups of k devices at stride `stride`."""
  d = k if k * stride <= gpus else max(gpus // stride, 1)
  m = k // d
  share = gpus if op == "all_to_all" else gpus // d
  beta = max((k - 1) / k / b_gpu, share * (m - 1) / m / b_node)
  steps, inter = k - 1, m - 1
  if op == "all_reduce":
    beta, steps, inter = 2 * beta, 2 * steps, 2 * inter
  alpha = (lat_us["base"] + (steps - inter) * lat_us["intra"] + inter * lat_us["inter"]) * 1e-6
  return {"alpha": alpha, "beta": beta}


def link_profile(nodes: int, gpus: int, *, b_gpu: float, b_node: float, source: str,
                 lat_us: dict = NCCL_RING_SIMPLE_US) -> dict:
  """The profile JSON (`planner.load_profile`'s format) of a nodes x gpus cluster from its links."""
  world = nodes * gpus
  needed = sorted({(k, s) for pt in plan_space(nodes, gpus, techniques=True, lossy=True)
                   for _, k, s in groups_needed(pt, world, gpus)})
  groups = {group_key(k, s): {op: group_fit(op, k, s, gpus, b_gpu, b_node, lat_us) for op in OPS}
            for k, s in needed}
  return {"mesh": {"nodes": nodes, "gpus": gpus}, "backend": "links", "source": source,
          "links": {"b_gpu_bytes_per_s": b_gpu, "b_node_bytes_per_s": b_node, "latency_us": lat_us},
          "groups": groups}


def amsp_a800() -> dict:
  """AMSP's 1024-GPU cluster (§VI-A) from its published link figures."""
  return link_profile(128, 8, b_gpu=200e9, b_node=4 * 200e9 / 8,
                      source="AMSP §VI-A: 128 nodes x 8 A800, NVLink 400 GB/s bidirectional per GPU, "
                             "4 x HDR InfiniBand 200 Gb/s per node, no SHARP; NCCL ring latencies")
