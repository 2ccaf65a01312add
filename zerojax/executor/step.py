"""The executor's jitted train step: inside one `jax.shard_map`, every micro-batch's forward and backward
through the model's ZeRO units (one micro-step body; MiCS's in-backward replica sync is its parameter),
the accumulation boundary's sync, then the optimizer on sharded global arrays (docs/DESIGN.md, "The flow
of one step"); and the forward-only evaluation.

`Steps` is built by `zerojax.executor.Executor` from the objects it names: the components run the plan's
collectives, the `Placement` says where the state lives (one copy or one per replica, device or host
memory), the stateful components carry their state through the step. Nothing here reads the plan.

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
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import gpu_aot
from zerojax.engine import layout as layout_lib, logical as logical_lib
from zerojax.engine.components import Components, GradReduction
from zerojax.engine.model import Model, call_loss
from zerojax.state.placement import Placement
from zerojax.state.stateful import InBackward, Phased, ReplacesWeights, SyncsReplicas, keep
from zerojax.state.train_state import TrainState
from zerojax.engine.unit import ShardedUnit, UnitState, shard_cotangents
from zerojax.executor.offload_update import Streamed
from zerojax.executor.update import OnDevice, OnHost


class StepMetrics(NamedTuple):
  loss: jax.Array
  grad_norm: jax.Array
  finite: jax.Array
  aux: Any = None        # the loss's aux, averaged over micro-batches and devices (`Model.has_aux`)


@dataclasses.dataclass(frozen=True)
class Probe:
  """What the model's loss does with its units, read from one trace of a micro-batch's loss (`Steps.probe`)
  before any program is traced; tracing a program then writes nothing.

  Attributes:
    calls: `((unit, calls per micro-batch), ...)`; every use of a parameter shard is a unit's call.
    per_layer: the scanned units whose layers the model calls one by one (flax `nn.scan`, a `lax.scan` of
      `zerojax.unit`) although the plan prefetches by default: they run per layer.
    reduction: the gradient reduction the step runs (`Steps._gradient_reduction`); its dtype is the
      gradient's.
  """
  calls: tuple[tuple[str, int], ...]
  per_layer: tuple[str, ...]
  reduction: GradReduction


# The update strategy of each `Plan.update_mode` (`zerojax.executor.update`).
UPDATES = {"device": OnDevice, "bulk": OnDevice, "streamed": Streamed, "host": OnHost}


class Steps:
  """The step and evaluation programs of an `Executor`.

  Args:
    model: the model, written as ZeRO units.
    optimizer: the optimizer on the flat layout (`zerojax.engine.logical.logical_optimizer`).
    user_optimizer: the optimizer as the user gave it (the streamed offloaded update runs it per chunk).
    layout: the parameter layout.
    components: the plan compiled for the mesh (`zerojax.engine.components.compile`).
    placement: where the train state lives (`zerojax.state.placement`).
    stateful: `{TrainState field: component}`, the plan's stateful components.
    metas: `{unit: UnitMeta}`, the components bound to each unit's leaves.
    accum_steps: micro-batches per optimizer step.
  """

  def __init__(self, model: Model, optimizer: optax.GradientTransformation,
               user_optimizer: optax.GradientTransformation, layout: layout_lib.Layout, components: Components,
               placement: Placement, stateful: dict, metas: dict, accum_steps: int):
    self.model, self.optimizer, self.user_optimizer, self.layout = model, optimizer, user_optimizer, layout
    self.components, self.placement, self.stateful, self.metas = components, placement, stateful, metas
    self.accum_steps = accum_steps
    self.mesh = placement.mesh
    self.world = self.mesh.size
    self.batch_axes = tuple(self.mesh.axis_names)  # the batch is sharded over every device
    self.batch_sharding = NamedSharding(self.mesh, P(None, self.batch_axes))
    self._step = None
    self.probed: Probe | None = None  # the probe the step runs before its first program (`probe`)
    self.update = UPDATES[placement.offload.update](model, optimizer, user_optimizer, layout,
                                                    components.reduction.dtype, placement)

  def _units(self, p_shards: dict, sinks: dict, sync_axes: tuple[str, ...] = (), state: dict | None = None,
             reduction: GradReduction | None = None) -> dict:
    reduction = reduction or self.components.reduction
    metas = {u: dataclasses.replace(m, sync_axes=sync_axes, reduction=reduction) for u, m in self.metas.items()}
    state = state or {}
    return {u: ShardedUnit(jax.tree.leaves(p_shards[u]), jax.tree.leaves(sinks[u]), metas[u],
                           state.get(u)) for u in p_shards}

  def _local_grads(self, master, batch, step=None, rng=None, mutable=None, local=None, phase="dense", *,
                   probe: Probe):
    """shard_map body: master shard (over A_os), local batch, the step, the run's rng, the mutable
    collections and `{name: what each stateful component's body_in passes}` -> reduced gradient shard,
    mean loss, mean aux, device-averaged mutable collections, `{name: the component's output}`."""
    model, local, parts, reduction = self.model, local or {}, self.components, probe.reduction
    in_backward = {n: c for n, c in self.stateful.items() if isinstance(c, InBackward)}
    carried = {n: local[n] for n in in_backward}  # through the backward: its cotangent is the new state
    syncer = next((c for c in self.stateful.values() if isinstance(c, SyncsReplicas) and phase in c.phases), None)
    master = self.placement.local(master)  # this device's copy
    p_shards = parts.gather.from_master(master)  # step 0
    rank = lax.axis_index(self.batch_axes)  # node-major, as the batch is sharded
    key = lambda i: None if rng is None else jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(rng), step), i), rank)
    for c in in_backward.values():  # the state is each unit's one backward's cotangent
      self._check_single_calls(probe, c.setting)
    if parts.sync.in_backward and syncer is None:
      self._check_single_calls(probe)
    zeros_g = reduction.sinks(self.layout.tree())

    def state(carried, i):
      """`{unit: UnitState or None}`: each in-backward component's value under its key, the rounding seed."""
      keyed = {c: c.unit_states(carried[n]) for n, c in in_backward.items()}
      seeds = parts.reduction.seeds(self.metas, step, i, rank)
      return {u: UnitState({c: v[u] for c, v in keyed.items()}, seeds[u]) if keyed or seeds[u] is not None
              else None for u in self.metas}

    def micro(acc, mut, err, mb, i, sync_axes=()):
      """One micro-batch's forward and backward: each unit reduces its gradient into its sinks. With
      `sync_axes` (the window's last micro-step under MiCS's in-backward sync) the sinks are the window's
      accumulated gradient, which each unit's backward adds to its own and all-reduces over the replicas."""
      units = {}
      def f(s, e):
        u = units.setdefault("u", self._units(p_shards, s, sync_axes, state(e, i), reduction))
        loss, aux, new = call_loss(model, u, mb, key(i), mut)
        return loss, (aux, new)
      sinks = acc if sync_axes else zeros_g
      (loss, (aux, mut)), (g, err) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(sinks, err)
      return (g if sync_axes else jax.tree.map(jnp.add, acc, g)), mut, err, loss, aux

    def scanned(carry, xs):
      acc, mut, err, loss, aux = micro(*carry, *xs)
      return (acc, mut, err), (loss, aux)

    index, sync = jnp.arange(self.accum_steps), parts.sync
    if sync.in_backward and syncer is None:
      # MiCS §3.4 with the boundary all-reduce overlapped: the window's last micro-step all-reduces each
      # unit's gradient (plus what the window accumulated) inside its backward, so layer i's all-reduce
      # runs while layer i-1's backward computes. The sums are the same as after the window.
      head = jax.tree.map(lambda x: x[:-1], batch)
      (acc, mutable, carried), (losses, aux) = lax.scan(scanned, (zeros_g, mutable, carried), (head, index[:-1]))
      acc, mutable, carried, loss_l, aux_l = micro(acc, mutable, carried, jax.tree.map(lambda x: x[-1], batch),
                                                   self.accum_steps - 1, sync.replicas)
      losses = jnp.concatenate([losses, loss_l[None]])
      aux = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), aux, aux_l)
    else:
      (acc, mutable, carried), (losses, aux) = lax.scan(scanned, (zeros_g, mutable, carried), (batch, index))
      acc = sync(acc, all_reduce=syncer is None)
    loss = parts.mean(jnp.mean(losses))  # over the axes of size > 1: none on one device
    aux = jax.tree.map(lambda a: parts.mean(jnp.mean(_inexact(a), axis=0)), aux)
    mutable = jax.tree.map(lambda m: parts.mean(m) if _is_inexact(m) else m, mutable)
    # Each device's loss is a mean over its micro-batch: the global mean divides by W * accum once (by the
    # devices of one copy of the state).
    denom = self.placement.divisor(self.world, self.accum_steps)
    out = {n: carried.get(n) for n in self.stateful}
    if syncer is None and denom == 1 and self.update.widens_per_chunk:
      grads = acc  # the update widens each chunk's gradient (`Update.wide`), not all at once
    elif syncer is None:
      grads = jax.tree.map(lambda g: g.astype(parts.reduction.dtype) / denom, acc)
    else:
      grads, out[syncer.name] = syncer.sync(acc, local[syncer.name], denom, phase)
    grads, loss, aux = self.placement.per_copy((grads, loss, aux))
    return grads, loss, aux, mutable, out

  def probe(self, state: TrainState, batch) -> Probe:
    """The `Probe` of one trace of a micro-batch's loss on the parameter shards, outside any program: how
    often each unit is called, which run per layer, the gradient reduction the step runs; raises where
    the loss uses a parameter shard outside a unit (`logical.unit_calls`). `state` and `batch` (leaves
    `[accum_steps, global_batch, ...]`) are read for their shapes only."""
    shape = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    shards = jax.eval_shape(lambda: {u: shard_cotangents(m, m.leaves[0].layers) for u, m in self.metas.items()})
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[1] // self.world, *x.shape[2:]), x.dtype), batch)

    def loss(shards, mb, rng, mutable):
      units = self._units(shards, self.components.reduction.sinks(self.layout.tree()))
      return call_loss(self.model, units, mb, None if rng is None else jax.random.wrap_key_data(rng), mutable)[0]
    jaxpr = jax.make_jaxpr(loss, axis_env=list(self.mesh.shape.items()))(
        shards, mb, jax.tree.map(shape, state.rng), jax.tree.map(shape, state.mutable)).jaxpr
    invars, of_unit = iter(jaxpr.invars), {}
    for u in sorted(shards):
      of_unit[u] = [next(invars) for _ in jax.tree.leaves(shards[u])]
    calls = logical_lib.unit_calls(jaxpr, of_unit)
    per_layer = tuple(u for u, m in sorted(self.metas.items()) if m.prefetch and m.scanned and 1 in calls[u])
    counts = tuple((u, len(c)) for u, c in sorted(calls.items()))
    return Probe(counts, per_layer, self._gradient_reduction(counts))

  def _probe_once(self, state: TrainState, batch) -> Probe:
    if self.probed is None:
      self.probed = self.probe(state, batch)
    return self.probed

  def _gradient_reduction(self, calls: tuple):
    """The reduction the step's units run: the plan's, or where no collective reduces the gradient, one
    micro-step makes the whole window, no component syncs the replicas' gradients and every unit is called
    once (a second call's gradient would be added to the first in the sink's dtype), the plan's kept in
    the narrower dtype the gradient is computed in (`GradReduction.kept_in`): the step widens it to
    `reduce_dtype` where it divides by the devices, with the same bits."""
    parts = self.components
    r, computed = parts.reduction, parts.gather.compute_dtype
    if (parts.reduces or self.accum_steps > 1 or jnp.dtype(computed).itemsize >= jnp.dtype(r.dtype).itemsize
        or any(isinstance(c, SyncsReplicas) for c in self.stateful.values())
        or any(n > 1 for _, n in calls)):
      return r
    return r.kept_in(computed)

  def phase(self, state: TrainState) -> str:
    """The program a step of `state` runs: the one a stateful component picks (`Stateful.phase`), else
    "dense". Reads scalars of the state on the host."""
    for c in self.stateful.values():
      picked = c.phase(state) if isinstance(c, Phased) else None
      if picked is not None:
        return picked
    return "dense"

  @staticmethod
  def _check_single_calls(probe: Probe, field: str = "sync_in_backward=True") -> None:
    for name, n in probe.calls:
      if n > 1:
        raise ValueError(f"unit {name!r} is called {n} times per micro-batch; the plan's "
                         f"{field} needs one call per unit: set it to False in the plan, or make each call "
                         "its own unit")

  def _train_step(self, state: TrainState, batch, phase: str = "dense", *, probe: Probe):
    where = self.placement
    offload = where.offload  # offloaded fields come to the device where read, then go back
    host = state
    state = state.replace(params=offload.forward_params(host.params, self.components.gather.dtype, host.forward))
    start = state.params  # what the step started from, before any barrier behind the backward
    data = P(None, self.batch_axes)
    body_in = {n: c.body_in(state.stateful[n], phase) for n, c in self.stateful.items()}
    out_specs = {n: c.body_out_specs(phase) for n, c in self.stateful.items()}
    per = where.spec()  # the loss and aux: one per copy
    grads, loss, aux, mutable, out = jax.shard_map(
        functools.partial(self._local_grads, phase=phase, probe=probe), mesh=self.mesh,
        in_specs=(where.param_specs, data, P(), P(), P(), {n: s for n, (_, s) in body_in.items()}),
        out_specs=(where.param_specs, per, per, P(), out_specs), check_vma=False)(
            state.params, batch, state.step, state.rng, state.mutable, {n: v for n, (v, _) in body_in.items()})
    # One optimizer per copy: each replica's norm, update and skip are its own.
    grad_norm = where.per_replica(optax.tree.norm)(self.update.wide(grads))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    u = self.update(host, state, grads, finite)
    new = state.replace(step=state.step + 1, params=u.params, opt_state=u.opt_state, forward=u.forward,
                        skipped=state.skipped + (~finite).astype(jnp.int32),
                        mutable=keep(finite, mutable, state.mutable),
                        stateful={n: c.update(state.stateful[n], out[n], u.updates, state.step, finite, phase)
                                  for n, c in self.stateful.items()})
    for n, c in self.stateful.items():  # a component may replace the master weights after the update
      if isinstance(c, ReplacesWeights):
        own, params = c.after_update(new.stateful[n], new.params, phase, before=start)
        new = new.replace(params=params, stateful={**new.stateful, n: own})
    return self.update.store(new), StepMetrics(loss, grad_norm, finite, aux)

  def compiler_options(self, state_shardings: TrainState) -> dict:
    """The XLA options the step compiles with (`gpu_aot.compiler_options`): on GPUs, with offloaded state,
    every move of an offloaded array in flight at once if the schedule wants (`HostOffload.moves`)."""
    return gpu_aot.compiler_options(self.mesh, host_moves=self.placement.offload.moves(state_shardings))

  def step_fn(self, state_shardings: TrainState):
    """The jitted `(state, batch) -> (state, StepMetrics)`; donates state.

    `batch` is a pytree (numpy or jax arrays) whose leaves lead with `[accum, global_batch, ...]`, or
    with `[global_batch, ...]` when `accum_steps == 1`; see `shard_batch`. The step runs the program of
    `phase(state)`, each compiled on first use; `step.lower(state, batch, phase=None)` lowers one
    (default: a replica sync's steady state, `SyncsReplicas.phases[-1]`, else "dense"), `step.trace` traces it. On GPUs it
    compiles with `zerojax.gpu_aot.GPU_COMPILER_OPTIONS`. `state_shardings`: `TrainStates.shardings()`.
    Before its first program the step runs its `probe` once (kept in `probed`).
    """
    if self._step is None:
      sh, programs = state_shardings, {}
      # Per-replica metrics stay on their replica's devices: gathering them would cross nodes.
      metrics = NamedSharding(self.mesh, self.placement.spec())

      def program(phase, state, batch):
        probe = self._probe_once(state, batch)
        if phase not in programs:
          programs[phase] = jax.jit(functools.partial(self._train_step, phase=phase, probe=probe),
                                    in_shardings=(sh, self.batch_sharding),
                                    out_shardings=(sh, metrics), donate_argnums=0,
                                    compiler_options=self.compiler_options(sh) or None)
        return programs[phase]

      def step(state, batch):
        phase, batch = self.phase(state), self.shard_batch(batch)
        state, metrics = program(phase, state, batch)(state, batch)
        return state, self.placement.summarize(metrics)  # per copy -> one value each
      default = next((c.phases[-1] for c in self.stateful.values() if isinstance(c, SyncsReplicas)), "dense")
      step.lower = lambda state, batch, phase=None: program(phase or default, state, batch).lower(state, batch)
      step.trace = lambda state, batch, phase=None: program(phase or default, state, batch).trace(state, batch)
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
    axes = tuple(a for a in self.mesh.axis_names if self.mesh.shape[a] > 1)  # every device's batch, every replica
    mean = lambda x: lax.pmean(x, axes) if axes else x

    def local(master, batch, mutable):
      master = self.placement.local(master)  # each copy on its devices' batch (equal right after a sync)
      shards = self.components.gather.from_master(master)
      loss, aux, _ = call_loss(self.model, self._units(shards, shards), batch, None, mutable)
      if not self.model.has_aux:
        return mean(loss)
      return mean(loss), jax.tree.map(lambda a: mean(_inexact(a)), aux)
    body = jax.shard_map(local, mesh=self.mesh, in_specs=(self.placement.param_specs, P(self.batch_axes), P()),
                         out_specs=P(), check_vma=False)
    offload = self.placement.offload
    run = jax.jit(lambda params, batch, mutable: body(offload.fetch("params", params), batch, mutable))
    return lambda params, batch, mutable=None: run(params, batch, mutable)


def _is_inexact(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _inexact(x):
  return x if _is_inexact(x) else x.astype(jnp.float32)
