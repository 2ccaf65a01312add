"""Host offload (`Sharding.offload`, `zerojax.engine.offload`): the optimizer states and fp32 master weights in
host memory change where the state lives, never what is trained; checkpoints move across the setting;
memory_report counts host bytes apart. The compiled H100 program's side is in test_offload_gpu.py."""
from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
import pytest

import zerojax
import zerojax.plan as plans
from tests import helpers
from zerojax.executor.memory import memory_report
from zerojax.executor.step import UPDATES
from zerojax.engine.offload import HOST, HostOffload, check_supported
from zerojax.train.checkpoint import Checkpointer

BOTH = ("opt_state", "master")


def kinds(tree) -> set:
  return {x.sharding.memory_kind or "device" for x in jax.tree.leaves(tree) if x.ndim}


@pytest.fixture(scope="module")
def runs():
  """zero3 on 2 x 4 for 3 steps with each offload setting, and mics (replicas) without and with both."""
  mesh = zerojax.make_mesh(2, 4)
  out = {}
  for name, plan in [("zero3", plans.zero3()), ("mics", plans.mics())]:
    for off in ((), ("opt_state",), BOTH)[:: 1 if name == "zero3" else 2]:
      out[name, off] = helpers.run(dataclasses.replace(plan, offload=off), mesh, helpers.optimizer())
  return out


@pytest.mark.parametrize("plan", ["zero3", "mics"])
def test_offload_trains_bitwise_what_the_device_trains(runs, plan):
  """Losses and the whole train state after 3 steps equal those without offload, bit for bit (the same
  ops on the same platform; only where the arrays live changes)."""
  _, ref, _, ref_losses = runs[plan, ()]
  for (name, off), (ex, state, _, losses) in runs.items():
    if name != plan or not off:
      continue
    assert losses == ref_losses, off
    # `forward`: the 16-bit weights an offloaded run keeps (none without offload)
    chex.assert_trees_all_equal(state.replace(forward=None), ref, custom_message=str(off))
    assert kinds(state.opt_state) == {HOST}
    assert kinds(state.params) == ({HOST} if "master" in off else {"device"})
    # every step keeps them there: the step's outputs carry the host shardings
    assert ex.shardings().opt_state == jax.tree.map(lambda x: x.sharding, state.opt_state)


def test_eval_and_logical_views_read_offloaded_master(runs):
  ex, state, _, _ = runs["zero3", BOTH]
  ref_ex, ref, _, _ = runs["zero3", ()]
  batch = helpers.batches(1, 1)[0][0]
  assert float(ex.eval_fn()(state.params, batch)) == float(ref_ex.eval_fn()(ref.params, batch))
  chex.assert_trees_all_equal(ex.logical_params(state), ref_ex.logical_params(ref))


def test_memory_report_counts_host_bytes_apart(runs):
  for off in ((), ("opt_state",), BOTH):
    ex, state, _, _ = runs["zero3", off]
    rep = memory_report(ex, state)
    e, m = rep["expected"], rep["measured"]
    want = (e["optimizer"] if "opt_state" in off else 0) + (e["master"] if "master" in off else 0)
    assert e["host"] == want == m["host"], off
    assert e["device"] == e["total"] - e["host"]
    assert e["host"] > 0 or not off


def test_checkpoints_restore_across_offload_settings(runs, tmp_path):
  """Saved with the states in host memory, restored without (on another mesh), and back: the same
  values, each in the memory the restoring plan names."""
  ex, state, _, _ = runs["zero3", BOTH]
  with Checkpointer(str(tmp_path / "a")) as c:
    c.save(ex, state)
  plain = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plans.zero3(), zerojax.make_mesh(1, 8),
                           accum_steps=2)
  with Checkpointer(str(tmp_path / "a"), read_only=True) as c:
    restored, _ = c.restore(plain)
  assert kinds(restored.opt_state) == kinds(restored.params) == {"device"}
  chex.assert_trees_all_equal(plain.logical_params(restored), ex.logical_params(state))
  with Checkpointer(str(tmp_path / "b")) as c:
    c.save(plain, restored)
  half = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plans.zero3(offload=("opt_state",)),
                          zerojax.make_mesh(2, 4), accum_steps=2)
  with Checkpointer(str(tmp_path / "b"), read_only=True) as c:
    back, _ = c.restore(half)
  assert kinds(back.opt_state) == {HOST} and kinds(back.params) == {"device"}
  chex.assert_trees_all_equal(back.opt_state, state.opt_state)
  chex.assert_trees_all_equal(back.params, state.params)
  # and it trains on from there like the run that never left the device
  step = half.step_fn()
  b = helpers.batches(1, 2, seed=7)[0]
  ref_ex, ref, _, _ = runs["zero3", ()]
  ref = jax.tree.map(lambda x: x.copy(), ref)
  _, m1 = step(back, b)
  _, m2 = ref_ex.step_fn()(ref, b)
  assert float(m1.loss) == float(m2.loss)


@pytest.mark.parametrize("value, match", [
    ("opt_state", r"offload='opt_state' must be a tuple of field names, e.g. \('opt_state',\)"),
    (("grads",), r"offload names 'grads'; use a tuple of \('opt_state', 'master'\)"),
])
def test_bad_offload_is_refused_in_one_line(value, match):
  with pytest.raises(ValueError, match=match) as e:
    plans.zero3(offload=value)
  assert "\n" not in str(e.value)


def test_offload_order_and_gin_spelling_are_one_setting():
  assert plans.zero3(offload=["master", "opt_state"]).sharding.offload == BOTH
  assert plans.zero3(offload=None).sharding.offload == ()
  p = plans.mics(offload=("opt_state",))
  assert plans.Plan(p.name, **p.settings()) == p
  assert p.label().endswith("+offload(opt_state)")


def test_the_update_mode_is_decided_once_by_the_plan():
  """`Plan.update_mode` decides the update strategy (`zerojax.executor.update`): a plan carrying state across
  steps (its components read the whole step's updates) fetches offloaded states in bulk, and refuses the
  update on the host in one line; exactly the shipped plans with a stateful component carry state."""
  from tests import golden_configs
  from zerojax.state.train_state import stateful_components
  mesh = zerojax.make_mesh(2)
  for name, plan in golden_configs.plans().items():
    if isinstance(plan, plans.Plan):
      plan = plan.resolve(mesh)
      ex = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plan, mesh)
      assert plans.carries_state(plan.reduction, plan.sync) == bool(ex.stateful), name
      assert bool(stateful_components(plan, mesh, ex.layout, ex.metas)) == bool(ex.stateful)
      assert type(ex.steps.update) is UPDATES[plan.update_mode] and ex.placement.offload.update == plan.update_mode
  assert plans.zero3(offload=BOTH).update_mode == "streamed"
  assert plans.mics(offload=BOTH, replica_sync=plans.radius()).update_mode == "bulk"
  assert plans.zeropp(offload=BOTH, offload_update="host").update_mode == "host"
  with pytest.raises(ValueError, match="offload_update='host' runs the whole update on the host") as e:
    plans.zeropp(offload=BOTH, offload_update="host", grad_error_feedback=True)
  assert "\n" not in str(e.value)


def test_a_backend_without_host_memory_is_refused_in_one_line():
  class Dev:
    platform = "tpu-like"

    def addressable_memories(self):
      return []

  class Mesh:
    devices = np.array([Dev()])

  with pytest.raises(ValueError, match=r"needs the memory kind 'pinned_host', which tpu-like devices .* drop "
                                       r"offload") as e:
    check_supported(Mesh(), "plan 'zero3': offload=('opt_state',)")
  assert "\n" not in str(e.value)
  assert not HostOffload().fields and HostOffload(("opt_state",)).host("opt_state")


def test_the_docs_example_builds_the_plans_it_names():
  from tests.doc_sections import code_blocks
  scope = {"zerojax": zerojax}
  for code in code_blocks("Turning it on", "offload.md"):
    exec(compile(code, "docs/offload.md", "exec"), scope)
  assert scope["plan"].sharding.offload == BOTH


def test_init_writes_offloaded_fields_to_host_memory_with_the_same_values():
  mesh = zerojax.make_mesh(2, 4)
  states = {}
  for off in ((), BOTH):
    ex = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plans.zero3(offload=off), mesh)
    states[off] = ex.init(jax.random.key(3))
  assert kinds(states[BOTH].params) == kinds(states[BOTH].opt_state) == {HOST}
  # `forward`: the 16-bit weights an offloaded run keeps (none without offload)
  chex.assert_trees_all_equal(states[BOTH].replace(forward=None), states[()])


@pytest.mark.e2e
def test_train_py_trains_and_resumes_with_offload(tmp_path):
  """train.py as a user runs it with `zero3.offload`: the loss of a run interrupted and resumed from its
  checkpoint with offload switched off equals the uninterrupted offloaded run's, step for step."""
  import json

  from tests.train_helpers import train

  common = ("make_optimizer.learning_rate=1e-2", "make_optimizer.warmup_steps=2", "train.checkpoint_every=3")
  r = train(tmp_path / "a", "train.steps=6", "zero3.offload=('opt_state', 'master')", *common)
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.load(open(tmp_path / "a" / "summary.json"))
  assert summary["plan"].endswith("+offload(opt_state,master)")
  host = summary["memory_bytes_per_device"]
  assert host["host"] == host["master"] + host["optimizer"] > 0
  r = train(tmp_path / "b", "train.steps=3", "zero3.offload=('opt_state', 'master')", *common)
  assert r.returncode == 0, r.stderr[-3000:]
  r = train(tmp_path / "b", "train.steps=6", *common)  # resumed at step 3, offload off
  assert r.returncode == 0, r.stderr[-3000:]
  loss = lambda d: [json.loads(l)["loss"] for l in open(d / "metrics.jsonl")]
  assert loss(tmp_path / "b") == loss(tmp_path / "a")
