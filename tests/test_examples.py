"""The examples: each one's gradients, aux and statistics equal the unsharded flax `apply` (one ZeRO-3
step), and a short run with the ZeRO++ plan lowers the loss."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from examples import lm1b_transformer as lm1b
from examples import resnet_batchnorm as resnet
from tests import flax_models as fm
from tests import helpers

SMALL_LM = lm1b.Config(vocab_size=32, max_len=16, emb_dim=32, num_heads=2, num_layers=2, mlp_dim=64)
SMALL_RESNET = resnet.ResNet(stage_sizes=(1, 1), filters=8)


@pytest.fixture(scope="module")
def mesh():
  return zerojax.make_mesh(2, 4)


def _f64(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
                      else x, tree)


def check_against_reference(ex, apply_fn, batch, mesh, x64=False):
  """Against the unsharded reference; `x64`: computed in float64 and rounded to float32 (for a model with
  no random draws: float64 draws other dropout masks). The jitted float32 reference of the BatchNorm ResNet
  is itself 7.6e-4 (relative L2) away from float64 (BatchNorm's variance as E[x^2] - E[x]^2 cancels), and
  the executor's float32 step lands within 2e-7 of float64 or at the jitted reference's distance depending
  on XLA's fusion of that variance; the bound is twice the jitted float32 reference's distance."""
  state = ex.init(jax.random.key(0))
  v0 = fm.copy(ex.logical_variables(state))
  key = jax.random.wrap_key_data(jnp.array(state.rng))
  cast = _f64 if x64 else (lambda t: t)
  with jax.enable_x64(x64):
    ref = fm.reference(apply_fn, cast(v0["params"]), cast({k: v for k, v in v0.items() if k != "params"}),
                       cast(batch), key, mesh.size)
    grad, loss, aux, stats = jax.tree.map(
        lambda x: np.asarray(x, np.float32) if np.issubdtype(np.asarray(x).dtype, np.floating) else np.asarray(x), ref)
  got, metrics, state = fm.step_grads(ex, state, batch)
  bound = 2e-6
  if x64:  # no closer to float64 than float32 gets: twice the jitted float32 reference's own distance
    ref32 = fm.reference(apply_fn, v0["params"], {k: v for k, v in v0.items() if k != "params"}, batch, key,
                         mesh.size)
    bound = max(bound, 2 * helpers.rel_l2(jax.tree.map(np.asarray, ref32[0]), grad))
  assert helpers.rel_l2(got, grad) < bound
  np.testing.assert_allclose(float(metrics.loss), float(loss), rtol=1e-5)
  chex.assert_trees_all_close(metrics.aux, aux, rtol=1e-5, atol=1e-7)
  return ex.logical_variables(state), stats


@pytest.mark.slow  # flax models against the unsharded apply in the fast suite: test_flax.py
def test_lm1b_matches_unsharded_apply(mesh):
  """Dropout in every block and in attention, a padding mask in a dict batch, tied embeddings."""
  ex = lm1b.build(SMALL_LM, zerojax.zero3(param_dtype="float32"), mesh, helpers.capture_grads())
  assert set(ex.layout.tree()) == {"_root", "block0", "block1"}
  batch = lm1b.synthetic_batch(SMALL_LM, np.random.default_rng(0), 32, accum=1)
  apply_fn = fm.linen_apply(lm1b.TransformerLM(SMALL_LM), lm1b.loss_fn, mutable=())
  check_against_reference(ex, apply_fn, batch, mesh)


@pytest.mark.slow  # BatchNorm models against the unsharded apply in the fast suite: test_flax.py
def test_resnet_matches_unsharded_apply(mesh):
  """BatchNorm statistics: each device's, carried through its micro-batches, averaged over devices."""
  ex = resnet.build(SMALL_RESNET, zerojax.zero3(param_dtype="float32"), mesh, helpers.capture_grads())
  batch = resnet.synthetic_batch(np.random.default_rng(0), 64, accum=1)
  apply_fn = fm.linen_apply(SMALL_RESNET, resnet.loss_fn, rngs=())
  got, want = check_against_reference(ex, apply_fn, batch, mesh, x64=True)
  assert helpers.max_rel_diff(got["batch_stats"], want["batch_stats"]) < 1e-5


@pytest.mark.slow  # 40-50 steps each; the examples' exactness against the unsharded apply is in the fast suite
@pytest.mark.parametrize("example", ["lm1b", "resnet"])
def test_examples_train_with_zeropp(example):
  """A short run of each example as written (the ZeRO++ plan of configs/zeropp.gin): the loss falls."""
  if example == "lm1b":
    losses = lm1b.train(steps=40, cfg=SMALL_LM, batch=32, log_every=0)
  else:
    losses = resnet.train(steps=50, batch=32, log_every=0, model_def=SMALL_RESNET)
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
