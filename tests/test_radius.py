"""Radius (Zheng & Zhang): periodic top-k replica sync with a residual and a dense warm-up, on every plan
with replicas.

The checklist of `shared/notes/radius_digest.md` §5 that holds on CPU: against a single-device
reference of Algorithms 1–2 written plainly below (`reference_radius`), bitwise against the dense plan,
read from the compiled program, and through checkpoints.
"""
import math

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import analysis, comm, layout as layout_lib, plan as plans
from zerojax.planner.space import Point
from zerojax.train import checkpoint, state_spec
from zerojax.train.optim import decay_mask
from tests import helpers

RADIUS = plans.radius(density=0.25, period=3, dense_steps=1)
PHASES = ["dense", "select", "sparse", "sparse", "select", "sparse"]
PLANS = {  # plan, mesh, replicas
    "mics4": (lambda r: plans.mics(group_size=4, param_dtype="float32", replica_sync=r), (2, 4), 2),
    "dp": (lambda r: plans.dp(param_dtype="float32", replica_sync=r), (2, 4), 8),
    "zero1_in_node": (lambda r: Point(1, 1, 4).plan(2, 4, param_dtype="float32", replica_sync=r), (2, 4), 2),
}


# -- the reference: Algorithms 1–2 on one device -----------------------------------------------------

def top_k_mask(update: np.ndarray, k: int, shards: int, size: int) -> np.ndarray:
  """Algorithm 1 line 23 per shard of a flat padded leaf: the k largest |update| of each of its `shards`
  chunks; padding ranks last, ties go to the lower position."""
  c = update.shape[-1] // shards
  score = np.abs(np.asarray(update, np.float64)).reshape(*update.shape[:-1], shards, c)
  score = np.where(np.arange(shards * c).reshape(shards, c) < size, score, -1.0)
  order = np.argsort(-score, axis=-1, kind="stable")[..., :k]
  mask = np.zeros(score.shape, bool)
  np.put_along_axis(mask, order, True, axis=-1)
  return mask.reshape(update.shape)


def reference_radius(model, opt, params, batches, *, layout, replicas, shards, radius):
  """Algorithm 1 with the optimizer as Algorithm 2, on one device.

  Replica n's gradient is the gradient of the mean loss over its share of the global batch, / replicas;
  each keeps its own residual. Leaves are flat and padded as in `layout`, each split into `shards`
  chunks that select their own k. Returns per step (phase, params, residual [replicas, ...], masks).
  """
  lays = layout.leaves
  treedef = jax.tree.structure(params)
  to_flat = lambda tree: [np.asarray(layout_lib.flatten_leaf(x, l)) for x, l in zip(jax.tree.leaves(tree), lays)]
  to_tree = lambda flats: treedef.unflatten([layout_lib.unflatten_leaf(jnp.asarray(f), l) for f, l in zip(flats, lays)])
  grad = jax.jit(jax.grad(lambda p, b: jnp.mean(jax.vmap(lambda t: model.loss(p, t))(b))))
  state, out = opt.init(params), []
  residual = [[np.zeros(l.flat_shape(), np.float32) for l in lays] for _ in range(replicas)]
  masks, selected_at = None, -1
  for t, b in enumerate(batches):
    rows = b.shape[1] // replicas
    local = [[g / np.float32(replicas) for g in to_flat(grad(params, b[:, n * rows:(n + 1) * rows]))]
             for n in range(replicas)]
    leaves = range(len(lays))
    if t < radius.dense_steps:                                   # lines 3–5: dense warm-up
      phase, agg = "dense", [sum(local[n][i] for n in range(replicas)) for i in leaves]
    elif selected_at < 0 or t - selected_at >= radius.period:    # lines 7–11: dense with the residual
      phase = "select"
      agg = [sum(local[n][i] + residual[n][i] for n in range(replicas)) for i in leaves]
      residual = [[np.zeros_like(r) for r in rs] for rs in residual]
    else:                                                        # lines 13–17: the selection only
      phase = "sparse"
      agg = [sum(local[n][i] for n in range(replicas)) * masks[i] for i in leaves]
      residual = [[r + np.where(m, 0, g) for r, g, m in zip(rs, gs, masks)] for rs, gs in zip(residual, local)]
    updates, state = opt.update(to_tree(agg), state, params)    # lines 20–21: clip, correction
    params = optax.apply_updates(params, updates)
    if phase == "select":                                        # lines 22–23: new indices
      masks = [top_k_mask(u, radius.shard_k(l.padded // shards), shards, l.size)
               for u, l in zip(to_flat(updates), lays)]
      selected_at = t
    out.append((phase, params, [np.stack(r) for r in zip(*residual)], masks))
  return out


# -- the executor ----------------------------------------------------------------------------------

def executor_masks(ex, state) -> list[np.ndarray]:
  shards = math.prod(ex.mesh.shape[a] for a in ex.plan.opt_order)
  return [np.asarray(comm.radius.indices_to_mask(jnp.asarray(np.asarray(i)), l.padded // shards, shards))
          for i, l in zip(jax.tree.leaves(state.radius.indices), ex.layout.leaves)]


def run_radius(plan, mesh, opt, batches, accum=2, params=None):
  """Trains with the executor; returns (executor, initial params, final state, per-step records)."""
  model = helpers.tiny_gpt()
  ex = zerojax.Executor(model, opt, plan, mesh, accum_steps=accum)
  params = jax.jit(model.init)(jax.random.key(0)) if params is None else params
  state, step, out = ex.init_from_params(params), ex.step_fn(), []
  for b in batches:
    phase = ex.phase(state)
    state, m = step(state, jax.device_put(b, ex.batch_sharding))
    radius = state.radius
    out.append((phase, jax.tree.map(np.asarray, ex.logical_params(state)),
                [np.asarray(r) for r in jax.tree.leaves(radius.residual)] if radius else None,
                executor_masks(ex, state) if radius else None, float(m.loss)))
  return ex, params, state, out


@pytest.fixture(scope="module", params=list(PLANS))
def against_reference(request):
  make, shape, replicas = PLANS[request.param]
  opt = helpers.optimizer("sgd")
  batches = helpers.batches(len(PHASES), 2)
  ex, init, state, got = run_radius(make(RADIUS), zerojax.make_mesh(*shape), opt, batches)
  shards = math.prod(ex.mesh.shape[a] for a in ex.plan.opt_order)
  want = reference_radius(ex.model, opt, init, batches, layout=ex.layout, replicas=replicas, shards=shards,
                          radius=RADIUS)
  return request.param, ex, state, got, want


def test_matches_the_reference_algorithm(against_reference):
  """Properties 3, 5, 7, 8, 9, 11: phases, indices, residuals and weights of every step equal the plain
  reference's (DP, MiCS, ZeRO-1 inside a node with replicas across nodes)."""
  name, ex, _, got, want = against_reference
  assert [g[0] for g in got] == [w[0] for w in want] == PHASES
  for t, ((_, params, residual, masks, _), (_, ref_params, ref_residual, ref_masks)) in enumerate(zip(got, want)):
    assert helpers.max_rel_diff(params, ref_params) < 1e-5, (name, t)
    for r, rr in zip(residual, ref_residual):
      np.testing.assert_allclose(r, rr, rtol=0, atol=1e-6 * max(1.0, float(np.abs(rr).max())), err_msg=f"{name} {t}")
    if ref_masks is not None:
      for m, rm, lay, k in zip(masks, ref_masks, ex.layout.leaves, ex.radius_k):
        np.testing.assert_array_equal(m, rm, err_msg=f"{name} step {t}")
  # k = ⌈d·c⌉ per shard of c elements, per layer: the selection holds exactly that many
  shards = math.prod(ex.mesh.shape[a] for a in ex.plan.opt_order)
  for m, lay, k in zip(got[-1][3], ex.layout.leaves, ex.radius_k):
    assert k == math.ceil(RADIUS.density * lay.padded // shards - 1e-9) or k == math.ceil(RADIUS.density * lay.padded / shards)
    assert (m.reshape(*m.shape[:-1], shards, -1).sum(-1) == k).all()
  # the residual is per replica, zero where selected, and moved: the sparse steps sent less than all
  residual, masks = got[-1][2], got[-1][3]
  assert all((r[:, m] == 0).all() for r, m in zip(residual, masks))
  assert any(not np.array_equal(r[0], r[1]) for r in residual)
  assert helpers.max_rel_diff(got[-1][1], want[-1][1]) < 1e-5


def test_replicas_hold_bitwise_equal_weights_and_indices(against_reference):
  """Properties 3, 4: members of a replication group hold identical master weights, optimizer states and
  index sets (selected from identical values, no communication)."""
  _, ex, state, _, _ = against_reference
  for x in jax.tree.leaves((state.params, state.opt_state, state.radius.indices)):
    by_index = {}
    for sh in x.addressable_shards:
      by_index.setdefault(str(sh.index), []).append(np.asarray(sh.data))
    for copies in by_index.values():
      for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0])


@pytest.fixture(scope="module")
def dense_mics():
  """4 adamw steps of MiCS (groups of 4 on 2 x 4), dense replica sync."""
  batches = helpers.batches(4, 2)
  _, init, state, got = run_radius(PLANS["mics4"][0](None), zerojax.make_mesh(2, 4), helpers.optimizer("adamw"),
                                   batches)
  return init, batches, jax.tree.map(np.asarray, (state.params, state.opt_state)), got


@pytest.mark.parametrize("sync", [plans.radius(density=1.0, period=3, dense_steps=1),
                                  plans.radius(density=0.3, period=1),
                                  plans.radius(density=0.3, period=2, dense_steps=4)],
                         ids=["density_1", "period_1", "before_the_switch"])
def test_bitwise_equal_to_dense(sync, dense_mics):
  """Properties 1–3: density 1, period 1, or steps before the switch train bitwise like the dense plan
  (AdamW, accumulation 2, through select and sparse steps)."""
  init, batches, want, dense = dense_mics
  _, _, state, got = run_radius(PLANS["mics4"][0](sync), zerojax.make_mesh(2, 4), helpers.optimizer("adamw"),
                                batches, params=init)
  assert [g[4] for g in got] == [d[4] for d in dense]
  for a, b in zip(jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), b, strict=True)
  if sync.period > 1 and sync.dense_steps < 4:
    assert {g[0] for g in got} == {"dense", "select", "sparse"}


def test_selection_ranks_the_adamw_corrected_update():
  """Property 6: the indices are the top-k of |m̂/(√v̂+ε) + λw| (Algorithm 2, after the clip) at the select
  step, which differs from the top-k of the (clipped, averaged) gradient."""
  opt = helpers.optimizer("adamw")  # clip 1, lr 1e-3, b1 0.9, b2 0.999, eps 1e-6, weight decay 0.1 on matrices
  ex = zerojax.Executor(helpers.tiny_gpt(), opt, PLANS["mics4"][0](RADIUS), zerojax.make_mesh(2, 4), accum_steps=2)
  state, step = ex.init(jax.random.key(0)), ex.step_fn()
  logical = lambda tree: jax.tree.map(np.asarray, layout_lib.to_logical(tree, ex.layout))
  moment = lambda st, name: logical(optax.tree_utils.tree_get(st.opt_state, name))
  w_prev = mu_prev = None
  for b in helpers.batches(2, 2):  # step 0 dense, step 1 select
    w_prev, mu_prev = logical(state.params), moment(state, "mu")
    state, _ = step(state, jax.device_put(b, ex.batch_sharding))
  mu, nu = moment(state, "mu"), moment(state, "nu")
  b1, b2, eps, lam, t = 0.9, 0.999, 1e-6, 0.1, 2
  corrected = jax.tree.map(lambda m, v, w, d: (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + lam * d * w,
                           mu, nu, w_prev, decay_mask(w_prev))
  grad = jax.tree.map(lambda m1, m0: (m1 - b1 * m0) / (1 - b1), mu, mu_prev)
  agree = {"corrected": 0, "gradient": 0}
  total = 0
  for m, lay, k, c, g in zip(executor_masks(ex, state), ex.layout.leaves, ex.radius_k, jax.tree.leaves(corrected),
                             jax.tree.leaves(grad)):
    for name, score in (("corrected", c), ("gradient", g)):
      agree[name] += int((m & top_k_mask(np.asarray(layout_lib.flatten_leaf(jnp.asarray(score), lay)), k, 4,
                                         lay.size)).sum())
    total += int(m.sum())
  assert agree["corrected"] / total > 0.995, agree
  assert agree["gradient"] / total < 0.9, agree
