"""Shared fixtures for the executor tests: a tiny GPT, a reference single-device trainer."""
import dataclasses
import socket

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.models.gpt import GPTConfig, gpt
from zerojax.train.optim import decay_mask

TINY = GPTConfig(seq_len=16, d_model=32, num_heads=2, num_layers=2)


def tiny_gpt():
  return gpt(TINY)


def optimizer(kind="adamw"):
  if kind == "adamw":  # eps well above fp32 reassociation noise of near-zero gradients
    opt = optax.adamw(1e-3, eps=1e-6, weight_decay=0.1, mask=decay_mask)
  elif kind == "lion":
    opt = optax.lion(1e-4, weight_decay=0.1, mask=decay_mask)
  else:
    opt = optax.sgd(0.1, momentum=0.9)
  return optax.chain(optax.clip_by_global_norm(1.0), opt)


def batches(n=3, accum=2, batch=16, seq=TINY.seq_len, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, (accum, batch, seq + 1)).astype(np.int32) for _ in range(n)]


def reference_train(model, opt, params, batches):
  """Plain single-device jax.grad + the same optax optimizer on the same global batches."""
  def loss(p, b):  # mean over micro-batches of the mean over each global micro-batch
    return jnp.mean(jax.vmap(lambda t: model.loss(p, t))(b))

  @jax.jit
  def step(p, o, b):
    l, g = jax.value_and_grad(loss)(p, b)
    u, o = opt.update(g, o, p)
    return optax.apply_updates(p, u), o, l

  o, losses = opt.init(params), []
  for b in batches:
    params, o, l = step(params, o, b)
    losses.append(float(l))
  return params, losses


def assert_trees_identical(*trees):
  """Equal trees, leaf by leaf equal in value, shape and dtype (`np.testing.assert_array_equal(strict=True)` on
  each leaf). chex compares bfloat16 leaves as float32, so the dtypes are checked first on their own."""
  chex.assert_trees_all_equal_dtypes(*trees)
  chex.assert_trees_all_equal(*trees, strict=True)


def max_rel_diff(a, b):
  """Largest |a - b| / max|b| over the leaves of two pytrees (in numpy, in float32: no program to compile
  per leaf shape)."""
  def rel(x, y):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    return float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12))
  return max(jax.tree.leaves(jax.tree.map(rel, a, b)))


def capture_grads() -> optax.GradientTransformation:
  """An "optimizer" that applies no update and keeps the last gradient it was given as its state."""
  return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                      lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def sharded_grads(plan, mesh, model, params, batch):
  """The gradient one executor step hands to the optimizer, in the model's shapes, and the metrics."""
  from zerojax.engine import layout as layout_lib
  ex = zerojax.Executor(model, capture_grads(), plan, mesh, accum_steps=batch.shape[0])
  state, m = ex.step_fn()(ex.init_from_params(params), jax.device_put(batch, ex.batch_sharding))
  return layout_lib.to_logical(state.opt_state, ex.layout), m


def reference_grads(model, params, batch):
  """Single-device `jax.grad` of the mean loss over the micro-batches of `batch`."""
  return jax.jit(jax.grad(lambda p: jnp.mean(jax.vmap(lambda t: model.loss(p, t))(batch))))(params)


def rel_l2(a, b):
  """||a - b|| / ||b|| over all leaves of two pytrees: the whole gradient's relative error."""
  a, b = ([np.asarray(x, np.float64) for x in jax.tree.leaves(t)] for t in (a, b))  # numpy: nothing to compile
  num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b))
  den = sum(float(np.sum(y ** 2)) for y in b)
  return (num / den) ** 0.5


def reference_case():
  """(tiny GPT, its initial params, one batch of 2 micro-batches, single-device `jax.grad` on it)."""
  model = tiny_gpt()
  params = jax.jit(model.init)(jax.random.key(0))
  batch = batches(1, 2)[0]
  return model, params, batch, reference_grads(model, params, batch)


def run(plan, mesh, opt, model=None, steps=3, accum=2, pad_multiple=1):
  model = model or tiny_gpt()
  ex = zerojax.Executor(model, opt, dataclasses.replace(plan, pad_multiple=pad_multiple), mesh, accum_steps=accum)
  params = jax.jit(model.init)(jax.random.key(0))
  state = ex.init_from_params(params)
  step = ex.step_fn()
  losses = []
  for b in batches(steps, accum):
    state, m = step(state, jax.device_put(b, ex.batch_sharding))
    losses.append(float(m.loss))
  return ex, state, params, losses


def data(shape, seed=0):
  """Gaussian values with a few large outliers, as in real gradients and weights."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  x.reshape(-1)[rng.integers(0, x.size, x.size // 100)] *= 30
  return x


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def sweep(points, fast):
  """A parameter sweep for `pytest.mark.parametrize` whose points outside `fast` are marked `slow`: the fast
  suite runs the representative points, `pytest -m ''` the whole sweep. A point that is a tuple fills
  several argument names."""
  fast = list(fast)
  unknown = [p for p in fast if p not in points]
  assert not unknown, f"fast points {unknown} are not in the sweep"
  as_param = lambda p, marks=(): pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=marks)
  return [as_param(p) if p in fast else as_param(p, pytest.mark.slow) for p in points]
