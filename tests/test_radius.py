"""Radius (Zheng & Zhang): periodic top-k replica sync with a residual and a dense warm-up, on every plan
with replicas.

The checklist of `shared/notes/radius_digest.md` §5 that holds on CPU: against a single-device
reference of Algorithms 1–2 written plainly below (`reference_radius`), bitwise against the dense plan,
read from the compiled program, and through checkpoints.
"""
import dataclasses
import math

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax import analysis, comm, plan as plans
from zerojax.engine import layout as layout_lib
from zerojax.executor.memory import memory_report
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
  # each a whole-tree program (eager per-leaf ops would compile each op of each leaf's shape)
  flat = jax.jit(lambda tree: [layout_lib.flatten_leaf(x, l) for x, l in zip(jax.tree.leaves(tree), lays)])
  to_flat = lambda tree: [np.asarray(x) for x in flat(tree)]
  to_tree = jax.jit(lambda flats: treedef.unflatten([layout_lib.unflatten_leaf(f, l) for f, l in zip(flats, lays)]))
  grad = jax.jit(jax.grad(lambda p, b: jnp.mean(jax.vmap(lambda t: model.loss(p, t))(b))))
  update = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), u, s))(*opt.update(g, s, p)))
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
    params, updates, state = update(to_tree(agg), state, params)  # lines 20–21: clip, correction
    if phase == "select":                                        # lines 22–23: new indices
      masks = [top_k_mask(u, radius.shard_k(l.padded // shards), shards, l.size)
               for u, l in zip(to_flat(updates), lays)]
      selected_at = t
    out.append((phase, params, [np.stack(r) for r in zip(*residual)], masks))
  return out


# -- the executor ----------------------------------------------------------------------------------

def executor_masks(ex, state) -> list[np.ndarray]:
  return [np.asarray(m) for m in _masks_of(ex)([np.asarray(i) for i in jax.tree.leaves(state.stateful["radius"].indices)])]


_cache = {}


def _masks_of(ex):
  """One program per executor: the per-leaf indices as masks over the flat leaves."""
  if ex not in _cache:
    shards = math.prod(ex.mesh.shape[a] for a in ex.plan.sharding.opt_order)
    _cache[ex] = jax.jit(lambda idx: [comm.radius.indices_to_mask(i, l.padded // shards, shards)
                                      for i, l in zip(idx, ex.layout.leaves)])
  return _cache[ex]


def run_radius(plan, mesh, opt, batches, accum=2, params=None):
  """Trains with the executor; returns (executor, initial params, final state, per-step records)."""
  model = helpers.tiny_gpt()
  ex = zerojax.Executor(model, opt, plan, mesh, accum_steps=accum)
  params = jax.jit(model.init)(jax.random.key(0)) if params is None else params
  state, step, out = ex.init_from_params(params), ex.step_fn(), []
  for b in batches:
    phase = ex.phase(state)
    state, m = step(state, jax.device_put(b, ex.batch_sharding))
    radius = state.stateful.get("radius")
    out.append((phase, jax.tree.map(np.asarray, ex.logical_params(state)),
                [np.asarray(r) for r in jax.tree.leaves(radius.residual)] if radius else None,
                executor_masks(ex, state) if radius else None, float(m.loss)))
  return ex, params, state, out


@pytest.fixture(scope="module", params=helpers.sweep(list(PLANS), ["mics4"]))
def against_reference(request):
  make, shape, replicas = PLANS[request.param]
  opt = helpers.optimizer("sgd")
  batches = helpers.batches(len(PHASES), 2)
  ex, init, state, got = run_radius(make(RADIUS), zerojax.make_mesh(*shape), opt, batches)
  shards = math.prod(ex.mesh.shape[a] for a in ex.plan.sharding.opt_order)
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
      for m, rm, lay, k in zip(masks, ref_masks, ex.layout.leaves, ex.stateful["radius"].k):
        np.testing.assert_array_equal(m, rm, err_msg=f"{name} step {t}")
  # k = ⌈d·c⌉ per shard of c elements, per layer: the selection holds exactly that many
  shards = math.prod(ex.mesh.shape[a] for a in ex.plan.sharding.opt_order)
  for m, lay, k in zip(got[-1][3], ex.layout.leaves, ex.stateful["radius"].k):
    assert k == math.ceil(RADIUS.density * lay.padded // shards - 1e-9) or k == math.ceil(RADIUS.density * lay.padded / shards)
    assert (m.reshape(*m.shape[:-1], shards, -1).sum(-1) == k).all()
  # the residual is per replica, zero where selected, and moved: the sparse steps sent less than all
  residual, masks = got[-1][2], got[-1][3]
  assert all((r[:, m] == 0).all() for r, m in zip(residual, masks))
  assert any(not np.array_equal(r[0], r[1]) for r in residual)
  assert helpers.max_rel_diff(got[-1][1], want[-1][1]) < 1e-5


def test_replicas_hold_bitwise_equal_weights_and_indices(against_reference):
  """Properties 3, 4: members of a replication group hold identical master weights, optimizer states and
  index sets (selected from identical values, no communication); the residual and indices cost what
  `memory_report` says."""
  _, ex, state, _, _ = against_reference
  mem = memory_report(ex, state)
  assert mem["measured"]["radius"] == mem["expected"]["radius"] >= mem["expected"]["master"]
  for x in jax.tree.leaves((state.params, state.opt_state, state.stateful["radius"].indices)):
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


@pytest.mark.parametrize("sync", [pytest.param(plans.radius(density=1.0, period=3, dense_steps=1), marks=pytest.mark.slow),
                                  pytest.param(plans.radius(density=0.3, period=1), marks=pytest.mark.slow),
                                  pytest.param(plans.radius(density=0.3, period=2, dense_steps=4), marks=pytest.mark.slow)],
                         ids=["density_1", "period_1", "before_the_switch"])
def test_bitwise_equal_to_dense(sync, dense_mics):
  """Properties 1–3: density 1, period 1, or steps before the switch train bitwise like the dense plan
  (AdamW, accumulation 2, through select and sparse steps)."""
  init, batches, want, dense = dense_mics
  _, _, state, got = run_radius(PLANS["mics4"][0](sync), zerojax.make_mesh(2, 4), helpers.optimizer("adamw"),
                                batches, params=init)
  assert [g[4] for g in got] == [d[4] for d in dense]
  helpers.assert_trees_identical((state.params, state.opt_state), want)
  if sync.period > 1 and sync.dense_steps < 4:
    assert {g[0] for g in got} == {"dense", "select", "sparse"}


@pytest.mark.slow  # Radius against its reference algorithm in the fast suite: test_matches_the_reference_algorithm[mics4]
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
  for m, lay, k, c, g in zip(executor_masks(ex, state), ex.layout.leaves, ex.stateful["radius"].k, jax.tree.leaves(corrected),
                             jax.tree.leaves(grad)):
    for name, score in (("corrected", c), ("gradient", g)):
      agree[name] += int((m & top_k_mask(np.asarray(layout_lib.flatten_leaf(jnp.asarray(score), lay)), k, 4,
                                         lay.size)).sum())
    total += int(m.sum())
  assert agree["corrected"] / total > 0.995, agree
  assert agree["gradient"] / total < 0.9, agree


# -- the wire ----------------------------------------------------------------------------------------

def test_sparse_step_moves_k_elements_on_the_replica_all_reduce():
  """Properties 13, 14: read from the compiled programs, the sparse step's replica sync is one all-reduce
  of the k selected fp32 values per device over the replication groups (no all-gather, no indices); the
  select step's moves the whole shard, as the dense plan's does; the group's own collectives are the
  dense plan's."""
  mesh = zerojax.make_mesh(2, 4)
  ex = zerojax.Executor(helpers.tiny_gpt(), optax.adam(1e-3), PLANS["mics4"][0](RADIUS), mesh, accum_steps=2)
  state = ex.init(jax.random.key(0))
  batch = jax.device_put(helpers.batches(1, 2)[0], ex.batch_sharding)
  found = {p: analysis.collectives_from_hlo(ex.step_fn().lower(state, batch, phase=p).compile().as_text(), ex.mesh)
           for p in ("dense", "select", "sparse")}
  sync = {p: [c for c in f if c.role == "replica sync"] for p, f in found.items()}
  elements = {p: sum(c.count * sum(math.prod(s) for s in c.operand_shapes) for c in cs) for p, cs in sync.items()}
  k = sum(k * (lay.layers or 1) for k, lay in zip(ex.stateful["radius"].k, ex.layout.leaves))
  shard = sum(lay.padded // 4 * (lay.layers or 1) for lay in ex.layout.leaves)
  assert elements == {"dense": shard, "select": shard, "sparse": k}
  assert k == pytest.approx(RADIUS.density * shard, rel=0.02)
  assert len(sync["sparse"]) == 1 and sync["sparse"][0].op == "all-reduce" and sync["sparse"][0].dtype == "f32"
  assert sync["sparse"][0].bytes_per_device == 4 * k  # ring model: 2 replicas, 2 (n - 1) / n x 4k bytes
  replication = {frozenset(range(j, 8, 4)) for j in range(4)}
  assert all({frozenset(g) for g in c.replica_groups} == replication for cs in sync.values() for c in cs)
  group = lambda f: sorted((c.op, c.operand_shapes, c.count) for c in f if c.role not in ("replica sync", "metrics"))
  assert group(found["sparse"]) == group(found["select"])
  assert not any(c.op == "all-gather" and c.role == "replica sync" for f in found.values() for c in f)


# -- the residual ------------------------------------------------------------------------------------

@pytest.mark.slow  # Radius against its reference algorithm in the fast suite: test_matches_the_reference_algorithm[mics4]
def test_residual_conservation_over_a_window():
  """Properties 8–10: with frozen weights and one batch, a sparse step sends the mean gradient on the
  selection and exactly zero elsewhere; each replica's residual keeps exactly what it did not send (zero
  on the selection, after two steps exactly twice that of one), and the window's select step delivers it:
  over the window the optimizer receives T x the dense gradient."""
  radius = plans.radius(density=0.25, period=4)
  model, mesh = helpers.tiny_gpt(), zerojax.make_mesh(2, 4)
  params = jax.jit(model.init)(jax.random.key(0))
  batch = helpers.batches(1, 2)[0]
  ex = zerojax.Executor(model, helpers.capture_grads(), PLANS["mics4"][0](radius), mesh, accum_steps=2)
  dense = [np.asarray(layout_lib.flatten_leaf(g, l))
           for g, l in zip(jax.tree.leaves(helpers.reference_grads(model, params, batch)), ex.layout.leaves)]
  state, step = ex.init_from_params(params), ex.step_fn()
  phases, sent, residual = [], [], []
  for _ in range(5):
    phases.append(ex.phase(state))
    state, _ = step(state, jax.device_put(batch, ex.batch_sharding))
    sent.append([np.asarray(g) for g in jax.tree.leaves(state.opt_state)])  # the gradient the optimizer got
    residual.append([np.asarray(r) for r in jax.tree.leaves(state.stateful["radius"].residual)])
  assert phases == ["select", "sparse", "sparse", "sparse", "select"]
  masks = executor_masks(ex, state)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * max(float(np.abs(b).max()), 1e-30))
  for i, (d, m) in enumerate(zip(dense, masks)):
    close(sent[0][i], d)
    for s in (1, 2, 3):
      assert (sent[s][i][~m] == 0).all() and (residual[s][i][:, m] == 0).all()
      close(sent[s][i][m], d[m])
      close(residual[s][i].sum(0), s * np.where(m, 0, d))
    np.testing.assert_array_equal(residual[2][i], 2 * residual[1][i])
    assert (residual[4][i] == 0).all() and (residual[0][i] == 0).all()
    close(sent[4][i], d + residual[3][i].sum(0))
    close(sum(sent[s][i] for s in (1, 2, 3, 4)), 4 * d)
  assert any(not np.array_equal(r[0], r[1]) for r in residual[1])  # per replica: each its own rows


# -- checkpoints -------------------------------------------------------------------------------------

def ckpt_executor(plan, mesh):
  from zerojax.train.optim import make_optimizer
  return zerojax.Executor(helpers.tiny_gpt(), make_optimizer(total_steps=10), dataclasses.replace(plan, pad_multiple=3), mesh)


def logical(ex, state) -> dict:
  return {state_spec.SEP.join(layout_lib.path_names(p)): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(state_spec.logical_state(ex, state))}


@pytest.fixture(scope="module")
def saved_mid_window(tmp_path_factory):
  """MiCS + Radius, adamw: saved after 3 steps (dense, select, sparse; the window runs to step 4), then
  trained 2 more steps."""
  ex = ckpt_executor(PLANS["mics4"][0](RADIUS), zerojax.make_mesh(2, 4))
  state, step = ex.init(jax.random.key(0)), ex.step_fn()
  batches = [jax.device_put(b, ex.batch_sharding) for b in helpers.batches(5, 1)]
  for b in batches[:3]:
    state, _ = step(state, b)
  path = str(tmp_path_factory.mktemp("radius_ckpt"))
  with checkpoint.Checkpointer(path) as c:
    assert c.save(ex, state)
  want = logical(ex, state)
  for b in batches[3:]:
    state, _ = step(state, b)
  return ex, batches, want, jax.tree.map(np.asarray, state), path


def restore(ex, path):
  with checkpoint.Checkpointer(path, read_only=True) as c:
    return c.restore(ex)[0]


@pytest.mark.slow  # Radius state round trip in the fast suite: test_checkpoints_with_and_without_radius
def test_resume_mid_window_is_bitwise(saved_mid_window):
  """The residual, the indices and the last selection's step are checkpointed: resuming mid-window
  continues bitwise like the run that never stopped."""
  ex, batches, want, final, path = saved_mid_window
  state = restore(ex, path)
  assert {k for k in want if k.startswith("radius")} >= {"radius/selected_at", "radius/residual/blocks/fc/kernel",
                                                           "radius/indices/blocks/fc/kernel"}
  assert want["radius/indices/blocks/fc/kernel"].dtype == bool and want["radius/residual/blocks/fc/kernel"].shape == (
      2, 2, 32, 128)
  assert ex.phase(state) == "sparse" and int(state.stateful["radius"].selected_at) == 1
  step = ex.step_fn()
  for b in batches[3:]:
    state, _ = step(state, b)
  helpers.assert_trees_identical(state, final)


@pytest.mark.slow  # Radius against its reference algorithm in the fast suite: test_matches_the_reference_algorithm[mics4]
def test_restore_onto_another_mesh_and_plan(saved_mid_window):
  """Onto DP + Radius on 8 x 1 (8 replicas, unsharded leaves): weights and optimizer states bitwise, the
  residual's replica sum kept, the saved selection kept inside the new shards' k, and it trains on."""
  _, batches, want, _, path = saved_mid_window
  ex = ckpt_executor(PLANS["dp"][0](RADIUS), zerojax.make_mesh(8, 1))
  state = restore(ex, path)
  got = logical(ex, state)
  assert set(got) == set(want)
  for key in want:
    if key.startswith("radius/residual"):
      assert got[key].shape == (8,) + want[key].shape[1:]
      np.testing.assert_allclose(got[key].sum(0), want[key].sum(0), rtol=1e-6, atol=1e-12)
    elif key.startswith("radius/indices"):
      assert (got[key] >= want[key]).all(), key  # every saved index is kept (DP's k per leaf is larger)
    else:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert ex.phase(state) == "sparse"
  state, m = ex.step_fn()(state, jax.device_put(np.asarray(batches[3]), ex.batch_sharding))
  assert bool(m.finite)


@pytest.mark.slow  # checkpoint round trips in the fast suite: test_checkpoint.py
def test_checkpoints_with_and_without_radius(saved_mid_window, tmp_path):
  """A Radius checkpoint onto a dense plan is refused (its residual would be lost); a dense one onto a
  Radius plan starts with an empty residual and selects on its first step."""
  _, _, _, _, path = saved_mid_window
  mesh = zerojax.make_mesh(2, 4)
  dense = ckpt_executor(PLANS["mics4"][0](None), mesh)
  with pytest.raises(checkpoint.CheckpointError, match=r"replica_sync=None and would drop the unsent gradient"):
    restore(dense, path)
  with checkpoint.Checkpointer(str(tmp_path)) as c:
    assert c.save(dense, dense.init(jax.random.key(0)).replace(step=jnp.int32(2)))
  ex = ckpt_executor(PLANS["mics4"][0](RADIUS), mesh)
  state = restore(ex, str(tmp_path))
  assert int(state.stateful["radius"].selected_at) == -1 and ex.phase(state) == "select"
  assert all(float(jnp.abs(r).max()) == 0 for r in jax.tree.leaves(state.stateful["radius"].residual))


# -- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    ({"density": 0.0}, r"density=0.0 is outside \(0, 1\]"),
    ({"density": 1.5}, r"density=1.5 is outside \(0, 1\]"),
    ({"period": 0}, r"period=0 must be a whole number of steps >= 1"),
    ({"dense_steps": -1}, r"dense_steps=-1 must be a whole number of steps >= 0")])
def test_bad_values_are_one_line_errors(kw, match):
  with pytest.raises(ValueError, match=match) as e:
    plans.radius(**kw)
  assert "\n" not in str(e.value)


def test_radius_needs_replicas():
  with pytest.raises(ValueError, match=r"plan 'zero3': replica_sync=radius\(...\) .* \(no replicas\)") as e:
    zerojax.Executor(helpers.tiny_gpt(), optax.sgd(0.1), plans.zero3(replica_sync=plans.radius()),
                     zerojax.make_mesh(2, 4))
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"replica_sync='radius'; use None"):
    plans.mics(replica_sync="radius")


def test_gin():
  from zerojax.train import gin_registry  # noqa: F401

  @gin.configurable("radius_test")
  def configured(plan=gin.REQUIRED):
    return plan
  try:
    gin.parse_config(["radius_test.plan = @mics()", "mics.replica_sync = @radius()", "radius.density = 0.1",
                      "radius.period = 50"])
    plan = configured()
  finally:
    gin.clear_config()
  assert plan.sync.replica_sync == plans.Radius(density=0.1, period=50, dense_steps=0)
  assert plan.sharding.param_axes == ("gpu",)


@pytest.mark.e2e
def test_train_py_sigkill_mid_window_resumes_bitwise(tmp_path):
  """train.py with MiCS + Radius killed with SIGKILL after a mid-window checkpoint: the restart restores
  the residual and the window's indices and logs exactly the losses of a run never interrupted."""
  import os
  import signal
  from tests.train_helpers import GIN, run_train
  config = {"gin_file": "configs/mics_radius.gin",
            "gin": [g for g in GIN if not g.startswith(("train.steps", "train.checkpoint_every"))] + [
                "train.steps=12", "train.checkpoint_every=4", "radius.density=0.25", "radius.period=5",
                "radius.dense_steps=2"]}  # select at steps 2, 7; checkpoints after 4 and 8: both mid-window
  rc, out, uninterrupted, _ = run_train(str(tmp_path / "whole"), **config)
  assert rc == 0 and [r[0] for r in uninterrupted] == list(range(1, 13)), out[-3000:]
  workdir = str(tmp_path / "killed")
  has = lambda step: os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))
  rc, out, first, _ = run_train(workdir, signal.SIGKILL, lambda s: s >= 5 and has(4), **config)
  assert rc == -signal.SIGKILL and first == uninterrupted[:len(first)] and first[-1][0] < 12, out[-3000:]
  rc, out, rest, restored = run_train(workdir, **config)
  assert rc == 0 and restored in (4, 8), out[-3000:]
  assert rest == uninterrupted[restored:]
