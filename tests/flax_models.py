"""Small flax models (linen and NNX) with dropout, BatchNorm, a dict batch and aux metrics, and the
unsharded reference of one executor step: the plain flax `apply` on each device's slice of each
micro-batch, with the executor's rng for that slice."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zerojax.engine import layout as layout_lib
from zerojax.models.linen import linen_rngs

D, CLASSES = 16, 4


class Block(nn.Module):
  """Residual block: Dense, BatchNorm, gelu, Dropout."""

  @nn.compact
  def __call__(self, x, _=None, train=True):
    h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(D)(x))
    return x + nn.Dropout(0.3, deterministic=not train)(jax.nn.gelu(h)), None


class Net(nn.Module):
  """Dense -> 3 blocks (nn.scan-ed, or one unit per block) -> a block -> Dense."""
  scan: bool = True
  layers: int = 3

  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(D)(x)
    if self.scan:
      stack = nn.scan(Block, variable_axes={"params": 0, "batch_stats": 0}, length=self.layers,
                      split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast, nn.broadcast))
      x, _ = stack(name="blocks")(x, None, train)
    else:
      for i in range(self.layers):
        x, _ = Block(name=f"block{i}")(x, train=train)
    x, _ = Block(name="last")(x, train=train)
    return nn.Dense(CLASSES)(x)


class NBlock(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)
    self.bn = nnx.BatchNorm(D, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.3, rngs=rngs)

  def __call__(self, x, *, train=True):
    h = self.bn(self.lin(x), use_running_average=not train)
    return x + self.drop(jax.nn.gelu(h), deterministic=not train)


class NNet(nnx.Module):
  def __init__(self, rngs, layers=3):
    self.inp = nnx.Linear(8, D, rngs=rngs)
    self.blocks = nnx.List([NBlock(rngs) for _ in range(layers)])
    self.out = nnx.Linear(D, CLASSES, rngs=rngs)

  def __call__(self, x, train=True):
    x = self.inp(x)
    for b in self.blocks:
      x = b(x, train=train)
    return self.out(x)


def loss_fn(apply, batch, rng):
  """Weighted cross-entropy of a dict batch, with accuracy as aux; train mode when an rng is given."""
  logits = apply(batch["x"], train=rng is not None)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  loss = jnp.sum(ce * batch["w"]) / jnp.maximum(jnp.sum(batch["w"]), 1.0)
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"]), "weight": jnp.mean(batch["w"])}


def batch(n=64, seed=0, accum=None):
  rng = np.random.default_rng(seed)
  lead = (accum, n) if accum else (n,)
  return {"x": rng.normal(size=lead + (8,)).astype(np.float32),
          "y": rng.integers(0, CLASSES, lead).astype(np.int32),
          "w": (rng.random(lead) > 0.2).astype(np.float32)}


def linen_apply(net, loss=loss_fn, mutable=("batch_stats",), rngs=("dropout",)):
  """`(params, stats, batch, key) -> (loss, (aux, stats))` with flax's own `apply`."""
  def f(params, stats, b, key):
    box = {"stats": {}}

    def apply(*args, **kw):
      if not mutable:
        return net.apply({"params": params, **stats}, *args, rngs=linen_rngs(key, rngs), **kw)
      out, box["stats"] = net.apply({"params": params, **stats}, *args, rngs=linen_rngs(key, rngs),
                                    mutable=list(mutable), **kw)
      return out
    out, aux = loss(apply, b, key)
    return out, (aux, box["stats"])
  return f


def nnx_apply(model):
  """The same for an NNX module, on pure dicts: merge, reseed the dropout streams, call."""
  graphdef, p_state, s_state, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)

  def with_values(template, pure):
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, pure)
    return state

  def f(params, stats, b, key):
    m = nnx.merge(graphdef, with_values(p_state, params), with_values(s_state, stats["batch_stats"]),
                  with_values(rest, {}))
    nnx.reseed(m, **linen_rngs(key, ("dropout",)))
    loss, aux = loss_fn(lambda *a, **k: m(*a, **k), b, key)
    return loss, (aux, {"batch_stats": nnx.to_pure_dict(nnx.state(m, nnx.BatchStat))})
  return f


def reference(apply_fn, params, stats, batch, key, world, step=0):
  """Mean gradient, loss and aux over devices and micro-batches of `batch[accum, B, ...]`, and the
  statistics each device carries through its micro-batches, averaged over devices."""
  grad = jax.jit(jax.value_and_grad(apply_fn, has_aux=True))
  accum, n = jax.tree.leaves(batch)[0].shape[:2]
  per = n // world
  out = []
  for d in range(world):
    st = stats
    for m in range(accum):
      b = jax.tree.map(lambda x: x[m, d * per:(d + 1) * per], batch)
      k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, step), m), d)
      (loss, (aux, st)), g = grad(params, st, b, k)
      out.append((g, loss, aux))
    out[-1] = out[-1] + (st,)
  mean = lambda xs: jax.tree.map(lambda *a: sum(a) / len(a), *xs)
  return (mean([o[0] for o in out]), mean([o[1] for o in out]), mean([o[2] for o in out]),
          mean([o[3] for o in out if len(o) == 4]))


def step_grads(ex, state, batch):
  """One executor step with `helpers.capture_grads()`: (gradient in the user's tree, metrics, state)."""
  state, metrics = ex.step_fn()(state, batch)
  grads = jax.tree.map(layout_lib.unflatten_leaf, state.opt_state, ex.user_layout())
  return grads, metrics, state


def copy(tree):
  return jax.tree.map(jnp.array, tree)
