"""Radius (Zheng & Zhang, Algorithm 1) on a flax linen model whose user tree is not the units' tree.

The model: an embedding and a position table outside any unit (the root unit, `_root`), an `nn.scan`-ed
stack of MLP blocks (one scanned unit) and a head (a unit), under MiCS (groups of 4 on 2 x 4, 2 replicas).
The user's tree sorts the root's leaves last (`z_embed`, `z_pos`), the units' tree first, and the leaves
range from 32 to 8192 elements per layer, so each leaf's k (Algorithm 1 line 23, per A_os shard) differs.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import comm
from zerojax.engine import layout as layout_lib
from tests import helpers

V, D, T, LAYERS = 256, 32, 8, 3
SHARDS = 4  # MiCS group: the gpu axis of the 2 x 4 mesh
SPARSE = zerojax.radius(density=0.1, period=2, dense_steps=1)
PHASES = ["dense", "select", "sparse", "select", "sparse"]
# ~12 s to compile the three programs on CPU; Radius in the fast suite: test_radius.py (the GPT under MiCS)
pytestmark = pytest.mark.slow


class Block(nn.Module):
  """Pre-norm MLP block with a residual."""

  @nn.compact
  def __call__(self, x, _=None):
    h = nn.Dense(4 * D)(nn.LayerNorm()(x))
    return x + nn.Dense(D)(jax.nn.gelu(h)), None


class Head(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(V, name="out")(nn.LayerNorm()(x))


class LM(nn.Module):
  """Embedding + positions (root unit), scanned blocks (one scanned unit), head (a unit)."""

  @nn.compact
  def __call__(self, tokens):
    pos = self.param("z_pos", nn.initializers.normal(0.02), (T, D))
    x = nn.Embed(V, D, name="z_embed")(tokens) + pos[None]
    stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS,
                    in_axes=nn.broadcast)
    x, _ = stack(name="blocks")(x, None)
    return Head(name="head")(x)


def loss_fn(apply, batch, rng):
  tokens = batch["tokens"]
  logits = apply(tokens[:, :-1])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


def batches(n, accum=2, batch=16, seed=0):
  rng = np.random.default_rng(seed)
  return [{"tokens": rng.integers(0, V, (accum, batch, T + 1)).astype(np.int32)} for _ in range(n)]


def model():
  return zerojax.from_linen(LM(), jax.tree.map(lambda x: x[0], batches(1)[0]), loss_fn, units=(Block, Head))


def train(replica_sync, steps=len(PHASES)):
  """MiCS on 2 x 4 with `replica_sync`, adamw, from the same initial weights; (executor, state, phases,
  losses)."""
  plan = zerojax.mics(group_size=SHARDS, param_dtype="float32", replica_sync=replica_sync)
  ex = zerojax.Executor(model(), helpers.optimizer("adamw"), plan, zerojax.make_mesh(2, 4), accum_steps=2)
  state, step = ex.init(jax.random.key(0)), ex.step_fn()
  phases, losses = [], []
  for b in batches(steps):
    phases.append(ex.phase(state))
    state, m = step(state, b)
    losses.append(float(m.loss))
  return ex, state, phases, losses


@pytest.fixture(scope="module")
def sparse_run():
  return train(SPARSE)


def expected_k(ex):
  """Per user-tree path: (layers, elements per A_os shard, k), from the module's own parameter shapes
  (flax `init`), the mesh and the plan's alignment; the scanned leaves are those under `blocks`."""
  shapes = jax.eval_shape(LM().init, jax.random.key(0), jnp.zeros((2, T), jnp.int32))["params"]
  multiple = 8 * ex.plan.alignment  # devices x alignment (the plan's pad_multiple is 1)
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(shapes):
    names = layout_lib.path_names(path)
    layers = x.shape[0] if names[0] == "blocks" else None
    size = math.prod(x.shape[1:] if layers else x.shape)
    chunk = -(-size // multiple) * multiple // SHARDS
    out[names] = (layers, chunk, math.ceil(round(SPARSE.density * chunk, 6)))
  return out


def test_each_leaf_selects_its_own_k(sparse_run):
  """Every leaf's window holds ⌈density x shard⌉ distinct positions in each A_os shard (per layer), the k
  of that leaf, matched by path: the pairing of k's with leaves survives a user tree that is not the
  units' tree. The residual is zero on the selection."""
  ex, state, phases, _ = sparse_run
  assert phases == PHASES
  want = expected_k(ex)
  assert len({k for _, _, k in want.values()}) >= 5
  user_order = list(want)
  got = {}
  residual = dict(jax.tree_util.tree_leaves_with_path(state.stateful["radius"].residual))
  for path, idx in jax.tree_util.tree_leaves_with_path(state.stateful["radius"].indices):
    names = layout_lib.path_names(path)
    user = names[1:] if names[0] == "_root" else names
    layers, chunk, k = want[user]
    got[user] = None
    idx = np.asarray(idx)
    assert idx.shape == ((layers,) if layers else ()) + (SHARDS * k,), user
    per_shard = idx.reshape(*idx.shape[:-1], SHARDS, k)
    assert (np.diff(per_shard, axis=-1) > 0).all(), user  # ascending: k distinct positions
    mask = np.asarray(comm.radius.indices_to_mask(jnp.asarray(idx), chunk, SHARDS))
    assert (mask.reshape(*mask.shape[:-1], SHARDS, chunk).sum(-1) == k).all(), user
    res = np.asarray(residual[path])  # [replicas, (layers,) padded]
    assert (res[:, mask] == 0).all() and np.abs(res).max() > 0, user
  assert set(got) == set(want)
  assert list(got) != user_order  # the units' order differs from the user's: the test can see a swap


def test_replicas_hold_bitwise_equal_weights(sparse_run):
  """After select and sparse steps, the two replicas of every shard hold identical master weights,
  optimizer states and indices (each shard on 2 devices; the scalars on all 8)."""
  _, state, _, _ = sparse_run
  for x in jax.tree.leaves((state.params, state.opt_state, state.stateful["radius"].indices)):
    by_index = {}
    for sh in x.addressable_shards:
      by_index.setdefault(str(sh.index), []).append(np.asarray(sh.data))
    assert {len(c) for c in by_index.values()} == ({8} if x.ndim == 0 else {2})
    for copies in by_index.values():
      for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0])


def test_density_one_trains_like_the_dense_plan(sparse_run):
  """density=1 selects every element: through select and sparse steps the losses and master weights are
  bitwise those of the dense replica sync (and the sparse run's differ: the test can fail)."""
  _, sparse_state, _, sparse_losses = sparse_run
  _, dense, _, dense_losses = train(None)
  _, full, phases, full_losses = train(zerojax.radius(density=1.0, period=2, dense_steps=1))
  assert phases == PHASES
  assert full_losses == dense_losses
  helpers.assert_trees_identical((full.params, full.opt_state), (dense.params, dense.opt_state))
  assert sparse_losses[:3] == dense_losses[:3] and sparse_losses[3:] != dense_losses[3:]
  assert helpers.max_rel_diff(sparse_state.params, dense.params) > 1e-4
