"""Remat per plan (`Schedule.remat`): "full", "dots", "none" and "offloaded" give jax.grad's gradients; "none" recomputes
no forward matmul and holds more temporary memory; no mode keeps weights between forward and backward."""
import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax
from tests import helpers
from zerojax import plan as plans
from zerojax.engine import remat
from zerojax.plan.values import REMAT


@pytest.fixture(scope="module")
def setup():
  return (zerojax.make_mesh(2, 4), *helpers.reference_case())


@pytest.mark.parametrize("name,mode", helpers.sweep([("dp", "none"), ("zero2", "none"), ("zero3", "none"), ("zero3", "dots"),
                                                    ("zero2", "full"), ("zero3", "offloaded")],
                                                   [("zero3", "none"), ("zero3", "dots"), ("zero3", "offloaded")]))
def test_remat_modes_match_jax_grad(setup, name, mode):
  mesh, model, params, batch, want = setup
  got, _ = helpers.sharded_grads(plans.PLANS[name](param_dtype="float32", remat=mode), mesh, model, params, batch)
  assert helpers.max_rel_diff(got, want) < 1e-5


@pytest.mark.slow  # remat against jax.grad in the fast suite: test_remat_modes_match_jax_grad
def test_zeropp_remat_modes_agree(setup):
  """Under qwZ + hpZ + qgZ every mode uses the forward's dequantized weights: "none" saves the
  forward's activations, "full" recomputes the same ones, so the gradients agree up to reassociation
  (which can move an int4 gradient value by one quantization step: relative L2 error < 1e-3)."""
  mesh, model, params, batch, want = setup
  full, _ = helpers.sharded_grads(plans.zeropp(param_dtype="float32"), mesh, model, params, batch)
  none, _ = helpers.sharded_grads(plans.zeropp(param_dtype="float32", remat="none"), mesh, model, params, batch)
  assert helpers.rel_l2(none, full) < 1e-3
  assert abs(helpers.rel_l2(none, want) - helpers.rel_l2(full, want)) < 1e-3


def test_compiled_recompute_and_memory(setup):
  """ZeRO-3's compiled step: "full" recomputes every forward matmul in backward, "dots" only those with
  batch dimensions (attention), "none" none; temporary memory grows the other way. The backward
  re-gathers the weights in every mode."""
  mesh, model, params, batch, _ = setup
  dots, temp, gathers = {}, {}, {}
  for mode in REMAT:
    ex = zerojax.Executor(model, optax.sgd(1.0), plans.zero3(param_dtype="float32", remat=mode), mesh, accum_steps=2)
    compiled = ex.step_fn().lower(ex.init_from_params(params), jax.device_put(batch, ex.batch_sharding)).compile()
    hlo = compiled.as_text()
    dots[mode] = len(re.findall(r"= \S+ dot\(", hlo))
    gathers[mode] = len(re.findall(r"all-gather(-start)?\(", hlo))
    temp[mode] = compiled.memory_analysis().temp_size_in_bytes
  assert dots["offloaded"] == dots["full"] > dots["dots"] > dots["none"], dots
  assert temp["full"] < temp["dots"] < temp["none"], temp
  assert len(set(gathers.values())) == 1, gathers


def test_saved_residuals_hold_no_weights():
  """A weight used transposed (`w.T`) is a residual of plain `jax.vjp`; `remat.forward` keeps neither the
  weights nor anything computed from them alone, and the backward with the weights put back is jax.grad's."""
  def f(p, x):
    return (jnp.tanh(x @ p["w"]) * p["s"][None]) @ p["w"].T

  p = {"w": jax.random.normal(jax.random.key(0), (4, 6)), "s": jnp.arange(6.0)}
  x = jax.random.normal(jax.random.key(1), (3, 4))
  weight_shapes = {(4, 6), (6, 4), (6,), (1, 6)}

  def shapes(mode):
    def run(p, x):
      if mode == "plain":
        return jax.vjp(f, p, x)[1]
      return remat.forward(f, mode, p, x)[1]
    return {tuple(r.shape) for r in jax.tree.leaves(jax.eval_shape(run, p, x))}

  assert shapes("plain") & weight_shapes
  for mode in ("none", "dots"):
    assert not shapes(mode) & weight_shapes, (mode, shapes(mode))
    out, saved = remat.forward(f, mode, p, x)
    got = saved.vjp_with(p)(jnp.ones_like(out))
    want = jax.vjp(f, p, x)[1](jnp.ones_like(out))
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def test_remat_defaults_and_bad_values():
  """Plans whose weights are resident (DP, ZeRO-1/2) recompute nothing; sharded ones recompute all."""
  assert {n: plans.PLANS[n]().remat_mode for n in plans.PLANS} == {
      "dp": "none", "zero1": "none", "zero2": "none", "zero3": "full", "mics": "full", "zeropp": "full"}
  assert plans.zero3(remat="dots").remat_mode == "dots"
  with pytest.raises(ValueError, match="remat='some'.*one of"):
    plans.zero3(remat="some")
