"""DiLoCo (`outer_sync=diloco(...)`, `zerojax.state.diloco`): identities that pin the outer step down, the
inner step's program (nothing crosses nodes), per-replica state in checkpoints, and the plan's refusals."""
from __future__ import annotations


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
import zerojax.plan as plans
from tests import helpers
from zerojax.analysis import collectives_from_hlo
from zerojax.executor.memory import memory_report
from zerojax.state.diloco import fragment_rows
from zerojax.train import state_spec
from zerojax.train.checkpoint import Checkpointer

MESH = (2, 4)


def run(outer, opt, steps, mesh=MESH, accum=2, plan=None):
  plan = plan or plans.mics(outer_sync=outer, param_dtype="float32")
  return helpers.run(plan, zerojax.make_mesh(*mesh), opt, steps=steps, accum=accum)


def reference(opt, outer, steps, nodes=2, accum=2):
  """Plain JAX: `nodes` independent replicas, each `jax.grad` + `opt` on its node's slice of every global
  batch, and DiLoCo's outer update (Algorithm 1) on the whole model every `outer.every` steps; with
  `outer.overlap` (Streaming DiLoCo §2.3, τ = 1) the outer gradient of the replicas a step started from,
  applied after that step with the replicas keeping `outer.mix` of their weights."""
  model = helpers.tiny_gpt()
  p0 = jax.jit(model.init)(jax.random.key(0))
  loss = lambda p, b: jnp.mean(jax.vmap(lambda t: model.loss(p, t))(b))

  @jax.jit
  def inner(p, o, b):
    g = jax.grad(loss)(p, b)
    u, o = opt.update(g, o, p)
    return optax.apply_updates(p, u), o

  reps = [(p0, opt.init(p0)) for _ in range(nodes)]
  outer_p, mom = p0, jax.tree.map(jnp.zeros_like, p0)
  custom = outer.outer_optimizer  # another optax transformation: its update on the outer gradient
  custom_state = custom.init(p0) if custom is not None else None

  @jax.jit  # one program (eagerly, every op of every leaf would compile alone)
  def outer_step(outer_p, mom, custom_state, source, reps):
    delta = jax.tree.map(lambda op, *ps: op - sum(ps) / nodes, outer_p, *source)
    if custom is not None:
      u, custom_state = custom.update(delta, custom_state, outer_p)
      outer_p = optax.apply_updates(outer_p, u)
    else:
      mom = jax.tree.map(lambda m, d: outer.momentum * m + d, mom, delta)
      step = jax.tree.map(lambda d, m: d + outer.momentum * m, delta, mom) if outer.nesterov else mom
      outer_p = jax.tree.map(lambda o, s: o - outer.lr * s, outer_p, step)
    mix = outer.mix if outer.overlap else 0.0
    reps = [jax.tree.map(lambda p, q: mix * p + (1 - mix) * q, p, outer_p) if mix else outer_p for p in reps]
    return outer_p, mom, custom_state, reps

  for i, b in enumerate(helpers.batches(steps, accum)):
    rows = b.shape[1] // nodes
    start = [p for p, _ in reps]
    reps = [inner(p, o, b[:, r * rows:(r + 1) * rows]) for r, (p, o) in enumerate(reps)]
    if outer.fragment_at(i) is not None:
      source = start if outer.overlap else [p for p, _ in reps]
      outer_p, mom, custom_state, ps = outer_step(outer_p, mom, custom_state, source, [p for p, _ in reps])
      reps = [(p, o) for p, (_, o) in zip(ps, reps)]
  return outer_p, [p for p, _ in reps]


def test_one_inner_step_with_plain_outer_sgd_is_data_parallel_training():
  """H = 1, outer lr 1, no momentum: each sync replaces the weights by the replicas' mean, which for an
  SGD inner optimizer is the data-parallel step of MiCS itself."""
  opt = optax.sgd(0.1)
  outer = plans.diloco(every=1, lr=1.0, momentum=0.0)
  ex, state, _, losses = run(outer, opt, 3)
  ref_ex, ref, _, ref_losses = helpers.run(plans.mics(param_dtype="float32"), zerojax.make_mesh(*MESH), opt, steps=3)
  got, want = ex.logical_params(state), ref_ex.logical_params(ref)
  assert helpers.max_rel_diff(got, want) < 2e-6
  assert np.allclose(losses, ref_losses, rtol=1e-6, atol=0)


@pytest.mark.parametrize("outer, steps", [
    (plans.diloco(every=2), 4), (plans.diloco(every=3, momentum=0.5, nesterov=False, lr=0.9), 4),
    (plans.diloco(every=2, overlap=True), 5), (plans.diloco(every=2, overlap=True, mix=0.0, momentum=0.5), 4),
    (plans.diloco(every=2, outer_optimizer=optax.sgd(optax.linear_schedule(0.7, 0.35, 4), momentum=0.8)), 4)])
def test_replicas_and_outer_update_match_plain_jax(outer, steps):
  """H > 1 (clipping and momentum per replica): the executor's replicas equal n independent plain-JAX
  replicas with the outer update, to float reassociation of the in-node reductions; with `overlap` the
  outer gradient of the step's start, applied after it and mixed with the replicas' own weights."""
  opt = helpers.optimizer("sgd")
  ex, state, _, _ = run(outer, opt, steps)
  outer_ref, reps = reference(opt, outer, steps)
  if outer.overlap and outer.mix:  # the replicas differ after a mixed sync: the test would see a no-op
    assert helpers.max_rel_diff(reps[0], reps[1]) > 1e-4
  unflat = lambda tree: ex.to_user(jax.tree.map(zerojax.engine.layout.unflatten_leaf, tree, ex.layout.tree()))
  for r, want in enumerate(reps):
    got = unflat(jax.tree.map(lambda x: np.asarray(x)[r], state.params))  # on the host: nothing to compile
    assert helpers.max_rel_diff(got, want) < 1e-5, r
  got_outer = unflat(jax.tree.map(np.asarray, state.stateful["outer"].params))
  assert helpers.max_rel_diff(got_outer, outer_ref) < 1e-5


@pytest.mark.parametrize("bits", [None, 4])
def test_inner_step_crosses_no_node_and_the_outer_step_moves_the_model(bits):
  """On the compiled programs: the inner step has no collective between nodes; the outer step's
  cross-node bytes are those of the model's shard (fp32 ring all-reduce, or the int4 blocks' all-gather)."""
  from zerojax.executor.aot import abstract_inputs

  ex = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plans.mics(outer_sync=plans.diloco(every=4, bits=bits)),
                        zerojax.make_mesh(*MESH), accum_steps=2)
  state, batch = abstract_inputs(ex, (2, 16, helpers.TINY.seq_len + 1))
  cross = {}
  for phase in ("dense", "outer0"):
    text = ex.step_fn().lower(state, batch, phase=phase).compile().as_text()
    found = collectives_from_hlo(text, ex.mesh)
    assert any(c.bytes_per_device > 0 for c in found), phase  # the in-node reductions are there
    cross[phase] = sum(c.count * c.cross_node_bytes_per_device for c in found)
  assert cross["dense"] == 0
  elements = sum(l.padded * (l.layers or 1) for l in ex.layout.leaves) // 4  # this device's shard of the model
  want = 4 * elements if bits is None else elements * (0.5 + 4 / 256)  # N = 2: 2 (N-1)/N x fp32; (N-1) x int4 + scales
  assert cross["outer0"] == pytest.approx(want, rel=1e-6) == ex.stateful["outer"].cross_node_bytes(0)


def test_fragments_sync_their_layers_at_staggered_steps():
  outer = plans.diloco(every=4, fragments=2)
  assert [outer.fragment_at(s) for s in range(8)] == [None, 0, None, 1, None, 0, None, 1]
  # overlapped: each fragment's outer step runs one inner step later, while its outer gradient crosses nodes
  late = plans.diloco(every=4, fragments=2, overlap=True)
  assert [late.fragment_at(s) for s in range(9)] == [None, None, 0, None, 1, None, 0, None, 1]
  assert [plans.diloco(every=1, overlap=True).fragment_at(s) for s in range(3)] == [None, 0, 0]
  ex = zerojax.Executor(helpers.tiny_gpt(), optax.sgd(0.1), plans.mics(outer_sync=outer), zerojax.make_mesh(*MESH))
  rows = fragment_rows(ex.layout, 2)
  scanned = [i for i, l in enumerate(ex.layout.leaves) if l.layers]
  assert all(rows[0][i] == (0,) and rows[1][i] == (1,) for i in scanned)  # 2 layers: one each
  single = [i for i in range(len(ex.layout.leaves)) if i not in scanned]
  assert all((rows[0][i] is None) != (rows[1][i] is None) for i in single)  # every other leaf in one fragment
  # after fragment 0's sync its layers agree across replicas and fragment 1's do not
  _, state, _, _ = run(outer, helpers.optimizer("sgd"), 2)
  blocks = np.asarray(state.params["blocks"]["fc"]["kernel"])  # [replicas, layers, padded]
  assert np.array_equal(blocks[0, 0], blocks[1, 0]) and not np.array_equal(blocks[0, 1], blocks[1, 1])


@pytest.mark.parametrize("bits, bound", [(8, 0.02), (4, 0.2)])
def test_quantized_outer_gradients_stay_within_their_bound(bits, bound):
  """int8 / int4 outer gradients: after the sync every replica holds the same weights, within the bound
  of the fp32 sync's (relative L2 of the outer step's change)."""
  fp32 = run(plans.diloco(every=2), helpers.optimizer("sgd"), 2)[1]
  q = run(plans.diloco(every=2, bits=bits), helpers.optimizer("sgd"), 2)[1]
  p = np.asarray(q.params["blocks"]["fc"]["kernel"])
  assert np.array_equal(p[0], p[1])
  ex0, init, _, _ = run(plans.diloco(every=2), helpers.optimizer("sgd"), 0)
  logical = lambda s: jax.tree.map(zerojax.engine.layout.unflatten_leaf, s.stateful["outer"].params, ex0.layout.tree())
  moved = lambda s: jax.tree.map(lambda a, b: a - b, logical(s), logical(init))
  assert 0 < helpers.rel_l2(moved(q), moved(fp32)) < bound


@pytest.mark.parametrize("outer", [plans.diloco(every=4), plans.diloco(every=3, overlap=True)])
def test_checkpoint_between_syncs_resumes_bitwise_and_restores_onto_another_mesh(tmp_path, outer):
  """3 inner steps of H = 4 (the replicas differ), saved, restored, 3 more: bitwise the 6-step run; and
  the same checkpoint restores onto 2 x 2 devices (as many nodes) with every logical array equal. With
  overlap (H = 3) the checkpoint falls between a sync's inner step and the step that applies it."""
  opt = helpers.optimizer()
  ex, state, _, _ = run(outer, opt, 3)
  blocks = np.asarray(state.params["blocks"]["fc"]["kernel"])
  assert not np.array_equal(blocks[0], blocks[1])  # between syncs: one replica per node
  with Checkpointer(str(tmp_path)) as c:
    c.save(ex, state)
  with Checkpointer(str(tmp_path), read_only=True) as c:
    restored, _ = c.restore(ex)
  step, losses = ex.step_fn(), []
  for b in helpers.batches(6, 2)[3:]:
    restored, m = step(restored, b)
    losses.append(float(m.loss))
  _, full, _, full_losses = run(outer, opt, 6)
  assert losses == full_losses[3:]
  chex.assert_trees_all_equal(restored, full)
  small = zerojax.Executor(helpers.tiny_gpt(), opt, plans.mics(outer_sync=outer, param_dtype="float32"),
                           zerojax.make_mesh(2, 2, devices=jax.devices()[:4]), accum_steps=2)
  with Checkpointer(str(tmp_path), read_only=True) as c:
    other, _ = c.restore(small)
  a, b = state_spec.logical_state(ex, state), state_spec.logical_state(small, other)
  chex.assert_trees_all_equal(a, b)


def test_an_optax_outer_optimizers_state_is_stored_logically_and_counted():
  """`outer_optimizer=optax.adam(...)`: its state (count, mu, nu) round-trips through the checkpoint layout
  bitwise, mu and nu in the parameters' logical shapes, and the memory report counts it."""
  outer = plans.diloco(every=2, outer_optimizer=optax.adam(0.05))
  ex, state, _, _ = run(outer, helpers.optimizer("sgd"), 2)
  tree = state_spec.logical_state(ex, state)
  mu = jax.tree.leaves(tree["outer"]["momentum"]["0"]["mu"])
  assert sorted(x.shape for x in mu) == sorted(l.logical_shape for l in ex.layout.leaves)
  assert int(np.asarray(tree["outer"]["momentum"]["0"]["count"])) == 1  # one sync in two steps
  back = state_spec.state_from_logical(ex, tree)
  chex.assert_trees_all_equal(back.stateful["outer"], state.stateful["outer"])
  rep = memory_report(ex, state)
  assert rep["expected"]["outer"] == rep["measured"]["outer"] == 3 * rep["expected"]["master"]  # params, mu, nu


def test_memory_report_counts_the_outer_state():
  ex = zerojax.Executor(helpers.tiny_gpt(), optax.adamw(1e-3), plans.mics(outer_sync=plans.diloco()), zerojax.make_mesh(*MESH))
  rep = memory_report(ex, ex.init(jax.random.key(0)))
  assert rep["expected"]["outer"] == 2 * rep["expected"]["master"] == rep["measured"]["outer"] > 0
  assert rep["expected"]["master"] == rep["measured"]["master"]  # each device holds its replica's shard


@pytest.mark.parametrize("make, match", [
    (lambda: plans.zero3(outer_sync=plans.diloco()), r"needs the model states sharded inside each node .* use mics\(\)"),
    (lambda: plans.dp(outer_sync=plans.diloco()), r"replicated over \('node', 'gpu'\); use mics\(\)"),
    (lambda: plans.mics(outer_sync=plans.diloco(), replica_sync=plans.radius()), r"use one of them"),
    (lambda: plans.diloco(every=0), r"every=0 must be a whole number of inner steps >= 1"),
    (lambda: plans.diloco(every=4, fragments=5), r"fragments=5 must be a whole number in \[1, every=4\]"),
    (lambda: plans.diloco(bits=2), r"bits=2; use None \(fp32 outer gradients\), 8 or 4"),
    (lambda: plans.diloco(overlap=True, mix=1.0), r"mix=1.0 must be in \[0, 1\) \(Streaming DiLoCo uses 0.5"),
    (lambda: plans.diloco(overlap=1), r"overlap=1 must be True or False"),
])
def test_bad_settings_are_refused_in_one_line(make, match):
  with pytest.raises(ValueError, match=match) as e:
    zerojax.Executor(helpers.tiny_gpt(), optax.sgd(0.1), make(), zerojax.make_mesh(*MESH))
  assert "\n" not in str(e.value)


def test_the_docs_example_builds_the_plans_it_names():
  from tests.doc_sections import code_blocks
  scope = {"zerojax": zerojax}
  for code in code_blocks("Turning it on", "diloco.md"):
    exec(compile(code, "docs/diloco.md", "exec"), scope)
  assert scope["plan"].sync.outer_sync == plans.diloco(every=50, fragments=4, bits=4, overlap=True)


@pytest.mark.e2e
def test_train_py_killed_between_syncs_resumes_with_the_uninterrupted_losses(tmp_path):
  """train.py with configs/diloco_mics.gin (H = 6), SIGKILL after the checkpoint of step 4 (the replicas
  differ then), restarted: every step's loss and gradient norm equal those of a run never interrupted."""
  import os
  import signal

  from tests.train_helpers import GIN, run_train
  gin = tuple(GIN) + ("diloco.every=6",)
  cfg = dict(gin_file="configs/diloco_mics.gin", gin=gin)
  rc, out, full, _ = run_train(str(tmp_path / "full"), **cfg)
  assert rc == 0, out[-3000:]
  work = str(tmp_path / "killed")
  has = lambda step: os.path.isdir(os.path.join(work, "checkpoints", str(step)))
  rc, out, first, _ = run_train(work, signal.SIGKILL, lambda s: s >= 5 and has(4), **cfg)
  assert rc == -signal.SIGKILL, out[-3000:]
  rc, out, second, restored = run_train(work, **cfg)
  assert rc == 0 and restored is not None and restored % 6 != 0, out[-3000:]  # resumed between two syncs
  assert second == full[restored:]


def test_the_benchmark_spells_its_variants_and_compares_within_each_repetition():
  """benchmarks/bench_diloco.py: variant names become gin params, and the cluster summary divides each
  repetition's step time by MiCS's and ZeRO++'s of the same repetition (median and spread)."""
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import bench_diloco

  gin_file, params = bench_diloco.variant_params("h10f4int4ovmix0")
  assert gin_file == "configs/diloco_mics.gin"
  assert params == ["diloco.every=10", "diloco.fragments=4", "diloco.bits=4", "diloco.overlap=True", "diloco.mix=0"]
  assert "diloco.overlap=True" not in bench_diloco.variant_params("h10")[1]
  with pytest.raises(ValueError, match="h10f4ovmix0"):
    bench_diloco.variant_params("h10x")
  runs = [{"rate": "1gbit", "system": s, "rep": rep, "mean_step_time_s": t, "cross_node_bytes_per_step_per_node": b}
          for rep, times in enumerate([(1.0, 0.5, 0.6), (2.0, 1.0, 0.8)])
          for s, t, b in zip(("mics", "zeropp", "h10"), times, (40, 10, 4))]
  runs.append({"rate": "1gbit", "system": "h10", "rep": 2, "error": "ClusterError: ..."})
  row = bench_diloco.summarize(runs)["summary"]["1gbit"]["h10"]
  assert row["reps"] == 2 and row["mean_step_time_s"] == {"median": 0.7, "min": 0.6, "max": 0.8}
  assert row["over_mics"] == {"median": pytest.approx(0.5), "min": 0.4, "max": 0.6}
  assert row["over_zeropp"]["min"] == 0.8 and row["over_zeropp"]["max"] == 1.2
  assert "over_mics" not in bench_diloco.summarize(runs)["summary"]["1gbit"]["mics"]
