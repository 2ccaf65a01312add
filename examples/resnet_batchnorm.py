"""An ImageNet-style ResNet with BatchNorm (flax's examples/imagenet) trained with zerojax in two statements.

The residual blocks are the ZeRO units; the stem, the head and nothing else form the root unit. The
BatchNorm statistics (`batch_stats`) are a mutable collection: each device normalises with its own
slice of the batch, and after each step the executor averages the updated statistics over the
data-parallel devices, so they are checkpointed and restored with the train state. The images are
synthetic 16x16 RGB pictures whose class is the colour of a bright square.

  python examples/resnet_batchnorm.py --steps 200

References:
  He et al. 2016 (ResNet); Ioffe & Szegedy 2015 (BatchNorm); flax examples/imagenet (the model);
  ZeRO++: Wang et al. 2023 (the plan).
"""
from __future__ import annotations

import argparse
import functools
import os
import time

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax

CLASSES, SIZE = 3, 16


class ResNetBlock(nn.Module):
  """Two 3x3 convolutions with BatchNorm and a projection shortcut when the shape changes."""
  filters: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, *, train: bool):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
    y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)))
    y = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
    if x.shape != y.shape:
      x = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  stage_sizes: tuple = (1, 1)
  filters: int = 16

  @nn.compact
  def __call__(self, x, *, train: bool):
    x = nn.Conv(self.filters, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        x = ResNetBlock(self.filters * 2 ** i, strides=2 if i > 0 and j == 0 else 1)(x, train=train)
    return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))


def loss_fn(apply, batch, rng):
  logits = apply(batch["image"], train=rng is not None)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def synthetic_batch(rng: np.random.Generator, batch: int, accum: int | None = None) -> dict:
  """Noisy images with a bright 4x4 square at a random place, in the colour channel given by the label."""
  lead = (accum, batch) if accum else (batch,)
  label = rng.integers(0, CLASSES, lead)
  image = rng.normal(0, 0.5, lead + (SIZE, SIZE, 3)).astype(np.float32)
  r = rng.integers(0, SIZE - 4, lead + (2,))
  rows, cols = np.arange(SIZE)[:, None], np.arange(SIZE)[None, :]
  r0, r1 = r[..., 0, None, None], r[..., 1, None, None]
  inside = (rows >= r0) & (rows < r0 + 4) & (cols >= r1) & (cols < r1 + 4)
  image = image + 2.0 * (inside[..., None] & (np.arange(3) == label[..., None, None, None]))
  return {"image": image.astype(np.float32), "label": label.astype(np.int32)}


def build(model_def: ResNet = ResNet(), plan: zerojax.Plan | None = None, mesh=None, optimizer=None,
          accum_steps=1):
  """The two statements: the model from the user's module, and the executor."""
  example = synthetic_batch(np.random.default_rng(0), 2)
  model = zerojax.from_linen(model_def, example, loss_fn, units=(ResNetBlock,), mutable=("batch_stats",))
  optimizer = optimizer or optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      3e-3, weight_decay=1e-4, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
  plan = plan or zerojax.zeropp(compute_dtype="float32")  # configs/zeropp.gin: qwZ, hpZ, qgZ
  return zerojax.Executor(model, optimizer, plan, mesh or zerojax.make_mesh(2, 4), accum_steps=accum_steps)


def train(steps: int = 200, batch: int = 64, plan=None, log_every: int = 50, model_def=ResNet()) -> list:
  ex = build(model_def, plan=plan)
  state, step = ex.init(jax.random.key(0)), ex.step_fn()
  rng, losses, t0 = np.random.default_rng(1), [], time.time()
  for i in range(steps):
    state, metrics = step(state, synthetic_batch(rng, batch))
    losses.append(float(metrics.loss))
    if log_every and (i + 1) % log_every == 0:
      print(f"step {i + 1}: loss {losses[-1]:.3f} accuracy {float(metrics.aux['accuracy']):.3f} "
            f"({time.time() - t0:.0f}s)", flush=True)
  stats = ex.logical_variables(state)["batch_stats"]
  print("batch_stats of the stem:", jax.tree.map(lambda x: float(jnp.mean(x)), stats["BatchNorm_0"]))
  return losses


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--plan", default="zeropp", choices=sorted(zerojax.PLANS))
  args = parser.parse_args()
  train(args.steps, plan=zerojax.PLANS[args.plan](compute_dtype="float32"))
