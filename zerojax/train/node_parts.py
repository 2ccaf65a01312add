"""The parts of the train state each node keeps in its copy, and the state assembled from the parts the
nodes of a run hold (`zerojax.train.replica` writes and reads the copies).

A node's copy holds every leaf the nodes share whole, its own row of each leaf held one row per node
(DiLoCo's replicas, Radius's residuals), and its part of each leaf sharded across nodes (ZeRO-3, ZeRO++,
hpZ's primary shards, MiCS groups spanning nodes), with the part of the next node around the ring
(`neighbour`), moved to it by one `ppermute` over the node axis when the copy is taken: a lost node's part
survives on its predecessor, as Gemini (Wang et al., SOSP '23, §4) places checkpoint replicas in peers'
memory.

`assemble` builds the state on any number of nodes: each leaf from the parts the holders keep (each
element from one holder, over the interconnect: a masked sum over the nodes, exact), and the per-node
rows by the rule of merging and splitting replicas (`zerojax.train.replica`'s docstring).
"""
from __future__ import annotations

import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.mesh import AXES
from zerojax.train.state_spec import SEP, CheckpointError, logical_state, new_row, seed_params, state_spec_of

NODE = AXES[0]


def _axes(entry) -> tuple[str, ...]:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def per_node(executor, leaf) -> bool:
  """Whether a stored leaf holds one row per node: `[nodes, ...]`, its first dimension sharded over the
  node axis alone (DiLoCo's replicas, Radius's residual)."""
  spec = tuple(leaf.sharding.spec)
  return (len(leaf.shape) > 0 and len(spec) > 0 and _axes(spec[0]) == (NODE,)
          and leaf.shape[0] == executor.mesh.shape[NODE])


def across_nodes(executor, leaf) -> bool:
  """Whether a stored leaf (not a per-node row) is sharded over the node axis: each node holds part of it
  (ZeRO-3, ZeRO++, hpZ's primary shards, MiCS groups spanning nodes), so a node's copy also holds its
  neighbour's part."""
  spec = tuple(leaf.sharding.spec)
  return not per_node(executor, leaf) and any(NODE in _axes(e) for e in spec)


def neighbour(node: int, nodes: int) -> int | None:
  """The node whose part node `node` also keeps: the next one, around the ring (None on one node)."""
  return (node + 1) % nodes if nodes > 1 else None


def sharded_across_nodes(executor) -> str | None:
  """The first leaf of `executor`'s train state that no node holds whole (its copies then keep a
  neighbour's part too), as `'<leaf> is sharded over <spec>'`, or None when every node holds every leaf."""
  for leaf in state_spec_of(executor).leaves:
    if across_nodes(executor, leaf):
      return f"{SEP.join(leaf.names)} is sharded over {tuple(leaf.sharding.spec)}"
  return None



def _bounds(index, shape) -> tuple[tuple[int, int], ...]:
  """A shard's index (slices) as `(start, stop)` per dimension."""
  return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape))


def _on_node(y, x, mesh, node: int, source: int | None = None) -> dict:
  """The shards of `y` on node `node`'s devices by the part of `x` they hold, one per distinct part: `x`'s
  own (`source` None, `y` is `x`), or node `source`'s, which `_shift` moved to the same devices of `node`."""
  where = x.sharding.devices_indices_map(tuple(x.shape))
  shards = {s.device: s for s in y.addressable_shards}
  devices = list(mesh.devices[node].flat)
  out = {}
  for d, holder in zip(devices, devices if source is None else mesh.devices[source].flat):
    out.setdefault(_bounds(where[holder], x.shape), shards[d])
  return out


def _tiles(parts: list) -> list:
  """A node's parts `[(bounds, array)]` of one leaf, merged into one when they tile their bounding box (the
  distinct shards of a sharding never overlap): a node's part of a leaf sharded over ('node', 'gpu') is
  one block."""
  if len(parts) <= 1:
    return parts
  lo = [min(b[d][0] for b, _ in parts) for d in range(len(parts[0][0]))]
  hi = [max(b[d][1] for b, _ in parts) for d in range(len(parts[0][0]))]
  if sum(a.size for _, a in parts) != int(np.prod([h - l for l, h in zip(lo, hi)])):
    return parts
  out = np.empty([h - l for l, h in zip(lo, hi)], parts[0][1].dtype)
  for b, a in parts:
    out[tuple(slice(s - l, e - l) for (s, e), l in zip(b, lo))] = a
  return [(tuple(zip(lo, hi)), out)]


_SHIFTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _shift(executor, values: list) -> dict:
  """For each leaf sharded across nodes (`across_nodes`), by its index in `values`: the array whose shards
  on node n's devices are node n + 1's (one `ppermute` over the node axis, around the ring). Empty on one
  node or when every node holds every leaf."""
  spec, nodes = state_spec_of(executor), int(executor.mesh.shape[NODE])
  at = [i for i, l in enumerate(spec.leaves) if across_nodes(executor, l)] if nodes > 1 else []
  if not at:
    return {}
  if executor not in _SHIFTS:
    specs = tuple(spec.leaves[i].sharding.spec for i in at)
    ring = [(j, (j - 1) % nodes) for j in range(nodes)]  # node j's part goes to node j - 1
    _SHIFTS[executor] = jax.jit(jax.shard_map(lambda *xs: tuple(jax.lax.ppermute(x, NODE, ring) for x in xs),
                                              mesh=executor.mesh, in_specs=specs, out_specs=specs, check_vma=False))
  return dict(zip(at, _SHIFTS[executor](*[values[i] for i in at])))


def take(executor, state, node: int, **meta) -> tuple[dict[str, np.ndarray], dict]:
  """Node `node`'s copy of `state` on the host: its arrays and its meta. The device-to-host part of a save:
  every process calls it at the same step (the conversion to the logical layout and the neighbour's part
  are programs over the mesh); only `node`'s shards are read, which must be this process's. Every shard's
  transfer starts before the first is waited for.

  The arrays: a per-node row under its leaf's key (`params/...`); the node's part of every other leaf under
  its key (`<key>#<i>` for further parts), and of a leaf sharded across nodes also node `neighbour`'s part
  (`<key>@<node>`). `meta["parts"]` gives each such array's leaf, node and bounds; `meta["covers"]` the
  nodes whose parts the copy holds (every node when every node holds every leaf)."""
  spec, mesh = state_spec_of(executor), executor.mesh
  nodes = int(mesh.shape[NODE])
  values = spec.unnest(logical_state(executor, state))
  shifted = _shift(executor, values)
  nxt = neighbour(node, nodes) if shifted else None
  own = [_on_node(x, x, mesh, node) for x in values]
  theirs = {i: _on_node(y, values[i], mesh, node, source=nxt) for i, y in shifted.items()}
  for s in (s for found in own + list(theirs.values()) for s in found.values()):
    s.data.copy_to_host_async()
  arrays, parts = {}, {}
  for i, (l, x) in enumerate(zip(spec.leaves, values)):
    key = SEP.join(l.names)
    if per_node(executor, l):  # this node's row
      row = np.zeros(x.shape[1:], x.dtype)
      for bounds, s in own[i].items():
        row[tuple(slice(*b) for b in bounds[1:])] = np.asarray(s.data)[0]
      arrays[key] = row
      continue
    for tag, n, found in [(key, node, own[i])] + ([(f"{key}@{nxt}", nxt, theirs[i])] if i in theirs else []):
      for j, (bounds, a) in enumerate(_tiles([(b, np.asarray(s.data)) for b, s in found.items()])):
        name = tag if j == 0 else f"{tag}#{j}"
        arrays[name], parts[name] = a, [key, n, [list(b) for b in bounds]]
  covers = [node] + ([nxt] if nxt is not None else []) if shifted else list(range(nodes))
  info = {"step": int(state.step), "node": node, "nodes": nodes, "plan": executor.plan.name, "covers": covers,
          "parts": parts, **meta}
  return arrays, info



def _drop_node(entry):
  """A sharding entry without the node axis: the axes it keeps within a node."""
  rest = tuple(a for a in _axes(entry) if a != NODE)
  return None if not rest else rest[0] if len(rest) == 1 else rest


def _select(x, covered):
  """Per element of `x`'s rows (one per node), the value of the first node whose copy covers it (exact:
  the others add zeros), and whether every element is covered by some node."""
  first = jnp.argmax(covered, axis=0)
  mine = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1)) == first[None]
  value = jnp.any(x & mine, 0) if x.dtype == jnp.bool_ else jnp.sum(jnp.where(mine, x, jnp.zeros_like(x)), 0)
  return value, jnp.all(jnp.any(covered, 0))



def _merge_rows(executor, spec, staged: dict, values: list, held: Sequence[bool]) -> list:
  """`values` with each per-node row leaf (`staged`, one row per node of the new mesh) by the rule of
  merging and splitting replicas: a holder keeps its row, a new node's row is `new_row` of the first
  holder's (seeded from the assembled `values` where the leaf has a seed)."""
  nodes, src, seeds = len(held), list(held).index(True), seed_params(spec)
  keep = np.asarray(held)
  seeded = {j: values[j] for i, j in seeds.items() if i in staged and j not in staged}

  def pick(x):  # the first holder's row on every node: exact (the others add zeros)
    mask = jnp.asarray(np.arange(nodes) == src).reshape((nodes,) + (1,) * (x.ndim - 1))
    return jnp.any(x & mask, 0) if x.dtype == jnp.bool_ else jnp.sum(jnp.where(mask, x, jnp.zeros_like(x)), 0)

  def merge(staged, seeded):
    out = {}
    for i, x in staged.items():
      j = seeds.get(i)
      seed = None if j is None else pick(staged[j]) if j in staged else seeded[j]
      new = new_row(spec.leaves[i], pick(x), seed)
      out[i] = jnp.where(jnp.asarray(keep).reshape((nodes,) + (1,) * (x.ndim - 1)), x, new[None])
    return out

  merged = jax.jit(merge, out_shardings={i: spec.leaves[i].sharding for i in staged})(staged, seeded)
  return [merged.get(i, v) for i, v in enumerate(values)]


def assemble(executor, step: int, held: Sequence[bool], load: Callable[[int], tuple[dict, dict]]):
  """The `TrainState` of `step` on `executor`'s mesh from the nodes' copies (the module docstring's rule).

  Every leaf but the per-node rows is assembled from the parts the holders' copies keep (their own, and a
  lost neighbour's): each node of the new mesh stages what its copy holds of the leaf, and each element is
  taken from the first node that holds it, over the interconnect (a masked sum over the nodes: exact).
  A node stages at most the whole leaf, sharded over its own devices, one leaf at a time.

  Args:
    executor: the run restored into; its mesh has `len(held)` nodes.
    step: the step every holder's folder has.
    held: per node of the new mesh, whether it holds a copy of `step` (others are new).
    load: for a node whose devices are this process's and that holds a copy: its arrays and meta (`take`).
  """
  mesh, spec = executor.mesh, state_spec_of(executor)
  nodes = int(mesh.shape[NODE])
  if len(held) != nodes or not any(held):
    raise CheckpointError(f"restoring step {step} onto {nodes} nodes needs a holder flag per node and at least "
                          f"one holder; got {list(held)}")
  copies = {}

  def copy_of(node) -> tuple[dict, dict]:
    """Node `node`'s arrays, and its parts by leaf: `{key: [(bounds, array)]}`."""
    if node not in copies:
      arrays, meta = load(node)
      parts = {}
      for name, (key, _, bounds) in meta.get("parts", {}).items():
        parts.setdefault(key, []).append((tuple(tuple(b) for b in bounds), arrays[name]))
      copies[node] = arrays, parts
    return copies[node]

  def wrong(node, key, shape, dtype, got) -> CheckpointError:
    return CheckpointError(f"the node copy of node {node} of step {step} has {got} for {key}, expected "
                           f"shape {shape} {np.dtype(dtype)}: it was written by another model or optimizer")

  def parts_of(node, key, shape, dtype) -> list:
    arrays, parts = copy_of(node)
    found = parts.get(key) or ([(tuple((0, n) for n in shape), arrays[key])] if key in arrays else None)
    if found is None:
      raise wrong(node, key, shape, dtype, "no such leaf")
    for bounds, a in found:
      if a.dtype != dtype or len(bounds) != len(shape) or any(e > n for (_, e), n in zip(bounds, shape)):
        raise wrong(node, key, shape, dtype, f"a part {[list(b) for b in bounds]} {a.dtype}")
    return found

  def gather(l, key):
    shape, cache = tuple(l.shape), {}
    sharding = NamedSharding(mesh, P(NODE, *(_drop_node(e) for e in l.sharding.spec)))

    def block(index):
      node, region = index[0].start or 0, _bounds(index[1:], shape)
      if (node, region) not in cache:
        x = np.zeros([e - s for s, e in region], l.dtype)
        covered = np.zeros(x.shape, bool)
        for bounds, a in (parts_of(node, key, shape, l.dtype) if held[node] else []):
          lo = [max(s, b[0]) for (s, _), b in zip(region, bounds)]
          hi = [min(e, b[1]) for (_, e), b in zip(region, bounds)]
          if all(h > o for o, h in zip(lo, hi)):
            to = tuple(slice(o - s, h - s) for o, h, (s, _) in zip(lo, hi, region))
            x[to] = a[tuple(slice(o - b[0], h - b[0]) for o, h, b in zip(lo, hi, bounds))]
            covered[to] = True
        cache[(node, region)] = x[None], covered[None]
      return cache[(node, region)]

    xs = jax.make_array_from_callback((nodes,) + shape, sharding, lambda i: block(i)[0])
    cs = jax.make_array_from_callback((nodes,) + shape, sharding, lambda i: block(i)[1])
    value, whole = jax.jit(_select, out_shardings=(l.sharding, NamedSharding(mesh, P())))(xs, cs)
    if not bool(whole):
      raise CheckpointError(f"the node copies of step {step} do not hold all of {key} (neighbouring nodes were "
                            "lost together); start from the checkpoint: move the node copies aside")
    return value

  def staged_row(l, key):
    shape = tuple(l.shape[1:])

    def fill(index):
      node = index[0].start or 0
      if not held[node]:
        return np.zeros((1,) + shape, l.dtype)[(slice(None),) + tuple(index[1:])]
      x = copy_of(node)[0].get(key)
      if x is None or tuple(x.shape) != shape or x.dtype != l.dtype:
        raise wrong(node, key, shape, l.dtype, "no such leaf" if x is None else f"shape {tuple(x.shape)} {x.dtype}")
      return np.asarray(x)[tuple(index[1:])][None]

    return jax.make_array_from_callback((nodes,) + shape, NamedSharding(mesh, P(NODE, *tuple(l.sharding.spec)[1:])),
                                        fill)

  keys = [SEP.join(l.names) for l in spec.leaves]
  rows = {i for i, l in enumerate(spec.leaves) if per_node(executor, l)}
  values = [None if i in rows else gather(l, k) for i, (l, k) in enumerate(zip(spec.leaves, keys))]
  if rows:
    values = _merge_rows(executor, spec, {i: staged_row(spec.leaves[i], keys[i]) for i in sorted(rows)}, values,
                         held)
  state = spec.from_logical(spec.nest(values))
  if int(state.step) != step:
    raise CheckpointError(f"the node copies of step {step} hold step {int(state.step)}; a folder was renamed")
  return state
