"""A communication component that carries state across steps, declared like an optax transformation.

docs/DESIGN.md, "State across steps". optax makes each feature a `GradientTransformation(init, update)`
that owns its state; here a component of a plan that must remember something from one step to the next
(what a quantization dropped; a replica's unsent gradient and its selection) is a `Stateful`: its core
says how its state is created (`init`), sharded (`specs`),
updated after the optimizer (`update`), checkpointed (`stored`) and counted (`memory_bytes`); what else
the step does with it is a capability it declares by subclassing (`InBackward`, `Phased`,
`SyncsReplicas`, `ReplacesWeights`). The executor, the checkpoint spec (`zerojax.train.state_spec`) and the
memory report iterate over the plan's components (`zerojax.state.train_state.stateful_components`) and never
name one. Its state lives in the train state's `stateful` mapping under the component's `name`.

A step runs one compiled program per *phase*: "dense" (no component changes the replica sync) or one a
component picks on the host (`phase`, from the step and its state). Inside the step's `shard_map` a
component's local state reaches either the units' backward (`InBackward`: every micro-step, the new
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

from zerojax.engine.unit import StateKey


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


class Stateful(abc.ABC):
  """A plan's component with state across steps: the core every such component has. Subclasses set
  `name` and `setting` and implement the abstract `of`, `init`, `specs`, `stored`, `memory_bytes` and
  `refuse_restore` (a subclass missing one cannot be built). What the step does with the state beyond
  its `update` is a capability, a subclass below: `InBackward` (the units' backward carries it),
  `Phased` (it picks the step's program on the host), `SyncsReplicas` (its `sync` replaces the replica
  all-reduce in its phases) and `ReplacesWeights` (its `after_update` may replace the master weights).

  Attributes:
    name: the component's key in the train state's `stateful` mapping and its top-level name in
      checkpoints.
    setting: the plan setting that turns the component on, for error messages.
  """
  name: ClassVar[str]
  setting: ClassVar[str]

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

  def update(self, state, out, updates, step, finite, phase: str) -> Any:
    """After the optimizer's update, outside the step's `shard_map`: the next state from the body's output
    `out`, the optimizer's `updates` and the step; `finite` is False on a skipped step (then keep `state`)."""
    return state

  def body_in(self, state, phase: str) -> tuple[Any, Any]:
    """`(values, specs)`: the part of the state the step's `shard_map` body takes in `phase` (none)."""
    return None, None

  def body_out_specs(self, phase: str) -> Any:
    """PartitionSpecs of what the body returns for the component in `phase` (nothing)."""
    return None

  @abc.abstractmethod
  def memory_bytes(self) -> int:
    """Bytes of the state per device."""

  @abc.abstractmethod
  def stored(self) -> list[Stored]:
    """How each leaf of the state is checkpointed, in the order of `jax.tree.leaves(state)`."""


class InBackward(Stateful, StateKey):
  """Capability: the units' backward updates the state every micro-step, as the cotangent of the old
  (qgZ's error feedback). `body_in` passes this device's part into the step's `shard_map`; there the
  component builds each unit's value (`unit_states`), which reaches the unit under the component's own
  key (`zerojax.engine.unit.StateKey`: `error`, `backward`); the body's output is the cotangent of its
  part, each unit's new value in place of the old."""

  @abc.abstractmethod
  def unit_states(self, local) -> dict:
    """Inside the body: `{unit: value}` from `local`, what `body_in` passed (a scanned unit's value leads
    with the layer axis). Each unit is called once per micro-step, so the cotangent of `local` is the
    new state."""


class Phased(Stateful):
  """Capability: the component picks the step's program on the host.

  Attributes:
    phases: the programs besides "dense" that `phase` picks; the last one is a run's steady state (the
      program `step.lower` lowers by default).
  """
  phases: tuple[str, ...] = ()

  @abc.abstractmethod
  def phase(self, state) -> str | None:
    """On the host: the program the step of `state` (a `TrainState`) runs, one of `phases`, or None."""


class SyncsReplicas(Phased):
  """Capability: in its phases the component's `sync` replaces the dense all-reduce over the replica
  axes (Radius's sparse sync)."""

  @abc.abstractmethod
  def sync(self, grads, local, denom, phase: str) -> tuple[Any, Any]:
    """Inside the body, in a phase of `phases`: the replica sync (over the replica axes the component
    was built with). `grads` are the local gradient sums (reduced over A_os), `local` what `body_in`
    passed, `denom` devices x micro-batches; returns the mean gradients and the body's output for the
    component."""


class ReplacesWeights(Phased):
  """Capability: after the update, in its phases, the component may replace the master weights (DiLoCo's
  outer step restarts every replica from the outer parameters)."""

  @abc.abstractmethod
  def after_update(self, own, params, phase: str, before) -> tuple[Any, Any]:
    """After the optimizer's update (and the skip of a non-finite step), outside the body: the component's
    state and the master weights. `before` is the master weights the step started from: what depends on
    them only may run concurrently with the step's forward and backward (Streaming DiLoCo's overlapped
    outer gradient)."""
