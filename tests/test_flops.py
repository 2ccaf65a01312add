"""`analysis.flops.matmul_flops`: the matmul FLOPs of a compiled program, counted through the layer loop's
trip count (XLA's own `cost_analysis` counts a loop's body once, and is empty on compile-only GPUs)."""
import jax
import jax.numpy as jnp

from zerojax.analysis.flops import matmul_flops


def test_a_scanned_stack_counts_every_layer_and_the_backward():
  def loss(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()

  ws, x = jnp.ones((5, 64, 64)), jnp.ones((16, 64))
  forward = jax.jit(loss).lower(ws, x).compile().as_text()
  backward = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(ws, x).compile().as_text()
  one = 2 * 16 * 64 * 64  # one layer's matmul
  assert matmul_flops(forward) == 5 * one
  assert matmul_flops(backward) == 3 * 5 * one  # forward, input gradient, weight gradient


def test_batched_contractions():
  a, b = jnp.ones((3, 8, 16)), jnp.ones((3, 16, 4))
  text = jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b)).lower(a, b).compile().as_text()
  assert matmul_flops(text) == 2 * 3 * 8 * 16 * 4
