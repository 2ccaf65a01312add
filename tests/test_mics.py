"""MiCS (Zhang et al. 2022): partition groups of any size, hierarchical all-gather, 2-hop gradient sync.

The checklist of `shared/notes/mics_digest.md` §3, property by property, read from the compiled program
and compared with single-device jax.grad.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax import analysis, comm, mesh as mesh_lib, plan as plans
from zerojax.comm import formats
from zerojax.executor.memory import memory_report
from zerojax.train import checkpoint, state_spec
from tests import helpers

SHAPES = [(2, 4), (4, 2)]
GROUPS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def model_and_ref():
  return helpers.reference_case()


def compiled_collectives(plan, mesh, model, params, accum=2):
  ex = zerojax.Executor(model, optax.sgd(0.1), plan, mesh, accum_steps=accum)
  state = ex.init_from_params(params)
  batch = jax.device_put(helpers.batches(1, accum)[0], ex.batch_sharding)
  hlo = ex.step_fn().lower(state, batch).compile().as_text()
  return ex, analysis.collectives_from_hlo(hlo, ex.mesh)


def rank_groups(mesh, k):
  """Partition groups (consecutive ranks) and replication groups (strided) as sets of device ids."""
  ids = [d.id for d in mesh.devices.flat]
  parts = [frozenset(ids[i:i + k]) for i in range(0, len(ids), k)]
  repls = [frozenset(ids[j::k]) for j in range(k)]
  return parts, repls


@pytest.mark.parametrize("shape,k", helpers.sweep([(s, k) for k in GROUPS for s in SHAPES],
                                                  [((2, 4), 2), ((2, 4), 4), ((4, 2), 8)]))
def test_groups_replicas_and_2hop_sync_in_the_compiled_program(shape, k, model_and_ref):
  """§3 properties 1, 4, 7, 8, 11, 12: every gather, reduce-scatter and all-to-all stays inside one
  partition group of k consecutive ranks; every micro-step collective does; the replica all-reduce runs
  over the strided replication groups exactly once per accumulation window (none when k = n)."""
  model, params, _, _ = model_and_ref
  mesh = zerojax.make_mesh(*shape)
  layers = helpers.TINY.num_layers
  ex, found = compiled_collectives(plans.mics(group_size=k, param_dtype="float32"), mesh, model, params, accum=4)
  parts, repls = rank_groups(ex.mesh, k)
  inside = lambda c: all(any(set(g) <= p for p in parts) for g in c.replica_groups)
  moves = [c for c in found if c.op in ("all-gather", "reduce-scatter", "all-to-all")]
  assert all(inside(c) for c in moves), [(c.op, c.replica_groups) for c in moves if not inside(c)]
  per_micro = [c for c in found if c.count > layers]  # inside the loop over the first 3 micro-batches
  assert bool(per_micro) == (k > 1) and all(inside(c) for c in per_micro)
  sync = [c for c in found if c.role == "replica sync"]
  if k == 8:
    assert sync == []
  else:  # once per window: per unit (a scanned unit once per layer) inside the last micro-step's backward
    assert sync and all(c.count <= layers for c in sync)
    assert all({frozenset(g) for g in c.replica_groups} == set(repls) for c in sync)
  gathers = [c for c in found if c.op == "all-gather" and c.role.endswith("all-gather")]
  assert (gathers == []) == (k == 1)  # a group of one is data parallelism: nothing to gather


@pytest.mark.parametrize("shape,k", helpers.sweep([(s, k) for k in GROUPS for s in SHAPES],
                                                  [((4, 2), 4)]))
def test_gradients_equal_single_device_grad(shape, k, model_and_ref):
  """Property 9: the 2-hop sum is the gradient of DP / ZeRO-3 up to float reassociation."""
  model, params, batch, want = model_and_ref
  got, _ = helpers.sharded_grads(plans.mics(group_size=k, param_dtype="float32"), zerojax.make_mesh(*shape),
                                 model, params, batch)
  assert helpers.rel_l2(got, want) < 1e-5


@pytest.mark.slow  # MiCS against jax.grad in the fast suite: test_executor.py, test_gradients_equal_single_device_grad
def test_multi_step_training_equals_dp(model_and_ref):
  mesh = zerojax.make_mesh(4, 2)
  opt = helpers.optimizer("sgd")
  ex_dp, st_dp, _, l_dp = run(plans.dp(param_dtype="float32"), mesh, opt)
  ex, st, _, l_m = run(plans.mics(group_size=4, param_dtype="float32"), mesh, opt)
  np.testing.assert_allclose(l_m, l_dp, rtol=1e-6)
  assert helpers.max_rel_diff(ex.logical_params(st), ex_dp.logical_params(st_dp)) < 1e-5


def run(plan, mesh, opt, steps=2, accum=2):
  from tests.helpers import run as run_executor
  return run_executor(plan, mesh, opt, steps=steps, accum=accum)


@pytest.mark.parametrize("k", helpers.sweep([2, 4], [4]))
def test_replicas_hold_bitwise_equal_shards(k):
  """Property 3: after optimizer steps, members of a replication group hold identical shards."""
  ex, state, _, _ = run(plans.mics(group_size=k, param_dtype="float32"), zerojax.make_mesh(2, 4),
                        helpers.optimizer("adamw"))
  for x in jax.tree.leaves((state.params, state.opt_state)):
    by_index = {}
    for sh in x.addressable_shards:
      by_index.setdefault(str(sh.index), []).append(np.asarray(sh.data))
    assert len(by_index) == (1 if x.ndim == 0 else k)
    for copies in by_index.values():
      assert len(copies) == 8 // len(by_index)
      for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0])


def test_model_state_per_device_is_one_over_k(model_and_ref):
  """Property 2: per-device master weights and optimizer states are S / k, whatever the cluster shape."""
  model, params, _, _ = model_and_ref
  seen = {}
  for shape in SHAPES:
    for k in GROUPS:
      ex = zerojax.Executor(model, optax.adam(1e-3), plans.mics(group_size=k), zerojax.make_mesh(*shape))
      rep = memory_report(ex, ex.init_from_params(params))
      assert rep["measured"]["master"] == rep["expected"]["master"]
      seen[(shape, k)] = rep["measured"]["master"] * k + rep["measured"]["optimizer"] * k
  assert len(set(seen.values())) == 1, seen


def shmap(f, mesh, in_specs, out_specs):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


@pytest.mark.parametrize("bits,dtype", [(None, jnp.float32), (None, jnp.bfloat16), (8, jnp.float32)])
def test_hierarchical_gather_is_bitwise_the_flat_gather(bits, dtype):
  """Properties 5, 6: stage 1 across nodes (one device per node), stage 2 inside the node; same output
  bits; a node sends (p - k) M / p across nodes instead of the flat ring's (p - 1) M / p."""
  mesh = mesh_lib.factor(zerojax.make_mesh(4, 2), [4])  # groups of 2 nodes x 2 gpus
  axes = mesh_lib.group_axes(mesh, 4)
  assert axes == ("node.2", "gpu")
  spec = P(("node.4",) + axes)
  full = jnp.asarray(np.random.default_rng(0).standard_normal(8 * 256), dtype)
  gather = lambda x, h: comm.all_gather_unit([x], axes, fmt=formats.integer(bits, 64), hierarchical=h)[0]
  outs, egress = {}, {}
  for h in (False, True):
    f = shmap(functools.partial(gather, h=h), mesh, spec, spec)
    outs[h] = np.asarray(f(full))
    found = analysis.collectives_from_hlo(f.lower(full).compile().as_text(), mesh)
    egress[h] = sum(c.node_egress_bytes * c.count for c in found)
    if h:
      sizes = sorted(len(g) for c in found for g in c.replica_groups[:1])
      assert sizes == [2, 2]  # two stages of 2: across the group's 2 nodes, inside the node
  np.testing.assert_array_equal(outs[True].view(np.uint8), outs[False].view(np.uint8))
  if bits is None:
    np.testing.assert_array_equal(outs[False][:1024].astype(np.float32), np.asarray(full[:1024], np.float32))
  p, k = 4, 2  # group size, devices per node
  m = (egress[False] / ((p - 1) / p))  # M implied by the flat gather
  assert egress[True] == pytest.approx((p - k) / p * m)


def test_hierarchical_and_flat_plans_train_bitwise_alike(model_and_ref):
  model, params, batch, _ = model_and_ref
  mesh = zerojax.make_mesh(4, 2)
  flat, _ = helpers.sharded_grads(plans.mics(group_size=4, hierarchical=False), mesh, model, params, batch)
  hier, _ = helpers.sharded_grads(plans.mics(group_size=4), mesh, model, params, batch)
  chex.assert_trees_all_equal(flat, hier)


@pytest.mark.parametrize("kw,bound", helpers.sweep(
    [(dict(grad_bits=8), 0.03), (dict(weight_bits=8, grad_bits=8), 0.07), (dict(secondary_axes=("gpu",)), 1e-5)],
    [(dict(weight_bits=8, grad_bits=8), 0.07)]))
def test_zeropp_techniques_inside_a_group_that_spans_nodes(kw, bound, model_and_ref):
  """qgZ's 2-hop all-to-all inside a 2-node group (intra-node hop, then across the group's nodes), qwZ
  on the hierarchical gather, hpZ's node-local secondary gather: against jax.grad, with the all-to-alls
  inside the group."""
  model, params, batch, want = model_and_ref
  mesh = zerojax.make_mesh(4, 2)
  plan = plans.mics(group_size=4, param_dtype="float32", **kw)
  got, _ = helpers.sharded_grads(plan, mesh, model, params, batch)
  err = helpers.rel_l2(got, want)
  assert err < bound and (err > 1e-3 or bound < 1e-3), err
  ex, found = compiled_collectives(plan, mesh, model, params)
  parts, _ = rank_groups(ex.mesh, 4)
  a2a = [c for c in found if c.op == "all-to-all"]
  assert bool(a2a) == ("grad_bits" in kw)
  assert all(any(set(g) <= p for p in parts) for c in a2a for g in c.replica_groups)


@pytest.mark.slow  # restores across plans in the fast suite: test_checkpoint.py
def test_checkpoint_restores_across_group_sizes_bitwise(tmp_path):
  ex4, st4, _, _ = run(plans.mics(group_size=4, param_dtype="float32"), zerojax.make_mesh(2, 4),
                       helpers.optimizer("adamw"))
  with checkpoint.Checkpointer(str(tmp_path), asynchronous=False) as ck:
    ck.save(ex4, st4, seed=0)
  ex8 = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer("adamw"), plans.mics(group_size=8, param_dtype="float32"),
                         zerojax.make_mesh(4, 2), accum_steps=2)
  with checkpoint.Checkpointer(str(tmp_path), read_only=True) as ck:
    st8, _ = ck.restore(ex8)
  a = jax.tree.map(np.asarray, state_spec.logical_state(ex4, st4))
  b = jax.tree.map(np.asarray, state_spec.logical_state(ex8, st8))
  chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize("plan,match", [
    (dict(group_size=3), r"plan 'mics': param_axes=3 is not a valid group of the 2 x 4 mesh: use one of \[1, 2, 4, 8\]"),
    (dict(group_size=16), r"=16 is not a valid group"),
    (dict(group_size=2, hierarchical=True), r"hierarchical=True, but the parameter group .* does not span nodes"),
    (dict(group_size=0), r"positive group size"),
])
def test_bad_groups_are_one_line_errors(plan, match):
  with pytest.raises(ValueError, match=match) as e:
    zerojax.Executor(helpers.tiny_gpt(), optax.sgd(0.1), plans.mics(**plan), zerojax.make_mesh(2, 4))
  assert "\n" not in str(e.value)


def test_factoring_names_groups_by_size():
  mesh = mesh_lib.factor(zerojax.make_mesh(2, 4), [2, 8])
  assert dict(mesh.shape) == {"node": 2, "gpu.4": 2, "gpu.2": 2}
  assert mesh_lib.group_axes(mesh, 2) == ("gpu.2",)
  assert mesh_lib.group_axes(mesh, 4) == ("gpu.4", "gpu.2")
  assert mesh_lib.group_axes(mesh, 8) == ("node", "gpu.4", "gpu.2")
  np.testing.assert_array_equal(np.asarray(mesh.devices).reshape(2, 4), zerojax.make_mesh(2, 4).devices)
  mesh = mesh_lib.factor(zerojax.make_mesh(8, 1), [2, 4])
  assert dict(mesh.shape) == {"node.8": 2, "node.4": 2, "node.2": 2, "gpu": 1}
  with pytest.raises(ValueError, match="do not nest"):
    mesh_lib.factor(zerojax.make_mesh(1, 6, devices=jax.devices()[:6]), [2, 3])


@pytest.mark.parametrize("plan,accum", helpers.sweep([(plans.mics(group_size=4), 2), (plans.mics(group_size=2), 1),
                                                     (plans.dp(), 2)], [(plans.mics(group_size=2), 1)]))
def test_sync_in_backward_gives_the_same_bits_and_one_all_reduce_per_unit(plan, accum, model_and_ref):
  """The replica all-reduce inside the last micro-step's backward: the gradient of the sync after the
  window (up to float reassociation: the last micro-step is compiled outside the micro-batch loop, so
  e.g. the embedding's scatter-add may sum duplicates in another order), still once per window, now one
  per unit inside the backward."""
  model, params, _, _ = model_and_ref
  batch = helpers.batches(1, accum)[0]
  mesh = zerojax.make_mesh(2, 4)
  import dataclasses
  after = dataclasses.replace(plan, sync_in_backward=False, param_dtype="float32")
  inside = dataclasses.replace(plan, sync_in_backward=True, param_dtype="float32")
  g_after, m_after = helpers.sharded_grads(after, mesh, model, params, batch)
  g_inside, m_inside = helpers.sharded_grads(inside, mesh, model, params, batch)
  assert float(m_after.loss) == float(m_inside.loss)
  assert helpers.rel_l2(g_inside, g_after) < 1e-6
  _, found = compiled_collectives(inside, mesh, model, params, accum=accum)
  sync = [c for c in found if c.role == "replica sync"]
  assert sync and all(c.count <= helpers.TINY.num_layers for c in sync)  # not once per micro-batch
  assert all("transpose(" in c.op_name for c in sync)  # inside the backward pass
  _, found = compiled_collectives(after, mesh, model, params, accum=accum)
  assert all("transpose(" not in c.op_name for c in found if c.role == "replica sync")


def test_a_unit_called_twice_is_refused_with_sync_in_backward():
  layer = zerojax.unit(lambda p, x: jnp.tanh(x @ p["w"]))

  def loss(params, tokens):
    x = jax.nn.one_hot(tokens[:, 0] % 8, 8)
    return jnp.mean(layer(params["l"], layer(params["l"], x)))

  model = zerojax.Model(lambda r: {"l": {"w": jax.random.normal(r, (8, 8))}}, loss)
  ex = zerojax.Executor(model, optax.sgd(0.1), plans.mics(group_size=4, sync_in_backward=True),
                        zerojax.make_mesh(2, 4))
  state = ex.init(jax.random.key(0))
  batch = jax.device_put(np.zeros((1, 8, 2), np.int32), ex.batch_sharding)
  with pytest.raises(ValueError, match="called 2 times per micro-batch"):
    ex.step_fn()(state, batch)
  import dataclasses
  ex = zerojax.Executor(model, optax.sgd(0.1), dataclasses.replace(plans.mics(group_size=4), sync_in_backward=False),
                        zerojax.make_mesh(2, 4))
  ex.step_fn()(ex.init(jax.random.key(0)), batch)
