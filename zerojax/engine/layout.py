"""Parameter layout: flat, zero-padded leaves sharded on their last axis.

docs/DESIGN.md, "Parameter layout". A model's parameters are a dict of *units* (one gather and one gradient
reduction each, FSDP's "unit"); a scanned unit's leaves carry a leading layer axis. Each leaf is
flattened and zero-padded to a multiple of (all devices x quantization block), giving a global array
`[padded]` (or `[layers, padded]`) whose last axis is split into one contiguous chunk per device of the
sharding axes: device (n, g) owns chunk `n * G + g` of a leaf sharded over ("node", "gpu"), so a tiled
all-gather returns the leaf in its original order. The padding is zeros and stays zeros: its gradient
is zero, so it never reaches the optimizer's statistics or the loss.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.mesh import group_size


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """Logical shape of one leaf (without the layer axis) and its padded flat length."""
  shape: tuple[int, ...]
  padded: int
  layers: int | None = None  # length of the leading layer axis of a scanned unit

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def logical_shape(self) -> tuple[int, ...]:
    """The leaf's shape in the model, with the layer axis of a scanned unit."""
    return ((self.layers,) if self.layers is not None else ()) + self.shape

  def flat_shape(self, shards: int = 1) -> tuple[int, ...]:
    """Shape of the flat padded leaf, or of one of `shards` equal chunks of its last axis."""
    return ((self.layers,) if self.layers is not None else ()) + (self.padded // shards,)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Layouts of every leaf of a params dict `{unit_name: pytree}`; hashable, so usable as static data."""
  treedef: Any
  leaves: tuple[LeafLayout, ...]

  def tree(self):
    return jax.tree.unflatten(self.treedef, self.leaves)


def make_layout(params: dict, scanned: frozenset[str] | set[str], multiple: int) -> Layout:
  """Builds the layout of `params` (arrays or ShapeDtypeStructs) padded to a multiple of `multiple`."""
  unknown = set(scanned) - set(params)
  if unknown:
    raise ValueError(f"scanned units {sorted(unknown)} are not keys of the params dict {sorted(params)}")

  def leaf(path, x, is_scanned):
    shape = tuple(x.shape[1:] if is_scanned else x.shape)
    name = jax.tree_util.keystr(path)
    if is_scanned and x.ndim == 0:
      raise ValueError(f"leaf {name} of a scanned unit has no leading layer axis")
    if math.prod(shape) == 0:
      raise ValueError(f"model leaf {name} has shape {tuple(x.shape)} with zero elements; remove it from the "
                       "params or give it a non-zero size")
    padded = -(-math.prod(shape) // multiple) * multiple
    return LeafLayout(shape, padded, x.shape[0] if is_scanned else None)

  tree = {u: jax.tree_util.tree_map_with_path(lambda p, x, s=u in scanned: leaf((jax.tree_util.DictKey(u),) + p, x, s),
                                              params[u]) for u in params}
  leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, LeafLayout))
  return Layout(treedef, tuple(leaves))


def is_layout(x) -> bool:
  return isinstance(x, LeafLayout)


def path_names(path) -> tuple[str, ...]:
  """A pytree path as names: a dict's key, an attribute's name, a sequence's index, each as a string."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def pad_flat(x: jax.Array, lay: LeafLayout) -> jax.Array:
  """One layer's leaf, any shape with `lay.size` elements -> flat zero-padded `[padded]`."""
  return jnp.pad(x.reshape(-1), (0, lay.padded - lay.size))


def flatten_leaf(x: jax.Array, lay: LeafLayout) -> jax.Array:
  """Logical leaf -> flat zero-padded `[padded]` (or `[layers, padded]`)."""
  if lay.layers is None:
    return pad_flat(x, lay)
  return jax.vmap(lambda y: pad_flat(y, lay))(x)


def unflatten_leaf(flat: jax.Array, lay: LeafLayout) -> jax.Array:
  """Flat padded `[..., padded]` -> `[..., *lay.shape]`: drops the padding, restores the shape (also of
  a stacked `[layers, padded]` leaf)."""
  return flat[..., :lay.size].reshape(flat.shape[:-1] + lay.shape)


def spec(lay: LeafLayout, axes: tuple[str, ...]) -> P:
  """PartitionSpec of a flat leaf sharded over `axes` on its last axis."""
  last = axes if axes else None
  return P(None, last) if lay.layers is not None else P(last)


def logical_sharding(mesh: Mesh, axes: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
  """Shards a leaf in its logical shape (as checkpoints store it) over `axes` (or one of them) on its
  largest divisible dimension; replicated when none divides."""
  groups = ([axes] if axes else []) + ([(a,) for a in axes] if len(axes) > 1 else [])
  for group in groups:
    k = group_size(mesh, group)
    for d in sorted(range(len(shape)), key=lambda i: -shape[i]):
      if shape[d] % k == 0:
        spec = [None] * len(shape)
        spec[d] = group if len(group) > 1 else group[0]
        return NamedSharding(mesh, P(*spec))
  return NamedSharding(mesh, P())


def specs(layout: Layout, axes: tuple[str, ...]):
  return jax.tree.map(lambda l: spec(l, axes), layout.tree(), is_leaf=is_layout)


def to_flat(params: dict, layout: Layout, mesh: Mesh, axes: tuple[str, ...], dtype=jnp.float32) -> dict:
  """Logical params -> flat padded global arrays sharded over `axes`.

  Host (numpy) params are cut on the host and each device is sent its own chunk only
  (`jax.make_array_from_callback`), so no device holds a whole leaf (e.g. a checkpoint read from disk);
  jax arrays are flattened by a jitted program.
  """
  if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params)):
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(layout, axes))
    def host_leaf(x, lay, sharding):
      flat = np.asarray(x).reshape((lay.layers, lay.size) if lay.layers is not None else (lay.size,))

      def chunk(index):  # this device's slice of the padded leaf, cut and cast alone
        *lead, last = index
        start, stop, _ = last.indices(lay.padded)
        part = np.zeros(flat[tuple(lead)].shape[:-1] + (stop - start,), dtype)
        part[..., :max(min(stop, lay.size) - start, 0)] = flat[tuple(lead) + (slice(start, min(stop, lay.size)),)]
        return part
      shape = flat.shape[:-1] + (lay.padded,)
      return jax.make_array_from_callback(shape, sharding, chunk)
    return jax.tree.map(host_leaf, params, layout.tree(), shardings, is_leaf=is_layout)
  return _flattener(layout, mesh, axes, np.dtype(dtype))(params)


def to_logical(flat: dict, layout: Layout) -> dict:
  """Flat padded params -> logical params (a plain pytree of the model's shapes), e.g. for export."""
  return _unflattener(layout)(flat)


# One jitted function per layout (and placement): a call with the same shapes reuses its compiled program
# instead of tracing and compiling a new one (evaluation and export call these again and again).
@functools.lru_cache(maxsize=64)
def _flattener(layout: Layout, mesh: Mesh, axes: tuple[str, ...], dtype: np.dtype):
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(layout, axes))
  return jax.jit(lambda p: jax.tree.map(lambda x, l: flatten_leaf(x.astype(dtype), l), p, layout.tree()),
                 out_shardings=shardings)


@functools.lru_cache(maxsize=64)
def _unflattener(layout: Layout):
  return jax.jit(lambda f: jax.tree.map(unflatten_leaf, f, layout.tree()))


def bytes_of(layout: Layout, dtype) -> int:
  """Total padded bytes of all leaves in `dtype`."""
  item = np.dtype(dtype).itemsize
  return sum(l.padded * (l.layers or 1) * item for l in layout.leaves)
