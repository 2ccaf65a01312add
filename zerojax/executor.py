"""The one executor: a train step driven by a `Plan` (docs/DESIGN.md, "The flow of one step").

Per step, inside one `jax.shard_map` over the ("node", "gpu") mesh:

0. gather the fp32 master shard (over A_os) into the parameter shard (over A_p), cast to the param dtype;
1. every micro-batch: forward and backward through the model's ZeRO units, each reducing its layer's
   gradient over A_g inside the backward pass; accumulate the G shard;
2. at the accumulation boundary: reduce-scatter over A_os \\ A_g, then all-reduce over the replica axes
   D \\ A_os (MiCS's 2-hop synchronisation, AMSP's T_os);
3. outside the shard_map, on sharded global arrays under `jit`: any elementwise optax transformation
   updates the master weights and optimizer states, so global reductions such as
   `clip_by_global_norm` are correct without hand-written collectives. It sees the user's tree, each leaf
   with its logical rank (`zerojax.logical`). A step whose loss or gradients are not finite is skipped
   (state unchanged) and counted.

A batch is any pytree whose leaves lead with `[accum, global_batch, ...]`, sharded over all data axes.
Each micro-batch gets an rng folded by step, micro-step and data-parallel rank; a model's mutable
collections (BatchNorm statistics) are carried through the micro-batches on each device and averaged
over the devices at the end of the step, as data-parallel training with per-device statistics does.

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
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import comm, fidelity, gpu_aot, layout as layout_lib, logical as logical_lib
from zerojax import mesh as mesh_lib
from zerojax.mesh import axis_sizes, group_size
from zerojax.model import Model, identity, call_loss  # noqa: F401  (re-exported)
from zerojax.plan import Plan
from zerojax.unit import ShardedUnit, UnitMeta



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
  rng: Any = None        # uint32 key data of the run's rng (models with `Model.rng`), replicated
  mutable: Any = None    # the model's mutable collections (`Model.init_state`), replicated
  radius: RadiusState | None = None  # with plan.replica_sync = radius(...)
  grad_error: Any = None  # with plan.grad_error_feedback: {unit: (e_send, e_node)} (`zerojax.fidelity`)


class StepMetrics(NamedTuple):
  loss: jax.Array
  grad_norm: jax.Array
  finite: jax.Array
  aux: Any = None        # the loss's aux, averaged over micro-batches and devices (`Model.has_aux`)


class Executor:
  """Builds the sharded train state and the jitted train step of a model under a plan.

  Args:
    model: the model, written as ZeRO units.
    optimizer: an elementwise optax `GradientTransformation`; it sees the user's tree with each leaf's
      logical rank (`zerojax.logical`), and one that needs more of a leaf's shape is refused.
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
    self.to_user, self.from_user = model.to_user or identity, model.from_user or identity
    self.user_optimizer = optimizer
    self.optimizer = logical_lib.logical_optimizer(optimizer, self.layout, self.to_user, self.from_user)
    self.param_specs = layout_lib.specs(self.layout, plan.opt_order)
    sizes = tuple(axis_sizes(mesh).items())
    self._metas = {}
    tree = self.layout.tree()
    for u in tree:
      leaves, treedef = jax.tree.flatten(tree[u], is_leaf=layout_lib.is_layout)
      self._metas[u] = UnitMeta(plan, sizes, treedef, tuple(leaves), scanned=u in model.scanned)
    self.error_shapes = fidelity.error_shapes(plan, mesh, self._metas)
    self.batch_sharding = NamedSharding(mesh, P(None, self.data_axes))
    self._step = None
    self._checked = False
    self.replicas = plan.replica_axes(mesh)
    if plan.replica_sync is not None:  # Radius: k per A_os shard of every leaf (per layer)
      shards = group_size(mesh, plan.opt_order)
      self.radius_k = tuple(plan.replica_sync.shard_k(l.padded // shards) for l in self.layout.leaves)

  # -- state -----------------------------------------------------------------------------------------
  def shardings(self, state_shapes: TrainState | None = None) -> TrainState:
    """NamedShardings of every field of the train state."""
    state_shapes = state_shapes or jax.eval_shape(self.init_from_flat, self.flat_shapes())
    params = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.param_specs)
    rep = NamedSharding(self.mesh, P())
    by_ndim = {1: NamedSharding(self.mesh, P(self.plan.opt_order or None)),
               2: NamedSharding(self.mesh, P(None, self.plan.opt_order or None))}
    opt = jax.tree.map(lambda x: rep if x.ndim == 0 else by_ndim[x.ndim], state_shapes.opt_state)
    radius = None
    if self.plan.replica_sync is not None:
      radius = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._radius_specs())
    errors = jax.tree.map(lambda s: NamedSharding(self.mesh, s), fidelity.error_specs(self.error_shapes, self.mesh))
    return TrainState(step=rep, params=params, opt_state=opt, skipped=rep,
                      rng=jax.tree.map(lambda _: rep, state_shapes.rng),
                      mutable=jax.tree.map(lambda _: rep, state_shapes.mutable), radius=radius, grad_error=errors)

  def _radius_specs(self) -> RadiusState:
    """PartitionSpecs of the Radius state: the residual has a leading replica axis."""
    res = jax.tree.map(lambda s: P(self.replicas, *s), self.param_specs, is_leaf=lambda s: isinstance(s, P))
    return RadiusState(residual=res, indices=self.param_specs, selected_at=P())

  def flat_shapes(self):
    return jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.flat_shape(), jnp.float32), self.layout.tree(),
                        is_leaf=layout_lib.is_layout)

  def init_from_flat(self, flat, rng=None, mutable=None):
    check_elementwise(self.optimizer, flat)
    model, key = self.model, jax.random.key(0)
    if model.rng:
      rng = jax.random.key_data(jax.random.fold_in(key if rng is None else rng, 1))
    if model.init_state is not None and mutable is None:
      mutable = model.init_state(key)
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
                      skipped=jnp.zeros((), jnp.int32), rng=rng if model.rng else None,
                      mutable=mutable if model.init_state is not None else None, radius=radius,
                      grad_error=fidelity.init_errors(self.error_shapes))

  def init(self, rng: jax.Array) -> TrainState:
    """Initialises the model and optimizer directly into the plan's sharded layout.

    Each unit is created by its own jitted program whose outputs are the unit's flat shards (the rest of
    `model.init` is dead code there), so no device ever holds more than its shards plus one unit's full
    parameters (FSDP's per-unit initialisation).
    """
    return self._init_state({u: f(rng) for u, f in self.init_programs().items()}, rng)

  def init_programs(self) -> dict:
    """`{unit: jitted rng -> the unit's flat master shards}`, the programs `init` runs."""
    programs = {}
    for u, spec in self.param_specs.items():
      make = lambda r, u=u: jax.tree.map(lambda x, l: layout_lib.flatten_leaf(x.astype(jnp.float32), l),
                                         self.model.init(r)[u], self.layout.tree()[u])
      programs[u] = jax.jit(make, out_shardings=jax.tree.map(lambda s: NamedSharding(self.mesh, s), spec))
    return programs

  def init_from_params(self, params, mutable=None) -> TrainState:
    """Shards logical params (the model's `{unit: ...}` dict, or the user's tree) and initialises the
    optimizer; `mutable` is the model's mutable collections (default: `Model.init_state`'s)."""
    if self.model.from_user is not None and not _same_structure(params, self.layout.tree()):
      params = self.from_user(params)
    flat = layout_lib.to_flat(params, self.layout, self.mesh, self.plan.opt_order)
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
    params = self.to_user(layout_lib.to_logical(state.params, self.layout))
    return params if device is None else _put(params, device)

  def logical_variables(self, state: TrainState, device=None) -> dict:
    """`{"params": logical_params(state), **mutable collections}`: what flax's `apply` takes (copies, so
    they outlive the state, which the step donates); `device` places them as in `logical_params`."""
    out = {"params": self.logical_params(state), **jax.tree.map(jnp.copy, state.mutable or {})}
    return out if device is None else _put(out, device)

  def user_layout(self):
    """The `LeafLayout`s in the user's tree (what the optimizer and its states are named by)."""
    return self.to_user(self.layout.tree())

  # -- the step --------------------------------------------------------------------------------------
  def _units(self, p_shards: dict, sinks: dict, sync_axes: tuple[str, ...] = (), qgz: dict | None = None) -> dict:
    metas = {u: dataclasses.replace(m, sync_axes=sync_axes) for u, m in self._metas.items()}
    qgz = qgz or {}
    return {u: ShardedUnit(jax.tree.leaves(p_shards[u]), jax.tree.leaves(sinks[u]), metas[u],
                           qgz.get(u, (None, None))) for u in p_shards}

  def _param_shards(self, master):
    """Step 0: master shard over A_os -> parameter shard over A_p, in the param dtype."""
    to_p = self.plan.opt_order[len(self.plan.param_axes):]
    cast = lambda m: m.astype(self.plan.param_dtype)
    if not to_p:
      return jax.tree.map(cast, master)
    return jax.tree.map(lambda m: comm.all_gather_raw(cast(m), to_p, axis=m.ndim - 1, tiled=True),
                        master)

  def _local_grads(self, master, batch, step=None, rng=None, mutable=None, errors=None, residual=None,
                   indices=None, phase="dense"):
    """shard_map body: master shard (over A_os), local batch, the step, the run's rng, the mutable
    collections and qgZ's error feedback rows -> reduced gradient shard, mean loss, mean aux,
    device-averaged mutable collections, new error rows; Radius's phases also take and return the
    residual (and the sparse one the window's indices)."""
    plan, model = self.plan, self.model
    p_shards, k_g = self._param_shards(master), group_size(self.mesh, plan.grad_axes)
    zeros_g = jax.tree.map(lambda l: jnp.zeros(l.flat_shape(k_g), plan.reduce_dtype), self.layout.tree(),
                           is_leaf=layout_lib.is_layout)
    rank = lax.axis_index(self.data_axes)  # node-major, as the batch is sharded
    key = lambda i: None if rng is None else jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(rng), step), i), rank)
    if not self._checked:  # once per executor: every use of a parameter shard is a unit's
      mb = jax.tree.map(lambda x: x[0], batch)
      jaxpr = jax.make_jaxpr(lambda sh: call_loss(model, self._units(sh, zeros_g), mb, key(0), mutable)[0])(
          p_shards)
      logical_lib.check_units_own_params(jaxpr.jaxpr, jaxpr.jaxpr.invars)
      self._checked = True

    qgz = lambda e, i: fidelity.unit_states(plan, self._metas, e, step, i, rank)

    def micro(carry, xs):
      acc, mut, err = carry
      mb, i = xs
      units = {}
      def f(s, e):
        u = units.setdefault("u", self._units(p_shards, s, qgz=qgz(e, i)))
        loss, aux, new = call_loss(model, u, mb, key(i), mut)
        return loss, (aux, new)
      (loss, (aux, mut)), (g, err) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(zeros_g, err)
      if plan.grad_error_feedback:  # each unit's errors are its one backward's cotangent
        self._check_single_calls(units["u"], "grad_error_feedback=True")
      return (jax.tree.map(jnp.add, acc, g), mut, err), (loss, aux)

    to_os = plan.opt_order[len(plan.grad_order):]
    replicas = plan.replica_axes(self.mesh)
    index = jnp.arange(self.accum_steps)
    if plan.sync_in_backward and replicas and not to_os and phase == "dense":
      # MiCS §3.4 with the boundary all-reduce overlapped: the window's last micro-step all-reduces each
      # unit's gradient (plus what the window accumulated) inside its backward, so layer i's all-reduce
      # runs while layer i-1's backward computes. The sums are the same as after the window.
      head = jax.tree.map(lambda x: x[:-1], batch)
      (acc, mutable, errors), (losses, aux) = lax.scan(micro, (zeros_g, mutable, errors), (head, index[:-1]))
      last_mb, units = jax.tree.map(lambda x: x[-1], batch), {}

      def last(s, e):
        u = units.setdefault("u", self._units(p_shards, s, replicas, qgz(e, self.accum_steps - 1)))
        loss, aux_l, new = call_loss(model, u, last_mb, key(self.accum_steps - 1), mutable)
        return loss, (aux_l, new)
      (loss_l, (aux_l, mutable)), (acc, errors) = jax.value_and_grad(last, (0, 1), has_aux=True)(acc, errors)
      self._check_single_calls(units["u"])
      losses = jnp.concatenate([losses, loss_l[None]])
      aux = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), aux, aux_l)
    else:
      (acc, mutable, errors), (losses, aux) = lax.scan(micro, (zeros_g, mutable, errors), (batch, index))
      if to_os:
        acc = jax.tree.map(lambda g: lax.psum_scatter(g, to_os, scatter_dimension=g.ndim - 1, tiled=True), acc)
      if replicas and phase == "dense":
        acc = jax.tree.map(lambda g: lax.psum(g, replicas), acc)
    loss = lax.pmean(jnp.mean(losses), self.data_axes)
    aux = jax.tree.map(lambda a: lax.pmean(jnp.mean(_inexact(a), axis=0), self.data_axes), aux)
    mutable = jax.tree.map(lambda m: lax.pmean(m, self.data_axes) if _is_inexact(m) else m, mutable)
    # Each device's loss is a mean over its micro-batch: the global mean divides by W * accum once.
    denom = self.world * self.accum_steps
    if phase == "dense":
      return jax.tree.map(lambda g: g / denom, acc), loss, aux, mutable, errors
    grads, treedef = jax.tree.flatten(acc)
    res = [r[0] for r in jax.tree.leaves(residual)]  # this replica's row
    if phase == "select":  # Radius Algorithm 1 lines 8–11
      grads, res = comm.radius.dense_all_reduce(grads, res, replicas, denom)
    else:                  # lines 13–17
      grads, res = comm.radius.sparse_all_reduce(grads, res, jax.tree.leaves(indices), replicas, denom)
    return treedef.unflatten(grads), loss, aux, mutable, errors, treedef.unflatten([r[None] for r in res])

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
  def _check_single_calls(units: dict, field: str = "sync_in_backward=True") -> None:
    for name, u in units.items():
      if len(u.meta.calls) > 1:
        raise ValueError(f"unit {name!r} is called {len(u.meta.calls)} times per micro-batch; the plan's "
                         f"{field} needs one call per unit: set it to False in the plan, or make each call "
                         "its own unit")

  def _train_step(self, state: TrainState, batch, phase: str = "dense"):
    data = P(None, self.data_axes)
    radius = state.radius
    args = (state.params, batch, state.step, state.rng, state.mutable, state.grad_error)
    err_specs = fidelity.error_specs(self.error_shapes, self.mesh)
    specs_in = (self.param_specs, data, P(), P(), P(), err_specs)
    if phase == "dense":
      grads, loss, aux, mutable, errors = jax.shard_map(
          self._local_grads, mesh=self.mesh, in_specs=specs_in,
          out_specs=(self.param_specs, P(), P(), P(), err_specs), check_vma=False)(*args)
    else:
      specs = self._radius_specs()
      grads, loss, aux, mutable, errors, residual = jax.shard_map(
          functools.partial(self._local_grads, phase=phase), mesh=self.mesh,
          in_specs=specs_in + (specs.residual, specs.indices),
          out_specs=(self.param_specs, P(), P(), P(), err_specs, specs.residual), check_vma=False)(
              *args, radius.residual, radius.indices)
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
                     skipped=state.skipped + (~finite).astype(jnp.int32), rng=state.rng,
                     mutable=keep(mutable, state.mutable), radius=radius,
                     grad_error=keep(errors, state.grad_error))
    return new, StepMetrics(loss, grad_norm, finite, aux)

  def step_fn(self, state_shardings: TrainState | None = None):
    """The jitted `(state, batch) -> (state, StepMetrics)`; donates state.

    `batch` is a pytree (numpy or jax arrays) whose leaves lead with `[accum, global_batch, ...]`, or
    with `[global_batch, ...]` when `accum_steps == 1`; see `shard_batch`. With Radius the step runs the
    program of `phase(state)`, each compiled on first use; `step.lower(state, batch, phase=None)` lowers
    one (default: "sparse" with Radius, else "dense"). On GPUs it compiles with
    `zerojax.gpu_aot.GPU_COMPILER_OPTIONS`.
    """
    if self._step is None:
      sh = state_shardings or self.shardings()
      programs = {}

      def program(phase):
        if phase not in programs:
          programs[phase] = jax.jit(functools.partial(self._train_step, phase=phase),
                                    in_shardings=(sh, self.batch_sharding),
                                    out_shardings=(sh, NamedSharding(self.mesh, P())), donate_argnums=0,
                                    compiler_options=gpu_aot.compiler_options(self.mesh) or None)
        return programs[phase]

      def step(state, batch):
        return program(self.phase(state))(state, self.shard_batch(batch))
      default = "dense" if self.plan.replica_sync is None else "sparse"
      step.lower = lambda state, batch, phase=None: program(phase or default).lower(state, batch)
      self._step = step
    return self._step

  def shard_batch(self, batch):
    """`batch` as the step takes it: every leaf `[accum, global_batch, ...]`, sharded over the data axes
    (a leaf `[global_batch, ...]` gets the accumulation axis when `accum_steps == 1`)."""
    batch = self._with_accum_axis(batch)
    self.check_batch(batch)
    put = lambda x: (x if isinstance(x, jax.Array) and x.sharding == self.batch_sharding
                     else jax.device_put(x, self.batch_sharding))
    return jax.tree.map(put, batch)

  def _with_accum_axis(self, batch):
    if self.accum_steps != 1:
      return batch
    example = self.model.example_batch
    if example is not None and jax.tree.structure(example) == jax.tree.structure(batch):
      return jax.tree.map(lambda x, e: x[None] if np.ndim(x) == len(e.shape) else x, batch, example)
    if all(np.ndim(x) >= 2 and np.shape(x)[0] == 1 for x in jax.tree.leaves(batch)):
      return batch
    return jax.tree.map(lambda x: x[None], batch)

  def check_batch(self, batch) -> None:
    """Raises a one-line error for a batch the step cannot shard: every leaf must lead with
    `[accum_steps, global_batch]`, global_batch the same for all leaves and divisible by the devices.

    Args:
      batch: a pytree of arrays (or `ShapeDtypeStruct`s), or the shape tuple of a one-array batch.
    """
    if isinstance(batch, tuple) and all(isinstance(d, int) for d in batch):
      batch = jax.ShapeDtypeStruct(batch, jnp.int32)
    sizes = set()
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
      shape, name = tuple(np.shape(x)), jax.tree_util.keystr(path) or "batch"
      if len(shape) < 2 or shape[0] != self.accum_steps:
        raise ValueError(f"batch leaf {name} of shape {shape} should be [accum_steps={self.accum_steps}, "
                         "global_batch, ...] (or [global_batch, ...] when accum_steps=1)")
      sizes.add(shape[1])
    if len(sizes) > 1:
      raise ValueError(f"batch leaves have different global batch sizes {sorted(sizes)} (axis 1 of "
                       "[accum_steps, global_batch, ...]); give every leaf the same")
    for b in sizes:
      if b % self.world:
        raise ValueError(f"global batch size {b} is not divisible by the {self.world} devices of the "
                         f"mesh; use a multiple of {self.world}")

  def eval_fn(self):
    """Jitted `(params, batch[global_batch, ...], mutable=None)` -> mean loss (and aux with
    `Model.has_aux`), forward only; the loss gets rng None and the mutable collections read-only."""
    def local(master, batch, mutable):
      shards = self._param_shards(master)
      loss, aux, _ = call_loss(self.model, self._units(shards, shards), batch, None, mutable)
      loss = lax.pmean(loss, self.data_axes)
      if not self.model.has_aux:
        return loss
      return loss, jax.tree.map(lambda a: lax.pmean(_inexact(a), self.data_axes), aux)
    run = jax.jit(jax.shard_map(local, mesh=self.mesh, in_specs=(self.param_specs, P(self.data_axes), P()),
                                out_specs=P(), check_vma=False))
    return lambda params, batch, mutable=None: run(params, batch, mutable)


def _put(tree, device):
  """`tree` on one device or under a sharding, for `logical_params(state, device=...)`."""
  if not isinstance(device, (jax.Device, jax.sharding.Sharding)):
    raise TypeError(f"device={device!r}: pass a jax.Device (e.g. jax.devices()[0]) or a jax.sharding.Sharding")
  return jax.device_put(tree, device)


def _is_inexact(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _inexact(x):
  return x if _is_inexact(x) else x.astype(jnp.float32)


def _same_structure(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b, is_leaf=layout_lib.is_layout)


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
