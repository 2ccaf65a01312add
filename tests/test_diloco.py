"""DiLoCo (`outer_sync=diloco(...)`, `zerojax.outer_sync`): identities that pin the outer step down, the
inner step's program (nothing crosses nodes), per-replica state in checkpoints, and the plan's refusals."""
from __future__ import annotations

import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
import zerojax.plan as plans
from tests import helpers
from zerojax.analysis import collectives_from_hlo
from zerojax.memory import memory_report
from zerojax.outer_sync import fragment_rows
from zerojax.train import state_spec
from zerojax.train.checkpoint import Checkpointer

MESH = (2, 4)


def run(outer, opt, steps, mesh=MESH, accum=2, plan=None):
  plan = plan or plans.mics(outer_sync=outer, param_dtype="float32")
  return helpers.run(plan, zerojax.make_mesh(*mesh), opt, steps=steps, accum=accum)


def reference(opt, outer, steps, nodes=2, accum=2):
  """Plain JAX: `nodes` independent replicas, each `jax.grad` + `opt` on its node's slice of every global
  batch, and DiLoCo's outer update (Algorithm 1) on the whole model every `outer.every` steps."""
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
  for i, b in enumerate(helpers.batches(steps, accum)):
    rows = b.shape[1] // nodes
    reps = [inner(p, o, b[:, r * rows:(r + 1) * rows]) for r, (p, o) in enumerate(reps)]
    if outer.fragment_at(i) is not None:
      delta = jax.tree.map(lambda op, *ps: op - sum(ps) / nodes, outer_p, *[p for p, _ in reps])
      mom = jax.tree.map(lambda m, d: outer.momentum * m + d, mom, delta)
      step = jax.tree.map(lambda d, m: d + outer.momentum * m, delta, mom) if outer.nesterov else mom
      outer_p = jax.tree.map(lambda o, s: o - outer.lr * s, outer_p, step)
      reps = [(outer_p, o) for _, o in reps]
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


@pytest.mark.parametrize("outer", [plans.diloco(every=2), plans.diloco(every=3, momentum=0.5, nesterov=False, lr=0.9)])
def test_replicas_and_outer_update_match_plain_jax(outer):
  """H > 1 (clipping and momentum per replica): the executor's replicas after 4 steps equal n independent
  plain-JAX replicas with the outer update, to float reassociation of the in-node reductions."""
  opt = helpers.optimizer("sgd")
  ex, state, _, _ = run(outer, opt, 4)
  outer_ref, reps = reference(opt, outer, 4)
  for r, want in enumerate(reps):
    got = ex.to_user(jax.tree.map(lambda x, l: zerojax.layout.unflatten_leaf(x[r], l), state.params,
                                  ex.layout.tree()))
    assert helpers.max_rel_diff(got, want) < 1e-5, r
  got_outer = jax.tree.map(zerojax.layout.unflatten_leaf, state.outer.params, ex.layout.tree())
  assert helpers.max_rel_diff(ex.to_user(got_outer), outer_ref) < 1e-5
