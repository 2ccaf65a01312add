"""Stateful components (`zerojax.state.stateful`): each kind owns one train-state field, declares its state's
shardings, checkpoint leaves and bytes consistently, and the executor, the checkpoint spec and the
memory report reach it only through the protocol.
"""
from __future__ import annotations

import dataclasses
import pathlib

import chex
import jax
import numpy as np
import optax
import pytest

import zerojax
import zerojax.plan as plans
from tests import helpers
from zerojax.executor.memory import memory_report
from zerojax.state.stateful import Stateful
from zerojax.train import state_spec
from zerojax.state.train_state import STATEFUL, TrainState

ROOT = pathlib.Path(__file__).resolve().parent.parent
# MiCS in groups of 2 nodes on 4 x 2: qgZ with two hops and error feedback, and Radius over 2 replicas.
BOTH = plans.mics(group_size=4, grad_bits=8, grad_error_feedback=True,
                  replica_sync=plans.radius(density=0.25, period=2, dense_steps=1))


@pytest.fixture(scope="module")
def both():
  ex = zerojax.Executor(helpers.tiny_gpt(), optax.adamw(1e-3), dataclasses.replace(BOTH, pad_multiple=3), zerojax.make_mesh(4, 2),
                        accum_steps=2)
  return ex, ex.init(jax.random.key(0))


def test_each_kind_owns_one_name_in_the_train_states_mapping():
  fields = [f.name for f in dataclasses.fields(TrainState)]
  names = [kind.name for kind in STATEFUL]
  assert "stateful" in fields and len(set(names)) == len(names) and not set(names) & set(fields)
  assert all(issubclass(kind, Stateful) for kind in STATEFUL)
  assert sorted(state_spec.STORED + state_spec.DERIVED) == sorted(fields)


def test_the_step_the_checkpoints_and_the_memory_report_name_no_component():
  """They iterate over `Executor.stateful` and ask the `Placement`; a component is named only by its own
  module, and the engine has no branch on a technique."""
  words = {w for kind in STATEFUL for w in (kind.name, kind.__name__, kind.setting.split("=")[0])}
  engine = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "zerojax/executor").glob("*.py"))
  assert len(engine) >= 3, engine
  for path in (*engine, "zerojax/train/state_spec.py", "zerojax/executor/memory.py"):
    text = (ROOT / path).read_text()
    assert [w for w in words if w in text] == [], path
  techniques = {"diloco", "DiLoCo", "Diloco", "radius", "Radius", "replica_sync", "outer_sync", "error_feedback",
                "replica_axes"}
  for path in engine:
    text = (ROOT / path).read_text()
    assert [w for w in techniques if w in text] == [], path


def test_a_plan_without_state_has_no_component():
  ex = zerojax.Executor(helpers.tiny_gpt(), optax.adamw(1e-3), plans.mics(), zerojax.make_mesh(2, 4))
  assert ex.stateful == {}
  shapes = jax.eval_shape(ex.init_from_flat, ex.flat_shapes())
  assert shapes.stateful == {} and all(kind.name not in shapes.stateful for kind in STATEFUL)
  assert all(memory_report(ex)["expected"][kind.name] == 0 for kind in STATEFUL)


@pytest.fixture(scope="module")
def outer():
  """DiLoCo's outer sync (it does not combine with Radius: its own executor), with qgZ's error feedback."""
  plan = plans.mics(outer_sync=plans.diloco(every=2), grad_bits=8, grad_error_feedback=True, pad_multiple=3)
  ex = zerojax.Executor(helpers.tiny_gpt(), optax.adamw(1e-3), plan, zerojax.make_mesh(2, 4), accum_steps=2)
  return ex, ex.init(jax.random.key(0))


def test_every_kind_is_checked_below(both, outer):
  assert set(both[0].stateful) | set(outer[0].stateful) == {kind.name for kind in STATEFUL}


@pytest.mark.slow  # each component alone in the fast suite: test_radius.py, test_fidelity.py, test_diloco.py
@pytest.mark.parametrize("which", ["both", "outer"])
def test_components_declare_their_state_consistently(which, request):
  """Per component: the state's leaves, PartitionSpecs and checkpoint leaves agree; the live shards on a
  device are the bytes it counts; the stored layout round-trips bitwise."""
  ex, state = request.getfixturevalue(which)
  for name, c in ex.stateful.items():
    held = state.stateful[name]
    leaves = jax.tree.leaves(held)
    specs = jax.tree.leaves(c.specs(), is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    stored = c.stored()
    assert len(leaves) == len(specs) == len(stored) > 0, name
    for x, spec, s in zip(leaves, specs, stored):
      assert x.sharding.is_equivalent_to(jax.sharding.NamedSharding(ex.mesh, spec), x.ndim), name
      assert len(s.shape) >= x.ndim - 1 and s.sharding.mesh.shape == ex.mesh.shape, name
  rep = memory_report(ex, state)
  for name in ex.stateful:
    assert rep["measured"][name] == rep["expected"][name] > 0, name
  logical = state_spec.logical_state(ex, state)
  back = state_spec.state_from_logical(ex, logical)
  helpers.assert_trees_identical(back, state)


@pytest.mark.slow  # three programs compiled
def test_both_components_in_one_step(both):
  """Error feedback and Radius together: the dense, select and sparse programs each update only what
  they own, the residual and the errors stay per replica / device, and the run stays finite."""
  ex, _ = both
  state, step = ex.init(jax.random.key(1)), ex.step_fn()  # the step donates its state
  phases = []
  for b in helpers.batches(3, 2):
    phases.append(ex.phase(state))
    old = [np.asarray(e) for e in jax.tree.leaves(state.stateful["grad_error"])]
    state, m = step(state, jax.device_put(b, ex.batch_sharding))
    assert bool(m.finite)
    assert any(not np.array_equal(np.asarray(e), o) for e, o in zip(jax.tree.leaves(state.stateful["grad_error"]), old)), phases[-1]
  assert phases == ["dense", "select", "sparse"]
  assert int(state.stateful["radius"].selected_at) == 1
  assert any(float(np.abs(np.asarray(r)).max()) > 0 for r in jax.tree.leaves(state.stateful["radius"].residual))


def test_a_new_stateful_technique_is_one_file_and_its_registration():
  """docs/DESIGN.md's worked example: `tests/toy_sync.py` (a replica sync run by the component every other
  step) registered by one entry in `STATEFUL`; the executor, the checkpoint spec and the memory report take
  it unchanged, and its steps give the dense sync's bits."""
  from tests.toy_sync import ToySync
  STATEFUL.append(ToySync)
  try:
    mesh, model = zerojax.make_mesh(2, 4), helpers.tiny_gpt()
    ex = zerojax.Executor(model, optax.adamw(1e-3), plans.Plan("toy", **plans.mics().settings()), mesh)
    ref = zerojax.Executor(model, optax.adamw(1e-3), plans.mics(), mesh)
    assert list(ex.stateful) == ["toy"] and ref.stateful == {}
    state, want = ex.init(jax.random.key(0)), ref.init(jax.random.key(0))
    rng, phases = np.random.default_rng(0), []
    for _ in range(4):
      batch = rng.integers(0, 64, (1, 8, 17)).astype(np.int32)
      phases.append(ex.phase(state))
      state, _ = ex.step_fn()(state, batch)
      want, _ = ref.step_fn()(want, batch)
    assert phases == ["dense", "toy", "dense", "toy"] and int(state.stateful["toy"]) == 2
    chex.assert_trees_all_equal(ex.logical_params(state), ref.logical_params(want))
    stored = state_spec.logical_state(ex, state)
    assert int(stored["toy"]) == 2  # stored at the top level under its name
    back = state_spec.state_from_logical(ex, stored)
    assert int(back.stateful["toy"]) == 2
    assert memory_report(ex)["expected"]["toy"] == 4
  finally:
    STATEFUL.remove(ToySync)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_second_in_backward_component_coexists_with_error_feedback(prefetch):
  """`tests/toy_backward.py`, a second in-backward component registered beside qgZ's error feedback: each
  builds its own per-unit state, which reaches every unit (every layer, in both call orders) under the
  component's own key, and gets its own cotangent back. The toy counts every backward call; the errors
  and the weights are bitwise those of the run without it."""
  from tests.toy_backward import BackwardCount
  STATEFUL.append(BackwardCount)
  try:
    mesh, model, accum = zerojax.make_mesh(2, 4), helpers.tiny_gpt(), 2
    # qgZ alone (no qwZ, no hpZ: nothing the claim needs, and half the compile time)
    base = plans.zeropp(weight_bits=None, secondary_axes=None, grad_bits=8, grad_error_feedback=True, prefetch=prefetch)
    ex = zerojax.Executor(model, optax.adamw(1e-3), plans.Plan("toy-backward", **base.settings()), mesh,
                          accum_steps=accum)
    ref = zerojax.Executor(model, optax.adamw(1e-3), base, mesh, accum_steps=accum)
    assert list(ex.stateful) == ["grad_error", "backward_count"] and list(ref.stateful) == ["grad_error"]
    state, want = ex.init(jax.random.key(0)), ref.init(jax.random.key(0))
    for b in helpers.batches(2, accum):
      state, _ = ex.step_fn()(state, b)
      want, _ = ref.step_fn()(want, b)
    counts = state.stateful["backward_count"]
    assert sorted(counts) == sorted(ex.metas) and any(np.ndim(c) == 2 for c in counts.values())  # a scanned unit
    assert all(np.all(np.asarray(c) == 2 * accum) for c in counts.values()), counts
    errors = jax.tree.leaves(state.stateful["grad_error"])
    assert any(float(np.abs(np.asarray(e)).max()) > 0 for e in errors)
    chex.assert_trees_all_equal((state.params, state.stateful["grad_error"]), (want.params, want.stateful["grad_error"]))
    assert memory_report(ex)["expected"]["backward_count"] == 4 * sum(int(np.prod(np.shape(c)[1:])) for c in counts.values())
  finally:
    STATEFUL.remove(BackwardCount)
