"""Where the train state lives: one object the executor asks, so that the engine has no branch on a technique.

Every plan keeps one copy of the master weights and optimizer states, sharded over A_os (`Placement`). A
plan whose replicas train apart between syncs (DiLoCo, Douillard et al. 2023, Algorithm 1: one replica
per node) keeps one copy per replica (`Replicas`): the master weights, optimizer states and skip count
lead with a replica axis sharded over the replica axes, the step takes this device's replica, the
optimizer runs once per replica (`jax.vmap`), a skipped step is skipped per replica, the gradient is
divided by the devices of one replica, and the step's metrics stay one per replica. `Components` says
which axes the replicas train apart over (`Components.replicas_apart`, decided by `components.compile`
from the plan); `of` builds the placement from them.

The placement also carries the host offload (`zerojax.engine.offload.HostOffload`, ZeRO-Offload §4): which
train-state fields live in host memory, and their moves to the device and back.

References:
  ZeRO: Rajbhandari et al. 2020, §5 (each device holds its partition of the model states).
  DiLoCo: Douillard et al. 2023, Algorithm 1 (each worker's inner optimization on its own replica).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.mesh import group_size
from zerojax.engine.offload import HostOffload
from zerojax.state.stateful import keep


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """One copy of the master weights and optimizer states, sharded over A_os (every plan but DiLoCo's).

  Attributes:
    mesh: the executor's mesh.
    master_specs: PartitionSpecs of the flat master weights over A_os (`layout.specs`), one copy.
    opt_order: A_os, the axes the optimizer states' flat leaves are sharded over.
    offload: the train-state fields in host memory and their moves (`HostOffload`).
  """
  mesh: Mesh
  master_specs: dict
  opt_order: tuple[str, ...]
  offload: HostOffload = HostOffload()

  replica_axes: tuple[str, ...] = ()  # the axes the replicas train apart over: none here

  @staticmethod
  def of(mesh: Mesh, master_specs: dict, opt_order: tuple[str, ...], offload: HostOffload,
         replicas_apart: tuple[str, ...]) -> "Placement":
    """The placement of a plan whose replicas train apart over `replicas_apart` (() for one copy)."""
    if replicas_apart:
      return Replicas(mesh, master_specs, opt_order, offload, replicas_apart)
    return Placement(mesh, master_specs, opt_order, offload)

  @property
  def fields(self) -> tuple[str, ...]:
    """The train-state fields that lead with the replica axis: none here."""
    return ()

  @property
  def replicas(self) -> int:
    """How many copies train apart: 1 here."""
    return 1

  def spec(self, *rest) -> P:
    """The PartitionSpec of a state leaf laid out as `rest` within one copy."""
    return P(*rest)

  @property
  def param_specs(self) -> dict:
    """PartitionSpecs of the train state's master weights."""
    return jax.tree.map(lambda s: self.spec(*s), self.master_specs, is_leaf=lambda s: isinstance(s, P))

  def opt_sharding(self, ndim: int) -> NamedSharding:
    """The sharding of an optimizer-state leaf of `ndim` dimensions: scalars replicated, flat leaves
    `[(layers,) padded]` sharded on their last axis over A_os."""
    order = self.opt_order or None
    rest = {0: (), 1: (order,), 2: (None, order)}[ndim - len(self.spec())]
    return NamedSharding(self.mesh, self.spec(*rest))

  def init(self, params, init_opt):
    """`(master weights, optimizer states, skip count)` of a new state from the flat master weights."""
    return params, init_opt(params), jnp.zeros((), jnp.int32)

  def local(self, master):
    """Inside the step's `shard_map`: the master weights this device trains."""
    return master

  def per_copy(self, tree):
    """Inside the step's `shard_map`: the body's per-copy outputs (gradients, loss, aux) as its out specs
    lay them out."""
    return tree

  def per_replica(self, f):
    """`f` (the optimizer's update, the gradient norm) run once per copy."""
    return f

  def keep(self, finite, new, old):
    """`new` where the step is finite, else `old`, per copy."""
    return keep(finite, new, old)

  def divisor(self, world: int, accum_steps: int) -> int:
    """What the summed gradients are divided by: the devices of one copy times the micro-batches."""
    return world // self.replicas * accum_steps

  def first(self, flat):
    """The master weights of the first copy (for evaluation and export)."""
    return flat

  def summarize(self, metrics):
    """The step's metrics as the caller sees them (one value each)."""
    return metrics

  def refuse_model(self, model, plan_name: str) -> None:
    """Raises for a model this placement cannot train."""


@dataclasses.dataclass(frozen=True, eq=False)
class Replicas(Placement):
  """One copy per replica (DiLoCo, Algorithm 1): the fields `fields` lead with `[replicas, ...]` sharded
  over `replica_axes`; each device trains its replica, and nothing in the step crosses the replicas."""

  @property
  def fields(self) -> tuple[str, ...]:
    return ("params", "opt_state", "skipped")

  @property
  def replicas(self) -> int:
    return group_size(self.mesh, self.replica_axes)

  def spec(self, *rest) -> P:
    return P(self.replica_axes, *rest)

  def init(self, params, init_opt):
    """Every replica starts from the same weights, with its own optimizer states and skip count."""
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.replicas,) + x.shape), params)
    return params, jax.vmap(init_opt)(params), jnp.zeros((self.replicas,), jnp.int32)

  def local(self, master):
    return jax.tree.map(lambda m: m[0], master)  # this device's replica: `[1, ...]` of the replica axis

  def per_copy(self, tree):
    return jax.tree.map(lambda x: x[None], tree)

  def per_replica(self, f):
    return jax.vmap(f)  # each replica's norm, clipping and skip are its own

  def keep(self, finite, new, old):
    return jax.tree.map(lambda n, o: jnp.where(finite.reshape(finite.shape + (1,) * (n.ndim - 1)), n, o), new, old)

  def first(self, flat):
    return jax.tree.map(lambda x: x[0], flat)  # every replica's right after a sync

  def summarize(self, metrics):
    """The replicas' metrics averaged (all finite), in a program of their own, so that the step itself
    reduces nothing across the replicas."""
    return _summary(metrics)

  def refuse_model(self, model, plan_name: str) -> None:
    if model.init_state is not None:
      raise ValueError(f"plan {plan_name!r} trains one replica per {'/'.join(self.replica_axes)} (outer_sync), but "
                       "the model has mutable collections (e.g. BatchNorm statistics) that the step averages "
                       "over every device; use a model without them")


@jax.jit
def _summary(m):
  return type(m)(jnp.mean(m.loss), jnp.mean(m.grad_norm), jnp.all(m.finite),
                 jax.tree.map(lambda a: jnp.mean(a, axis=0), m.aux))
