"""qgZ's per-device state for the fidelity options of a plan: error feedback buffers and rounding seeds.

`Plan.grad_error_feedback` keeps, per unit and device, what qgZ's two quantizations dropped at the last
micro-step (LoCo §3): `e_send`, one fp32 copy of the unit's local gradient buffer (all its leaves packed,
in qgZ's node-major order), and `e_node`, 1/G of it (the node-local sums this device requantizes for
the inter-node hop). In the train state each is a global array `[devices, (layers,) n]`, one row per
device, sharded over all mesh axes; it is checkpointed as stored (the same mesh and plan resume bitwise,
any other starts the errors from zero).

`Plan.stochastic_rounding` draws its noise from a key folded from the step, the micro-step, the
device's rank, the unit and (for scanned units) the layer: runs are reproducible and no two devices,
units or layers share noise.

References:
  LoCo: Xie et al. 2024, §3 (error feedback for low-bit gradient communication).
  SDP4Bit: Jia et al. 2024, §3 (stochastic rounding keeps the quantized gradient unbiased).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zerojax import mesh as mesh_lib
from zerojax.plan import Plan

SEED = 0x5D4B  # the base key of stochastic rounding (the same in every run: the step makes it vary)


def error_shapes(plan: Plan, mesh: Mesh, metas: dict) -> dict | None:
  """`{unit: (e_send, e_node)}` global shapes `[devices, (layers,) n]`, or None without error feedback."""
  if not plan.grad_error_feedback:
    return None
  gpus = math.prod(mesh.shape[a] for a in plan.grad_order if not mesh_lib.is_node_axis(a))
  out = {}
  for u, meta in metas.items():
    n = sum(l.padded for l in meta.leaves)
    layers = meta.leaves[0].flat_shape()[:-1]
    out[u] = tuple(jax.ShapeDtypeStruct((mesh.size, *layers, m), jnp.float32) for m in (n, n // gpus))
  return out


def error_specs(shapes: dict | None, mesh: Mesh):
  """PartitionSpecs of the error buffers: one row per device."""
  return None if shapes is None else jax.tree.map(lambda _: P(tuple(mesh.axis_names)), shapes)


def init_errors(shapes: dict | None):
  return None if shapes is None else jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def unit_states(plan: Plan, metas: dict, errors: dict | None, step, micro, rank) -> dict:
  """Inside the shard_map: `{unit: (error, seed)}` for `ShardedUnit.qgz` (the local rows of `errors`)."""
  out = {}
  for j, (u, meta) in enumerate(sorted(metas.items())):
    seed = None
    if plan.stochastic_rounding:
      key = jax.random.key(SEED)
      for x in (step, micro, rank, j):
        key = jax.random.fold_in(key, x)
      layers = meta.leaves[0].layers
      seed = jax.random.key_data(key if layers is None else jax.random.split(key, layers))
    out[u] = (None if errors is None else tuple(e[0] for e in errors[u]), seed)
  return out

