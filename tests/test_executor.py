"""Every plan trains exactly like single-device jax.grad (up to fp32 reassociation)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import zerojax
from zerojax import plan as plans
from tests import helpers


@pytest.fixture(scope="module")
def mesh():
  return zerojax.make_mesh(2, 4)


def run(plan, mesh, opt, model=None, steps=3, accum=2, pad_multiple=1):
  model = model or helpers.tiny_gpt()
  ex = zerojax.Executor(model, opt, plan, mesh, accum_steps=accum, pad_multiple=pad_multiple)
  params = jax.jit(model.init)(jax.random.key(0))
  state = ex.init_from_params(params)
  step = ex.step_fn()
  losses = []
  for b in helpers.batches(steps, accum):
    state, m = step(state, jax.device_put(b, ex.batch_sharding))
    losses.append(float(m.loss))
  return ex, state, params, losses


EXACT_PLANS = ["dp", "zero1", "zero2", "zero3", "mics"]  # nothing quantized


@pytest.mark.parametrize("name", EXACT_PLANS)
def test_plan_matches_single_device_grad(name, mesh):
  """3 steps, accumulation 2, 2 nodes x 4 gpus, clip + sgd-momentum + masked weight decay."""
  opt = helpers.optimizer("sgd")
  ex, state, init, losses = run(plans.PLANS[name](param_dtype="float32"), mesh, opt, pad_multiple=4)
  ref, ref_losses = helpers.reference_train(ex.model, opt, init, helpers.batches(3, 2))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert helpers.max_rel_diff(ex.logical_params(state), ref) < 1e-5
  assert helpers.max_rel_diff(ex.logical_params(state), init) > 1e-3  # it did train


@pytest.mark.parametrize("name", ["dp", "zero3", "mics"])
def test_adamw_matches(name, mesh):
  """Adam normalises each element's gradient, so gradients that are zero up to rounding (e.g. the key
  bias, to which softmax is invariant) turn fp32 reassociation noise into steps of up to the learning
  rate; the bound is therefore relative to the size of the update."""
  opt = helpers.optimizer("adamw")
  ex, state, init, _ = run(plans.PLANS[name](param_dtype="float32"), mesh, opt)
  ref, _ = helpers.reference_train(ex.model, opt, init, helpers.batches(3, 2))
  got = ex.logical_params(state)
  diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got, ref)))
  update = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), ref, init)))
  assert diff < 2e-3 * update


def test_lion_matches(mesh):
  """Lion steps by sign(.): only elements whose gradient is rounding noise may flip."""
  opt = helpers.optimizer("lion")
  ex, state, init, losses = run(plans.zero3(param_dtype="float32"), mesh, opt)
  ref, ref_losses = helpers.reference_train(ex.model, opt, init, helpers.batches(3, 2))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  got = jnp.concatenate([x.ravel() for x in jax.tree.leaves(ex.logical_params(state))])
  want = jnp.concatenate([x.ravel() for x in jax.tree.leaves(ref)])
  assert float(jnp.mean(jnp.abs(got - want) > 1e-6)) < 2e-3


def test_padding_stays_zero(mesh):
  ex, state, _, _ = run(plans.zero3(param_dtype="float32"), mesh, helpers.optimizer("adamw"), pad_multiple=64)
  for flat, lay in zip(jax.tree.leaves(state.params), ex.layout.leaves):
    assert lay.padded > lay.size or lay.padded % (8 * 64) == 0
    assert float(jnp.max(jnp.abs(flat[..., lay.size:]))) == 0.0 if lay.padded > lay.size else True


def test_owner_chunks_are_node_major(mesh):
  """Device (n, g) owns chunk n * G + g, so a tiled all-gather returns the leaf in order."""
  ex = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plans.zero3(), mesh)
  state = ex.init(jax.random.key(1))
  leaf = state.params["head"]["w_out"]
  full = np.asarray(leaf)
  chunk = full.shape[0] // 8
  for n in range(2):
    for g in range(4):
      dev = mesh.devices[n, g]
      (shard,) = [s for s in leaf.addressable_shards if s.device == dev]
      np.testing.assert_array_equal(np.asarray(shard.data), full[(n * 4 + g) * chunk:(n * 4 + g + 1) * chunk])
  gathered = jax.jit(jax.shard_map(lambda x: lax.all_gather(x, ("node", "gpu"), tiled=True), mesh=mesh,
                                   in_specs=jax.sharding.PartitionSpec(("node", "gpu")),
                                   out_specs=jax.sharding.PartitionSpec(), check_vma=False))(leaf)
  np.testing.assert_array_equal(np.asarray(gathered), full)


def test_user_model_written_as_units(mesh):
  """A model other than GPT, written with zerojax.unit, trains exactly like jax.grad under ZeRO-3 and MiCS."""
  d = 24

  def init(rng):
    k1, k2, k3 = jax.random.split(rng, 3)
    return {"inp": {"w": jax.random.normal(k1, (256, d)) * 0.1},
            "layers": {"w": jax.random.normal(k2, (3, d, d)) * 0.2, "b": jnp.zeros((3, d))},
            "out": {"w": jax.random.normal(k3, (d, 256)) * 0.1}}

  layer = zerojax.unit(lambda p, x: x + jnp.tanh(x @ p["w"] + p["b"][None]))
  embed = zerojax.unit(lambda p, t: p["w"][t])
  out = zerojax.unit(lambda p, x, y: -jnp.mean(jnp.take_along_axis(
      jax.nn.log_softmax(x @ p["w"]), y[..., None], axis=-1)))

  def loss(params, tokens):
    x = embed(params["inp"], tokens[:, 0])
    x, _ = lax.scan(lambda x, p: (layer(p, x), None), x, params["layers"])
    return out(params["out"], x, tokens[:, 1])

  model = zerojax.Model(init, loss, frozenset({"layers"}))
  opt = helpers.optimizer("sgd")
  for plan in (plans.zero3(param_dtype="float32"), plans.mics(param_dtype="float32")):
    ex, state, init_p, _ = run(plan, mesh, opt, model=model)
    ref, _ = helpers.reference_train(model, opt, init_p, helpers.batches(3, 2))
    assert helpers.max_rel_diff(ex.logical_params(state), ref) < 2e-5


def test_non_finite_step_is_skipped(mesh):
  ex = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plans.zero3(), mesh)
  state = ex.init(jax.random.key(0))
  before = jax.tree.map(np.asarray, state.params)
  poisoned = ex.shardings().params
  bad = jax.tree.map(lambda x, s: jax.device_put(x.at[..., 0].set(jnp.nan), s), state.params, poisoned)
  state = state.replace(params=bad)
  state, m = ex.step_fn()(state, jax.device_put(helpers.batches(1, 1)[0], ex.batch_sharding))
  assert not bool(m.finite) and int(state.skipped) == 1
  np.testing.assert_array_equal(np.asarray(state.params["head"]["w_out"][1:]), before["head"]["w_out"][1:])


def test_bf16_mixed_precision_close_to_fp32(mesh):
  opt = helpers.optimizer("sgd")
  _, _, _, l32 = run(plans.zero3(param_dtype="float32"), mesh, opt)
  _, _, _, l16 = run(plans.zero3(param_dtype="bfloat16"), mesh, opt)
  np.testing.assert_allclose(l16, l32, rtol=2e-2)
  assert l16 != l32
