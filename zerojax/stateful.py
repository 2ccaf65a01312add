"""A communication component that carries state across steps, declared like an optax transformation.

docs/DESIGN.md, "State across steps". optax makes each feature a `GradientTransformation(init, update)`
that owns its state; here a component of a plan that must remember something from one step to the next
(what a quantization dropped; a replica's unsent gradient and its selection) is a `Stateful`: it says how its state is created (`init`), sharded (`specs`),
used and updated by the step (`body_in`, `sync`, `update`, `after_update`), placed (`replica_axes`), checkpointed (`stored`) and counted
(`memory_bytes`). The executor, the checkpoint spec (`zerojax.train.state_spec`) and the memory report
(`zerojax.memory`) iterate over the plan's components (`zerojax.train_state.stateful_components`) and never name
one. Its state lives in the `TrainState` field of the component's `name`.

A step runs one compiled program per *phase*: "dense" (no component changes the replica sync) or one a
component picks on the host (`phase`, from the step and its state). Inside the step's `shard_map` a
component's local state reaches either the units' backward (`in_backward`: every micro-step, the new
state is the cotangent of the old) or the replica sync (`sync` replaces the
dense all-reduce over the replica axes in the phases it names); after the optimizer's update
(`update`) it becomes the next state, or stays the old one where the step is skipped (`keep`).

References:
  optax: `GradientTransformation(init, update)` (optax/_src/base.py).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding


def same(x):
  return x


@dataclasses.dataclass(frozen=True)
class Stored:
  """How a checkpoint holds one leaf of a component's state, in a layout that may restore onto another
  mesh or plan (`zerojax.train.state_spec`).

  Attributes:
    shape, dtype: of the stored array.
    sharding: of the stored array on the executor's mesh.
    to_logical: held leaf -> stored array (traced under `jit`).
    from_logical: stored array -> held leaf (traced under `jit`); it also gets the arrays `accepts` lets
      through, in their saved shape.
    fill: the value of every element when a checkpoint lacks the leaf (one saved without the component).
    accepts: saved shapes other than `shape` the leaf restores from (e.g. another replica count); None: none.
    read_sharding: the sharding such a saved shape is read with.
    seeds_replicas: a replica that joins (a node added on restore, `zerojax.train.replica`) starts its
      master weights from this leaf: the parameter named by the leaf's path below the component's sub-tree
      (DiLoCo's outer parameters, Algorithm 1).
  """
  shape: tuple[int, ...]
  dtype: Any
  sharding: NamedSharding
  to_logical: Callable = same
  from_logical: Callable = same
  fill: Any = 0
  accepts: Callable[[tuple], bool] | None = None
  read_sharding: Callable[[tuple], NamedSharding] | None = None
  seeds_replicas: bool = False

  def restores(self, saved_shape) -> bool:
    saved_shape = tuple(saved_shape)
    return saved_shape == self.shape or (self.accepts is not None and self.accepts(saved_shape))

  def fresh(self) -> np.ndarray:
    return np.full(self.shape, self.fill, self.dtype)


def keep(finite, new, old):
  """`new` where the step is finite, else `old` (a skipped step leaves the state as it was)."""
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def keep_replicas(finite, new, old):
  """`keep` per replica: `finite` is `[replicas]`, every leaf leads with the replica axis."""
  return jax.tree.map(lambda n, o: jnp.where(finite.reshape(finite.shape + (1,) * (n.ndim - 1)), n, o), new, old)


class Stateful(abc.ABC):
  """A plan's component with state across steps. Subclasses set the class attributes and implement
  the abstract `of`, `init`, `specs`, `memory_bytes`, `stored` and `refuse_restore` (a subclass missing
  one cannot be built); the step's hooks default to "not used", and `sync` is needed only by a
  component with `phases`.

  Attributes:
    name: the `TrainState` field that holds the state, and its top-level name in checkpoints.
    setting: the plan setting that turns the component on, for error messages.
    phases: the programs besides "dense" that `phase` picks; the last one is a run's steady state (the
      program `step.lower` lowers by default).
    in_backward: the units' backward updates the state every micro-step, as the cotangent of the old.
    replaces_sync: in its phases the component's `sync` replaces the replica all-reduce (Radius); False:
      its phases change only what happens after the update (`after_update`, DiLoCo's outer step).
    replica_axes: the mesh axes over which the master weights and optimizer states hold a distinct replica
      each (DiLoCo: the nodes); the train state then gives them a leading replica axis sharded over these
      axes, and the step never reduces over them. () for every other component.
  """
  name: ClassVar[str]
  setting: ClassVar[str]
  phases: ClassVar[tuple[str, ...]] = ()
  in_backward: ClassVar[bool] = False
  replaces_sync: ClassVar[bool] = True
  replica_axes: ClassVar[tuple[str, ...]] = ()

  @classmethod
  @abc.abstractmethod
  def of(cls, plan, mesh, layout, metas) -> "Stateful | None":
    """The component of a resolved `plan` on `mesh` for the parameter `layout` and the units' `metas`,
    or None when the plan does not use it."""

  @classmethod
  @abc.abstractmethod
  def refuse_restore(cls, where: str, key: str) -> str:
    """The one-line reason a checkpoint at `where` holding this component's state (e.g. the leaf `key`)
    does not restore into a run without the component."""

  @abc.abstractmethod
  def init(self, flat) -> Any:
    """The initial state (global arrays) given the flat master weights; traced under `jit`."""

  @abc.abstractmethod
  def specs(self) -> Any:
    """PartitionSpecs of the state on the executor's mesh (a tree like the state)."""

  def phase(self, state) -> str | None:
    """On the host: the program the step of `state` (a `TrainState`) runs, one of `phases`, or None."""
    return None

  def body_in(self, state, phase: str) -> tuple[Any, Any]:
    """`(values, specs)`: the part of the state the step's `shard_map` body takes in `phase`."""
    return None, None

  def body_out_specs(self, phase: str) -> Any:
    """PartitionSpecs of what the body returns for the component in `phase`."""
    return None

  def sync(self, grads, local, denom, phase: str) -> tuple[Any, Any]:
    """Inside the body, in a phase of `phases`: the replica sync (over the replica axes the component
    was built with). `grads` are the local gradient sums (reduced over A_os), `local` what `body_in`
    passed, `denom` devices x micro-batches; returns the mean gradients and the body's output for the
    component."""
    raise TypeError(f"{type(self).__name__} names phases {self.phases} but defines no sync for them")

  def update(self, state, out, updates, step, finite, phase: str) -> Any:
    """After the optimizer's update, outside the body: the next state from the body's output `out`, the
    optimizer's `updates` and the step; `finite` is False on a skipped step (then keep `state`)."""
    return state

  def after_update(self, own, params, phase: str, before) -> tuple[Any, Any]:
    """After the optimizer's update (and the skip of a non-finite step), outside the body: the component's
    state and the master weights, which it may replace (DiLoCo's outer step restarts every replica from
    the outer parameters). `before` is the master weights the step started from: what depends on them only
    may run concurrently with the step's forward and backward (Streaming DiLoCo's overlapped outer
    gradient). Default: both as they are."""
    return own, params

  @abc.abstractmethod
  def memory_bytes(self) -> int:
    """Bytes of the state per device."""

  @abc.abstractmethod
  def stored(self) -> list[Stored]:
    """How each leaf of the state is checkpointed, in the order of `jax.tree.leaves(state)`."""
