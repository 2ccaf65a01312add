"""The one executor: a train step driven by a `Plan` (docs/DESIGN.md, "The flow of one step").

`Executor` binds a model, an optimizer and a plan to a mesh: the plan resolved and compiled into its
components, the layout, the units' metadata, the stateful components and the `Placement` (where the train
state lives), each an explicit object it holds. Its train state is made and viewed by `TrainStates`
(`zerojax.executor.states`) and its step built by `Steps` (`zerojax.executor.step`).

Per step, inside one `jax.shard_map` over the ("node", "gpu") mesh:

0. gather the fp32 master shard (over A_os) into the parameter shard (over A_p), cast to the param dtype;
1. every micro-batch: forward and backward through the model's ZeRO units, each reducing its layer's
   gradient over A_g inside the backward pass; accumulate the G shard;
2. at the accumulation boundary: reduce-scatter over A_os \\ A_g, then all-reduce over the replica axes
   D \\ A_os (MiCS's 2-hop synchronisation, AMSP's T_os), or a stateful component's sync;
3. outside the shard_map, on sharded global arrays under `jit`: any elementwise optax transformation
   updates the master weights and optimizer states, so global reductions such as
   `clip_by_global_norm` are correct without hand-written collectives. It sees the user's tree, each leaf
   with its logical rank (`zerojax.engine.logical`). A step whose loss or gradients are not finite is skipped
   (state unchanged) and counted.

A batch is any pytree whose leaves lead with `[accum, global_batch, ...]`, sharded over all data axes.
Each micro-batch gets an rng folded by step, micro-step and data-parallel rank; a model's mutable
collections (BatchNorm statistics) are carried through the micro-batches on each device and averaged
over the devices at the end of the step, as data-parallel training with per-device statistics does.

State across steps belongs to the plan's stateful components (`zerojax.state.stateful`, listed in
`zerojax.state.train_state`), each in its own field of the train state: the executor creates, shards, passes
and updates it through their `init`, `specs`, `body_in`, `sync` and `update`. A component may pick the
step's program on the host (`phase`): each step runs the program of its phase, compiled on first use.

References:
  ZeRO: Rajbhandari et al. 2020, §5. MiCS: Zhang et al. 2022, §3.4. AMSP: Chen et al. 2023, §3.
"""
from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from zerojax.engine import components as components_lib, layout as layout_lib, logical as logical_lib
from zerojax import mesh as mesh_lib
from zerojax.executor.states import TrainStates
from zerojax.executor.step import Probe, StepMetrics, Steps
from zerojax.mesh import axis_sizes
from zerojax.engine.model import Model, user_views
from zerojax.state.placement import Placement
from zerojax.plan import Plan
from zerojax.state.train_state import TrainState, stateful_components
from zerojax.engine.unit import UnitMeta

__all__ = ["Executor", "Model", "Probe", "StepMetrics"]  # StepMetrics and Model re-exported


class Executor:
  """Builds the sharded train state and the jitted train step of a model under a plan.

  Args:
    model: the model, written as ZeRO units.
    optimizer: an elementwise optax `GradientTransformation`; it sees the user's tree with each leaf's
      logical rank (`zerojax.engine.logical`), and one that needs more of a leaf's shape is refused.
    plan: the sharding plan.
    mesh: the ("node", "gpu") mesh (or a factoring of it); the executor factors it further for plans
      that name groups by size, and keeps the result as `self.mesh`.
    accum_steps: micro-batches per optimizer step (gradient accumulation).
    gpu: whether to make a GPU's choices (prefetch, the kernels; `Plan.resolve`, `components.compile`) on any
      devices, e.g. CPU devices tracing a GPU's step (`zerojax.executor.aot`); None: whether they are GPUs.

  Attributes:
    plan, mesh: the plan resolved on the (factored) mesh.
    components: the plan compiled for the mesh (`zerojax.engine.components.compile`); nothing after reads the plan.
    layout: the parameter layout; `param_specs` its PartitionSpecs over A_os.
    metas: `{unit: UnitMeta}`, the components bound to each unit's leaves.
    stateful: `{TrainState field: component}`, the plan's stateful components.
    placement: where the train state lives (`zerojax.state.placement`: one copy or one per replica; host offload).
    states: the train state's creation, shardings and views (`TrainStates`).
    steps: the step and evaluation programs (`Steps`).
  """

  def __init__(self, model: Model, optimizer: optax.GradientTransformation, plan: Plan, mesh: Mesh, *,
               accum_steps: int = 1, gpu: bool | None = None):
    self._given = (plan, mesh)  # as given, for `on_devices`
    plan.check_groups(mesh)
    prefetch_optional = plan.schedule.prefetch is None  # the platform's default, not the user's setting
    mesh = mesh_lib.factor(mesh, plan.groups())  # groups of k consecutive devices become mesh axes
    plan = plan.resolve(mesh, gpu)
    plan.validate(mesh)
    if accum_steps < 1:
      raise ValueError(f"accum_steps={accum_steps} must be at least 1")
    self.model, self.plan, self.mesh, self.accum_steps = model, plan, mesh, accum_steps
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    if not isinstance(shapes, dict):
      raise TypeError(f"model.init must return a dict of units, got {type(shapes).__name__}")
    self.layout = layout_lib.make_layout(shapes, model.scanned, mesh.size * plan.alignment)
    self.to_user, self.from_user = user_views(model)
    self.user_optimizer = optimizer
    self.optimizer = logical_lib.logical_optimizer(optimizer, self.layout, self.to_user, self.from_user)
    self.param_specs = layout_lib.specs(self.layout, plan.sharding.opt_order)
    self.components = c = components_lib.compile(plan, mesh, gpu)  # what runs the plan; nothing below reads it
    sizes, tree = tuple(axis_sizes(mesh).items()), self.layout.tree()
    self.metas = {}
    for u in tree:
      leaves, treedef = jax.tree.flatten(tree[u], is_leaf=layout_lib.is_layout)
      self.metas[u] = UnitMeta(c.gather, c.reduction, c.remat, c.prefetch, sizes, treedef, tuple(leaves),
                               scanned=u in model.scanned, prefetch_optional=prefetch_optional)
    self.stateful = stateful_components(plan, mesh, self.layout, self.metas)  # {TrainState field: component}
    offload = c.offload.keeping_forward(c.gather.dtype)  # the forward's copy
    self.placement = Placement.of(mesh, self.param_specs, plan.sharding.opt_order, offload, c.replicas_apart)
    self.placement.refuse_model(model, plan.name)
    self.states = TrainStates(model, self.optimizer, self.layout, self.placement, self.stateful)
    self.steps = Steps(model, self.optimizer, optimizer, self.layout, c, self.placement, self.stateful,
                       self.metas, accum_steps)
    self.world, self.batch_axes, self.batch_sharding = mesh.size, self.steps.batch_axes, self.steps.batch_sharding

  def on_devices(self, devices, gpu: bool | None = None) -> "Executor":
    """This executor's model, optimizer, plan (as given) and accumulation on a mesh of the same shape and
    axes over `devices` (as many as this mesh has, taken in its device order), making a GPU's choices where
    `gpu` (the constructor's): e.g. CPU devices that trace the step of compile-only GPUs with its host
    memory kinds (`zerojax.executor.aot.compile_as_on_gpu`)."""
    plan, mesh = self._given
    grid = np.asarray(list(devices), dtype=object).reshape(np.shape(mesh.devices))
    return Executor(self.model, self.user_optimizer, plan, Mesh(grid, mesh.axis_names),
                    accum_steps=self.accum_steps, gpu=gpu)

  # -- the train state (`TrainStates`) --
  def init(self, rng: jax.Array) -> TrainState:
    """The model and optimizer initialised directly into the plan's sharded layout (`TrainStates.init`)."""
    return self.states.init(rng)

  def init_programs(self) -> dict:
    """`{unit: jitted rng -> the unit's flat master shards}`, the programs `init` runs."""
    return self.states.init_programs()

  def derive(self, state: TrainState) -> TrainState:
    """`state` with its derived fields rebuilt (`TrainStates.derive`); traced under `jit`."""
    return self.states.derive(state)

  def init_from_params(self, params, mutable=None) -> TrainState:
    """The state from logical params (`TrainStates.init_from_params`)."""
    return self.states.init_from_params(params, mutable)

  def init_from_flat(self, flat, rng=None, mutable=None) -> TrainState:
    """The state from flat master weights (traced under `jit`)."""
    return self.states.init_from_flat(flat, rng, mutable)

  def flat_shapes(self):
    """`ShapeDtypeStruct`s of the flat master weights."""
    return self.states.flat_shapes()

  def shardings(self, state_shapes: TrainState | None = None) -> TrainState:
    """NamedShardings of every field of the train state."""
    return self.states.shardings(state_shapes)

  def logical_params(self, state: TrainState, device=None):
    """The master weights in the user's tree and shapes (`TrainStates.logical_params`)."""
    return self.states.logical_params(state, device)

  def logical_variables(self, state: TrainState, device=None) -> dict:
    """`{"params": ..., **mutable collections}`, what flax's `apply` takes (`TrainStates.logical_variables`)."""
    return self.states.logical_variables(state, device)

  def user_layout(self):
    """The `LeafLayout`s in the user's tree (what the optimizer and its states are named by)."""
    return self.states.user_layout()

  # -- the step and evaluation (`Steps`) --
  def step_fn(self, state_shardings: TrainState | None = None):
    """The jitted `(state, batch) -> (state, StepMetrics)`, donating the state (`Steps.step_fn`)."""
    return self.steps.step_fn(state_shardings or self.shardings())

  def compiler_options(self) -> dict:
    """The XLA options the step compiles with (`Steps.compiler_options`)."""
    return self.steps.compiler_options(self.shardings())

  def eval_fn(self):
    """Jitted `(params, batch, mutable=None)` -> mean loss, forward only (`Steps.eval_fn`)."""
    return self.steps.eval_fn()

  def phase(self, state: TrainState) -> str:
    """The program a step of `state` runs (`Steps.phase`)."""
    return self.steps.phase(state)

  def shard_batch(self, batch):
    """`batch` as the step takes it (`Steps.shard_batch`)."""
    return self.steps.shard_batch(batch)

  def check_batch(self, batch) -> None:
    """Raises a one-line error for a batch the step cannot shard (`Steps.check_batch`)."""
    self.steps.check_batch(batch)

  def probe(self, state: TrainState, batch) -> Probe:
    """What the model's loss does with its units, read from one trace of it (`Steps.probe`); `batch`
    as the step takes it (`shard_batch`), arrays or `ShapeDtypeStruct`s."""
    return self.steps.probe(state, batch)

  def prefetch_fallbacks(self) -> dict[str, str]:
    """`{unit: why}` for the scanned units that run per layer although the plan prefetches by default
    (their layers are called one by one: flax `nn.scan`, a `lax.scan` of `zerojax.engine.unit`;
    `Probe.per_layer`); known once the step has run or been lowered (`Steps.probed`). An explicit
    `prefetch=True` raises for such a unit instead."""
    probe = self.steps.probed
    return {u: "its layers are called one by one (flax nn.scan or a lax.scan of zerojax.unit, not "
               "zerojax.scan_layers): each layer gathers when it runs (prefetch off for this unit)"
            for u in (probe.per_layer if probe is not None else ())}
