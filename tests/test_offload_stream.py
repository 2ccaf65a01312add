"""The streamed offloaded update (`zerojax.executor.offload_update.Streamed`, `zerojax.engine.chunked_update.global_scalars` /
`run_chunk`): chunk by chunk, it computes what the whole update computes, bit for bit, for dp and a flax
model (zero3 and mics: tests/test_offload.py); an optimizer that reduces its own states is refused."""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
import zerojax.plan as plans
from tests import flax_models as fm
from tests import helpers
from zerojax.engine import chunked_update
from zerojax.models.gpt import gpt

BOTH = ("opt_state", "master")


def test_a_chunk_with_the_global_scalars_is_the_whole_update_on_it():
  """Clipped SGD with momentum on two leaves: the update of one leaf alone, with the norm of both, equals the whole
  update's on that leaf, bitwise; with its own norm (plain optax on the leaf) it does not."""
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
  g = {"a": jnp.arange(1.0, 7.0), "b": jnp.full((3,), 5.0)}
  p = {"a": jnp.ones(6), "b": jnp.ones(3)}
  s = opt.init(p)
  whole, _ = opt.update(g, s, p)
  scalars = chunked_update.global_scalars(opt.update, g, s, p)
  assert len(scalars) >= 2  # the norm's partial sums, the norm, the clipping's test
  cut = lambda t: {"a": t["a"], "b": t["b"][:0]}
  part, _ = chunked_update.run_chunk(opt.update, scalars, cut(g), jax.tree.map(lambda x: cut(x) if isinstance(x, dict) else x,
                              s, is_leaf=lambda x: isinstance(x, dict)), cut(p))
  assert np.array_equal(part["a"], whole["a"])
  alone, _ = opt.update(cut(g), opt.init(cut(p)), cut(p))
  assert not np.array_equal(alone["a"], whole["a"])


def test_an_optimizer_that_reduces_its_states_is_refused_in_one_line():
  opt = optax.lamb(1e-3)
  p = {"a": jnp.ones(4)}
  with pytest.raises(ValueError, match="reduces its states or parameters to a scalar") as e:
    chunked_update.global_scalars(opt.update, p, opt.init(p), p)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("off", [("opt_state",), BOTH])
def test_dp_streamed_offload_trains_bitwise_what_the_device_trains(off):
  mesh = zerojax.make_mesh(2, 4)
  _, ref, _, ref_losses = helpers.run(plans.dp(), mesh, helpers.optimizer())
  _, state, _, losses = helpers.run(plans.dp(offload=off), mesh, helpers.optimizer())
  assert losses == ref_losses
  # `forward`: the 16-bit weights an offloaded run keeps (none without offload)
  chex.assert_trees_all_equal(state.replace(forward=None), ref)


@pytest.mark.parametrize("layers", [1, 3])
def test_streamed_layers_of_any_count_train_bitwise_what_the_device_trains(layers):
  """The scan over a unit's layers peels its first and last (`offload_stream.stream_layers`): one layer, and three (one
  step of the scan), as the two of `test_dp_streamed_offload_trains_bitwise_what_the_device_trains`."""
  mesh = zerojax.make_mesh(1, 2, devices=jax.devices()[:2])
  model = gpt(dataclasses.replace(helpers.TINY, num_layers=layers))
  _, ref, _, ref_losses = helpers.run(plans.dp(), mesh, helpers.optimizer(), model=model, steps=2)
  _, state, _, losses = helpers.run(plans.dp(offload=BOTH), mesh, helpers.optimizer(), model=model, steps=2)
  assert losses == ref_losses
  # `forward`: the 16-bit weights an offloaded run keeps (none without offload)
  chex.assert_trees_all_equal(state.replace(forward=None), ref)


@pytest.mark.parametrize("plan", ["dp", "zero3", "mics"])
def test_16bit_weights_kept_on_the_device_train_bitwise(plan):
  """bf16 compute, both fields offloaded: the train state keeps the master weights' bf16 rounding on the device
  (`TrainState.forward`), the step's forward reads it instead of fetching the fp32 master weights, and the
  update writes the new rounding. Losses and state are bitwise those without offload (the AdamW of
  `helpers.optimizer` clips by the global norm); the kept rounding is the master weights' after every step."""
  mesh = zerojax.make_mesh(2, 4)
  make = getattr(plans, plan)
  ex0, ref, _, ref_losses = helpers.run(make(compute_dtype="bfloat16"), mesh, helpers.optimizer())
  ex, state, _, losses = helpers.run(make(offload=BOTH, compute_dtype="bfloat16"), mesh, helpers.optimizer())
  assert ex.placement.offload.forward == jnp.bfloat16 and ex0.placement.offload.forward is None
  assert ref.forward is None and state.forward is not None
  assert losses == ref_losses
  chex.assert_trees_all_equal(state.replace(forward=None), ref)
  chex.assert_trees_all_equal(state.forward, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.params))
  assert all(x.sharding.memory_kind != "pinned_host" for x in jax.tree.leaves(state.forward))


def test_flax_model_streamed_offload_trains_bitwise_what_the_device_trains():
  """A linen model with scanned blocks, dropout and BatchNorm statistics, zero3, 2 steps."""
  mesh = zerojax.make_mesh(2, 4)
  out = {}
  for off in ((), BOTH):
    net = fm.Net(scan=True)
    model = zerojax.from_linen(net, jax.tree.map(lambda x: x[:2], fm.batch()), fm.loss_fn, units=(fm.Block,),
                               mutable=("batch_stats",), rngs=("dropout",))
    ex = zerojax.Executor(model, helpers.optimizer(), plans.zero3(offload=off), mesh, accum_steps=2)
    state, step, losses = ex.init(jax.random.key(0)), ex.step_fn(), []
    for seed in range(2):
      state, m = step(state, fm.batch(64, accum=2, seed=seed))
      losses.append(float(m.loss))
    out[off] = state, losses
  assert out[BOTH][1] == out[()][1]
  # `forward`: the 16-bit weights an offloaded run keeps (none without offload)
  chex.assert_trees_all_equal(out[BOTH][0].replace(forward=None), out[()][0])


def test_one_device_keeps_the_gradients_16bit_until_each_chunk_widens_them():
  """One device, one micro-step, bf16: nothing reduces the gradients, so they stay bf16 out of the backward and
  the streamed update widens each chunk's (`Update.wide`, `zerojax/executor/update.py`) instead of the step widening all of them:
  bitwise the step without offload, whose step widens them at once."""
  mesh = zerojax.make_mesh(1, 1, devices=jax.devices()[:1])
  model = gpt(dataclasses.replace(helpers.TINY, num_layers=3))
  runs = {off: helpers.run(plans.dp(offload=off, compute_dtype="bfloat16"), mesh, helpers.optimizer(), model=model,
                           accum=1) for off in ((), BOTH)}
  (_, ref, _, ref_losses), (ex, state, _, losses) = runs[()], runs[BOTH]
  assert ex.steps.update.widens_per_chunk and not runs[()][0].steps.update.widens_per_chunk
  assert losses == ref_losses
  chex.assert_trees_all_equal(state.replace(forward=None), ref)


def test_the_kept_16bit_forward_weights_are_rebuilt_on_restore(tmp_path):
  """A checkpoint stores no `TrainState.forward` (it is derived): zero3 with both fields offloaded in bf16,
  saved after 3 steps and restored on another mesh, rebuilds the rounding from the master weights, and trains
  on as the run that never stopped; a checkpoint of the plan without offload restores into it the same way."""
  from zerojax.train.checkpoint import Checkpointer

  plan = plans.zero3(offload=BOTH, compute_dtype="bfloat16")
  ex, state, _, _ = helpers.run(plan, zerojax.make_mesh(2, 4), helpers.optimizer())
  with Checkpointer(str(tmp_path / "a")) as c:
    c.save(ex, state)
  other = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plan, zerojax.make_mesh(1, 8), accum_steps=2)
  with Checkpointer(str(tmp_path / "a"), read_only=True) as c:
    back, _ = c.restore(other)
  chex.assert_trees_all_equal(back.forward, jax.tree.map(lambda x: x.astype(jnp.bfloat16), back.params))
  b = helpers.batches(1, 2, seed=7)[0]
  _, m1 = other.step_fn()(back, b)
  _, m2 = ex.step_fn()(state, b)
  assert float(m1.loss) == float(m2.loss)
  plain_ex, plain, _, _ = helpers.run(plans.zero3(compute_dtype="bfloat16"), zerojax.make_mesh(2, 4),
                                      helpers.optimizer())
  with Checkpointer(str(tmp_path / "b")) as c:
    c.save(plain_ex, plain)
  with Checkpointer(str(tmp_path / "b"), read_only=True) as c:
    into, _ = c.restore(other)
  chex.assert_trees_all_equal(into.forward, jax.tree.map(lambda x: x.astype(jnp.bfloat16), plain.params))
