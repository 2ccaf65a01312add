"""qgZ's error feedback buffers as train state, and the in-backward component that hands each unit its
buffers and keeps what its reduction dropped (`ErrorFeedback`, a `zerojax.engine.unit.StateKey`).

`Reduction.grad_error_feedback` keeps, per unit and device, what qgZ's two quantizations dropped at the last
micro-step (LoCo §3): `e_send`, one fp32 copy of the unit's local gradient buffer (all its leaves packed,
in qgZ's node-major order), and `e_node`, 1/G of it (the node-local sums this device requantizes for
the inter-node hop). In the train state each is a global array `[devices, (layers,) n]`, one row per
device, sharded over all mesh axes (`ErrorFeedback`, a `zerojax.state.stateful` component); it is checkpointed
as held (the same mesh and plan resume bitwise, any other starts the errors from zero).

`Reduction.stochastic_rounding` needs no train state: its key is folded from the step, the micro-step,
the device's rank, the unit and the layer (`GradReduction.seeds`).

References:
  LoCo: Xie et al. 2024, §3 (error feedback for low-bit gradient communication).
  SDP4Bit: Jia et al. 2024, §3 (stochastic rounding keeps the quantized gradient unbiased).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax import mesh as mesh_lib
from zerojax.state.stateful import InBackward, Stored, keep


@dataclasses.dataclass(frozen=True, eq=False)
class ErrorFeedback(InBackward):
  """qgZ's error feedback as a stateful component (`zerojax.state.stateful`): `{unit: (e_send, e_node)}`,
  each a global array `[devices, (layers,) n]` sharded over all mesh axes, carried through the units'
  backward every micro-step (`InBackward`): each unit's reduction adds back this device's rows
  (`error`) and the new errors, what its quantizations dropped, are the cotangent of the old ones
  (`backward`).

  Attributes:
    mesh: the executor's mesh.
    shapes: `{unit: (e_send, e_node)}` global `ShapeDtypeStruct`s.
  """
  name = "grad_error"
  setting = "grad_error_feedback=True"

  mesh: Mesh
  shapes: dict

  @classmethod
  def of(cls, plan, mesh, layout, metas):
    if not plan.reduction.grad_error_feedback:
      return None
    gpus = mesh_lib.group_size(mesh, [a for a in plan.sharding.grad_order if not mesh_lib.is_node_axis(a)])
    shapes = {}
    for u, meta in metas.items():
      n = sum(l.padded for l in meta.leaves)
      layers = meta.leaves[0].flat_shape()[:-1]
      shapes[u] = tuple(jax.ShapeDtypeStruct((mesh.size, *layers, m), jnp.float32) for m in (n, n // gpus))
    return cls(mesh, shapes)

  @classmethod
  def refuse_restore(cls, where, key):
    return (f"checkpoint {where} holds qgZ's error feedback buffers ({key}, ...), but this plan has "
            "grad_error_feedback=False; restore with grad_error_feedback=True")

  def init(self, flat):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes)

  def specs(self):
    """One row per device."""
    return jax.tree.map(lambda _: P(tuple(self.mesh.axis_names)), self.shapes)

  def body_in(self, state, phase):
    return state, self.specs()

  def body_out_specs(self, phase):
    return self.specs()

  def unit_states(self, local):
    """This device's row of each unit's `(e_send, e_node)`."""
    return {u: tuple(e[0] for e in errors) for u, errors in local.items()}

  def error(self, value):
    return value

  def backward(self, value, grads, reduced, dropped):
    return dropped

  def update(self, state, out, updates, step, finite, phase):
    return keep(finite, out, state)

  def memory_bytes(self) -> int:
    """Per device the local gradient's error and 1/G of it, fp32."""
    return sum(math.prod(x.shape[1:]) * 4 for x in jax.tree.leaves(self.shapes))

  def stored(self) -> list[Stored]:
    """As held, one row per device: another layout of them starts from zero (one step's residue)."""
    rows = NamedSharding(self.mesh, P(tuple(self.mesh.axis_names)))
    return [Stored(tuple(x.shape), np.dtype(x.dtype), rows,
                   from_logical=lambda v, x=x: v if tuple(v.shape) == tuple(x.shape) else jnp.zeros(x.shape, x.dtype),
                   accepts=lambda saved: True, read_sharding=lambda saved: NamedSharding(self.mesh, P()))
            for x in jax.tree.leaves(self.shapes)]
