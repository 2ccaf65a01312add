"""Radius's sparse replica sync as a stateful component (`zerojax.state.stateful`).

With `replica_sync=radius(...)` (`ReplicaSync`) the all-reduce over the replica axes is Radius's (Algorithm 1):
each step runs one of three compiled programs, picked on the host from the step and the last selection
(`phase`): "dense" (the warm-up, the plan's own step), "select" (dense all-reduce of gradient +
residual, then top-k of the optimizer's update per shard) or "sparse" (all-reduce of the k selected
values only). The collectives are `zerojax.comm.radius`'s.

State (`RadiusState`, `TrainState.stateful["radius"]`): per leaf the residual `[replicas, (layers,)
padded]`, sharded over the replica axes and, like the master weights, over A_os; per leaf the window's
indices `[(layers,) shards * k]`; the step of the last selection. A checkpoint stores the residual as
`[replicas, *logical shape]` (one row per replica: each keeps what it has not sent), the indices as a
bool mask in the leaf's logical shape, and the step of the last selection. The same plan on the same
mesh resumes bitwise; another mesh or plan gets the residual summed onto its first replica when the
replica counts differ (only the sum enters the next select step) and the mask re-tiled to its shards
(`comm.radius.mask_to_indices`); a checkpoint without Radius state starts with an empty residual and
selects on its first step.

References:
  Radius: Zheng & Zhang, Algorithm 1 (lines 8–11 select, 13–17 sparse, 23 top-k), §4.3 (residual), §5
  (memory: the residual and the indices).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import comm
from zerojax.engine import layout as layout_lib
from zerojax import mesh as mesh_lib
from zerojax.mesh import group_size
from zerojax.plan import Radius
from zerojax.state.stateful import Stored, SyncsReplicas, keep


@flax.struct.dataclass
class RadiusState:
  """Radius's state (Algorithm 1): what a replica has not sent, and the window's selection."""
  residual: Any          # per leaf [replicas, (layers,) padded]: each replica's unsent gradient (mean units),
                         # sharded over the replica axes and, like the master weights, over A_os
  indices: Any           # per leaf [(layers,) shards * k] int32: each A_os shard's k positions, ascending
  selected_at: jax.Array  # step of the last selection; -1 before the first


@dataclasses.dataclass(frozen=True, eq=False)
class RadiusSync(SyncsReplicas):
  """Radius's replica sync on one executor's mesh and layout.

  Attributes:
    radius: the plan's `Radius` (density, period, dense steps).
    mesh: the executor's mesh.
    layout: the parameter layout.
    opt_order: the axes of A_os (the master weights' shards).
    replicas: the replica axes (outside A_os).
    k: per leaf, the elements selected in each A_os shard (per layer).
  """
  name = "radius"
  setting = "replica_sync=radius(...)"
  phases = ("select", "sparse")

  radius: Radius
  mesh: Mesh
  layout: layout_lib.Layout
  opt_order: tuple[str, ...]
  replicas: tuple[str, ...]
  k: tuple[int, ...]

  @classmethod
  def of(cls, plan, mesh, layout, metas):
    radius, sharding = plan.sync.replica_sync, plan.sharding
    if radius is None:
      return None
    shards = group_size(mesh, sharding.opt_order)
    k = tuple(radius.shard_k(l.padded // shards) for l in layout.leaves)
    return cls(radius, mesh, layout, sharding.opt_order, sharding.replica_axes(mesh), k)

  @classmethod
  def refuse_restore(cls, where, key):
    return (f"checkpoint {where} holds Radius's residual and indices ({key}, ...), but this plan has "
            "replica_sync=None and would drop the unsent gradient; restore with the plan's "
            "replica_sync=radius(...): its next select step sends the residual")

  def _sizes(self) -> tuple[int, int]:
    return group_size(self.mesh, self.replicas), group_size(self.mesh, self.opt_order)

  def init(self, flat):
    reps, shards = self._sizes()
    leaves, treedef = jax.tree.flatten(flat)
    return RadiusState(
        residual=jax.tree.map(lambda x: jnp.zeros((reps,) + x.shape, jnp.float32), flat),
        indices=treedef.unflatten([jnp.tile(jnp.arange(k, dtype=jnp.int32), x.shape[:-1] + (shards,))
                                   for x, k in zip(leaves, self.k)]),
        selected_at=jnp.full((), -1, jnp.int32))

  def specs(self) -> RadiusState:
    """The residual has a leading replica axis; the indices are sharded like the master weights."""
    params = layout_lib.specs(self.layout, self.opt_order)
    res = jax.tree.map(lambda s: P(self.replicas, *s), params, is_leaf=lambda s: isinstance(s, P))
    return RadiusState(residual=res, indices=params, selected_at=P())

  def phase(self, state) -> str | None:
    """Algorithm 1: dense before `dense_steps`, then a select step when `period` steps have passed since
    the last one (or none was made, e.g. after restoring a dense checkpoint), else sparse. Reads two
    scalars."""
    step = int(state.step)
    if step < self.radius.dense_steps:
      return None
    at = int(state.stateful[self.name].selected_at)
    return "select" if at < 0 or step - at >= self.radius.period else "sparse"

  def body_in(self, state, phase):
    if phase not in self.phases:
      return None, None
    specs = self.specs()
    return (state.residual, state.indices), (specs.residual, specs.indices)

  def body_out_specs(self, phase):
    return self.specs().residual if phase in self.phases else None

  def sync(self, grads, local, denom, phase):
    residual, indices = local
    leaves, treedef = jax.tree.flatten(grads)
    res = [r[0] for r in jax.tree.leaves(residual)]  # this replica's row
    if phase == "select":  # Algorithm 1 lines 8–11
      leaves, res = comm.radius.dense_all_reduce(leaves, res, self.replicas, denom)
    else:                  # lines 13–17
      leaves, res = comm.radius.sparse_all_reduce(leaves, res, jax.tree.leaves(indices), self.replicas, denom)
    return treedef.unflatten(leaves), treedef.unflatten([r[None] for r in res])

  def update(self, state, out, updates, step, finite, phase):
    if phase == "select":  # the update is -lr x Algorithm 2's corrected gradient: rank its magnitude
      specs = self.specs().indices  # sharded like the master weights
      indices = jax.shard_map(self._select, mesh=self.mesh, in_specs=(specs,), out_specs=specs,
                              check_vma=False)(updates)
      return keep(finite, RadiusState(out, indices, step), state)
    if phase == "sparse":
      return state.replace(residual=keep(finite, out, state.residual))
    return state

  def _select(self, updates):
    """shard_map body, Algorithm 1 line 23: each shard's top-k positions of |update|."""
    leaves, treedef = jax.tree.flatten(updates)
    owner = mesh_lib.owner_index(self.opt_order) if self.opt_order else 0
    return treedef.unflatten([comm.radius.select(u, k, owner * u.shape[-1], lay.size)
                              for u, k, lay in zip(leaves, self.k, self.layout.leaves)])

  def memory_bytes(self) -> int:
    """Each replica's residual (fp32, sharded like the master weights) and its shard's indices (Radius §5)."""
    numel = sum(l.padded * (l.layers or 1) for l in self.layout.leaves)
    return numel * 4 // self._sizes()[1] + 4 * sum(k * (l.layers or 1) for k, l in zip(self.k, self.layout.leaves))

  def stored(self) -> list[Stored]:
    reps, shards = self._sizes()
    mesh, axes = self.mesh, self.opt_order
    others = tuple(a for a in mesh.axis_names if a not in self.replicas)
    residual, mask = [], []
    for lay, k in zip(self.layout.leaves, self.k):
      shape = (reps,) + lay.logical_shape
      rest = layout_lib.logical_sharding(mesh, axes, shape[1:]).spec
      residual.append(Stored(
          shape, np.dtype(np.float32),
          NamedSharding(mesh, P(self.replicas or None, *rest, *[None] * (len(shape) - 1 - len(rest)))),
          to_logical=lambda x, lay=lay: jax.vmap(lambda r: layout_lib.unflatten_leaf(r, lay))(x),
          from_logical=lambda x, lay=lay: jax.vmap(lambda r: layout_lib.flatten_leaf(r, lay))(
              comm.radius.fold_residual(x, reps)),
          accepts=lambda saved, shape=shape: saved[1:] == shape[1:],  # another replica count: folded
          read_sharding=lambda saved: layout_lib.logical_sharding(mesh, others, saved)))
      mask.append(Stored(
          lay.logical_shape, np.dtype(bool), layout_lib.logical_sharding(mesh, axes, lay.logical_shape),
          to_logical=lambda x, lay=lay: layout_lib.unflatten_leaf(
              comm.radius.indices_to_mask(x, lay.padded // shards, shards), lay),
          from_logical=lambda x, lay=lay, k=k: comm.radius.mask_to_indices(
              layout_lib.flatten_leaf(x, lay), k, shards, lay.size)))
    selected_at = Stored((), np.dtype(np.int32), NamedSharding(mesh, P()), fill=-1)  # -1: no selection yet
    return residual + mask + [selected_at]
