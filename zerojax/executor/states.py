"""The executor's train state: its creation directly into the plan's sharded layout (per unit, as FSDP
initialises), the shardings of every field, and the logical views (the user's tree, unpadded).

`TrainStates` is built by `zerojax.executor.Executor` from the objects it names; where each field lives
(one copy or one per replica, device or host memory) it asks the `Placement`.

References:
  ZeRO: Rajbhandari et al. 2020, §5 (each device holds its partition of the model states).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.engine import layout as layout_lib
from zerojax.engine.model import Model, user_views
from zerojax.state.placement import Placement
from zerojax.state.train_state import TrainState


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStates:
  """Creation, shardings and logical views of an `Executor`'s train state.

  Attributes:
    model: the model (its units' `init`, mutable collections, rng use, user-tree views).
    optimizer: the optimizer on the flat layout (`zerojax.engine.logical.logical_optimizer`).
    layout: the parameter layout.
    placement: where each field lives (`zerojax.state.placement`).
    stateful: `{TrainState field: component}`, the plan's stateful components.
  """
  model: Model
  optimizer: optax.GradientTransformation
  layout: layout_lib.Layout
  placement: Placement
  stateful: dict

  @property
  def mesh(self) -> Mesh:
    return self.placement.mesh

  def to_user(self, tree):
    return user_views(self.model)[0](tree)

  def from_user(self, tree):
    return user_views(self.model)[1](tree)

  def shardings(self, state_shapes: TrainState | None = None) -> TrainState:
    """NamedShardings of every field of the train state."""
    state_shapes = state_shapes or jax.eval_shape(self.init_from_flat, self.flat_shapes())
    where = self.placement
    params = jax.tree.map(lambda s: NamedSharding(self.mesh, s), where.param_specs)
    rep = NamedSharding(self.mesh, P())
    opt = jax.tree.map(lambda x: where.opt_sharding(x.ndim), state_shapes.opt_state)
    params = where.offload.place("params", params, state_shapes.params)  # the fields in host memory
    opt = where.offload.place("opt_state", opt, state_shapes.opt_state)
    forward = None if state_shapes.forward is None else jax.tree.map(
        lambda s: NamedSharding(self.mesh, s), where.param_specs)  # on the device, sharded as the master weights
    return TrainState(step=rep, params=params, opt_state=opt, skipped=NamedSharding(self.mesh, where.spec()),
                      forward=forward, rng=jax.tree.map(lambda _: rep, state_shapes.rng),
                      mutable=jax.tree.map(lambda _: rep, state_shapes.mutable),
                      stateful={n: jax.tree.map(lambda s: NamedSharding(self.mesh, s), c.specs())
                                for n, c in self.stateful.items()})

  def flat_shapes(self):
    return jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.flat_shape(), jnp.float32), self.layout.tree(),
                        is_leaf=layout_lib.is_layout)

  def init_from_flat(self, flat, rng=None, mutable=None):
    model, key = self.model, jax.random.key(0)
    if model.rng:
      rng = jax.random.key_data(jax.random.fold_in(key if rng is None else rng, 1))
    if model.init_state is not None and mutable is None:
      mutable = model.init_state(key)
    offload = self.placement.offload  # offloaded fields are written to host memory as they are made
    params, opt_state, skipped = self.placement.init(offload.fetch("params", flat), self.optimizer.init)
    opt_state = offload.store("opt_state", opt_state)
    return TrainState(step=jnp.zeros((), jnp.int32), params=offload.store("params", params), opt_state=opt_state,
                      skipped=skipped, forward=offload.forward_copy(params), rng=rng if model.rng else None,
                      mutable=mutable if model.init_state is not None else None,
                      stateful={n: c.init(flat) for n, c in self.stateful.items()})

  def derive(self, state: TrainState) -> TrainState:
    """`state` with its derived field rebuilt from its master weights (`TrainState.forward`, the rounding
    the forward reads where offloaded master weights keep it on the device; a checkpoint stores none)."""
    offload = self.placement.offload
    return state.replace(forward=offload.forward_copy(offload.fetch("params", state.params)))

  def init(self, rng: jax.Array) -> TrainState:
    """Initialises the model and optimizer directly into the plan's sharded layout.

    Each unit is created by its own jitted program whose outputs are the unit's flat shards (the rest of
    `model.init` is dead code there), so no device ever holds more than its shards plus one unit's full
    parameters (FSDP's per-unit initialisation).
    """
    return self._init_state({u: f(rng) for u, f in self.init_programs().items()}, rng)

  def init_programs(self) -> dict:
    """`{unit: jitted rng -> the unit's flat master shards}`, the programs `init` runs."""
    programs, offload = {}, self.placement.offload
    for u, spec in self.placement.master_specs.items():
      make = lambda r, u=u: offload.store("params", jax.tree.map(
          lambda x, l: layout_lib.flatten_leaf(x.astype(jnp.float32), l), self.model.init(r)[u],
          self.layout.tree()[u]))  # offloaded master weights go to host memory unit by unit
      shapes = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.flat_shape(), jnp.float32), self.layout.tree()[u],
                            is_leaf=layout_lib.is_layout)
      out = offload.place("params", jax.tree.map(lambda s: NamedSharding(self.mesh, s), spec), shapes)
      programs[u] = jax.jit(make, out_shardings=out)
    return programs

  def init_from_params(self, params, mutable=None) -> TrainState:
    """Shards logical params (the model's `{unit: ...}` dict, or the user's tree) and initialises the
    optimizer; `mutable` is the model's mutable collections (default: `Model.init_state`'s)."""
    if self.model.from_user is not None and not _same_structure(params, self.layout.tree()):
      params = self.from_user(params)
    flat = layout_lib.to_flat(params, self.layout, self.mesh, self.placement.opt_order)
    return self._init_state(flat, jax.random.key(0), mutable)

  def _init_state(self, flat, rng, mutable=None) -> TrainState:
    if self.model.init_state is not None and mutable is None:
      mutable = jax.jit(self.model.init_state)(rng)
    return jax.jit(self.init_from_flat, out_shardings=self.shardings())(flat, rng, mutable)

  def logical_params(self, state: TrainState, device=None):
    """The master weights in the user's tree and shapes (flax's `params`), without padding.

    Placement: with `device=None` each leaf is a global array still laid out over the executor's mesh
    (as the master weights are), so a program jitted on them is partitioned over the mesh. Pass a
    `jax.Device` (e.g. `jax.devices()[0]`) or a `jax.sharding.Sharding` to get them there instead, e.g.
    for evaluation or `save_pretrained` on one device; `jax.device_get` of the result gives numpy arrays.
    Across several processes every process calls it with `device=None` (see `zerojax.train.export`).
    """
    params = self.to_user(layout_lib.to_logical(self.placement.first(state.params), self.layout))
    return params if device is None else _put(params, device)

  def logical_variables(self, state: TrainState, device=None) -> dict:
    """`{"params": logical_params(state), **mutable collections}`: what flax's `apply` takes (copies, so
    they outlive the state, which the step donates); `device` places them as in `logical_params`."""
    out = {"params": self.logical_params(state), **jax.tree.map(jnp.copy, state.mutable or {})}
    return out if device is None else _put(out, device)

  def user_layout(self):
    """The `LeafLayout`s in the user's tree (what the optimizer and its states are named by)."""
    return self.to_user(self.layout.tree())


def _put(tree, device):
  """`tree` on one device or under a sharding, for `logical_params(state, device=...)`."""
  if not isinstance(device, (jax.Device, jax.sharding.Sharding)):
    raise TypeError(f"device={device!r}: pass a jax.Device (e.g. jax.devices()[0]) or a jax.sharding.Sharding")
  return jax.device_put(tree, device)


def _same_structure(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b, is_leaf=layout_lib.is_layout)
