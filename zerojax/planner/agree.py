"""One decision for the whole cluster: what the processes measure at start-up is reduced or broadcast.

Every process of a multi-process run measures on its own (the collective profile, each plan's compute,
the quantization kernels' rate), and plans 2–3% apart in predicted time are common, so processes that
each chose from their own figures could build different programs and wait on each other forever. The
planner therefore decides once: the local measurements are reduced across processes (`slowest`: the
largest, since a synchronous step is as slow as its slowest process), process 0 ranks the plans, and its
table and choice are broadcast (`from_process0`); every process then builds the plan it received. Whether
a profile file exists is read on process 0 alone and broadcast too, so no process starts profiling (a
collective) while another reads a file. With one process every function returns its input.

References:
  AMSP: Chen et al. 2023, §V (the planner runs once, before training).
"""
from __future__ import annotations

import json

import jax
import numpy as np


def from_process0(value):
  """Process 0's `value` (anything JSON can hold) on every process."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils
  lead = jax.process_index() == 0
  data = np.frombuffer(json.dumps(value).encode(), np.uint8) if lead else np.zeros(0, np.uint8)
  n = int(multihost_utils.broadcast_one_to_all(np.array([data.size], np.int32))[0])
  buf = data if lead else np.zeros(n, np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8)
  return json.loads(out.tobytes().decode())


def every_process(value) -> list:
  """`value` (anything JSON can hold) of every process, in process order."""
  if jax.process_count() == 1:
    return [value]
  from jax.experimental import multihost_utils
  data = json.dumps(value).encode()
  n = int(np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32))).max())
  buf = np.frombuffer(data.ljust(n), np.uint8)  # padded with spaces, which JSON ignores
  every = np.asarray(multihost_utils.process_allgather(buf)).astype(np.uint8).reshape(jax.process_count(), n)
  return [json.loads(row.tobytes().decode()) for row in every]


def slowest(values: dict[str, float]) -> dict[str, float]:
  """Each value's maximum over processes (every process passes the same keys)."""
  every = every_process(values)
  return {k: max(v[k] for v in every) for k in values}


def compute_table(table: dict) -> dict:
  """`compute.per_plan`'s table with every measured figure the slowest over processes, and the
  compiled step's bytes the largest."""
  out = dict(table)
  for key in ("compute_s", "measured", "temp_bytes"):
    out[key] = slowest(table[key])
  scalars = slowest({k: table[k] for k in ("dp_s", "quant_s_per_element") if table.get(k) is not None})
  out.update(scalars)
  return out
