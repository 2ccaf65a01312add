"""The one executor: a train step driven by a `Plan` (docs/DESIGN.md, "The flow of one step").

Per step, inside one `jax.shard_map` over the ("node", "gpu") mesh:

0. gather the fp32 master shard (over A_os) into the parameter shard (over A_p), cast to the param dtype;
1. every micro-batch: forward and backward through the model's ZeRO units, each reducing its layer's
   gradient over A_g inside the backward pass; accumulate the G shard;
2. at the accumulation boundary: reduce-scatter over A_os \\ A_g, then all-reduce over the replica axes
   D \\ A_os (MiCS's 2-hop synchronisation, AMSP's T_os), or a stateful component's sync;
3. outside the shard_map, on sharded global arrays under `jit`: any elementwise optax transformation
   updates the master weights and optimizer states, so global reductions such as
   `clip_by_global_norm` are correct without hand-written collectives. It sees the user's tree, each leaf
   with its logical rank (`zerojax.logical`). A step whose loss or gradients are not finite is skipped
   (state unchanged) and counted.

A batch is any pytree whose leaves lead with `[accum, global_batch, ...]`, sharded over all data axes.
Each micro-batch gets an rng folded by step, micro-step and data-parallel rank; a model's mutable
collections (BatchNorm statistics) are carried through the micro-batches on each device and averaged
over the devices at the end of the step, as data-parallel training with per-device statistics does.

State across steps belongs to the plan's stateful components (`zerojax.stateful`, listed in
`zerojax.train_state`), each in its own field of the train state: the executor creates, shards, passes
and updates it through their `init`, `specs`, `body_in`, `sync` and `update`. A component may pick the
step's program on the host (`phase`): each step runs the program of its phase, compiled on first use.

References:
  ZeRO: Rajbhandari et al. 2020, §5. MiCS: Zhang et al. 2022, §3.4. AMSP: Chen et al. 2023, §3.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import components as components_lib, fidelity, gpu_aot, layout as layout_lib, logical as logical_lib
from zerojax import mesh as mesh_lib
from zerojax.mesh import axis_sizes
from zerojax.model import Model, identity, call_loss  # noqa: F401  (re-exported)
from zerojax.plan import Plan
from zerojax.stateful import keep
from zerojax.train_state import TrainState, stateful_components
from zerojax.unit import ShardedUnit, UnitMeta


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

  Attributes:
    planner_rows: the planner's ranked table when `auto()` chose this executor's plan (set by the trainer,
      written to `summary.json`); None otherwise.
  """
  planner_rows: list[dict] | None = None

  def __init__(self, model: Model, optimizer: optax.GradientTransformation, plan: Plan, mesh: Mesh, *,
               accum_steps: int = 1):
    plan.check_groups(mesh)
    prefetch_optional = plan.schedule.prefetch is None  # the platform's default, not the user's setting
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
    self.layout = layout_lib.make_layout(shapes, model.scanned, mesh.size * plan.alignment)
    self.to_user, self.from_user = model.to_user or identity, model.from_user or identity
    self.user_optimizer = optimizer
    self.optimizer = logical_lib.logical_optimizer(optimizer, self.layout, self.to_user, self.from_user)
    self.param_specs = layout_lib.specs(self.layout, plan.sharding.opt_order)
    self.components = c = components_lib.compile(plan, mesh)  # what runs the plan; nothing below reads it
    sizes = tuple(axis_sizes(mesh).items())
    self._metas = {}
    tree = self.layout.tree()
    for u in tree:
      leaves, treedef = jax.tree.flatten(tree[u], is_leaf=layout_lib.is_layout)
      self._metas[u] = UnitMeta(c.gather, c.reduction, c.remat, c.prefetch, sizes, treedef, tuple(leaves),
                                scanned=u in model.scanned, prefetch_optional=prefetch_optional)
    self.stateful = stateful_components(plan, mesh, self.layout, self._metas)  # {TrainState field: component}
    self.batch_sharding = NamedSharding(mesh, P(None, self.data_axes))
    self._step = None
    self._checked = False

  # -- state -----------------------------------------------------------------------------------------
  def shardings(self, state_shapes: TrainState | None = None) -> TrainState:
    """NamedShardings of every field of the train state."""
    state_shapes = state_shapes or jax.eval_shape(self.init_from_flat, self.flat_shapes())
    params = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.param_specs)
    rep = NamedSharding(self.mesh, P())
    opt_order = self.plan.sharding.opt_order or None
    by_ndim = {1: NamedSharding(self.mesh, P(opt_order)), 2: NamedSharding(self.mesh, P(None, opt_order))}
    opt = jax.tree.map(lambda x: rep if x.ndim == 0 else by_ndim[x.ndim], state_shapes.opt_state)
    return TrainState(step=rep, params=params, opt_state=opt, skipped=rep,
                      rng=jax.tree.map(lambda _: rep, state_shapes.rng),
                      mutable=jax.tree.map(lambda _: rep, state_shapes.mutable),
                      **{n: jax.tree.map(lambda s: NamedSharding(self.mesh, s), c.specs())
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
    return TrainState(step=jnp.zeros((), jnp.int32), params=flat, opt_state=self.optimizer.init(flat),
                      skipped=jnp.zeros((), jnp.int32), rng=rng if model.rng else None,
                      mutable=mutable if model.init_state is not None else None,
                      **{n: c.init(flat) for n, c in self.stateful.items()})

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
    flat = layout_lib.to_flat(params, self.layout, self.mesh, self.plan.sharding.opt_order)
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

  def prefetch_fallbacks(self) -> dict[str, str]:
    """`{unit: why}` for the scanned units that run per layer although the plan prefetches by default
    (their layers are called one by one: flax `nn.scan`, a `lax.scan` of `zerojax.unit`); known once a
    step or eval program has been traced. An explicit `prefetch=True` raises for such a unit instead."""
    return {u: f"its layers are called one by one by {m.fallbacks[0]} (not zerojax.scan_layers): each "
               "layer gathers when it runs (prefetch off for this unit)"
            for u, m in self._metas.items() if m.fallbacks}

  # -- the step --------------------------------------------------------------------------------------
  def _units(self, p_shards: dict, sinks: dict, sync_axes: tuple[str, ...] = (), state: dict | None = None) -> dict:
    metas = {u: dataclasses.replace(m, sync_axes=sync_axes) for u, m in self._metas.items()}
    state = state or {}
    return {u: ShardedUnit(jax.tree.leaves(p_shards[u]), jax.tree.leaves(sinks[u]), metas[u],
                           state.get(u, (None, None))) for u in p_shards}

  def _local_grads(self, master, batch, step=None, rng=None, mutable=None, local=None, phase="dense"):
    """shard_map body: master shard (over A_os), local batch, the step, the run's rng, the mutable
    collections and `{name: what each stateful component's body_in passes}` -> reduced gradient shard,
    mean loss, mean aux, device-averaged mutable collections, `{name: the component's output}`."""
    model, local, parts = self.model, local or {}, self.components
    carried = {n: local[n] for n, c in self.stateful.items() if c.in_backward}  # through the backward
    syncer = next((c for c in self.stateful.values() if phase in c.phases), None)  # replaces the all-reduce
    p_shards = parts.gather.from_master(master)  # step 0
    zeros_g = parts.reduction.sinks(self.layout.tree())
    rank = lax.axis_index(self.data_axes)  # node-major, as the batch is sharded
    key = lambda i: None if rng is None else jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(rng), step), i), rank)
    if not self._checked:  # once per executor: every use of a parameter shard is a unit's
      mb = jax.tree.map(lambda x: x[0], batch)
      jaxpr = jax.make_jaxpr(lambda sh: call_loss(model, self._units(sh, zeros_g), mb, key(0), mutable)[0])(
          p_shards)
      logical_lib.check_units_own_params(jaxpr.jaxpr, jaxpr.jaxpr.invars)
      self._checked = True

    state = lambda e, i: fidelity.unit_states(parts.reduction, self._metas, e, step, i, rank)

    def micro(carry, xs):
      acc, mut, err = carry
      mb, i = xs
      units = {}
      def f(s, e):
        u = units.setdefault("u", self._units(p_shards, s, state=state(e, i)))
        loss, aux, new = call_loss(model, u, mb, key(i), mut)
        return loss, (aux, new)
      (loss, (aux, mut)), (g, err) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(zeros_g, err)
      for c in self.stateful.values():  # the state is each unit's one backward's cotangent
        if c.in_backward:
          self._check_single_calls(units["u"], c.setting)
      return (jax.tree.map(jnp.add, acc, g), mut, err), (loss, aux)

    index, sync = jnp.arange(self.accum_steps), parts.sync
    if sync.in_backward and syncer is None:
      # MiCS §3.4 with the boundary all-reduce overlapped: the window's last micro-step all-reduces each
      # unit's gradient (plus what the window accumulated) inside its backward, so layer i's all-reduce
      # runs while layer i-1's backward computes. The sums are the same as after the window.
      head = jax.tree.map(lambda x: x[:-1], batch)
      (acc, mutable, carried), (losses, aux) = lax.scan(micro, (zeros_g, mutable, carried), (head, index[:-1]))
      last_mb, units = jax.tree.map(lambda x: x[-1], batch), {}

      def last(s, e):
        u = units.setdefault("u", self._units(p_shards, s, sync.replicas, state(e, self.accum_steps - 1)))
        loss, aux_l, new = call_loss(model, u, last_mb, key(self.accum_steps - 1), mutable)
        return loss, (aux_l, new)
      (loss_l, (aux_l, mutable)), (acc, carried) = jax.value_and_grad(last, (0, 1), has_aux=True)(acc, carried)
      self._check_single_calls(units["u"])
      losses = jnp.concatenate([losses, loss_l[None]])
      aux = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), aux, aux_l)
    else:
      (acc, mutable, carried), (losses, aux) = lax.scan(micro, (zeros_g, mutable, carried), (batch, index))
      acc = sync(acc, all_reduce=syncer is None)
    loss = parts.mean(jnp.mean(losses))  # over the axes of size > 1: none on one device
    aux = jax.tree.map(lambda a: parts.mean(jnp.mean(_inexact(a), axis=0)), aux)
    mutable = jax.tree.map(lambda m: parts.mean(m) if _is_inexact(m) else m, mutable)
    # Each device's loss is a mean over its micro-batch: the global mean divides by W * accum once.
    denom = self.world * self.accum_steps
    out = {n: carried.get(n) for n in self.stateful}
    if syncer is None:
      return jax.tree.map(lambda g: g / denom, acc), loss, aux, mutable, out
    grads, out[syncer.name] = syncer.sync(acc, local[syncer.name], denom, phase)
    return grads, loss, aux, mutable, out

  def phase(self, state: TrainState) -> str:
    """The program a step of `state` runs: the one a stateful component picks (`Stateful.phase`), else
    "dense". Reads scalars of the state on the host."""
    for c in self.stateful.values():
      picked = c.phase(state)
      if picked is not None:
        return picked
    return "dense"

  @staticmethod
  def _check_single_calls(units: dict, field: str = "sync_in_backward=True") -> None:
    for name, u in units.items():
      if len(u.meta.calls) > 1:
        raise ValueError(f"unit {name!r} is called {len(u.meta.calls)} times per micro-batch; the plan's "
                         f"{field} needs one call per unit: set it to False in the plan, or make each call "
                         "its own unit")

  def _train_step(self, state: TrainState, batch, phase: str = "dense"):
    data = P(None, self.data_axes)
    body_in = {n: c.body_in(getattr(state, n), phase) for n, c in self.stateful.items()}
    out_specs = {n: c.body_out_specs(phase) for n, c in self.stateful.items()}
    grads, loss, aux, mutable, out = jax.shard_map(
        functools.partial(self._local_grads, phase=phase), mesh=self.mesh,
        in_specs=(self.param_specs, data, P(), P(), P(), {n: s for n, (_, s) in body_in.items()}),
        out_specs=(self.param_specs, P(), P(), P(), out_specs), check_vma=False)(
            state.params, batch, state.step, state.rng, state.mutable, {n: v for n, (v, _) in body_in.items()})
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new = state.replace(step=state.step + 1, params=keep(finite, params, state.params),
                        opt_state=keep(finite, opt_state, state.opt_state),
                        skipped=state.skipped + (~finite).astype(jnp.int32),
                        mutable=keep(finite, mutable, state.mutable),
                        **{n: c.update(getattr(state, n), out[n], updates, state.step, finite, phase)
                           for n, c in self.stateful.items()})
    return new, StepMetrics(loss, grad_norm, finite, aux)

  def step_fn(self, state_shardings: TrainState | None = None):
    """The jitted `(state, batch) -> (state, StepMetrics)`; donates state.

    `batch` is a pytree (numpy or jax arrays) whose leaves lead with `[accum, global_batch, ...]`, or
    with `[global_batch, ...]` when `accum_steps == 1`; see `shard_batch`. The step runs the program of
    `phase(state)`, each compiled on first use; `step.lower(state, batch, phase=None)` lowers one
    (default: a stateful component's steady state, `Stateful.phases[-1]`, else "dense"). On GPUs it
    compiles with `zerojax.gpu_aot.GPU_COMPILER_OPTIONS`.
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
      default = next((c.phases[-1] for c in self.stateful.values() if c.phases), "dense")
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
      shards = self.components.gather.from_master(master)
      loss, aux, _ = call_loss(self.model, self._units(shards, shards), batch, None, mutable)
      loss = self.components.mean(loss)
      if not self.model.has_aux:
        return loss
      return loss, jax.tree.map(lambda a: self.components.mean(_inexact(a)), aux)
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
