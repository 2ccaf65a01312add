"""The one executor: a train step driven by a `Plan` (docs/DESIGN.md, "The flow of one step").

`Executor` binds a model, an optimizer and a plan to a mesh (this module: the plan resolved and compiled
into components, the layout, the units' metadata, the stateful components); its train state lives in
`zerojax.state_views` and its step in `zerojax.step`.

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

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import components as components_lib, layout as layout_lib, logical as logical_lib
from zerojax import mesh as mesh_lib
from zerojax.mesh import axis_sizes
from zerojax.model import Model, identity
from zerojax.plan import Plan
from zerojax.state_views import StateViews
from zerojax.step import StepMetrics, StepMixin  # noqa: F401  (StepMetrics re-exported)
from zerojax.train_state import stateful_components
from zerojax.unit import UnitMeta


class Executor(StateViews, StepMixin):
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
    remat_choice: how `remat="auto"` was resolved for this executor (`zerojax.planner.remat.choose`'s
      report, set by the trainer); None when nothing chose it.
  """
  planner_rows: list[dict] | None = None
  remat_choice: dict | None = None

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
    # Per-replica master weights and optimizer states (DiLoCo: one replica per node): a leading replica
    # axis sharded over the component's `replica_axes`; the step reduces over the other axes only.
    self.replica_axes = next((c.replica_axes for c in self.stateful.values() if c.replica_axes), ())
    self.replicas = mesh_lib.group_size(mesh, self.replica_axes) if self.replica_axes else 0
    self.state_param_specs = (jax.tree.map(lambda s: P(self.replica_axes, *s), self.param_specs,
                                           is_leaf=lambda s: isinstance(s, P)) if self.replica_axes else self.param_specs)
    if self.replica_axes and model.init_state is not None:
      raise ValueError(f"plan {plan.name!r}: {next(c.setting for c in self.stateful.values() if c.replica_axes)} "
                       "trains one replica per node, but the model has mutable collections (e.g. BatchNorm "
                       "statistics) that the step averages over every device; use a model without them")
    self.batch_sharding = NamedSharding(mesh, P(None, self.data_axes))
    self._step = None
    self._checked = False

  def prefetch_fallbacks(self) -> dict[str, str]:
    """`{unit: why}` for the scanned units that run per layer although the plan prefetches by default
    (their layers are called one by one: flax `nn.scan`, a `lax.scan` of `zerojax.unit`); known once a
    step or eval program has been traced. An explicit `prefetch=True` raises for such a unit instead."""
    return {u: f"its layers are called one by one by {m.fallbacks[0]} (not zerojax.scan_layers): each "
               "layer gathers when it runs (prefetch off for this unit)"
            for u, m in self._metas.items() if m.fallbacks}
