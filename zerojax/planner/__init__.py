"""AMSP: per-component shard degrees chosen from a measured collective profile.

| module    | holds                                                                 |
|-----------|-----------------------------------------------------------------------|
| `space`   | the plan space: shard degrees s_p ≤ s_g ≤ s_os, nested, s_g ∈ {s_p, s_os}, and the techniques on them |
| `profile` | the collective profiler (`python -m zerojax.planner.profile`) and α-β fits |
| `cost`    | T_p + T_g + T_os^0 + T_os^1, the step (overlap none/full), the memory model |
| `compute` | each plan's compute: uniform, fitted on anchor plans, or measured     |
| `links`   | a profile written from a cluster's link figures (AMSP's A800 cluster)  |
| `solve`   | ranking (Pareto-pruned), the choice under a memory cap, `auto()`      |
| `agree`   | one decision for a multi-process cluster: reduce, then broadcast       |
| `compiled`| a plan's per-device memory from its train step compiled for compile-only GPUs (imported on demand) |

References:
  AMSP: Chen et al. 2023 (`shared/seeds/amsp.txt`).
"""
from zerojax.planner.cost import Workload, comm_time, model_state_bytes
from zerojax.planner.solve import Auto, PlanError, auto, choose, load_profile, rank, render, workload
from zerojax.planner.space import Point, degrees, plan_space

__all__ = ["Workload", "comm_time", "model_state_bytes", "Auto", "PlanError", "auto", "choose", "load_profile",
           "rank", "render", "workload", "Point", "degrees", "plan_space"]
