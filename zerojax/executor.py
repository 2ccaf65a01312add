"""The one executor: a train step driven by a `Plan` (DESIGN.md, "gradient flow for a plan").

Per step, inside one `jax.shard_map` over the ("node", "gpu") mesh:

0. gather the fp32 master shard (over A_os) into the parameter shard (over A_p), cast to the param dtype;
1. every micro-batch: forward and backward through the model's ZeRO units, each reducing its layer's
   gradient over A_g inside the backward pass; accumulate the G shard;
2. at the accumulation boundary: reduce-scatter over A_os \\ A_g, then all-reduce over the replica axes
   D \\ A_os (MiCS's 2-hop synchronisation, AMSP's T_os);
3. outside the shard_map, on sharded global arrays under `jit`: any elementwise optax transformation
   updates the master weights and optimizer states, so global reductions such as
   `clip_by_global_norm` are correct without hand-written collectives. A step whose loss or gradients
   are not finite is skipped (state unchanged) and counted.

With `plan.replica_sync = radius(...)` step 2's all-reduce is Radius's (Algorithm 1): each step runs one
of three compiled programs, picked on the host from the step and the last selection (`phase`):
"dense" (the warm-up, the plan's own step), "select" (dense all-reduce of gradient + residual, then
top-k of the optimizer's update per shard) or "sparse" (all-reduce of the k selected values only).

References:
  ZeRO: Rajbhandari et al. 2020, §5. MiCS: Zhang et al. 2022, §3.3. AMSP: Chen et al. 2023, §3.
  Radius: Zheng & Zhang, Algorithms 1–2.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import comm, layout as layout_lib
from zerojax import mesh as mesh_lib
from zerojax.mesh import axis_sizes, group_size
from zerojax.plan import Plan
from zerojax.unit import ShardedUnit, UnitMeta


class Model(NamedTuple):
  """A model written as ZeRO units.

  Attributes:
    init: `rng -> params`, a dict `{unit_name: pytree}` of logical parameters.
    loss: `(params, tokens) -> scalar` mean loss of a micro-batch; calls `zerojax.unit(f)(params[u], ...)`
      for every unit `u`, and `lax.scan` over the scanned units.
    scanned: names of the units whose leaves have a leading layer axis.
  """
  init: Callable[[jax.Array], dict]
  loss: Callable[[dict, jax.Array], jax.Array]
  scanned: frozenset = frozenset()


@flax.struct.dataclass
class RadiusState:
  """Radius's state (Algorithm 1): what a replica has not sent, and the window's selection."""
  residual: Any          # per leaf [replicas, (layers,) padded]: each replica's unsent gradient (mean units),
                         # sharded over the replica axes and, like the master weights, over A_os
  indices: Any           # per leaf [(layers,) shards * k] int32: each A_os shard's k positions, ascending
  selected_at: jax.Array  # step of the last selection; -1 before the first


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any            # fp32 master weights: flat padded leaves sharded over A_os
  opt_state: Any         # optimizer states, sharded like the master weights
  skipped: jax.Array     # steps skipped for non-finite loss or gradients (total)
  radius: RadiusState | None = None  # with plan.replica_sync = radius(...)


class StepMetrics(NamedTuple):
  loss: jax.Array
  grad_norm: jax.Array
  finite: jax.Array


class Executor:
  """Builds the sharded train state and the jitted train step of a model under a plan.

  Args:
    model: the model, written as ZeRO units.
    optimizer: an elementwise optax `GradientTransformation` (see `check_elementwise`).
    plan: the sharding plan.
    mesh: the ("node", "gpu") mesh (or a factoring of it); the executor factors it further for plans
      that name groups by size, and keeps the result as `self.mesh`.
    accum_steps: micro-batches per optimizer step (gradient accumulation).
    pad_multiple: leaves are padded to a multiple of (devices x lcm(pad_multiple, plan.alignment)).
  """

  def __init__(self, model: Model, optimizer: optax.GradientTransformation, plan: Plan, mesh: Mesh, *,
               accum_steps: int = 1, pad_multiple: int = 1):
    plan.check_groups(mesh)
    mesh = mesh_lib.factor(mesh, plan.groups())  # groups of k consecutive devices become mesh axes
    plan = plan.resolve(mesh)
    plan.validate(mesh)
    if accum_steps < 1:
      raise ValueError(f"accum_steps={accum_steps} must be at least 1")
    self.model, self.optimizer, self.plan, self.mesh = model, optimizer, plan, mesh
    self.accum_steps = accum_steps
    self.data_axes = tuple(mesh.axis_names)
    self.world = mesh.size
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    if not isinstance(shapes, dict):
      raise TypeError(f"model.init must return a dict of units, got {type(shapes).__name__}")
    self.layout = layout_lib.make_layout(shapes, model.scanned, mesh.size * math.lcm(pad_multiple, plan.alignment))
    self.param_specs = layout_lib.specs(self.layout, plan.opt_order)
    sizes = tuple(axis_sizes(mesh).items())
    self._metas = {}
    tree = self.layout.tree()
    for u in tree:
      leaves, treedef = jax.tree.flatten(tree[u], is_leaf=layout_lib.is_layout)
      self._metas[u] = UnitMeta(plan, sizes, treedef, tuple(leaves))
    self.batch_sharding = NamedSharding(mesh, P(None, self.data_axes))
    self._step = None
    self.replicas = plan.replica_axes(mesh)
    if plan.replica_sync is not None:  # Radius: k per A_os shard of every leaf (per layer)
      shards = group_size(mesh, plan.opt_order)
      self.radius_k = tuple(plan.replica_sync.shard_k(l.padded // shards) for l in self.layout.leaves)

  # -- state -----------------------------------------------------------------------------------------
  def shardings(self, state_shapes: TrainState | None = None) -> TrainState:
    """NamedShardings of every field of the train state."""
    state_shapes = state_shapes or jax.eval_shape(self._init_from_flat, self._flat_shapes())
    params = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.param_specs)
    rep = NamedSharding(self.mesh, P())
    by_ndim = {1: NamedSharding(self.mesh, P(self.plan.opt_order or None)),
               2: NamedSharding(self.mesh, P(None, self.plan.opt_order or None))}
    opt = jax.tree.map(lambda x: rep if x.ndim == 0 else by_ndim[x.ndim], state_shapes.opt_state)
    radius = None
    if self.plan.replica_sync is not None:
      radius = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._radius_specs())
    return TrainState(step=rep, params=params, opt_state=opt, skipped=rep, radius=radius)

  def _radius_specs(self) -> RadiusState:
    """PartitionSpecs of the Radius state: the residual has a leading replica axis."""
    res = jax.tree.map(lambda s: P(self.replicas, *s), self.param_specs, is_leaf=lambda s: isinstance(s, P))
    return RadiusState(residual=res, indices=self.param_specs, selected_at=P())

  def _flat_shapes(self):
    return jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.flat_shape(), jnp.float32), self.layout.tree(),
                        is_leaf=layout_lib.is_layout)

  def _init_from_flat(self, flat):
    check_elementwise(self.optimizer, flat)
    radius = None
    if self.plan.replica_sync is not None:
      reps, shards = group_size(self.mesh, self.replicas), group_size(self.mesh, self.plan.opt_order)
      leaves, treedef = jax.tree.flatten(flat)
      radius = RadiusState(
          residual=jax.tree.map(lambda x: jnp.zeros((reps,) + x.shape, jnp.float32), flat),
          indices=treedef.unflatten([jnp.tile(jnp.arange(k, dtype=jnp.int32), x.shape[:-1] + (shards,))
                                     for x, k in zip(leaves, self.radius_k)]),
          selected_at=jnp.full((), -1, jnp.int32))
    return TrainState(step=jnp.zeros((), jnp.int32), params=flat, opt_state=self.optimizer.init(flat),
                      skipped=jnp.zeros((), jnp.int32), radius=radius)

  def init(self, rng: jax.Array) -> TrainState:
    """Initialises the model and optimizer directly into the plan's sharded layout."""
    return self.init_from_params(jax.jit(self.model.init)(rng))

  def init_from_params(self, params: dict) -> TrainState:
    """Shards logical params (the model's own shapes) and initialises the optimizer."""
    flat = layout_lib.to_flat(params, self.layout, self.mesh, self.plan.opt_order)
    return jax.jit(self._init_from_flat, out_shardings=self.shardings())(flat)

  def logical_params(self, state: TrainState) -> dict:
    """The master weights in the model's own shapes, without padding (for evaluation or export)."""
    return layout_lib.to_logical(state.params, self.layout)

  # -- the step --------------------------------------------------------------------------------------
  def _units(self, p_shards: dict, sinks: dict, sync_axes: tuple[str, ...] = ()) -> dict:
    metas = {u: dataclasses.replace(m, sync_axes=sync_axes) for u, m in self._metas.items()}
    return {u: ShardedUnit(jax.tree.leaves(p_shards[u]), jax.tree.leaves(sinks[u]), metas[u]) for u in p_shards}

  def _param_shards(self, master):
    """Step 0: master shard over A_os -> parameter shard over A_p, in the param dtype."""
    to_p = self.plan.opt_order[len(self.plan.param_axes):]
    cast = lambda m: m.astype(self.plan.param_dtype)
    if not to_p:
      return jax.tree.map(cast, master)
    return jax.tree.map(lambda m: comm.all_gather_raw(cast(m), to_p, axis=m.ndim - 1, tiled=True),
                        master)

  def _local_grads(self, master, batch, residual=None, indices=None, phase="dense"):
    """shard_map body: master shard (over A_os) and local batch -> reduced gradient shard, mean loss;
    Radius's phases also take and return the residual (and the sparse one the window's indices)."""
    plan = self.plan
    p_shards = self._param_shards(master)
    k_g = group_size(self.mesh, plan.grad_axes)
    zeros_g = jax.tree.map(lambda l: jnp.zeros(l.flat_shape(k_g), plan.reduce_dtype), self.layout.tree(),
                           is_leaf=layout_lib.is_layout)

    def micro(acc, tokens):
      loss, g = jax.value_and_grad(lambda s: self.model.loss(self._units(p_shards, s), tokens))(zeros_g)
      return jax.tree.map(jnp.add, acc, g), loss

    to_os = plan.opt_order[len(plan.grad_order):]
    replicas = plan.replica_axes(self.mesh)
    if plan.sync_in_backward and replicas and not to_os and phase == "dense":
      # MiCS §3.4 with the boundary all-reduce overlapped: the window's last micro-step all-reduces each
      # unit's gradient (plus what the window accumulated) inside its backward, so layer i's all-reduce
      # runs while layer i-1's backward computes. The sums are the same as after the window.
      acc, losses = lax.scan(micro, zeros_g, batch[:-1])
      units = {}
      last = lambda s: self.model.loss(units.setdefault("u", self._units(p_shards, s, replicas)), batch[-1])
      loss, acc = jax.value_and_grad(last)(acc)
      self._check_single_calls(units["u"])
      losses = jnp.concatenate([losses, loss[None]])
    else:
      acc, losses = lax.scan(micro, zeros_g, batch)
      if to_os:
        acc = jax.tree.map(lambda g: lax.psum_scatter(g, to_os, scatter_dimension=g.ndim - 1, tiled=True), acc)
      if replicas and phase == "dense":
        acc = jax.tree.map(lambda g: lax.psum(g, replicas), acc)
    loss = lax.pmean(jnp.mean(losses), self.data_axes)
    # Each device's loss is a mean over its micro-batch: the global mean divides by W * accum once.
    denom = self.world * self.accum_steps
    if phase == "dense":
      return jax.tree.map(lambda g: g / denom, acc), loss
    grads, treedef = jax.tree.flatten(acc)
    res = [r[0] for r in jax.tree.leaves(residual)]  # this replica's row
    if phase == "select":  # Radius Algorithm 1 lines 8–11
      grads, res = comm.radius.dense_all_reduce(grads, res, replicas, denom)
    else:                  # lines 13–17
      grads, res = comm.radius.sparse_all_reduce(grads, res, jax.tree.leaves(indices), replicas, denom)
    return treedef.unflatten(grads), loss, treedef.unflatten([r[None] for r in res])

  def _select(self, updates):
    """shard_map body, Radius Algorithm 1 line 23: each shard's top-k positions of |update|."""
    leaves, treedef = jax.tree.flatten(updates)
    owner = mesh_lib.owner_index(self.plan.opt_order) if self.plan.opt_order else 0
    return treedef.unflatten([comm.radius.select(u, k, owner * u.shape[-1], lay.size)
                              for u, k, lay in zip(leaves, self.radius_k, self.layout.leaves)])

  def phase(self, state: TrainState) -> str:
    """The program a step of `state` runs: "dense", or with Radius "select" / "sparse" (Algorithm 1:
    dense before `dense_steps`, then a select step when `period` steps have passed since the last one
    (or none was made, e.g. after restoring a dense checkpoint), else sparse). Reads two scalars."""
    r = self.plan.replica_sync
    if r is None or int(state.step) < r.dense_steps:
      return "dense"
    at = int(state.radius.selected_at)
    return "select" if at < 0 or int(state.step) - at >= r.period else "sparse"

  @staticmethod
  def _check_single_calls(units: dict) -> None:
    for name, u in units.items():
      if len(u.meta.calls) > 1:
        raise ValueError(f"unit {name!r} is called {len(u.meta.calls)} times per micro-batch; the replica "
                         "all-reduce inside the backward (Plan.sync_in_backward) needs one call per unit: "
                         "set sync_in_backward=False in the plan, or make each call its own unit")

  def _train_step(self, state: TrainState, batch: jax.Array, phase: str = "dense"):
    data = P(None, self.data_axes)
    radius = state.radius
    if phase == "dense":
      grads, loss = jax.shard_map(
          self._local_grads, mesh=self.mesh, in_specs=(self.param_specs, data),
          out_specs=(self.param_specs, P()), check_vma=False)(state.params, batch)
    else:
      specs = self._radius_specs()
      grads, loss, residual = jax.shard_map(
          functools.partial(self._local_grads, phase=phase), mesh=self.mesh,
          in_specs=(self.param_specs, data, specs.residual, specs.indices),
          out_specs=(self.param_specs, P(), specs.residual), check_vma=False)(
              state.params, batch, radius.residual, radius.indices)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    if phase == "select":  # the update is -lr x Algorithm 2's corrected gradient: rank its magnitude
      indices = jax.shard_map(self._select, mesh=self.mesh, in_specs=(self.param_specs,),
                              out_specs=self.param_specs, check_vma=False)(updates)
      radius = keep(RadiusState(residual, indices, state.step), radius)
    elif phase == "sparse":
      radius = radius.replace(residual=keep(residual, radius.residual))
    new = TrainState(step=state.step + 1, params=keep(params, state.params),
                     opt_state=keep(opt_state, state.opt_state),
                     skipped=state.skipped + (~finite).astype(jnp.int32), radius=radius)
    return new, StepMetrics(loss, grad_norm, finite)

  def step_fn(self, state_shardings: TrainState | None = None):
    """The jitted `(state, batch[accum, global_batch, seq + 1]) -> (state, StepMetrics)`; donates state.

    With Radius the step runs the program of `phase(state)`, each compiled on first use;
    `step.lower(state, batch, phase=None)` lowers one (default: "sparse" with Radius, else "dense").
    """
    if self._step is None:
      sh = state_shardings or self.shardings()
      programs = {}

      def program(phase):
        if phase not in programs:
          programs[phase] = jax.jit(functools.partial(self._train_step, phase=phase),
                                    in_shardings=(sh, self.batch_sharding),
                                    out_shardings=(sh, NamedSharding(self.mesh, P())), donate_argnums=0)
        return programs[phase]

      def step(state, batch):
        self.check_batch(batch.shape)
        return program(self.phase(state))(state, batch)
      default = "dense" if self.plan.replica_sync is None else "sparse"
      step.lower = lambda state, batch, phase=None: program(phase or default).lower(state, batch)
      self._step = step
    return self._step

  def check_batch(self, shape: tuple[int, ...]) -> None:
    """Raises a clear error for a batch the step cannot shard: `[accum, global_batch, seq + 1]`."""
    if len(shape) != 3 or shape[0] != self.accum_steps:
      raise ValueError(f"batch of shape {tuple(shape)} should be [accum_steps={self.accum_steps}, "
                       "global_batch, seq_len + 1]")
    if shape[1] % self.world:
      raise ValueError(f"global batch size {shape[1]} is not divisible by the {self.world} devices of the "
                       f"mesh; use a multiple of {self.world}")

  def eval_fn(self):
    """Jitted mean loss of a batch `[global_batch, seq + 1]` (forward only)."""
    def local(master, tokens):
      shards = self._param_shards(master)
      return lax.pmean(self.model.loss(self._units(shards, shards), tokens), self.data_axes)
    return jax.jit(jax.shard_map(local, mesh=self.mesh, in_specs=(self.param_specs, P(self.data_axes)),
                                 out_specs=P(), check_vma=False))


def check_elementwise(optimizer: optax.GradientTransformation, flat_params) -> None:
  """Rejects optimizers whose state is not elementwise (e.g. adafactor's factored moments).

  On flat padded shards, a factored second moment would be computed over the wrong axes, so every
  non-scalar optimizer-state leaf must have the shape of a parameter leaf.
  """
  shapes = {tuple(x.shape) for x in jax.tree.leaves(flat_params)}
  state = jax.eval_shape(optimizer.init, flat_params)
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    if x.ndim and tuple(x.shape) not in shapes:
      raise ValueError(
          f"optimizer state leaf {jax.tree_util.keystr(path)} has shape {tuple(x.shape)}, which is not the "
          "shape of any flat parameter shard: factored optimizers (adafactor, ...) are not valid on ZeRO's "
          "flat shards; use an elementwise one (adamw, lion, sgd, ...)")
