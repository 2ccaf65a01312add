"""DiLoCo's outer optimizer across nodes as a stateful component (`zerojax.state.stateful`).

With `outer_sync=diloco(...)` (`ReplicaSync.outer_sync`, `zerojax.plan.diloco.Diloco`) every node trains its
own replica of the model: the train state's master weights and optimizer states get a leading replica axis
`[nodes, ...]`, sharded over the node axis (`zerojax.state.placement.Replicas`), and the inner step reduces gradients
inside the node only: nothing crosses nodes. After the inner step of a sync (`phase` "outer<f>" for
fragment f) the outer step runs (`after_update`, DiLoCo Algorithm 1 lines 8–12):

    Δ = θ_outer - mean over nodes (θ_replica)        (all-reduced over the nodes: fp32, or int8 / int4 blocks)
    m = μ m + Δ;   θ_outer -= lr (Δ + μ m)  (Nesterov; heavy-ball: lr m)
    θ_replica = θ_outer on every node                 (the inner optimizer states stay each node's own)

for the fragment's layers only (Streaming DiLoCo §2.2). With `overlap` (Streaming DiLoCo §2.3, τ = 1) Δ is
taken from the replica the *next* step starts from, is all-reduced during that step's forward and backward
(it depends on nothing the step computes) and applied after its update, the replica keeping α = `mix` of
its own weights: θ_replica = α θ_replica + (1 - α) θ_outer. Every node computes the same outer update from the
same all-reduced Δ, so the outer state is the same on every node and is held like the master weights
inside one node (sharded over A_os, replicated across nodes).

State (`OuterState`, `TrainState.stateful["outer"]`): per leaf the outer parameters and the outer
momentum, `[(layers,) padded]` fp32. A checkpoint stores both in the leaf's logical shape; with the
replicas' master weights and optimizer states (stored `[nodes, *logical shape]`), a run resumes bitwise on
the same mesh and restores onto another mesh, with fewer or more nodes by the replica rule
(`zerojax.train.state_spec`; docs/training.md, "When a node dies").

References:
  DiLoCo: Douillard et al. 2023, Algorithm 1, §3. Streaming DiLoCo: Douillard et al. 2025, §2.2, §2.3, §2.4.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import comm
from zerojax.engine import layout as layout_lib
from zerojax.comm import formats
from zerojax.mesh import group_size
from zerojax.plan.diloco import BLOCK, Diloco
from zerojax.state.stateful import ReplacesWeights, Stored


@flax.struct.dataclass
class OuterState:
  """DiLoCo's outer state: the parameters every replica restarts from, and the outer optimizer's state."""
  params: Any    # per leaf [(layers,) padded] fp32, sharded over A_os, the same on every node
  momentum: Any  # DiLoCo's SGD: the momentum, like params; another optax transformation (`outer_optimizer`):
                 # its state over the list of leaves (`jax.tree.leaves(params)`)


@dataclasses.dataclass(frozen=True, eq=False)
class OuterSync(ReplacesWeights):
  """DiLoCo's outer optimizer on one executor's mesh and layout.

  Attributes:
    diloco: the plan's `Diloco` (every, fragments, bits, lr, momentum, nesterov).
    mesh, layout: the executor's mesh and parameter layout.
    opt_order: the axes of A_os inside a node.
    nodes: the replica axes (the node axes; possibly of size 1).
    rows: per fragment, per leaf (in the layout's order): None (not in the fragment), () (the whole leaf)
      or the layer indices of a scanned leaf in the fragment.
  """
  name = "outer"
  setting = "outer_sync=diloco(...)"

  diloco: Diloco
  mesh: Mesh
  layout: layout_lib.Layout
  opt_order: tuple[str, ...]
  nodes: tuple[str, ...]
  rows: tuple[tuple[Any, ...], ...]

  @classmethod
  def of(cls, plan, mesh, layout, metas):
    d = plan.sync.outer_sync
    if d is None:
      return None
    return cls(d, mesh, layout, plan.sharding.opt_order, plan.sharding.replica_axes(mesh),
               fragment_rows(layout, d.fragments))

  @classmethod
  def refuse_restore(cls, where, key):
    return (f"checkpoint {where} holds DiLoCo's outer parameters and momentum ({key}, ...) and one replica per "
            "node; restore it with the plan's outer_sync=diloco(...) on a mesh with as many nodes")

  @property
  def phases(self) -> tuple[str, ...]:
    return tuple(f"outer{f}" for f in range(self.diloco.fragments))

  @property
  def replicas(self) -> int:
    return group_size(self.mesh, self.nodes)

  @property
  def optimizer(self) -> optax.GradientTransformation:
    """The outer optimizer (`Diloco.optimizer`); it sees the list of the leaves' flat shards."""
    return self.diloco.optimizer()

  @property
  def plain(self) -> bool:
    """DiLoCo's own SGD: its state is kept as the momentum, per leaf like the parameters (the checkpoint's
    `outer/momentum/...`)."""
    return self.diloco.outer_optimizer is None

  def to_optax(self, momentum):
    """The optax state over the list of leaves, from `OuterState.momentum`."""
    if not self.plain:
      return momentum
    return jax.tree.unflatten(jax.tree.structure(self._state_shapes()), jax.tree.leaves(momentum))

  def from_optax(self, state):
    """`OuterState.momentum` from the optax state over the list of leaves (or a tree shaped like it): with
    DiLoCo's SGD its one leaf per parameter (the momentum) in the parameters' tree."""
    if not self.plain:
      return state
    return jax.tree.unflatten(jax.tree.structure(self.layout.tree(), is_leaf=layout_lib.is_layout),
                              jax.tree.leaves(state))

  def owners(self, state):
    """Per leaf of the optax state, the index of the parameter leaf it is shaped like, or -1 (a scalar such
    as a step count)."""
    return optax.tree_utils.tree_map_params(self.optimizer, lambda _, i: i, state,
                                            list(range(len(self.layout.leaves))),
                                            transform_non_params=lambda _: -1)

  def init(self, flat):
    params = jax.tree.map(jnp.copy, flat)
    return OuterState(params=params, momentum=self.from_optax(self.optimizer.init(jax.tree.leaves(params))))

  def _state_shapes(self):
    leaves = [jax.ShapeDtypeStruct(l.flat_shape(), jnp.float32) for l in self.layout.leaves]
    return jax.eval_shape(self.optimizer.init, leaves)

  def specs(self) -> OuterState:
    params = layout_lib.specs(self.layout, self.opt_order)
    flat = jax.tree.leaves(params, is_leaf=lambda s: isinstance(s, P))
    state = self._state_shapes()
    return OuterState(params=params, momentum=self.from_optax(jax.tree.unflatten(
        jax.tree.structure(state), [flat[i] if i >= 0 else P() for i in jax.tree.leaves(self.owners(state))])))

  def phase(self, state) -> str | None:
    f = self.diloco.fragment_at(int(state.step))
    return None if f is None else f"outer{f}"

  def after_update(self, own: OuterState, params, phase: str, before):
    """After the inner step's update: DiLoCo's outer step for the fragment `phase` names (the module
    docstring); other phases leave both as they are. With `overlap` the outer gradient is taken from
    `before` (the replica after the sync's inner step, which this step started from), so its all-reduce
    waits on nothing the step computes, and the replica keeps `mix` of its weights."""
    if phase not in self.phases:
      return own, params
    f = self.phases.index(phase)
    own_specs = self.specs()
    replica = jax.tree.map(lambda s: P(self.nodes, *s), own_specs.params, is_leaf=lambda s: isinstance(s, P))
    step = jax.shard_map(lambda p, b, o, m: self._outer_step(f, p, b, o, m), mesh=self.mesh,
                         in_specs=(replica, replica, own_specs.params, own_specs.momentum),
                         out_specs=(replica, own_specs.params, own_specs.momentum), check_vma=False)
    params, outer, momentum = step(params, before if self.diloco.overlap else params, own.params, own.momentum)
    return OuterState(outer, momentum), params

  def _outer_step(self, f: int, params, source, outer, momentum):
    """shard_map body: this node's replica `[1, (layers,) c]` after the update, the replica the outer
    gradient is taken from (the same, or with `overlap` the step's start), the outer parameters and
    momentum `[(layers,) c]` of this device's shard -> the replica, outer parameters and momentum after
    the outer step of fragment `f`."""
    d, rows = self.diloco, self.rows[f]
    p_leaves, treedef = jax.tree.flatten(params)
    s_leaves = jax.tree.leaves(source)
    o_leaves = jax.tree.leaves(outer)
    picked = [i for i, r in enumerate(rows) if r is not None]
    if not picked:
      return params, outer, momentum
    # The fragment's rows of a leaf; a leaf outside the fragment enters the optimizer empty.
    part = lambda x, i: x[:0] if rows[i] is None else (x if rows[i] == () else x[np.asarray(rows[i])])
    put = lambda x, v, i: x if rows[i] is None else (v if rows[i] == () else x.at[np.asarray(rows[i])].set(v))
    deltas = [part(o_leaves[i], i) - part(s_leaves[i][0], i) for i in picked]
    mean = dict(zip(picked, _mean_over(deltas, self.moving_nodes, d.bits)))
    sub = [part(o, i) for i, o in enumerate(o_leaves)]
    state = self.to_optax(momentum)
    owners = jax.tree.leaves(self.owners(state))
    state_leaves, state_def = jax.tree.flatten(state)
    sub_state = jax.tree.unflatten(state_def, [part(x, i) if i >= 0 else x for x, i in zip(state_leaves, owners)])
    grads = [mean[i] if i in mean else s for i, s in enumerate(sub)]  # the outer gradient (DiLoCo Algorithm 1)
    updates, new_state = self.optimizer.update(grads, sub_state, sub)
    new = optax.apply_updates(sub, updates)
    state = jax.tree.unflatten(state_def, [put(x, v, i) if i >= 0 else v for x, v, i in
                                           zip(state_leaves, jax.tree.leaves(new_state), owners)])
    for i in picked:
      o_leaves[i] = put(o_leaves[i], new[i], i)
      mine = new[i]
      if d.overlap and d.mix:  # Streaming DiLoCo §2.3: the replica keeps α of the step it took meanwhile
        mine = d.mix * part(p_leaves[i][0], i) + (1 - d.mix) * new[i]
      p_leaves[i] = put(p_leaves[i][0], mine, i)[None]
    unflat = lambda leaves: jax.tree.unflatten(treedef, leaves)
    return unflat(p_leaves), unflat(o_leaves), self.from_optax(state)

  @property
  def moving_nodes(self) -> tuple[str, ...]:
    sizes = dict(self.mesh.shape)
    return tuple(a for a in self.nodes if sizes[a] > 1)

  def memory_bytes(self) -> int:
    """The outer parameters and the outer optimizer's state, sharded like the master weights inside a node
    (its scalars, such as a step count, are not counted, as `memory_report` measures arrays only)."""
    shards = group_size(self.mesh, self.opt_order)
    numel = sum(l.padded * (l.layers or 1) for l in self.layout.leaves)
    state = self._state_shapes()
    return 4 * numel // shards + sum(x.size * x.dtype.itemsize // shards for x, i in
                                     zip(jax.tree.leaves(state), jax.tree.leaves(self.owners(state))) if i >= 0)

  def cross_node_bytes(self, fragment: int) -> int:
    """Bytes each device sends to other nodes in fragment `fragment`'s outer step (ring all-reduce of
    fp32, or the all-gather of the quantized blocks)."""
    n = group_size(self.mesh, self.moving_nodes)
    if n == 1:
      return 0
    shards = group_size(self.mesh, self.opt_order)
    elements = sum(l.padded // shards * ((l.layers or 1) if rows == () else len(rows))
                   for l, rows in zip(self.layout.leaves, self.rows[fragment]) if rows is not None)
    if self.diloco.bits is None:
      return int(2 * (n - 1) / n * 4 * elements)
    return int((n - 1) * elements * formats.integer(self.diloco.bits, BLOCK).bytes_per_element())

  def stored(self) -> list[Stored]:
    """The outer parameters, then the optimizer's state, each leaf shaped like a parameter in the
    parameter's logical shape (DiLoCo's SGD: the momentum) and a scalar as it is."""
    def logical(lay, dtype, seeds=False):
      shape = lay.logical_shape
      return Stored(shape, np.dtype(dtype), layout_lib.logical_sharding(self.mesh, self.opt_order, shape),
                    to_logical=lambda x: layout_lib.unflatten_leaf(x, lay),
                    from_logical=lambda x: layout_lib.flatten_leaf(x, lay), seeds_replicas=seeds)
    out = [logical(lay, np.float32, seeds=True) for lay in self.layout.leaves]  # a joining replica starts here
    state = self._state_shapes()  # its leaves in the order of `OuterState.momentum`'s
    for x, i in zip(jax.tree.leaves(state), jax.tree.leaves(self.owners(state))):
      out.append(logical(self.layout.leaves[i], x.dtype) if i >= 0 else
                 Stored(tuple(x.shape), np.dtype(x.dtype), NamedSharding(self.mesh, P())))
    return out


def fragment_rows(layout: layout_lib.Layout, fragments: int) -> tuple[tuple[Any, ...], ...]:
  """Per fragment, per leaf: the leaf's part in it (`OuterSync.rows`). A scanned unit's layers are split
  into `fragments` runs of consecutive layers (Streaming DiLoCo §2.2); each other unit belongs whole to one
  fragment, spread over them in the layout's order."""
  tree = layout.tree()
  units = list(tree)
  single = [u for u in units if jax.tree.leaves(tree[u], is_leaf=layout_lib.is_layout)[0].layers is None]
  out = []
  for f in range(fragments):
    rows = []
    for u in units:
      for lay in jax.tree.leaves(tree[u], is_leaf=layout_lib.is_layout):
        if lay.layers is None:
          rows.append(() if single.index(u) * fragments // len(single) == f else None)
        else:
          picked = tuple(range(f * lay.layers // fragments, (f + 1) * lay.layers // fragments))
          rows.append((picked if len(picked) < lay.layers else ()) if picked else None)
    out.append(tuple(rows))
  return tuple(out)


def _mean_over(deltas: list, nodes: tuple[str, ...], bits: int | None) -> list:
  """The mean over `nodes` of each array of `deltas`: `lax.pmean` in fp32, or with `bits` the all-gather
  of block-quantized values (every node dequantizes every node's blocks, its own included, so all nodes
  get the same mean)."""
  if not nodes:
    return deltas
  if bits is None:
    return [lax.pmean(x, nodes) for x in deltas]
  fmt = formats.integer(bits, BLOCK)
  flat = [x.reshape(-1) for x in deltas]
  gathered = comm.all_gather_unit(flat, nodes, fmt=fmt)
  n = gathered[0].shape[0] // flat[0].shape[0]
  return [g.reshape(n, -1).mean(0).reshape(x.shape) for g, x in zip(gathered, deltas)]
