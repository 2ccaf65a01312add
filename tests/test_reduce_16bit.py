"""16-bit gradient reduction (`Reduction.reduce_via`): 16 bits on the wire on every backend, fp32 sums.

DeepSpeed's ZeRO-3 (and ZeRO++'s baseline) reduces gradients in 16 bits; XLA:CPU widens a bf16
reduce-scatter to fp32 in the compiled program, so the executor moves the raw 16-bit words by qgZ's
2-hop all-to-all and sums them in fp32 (`comm.reduce.all_to_all_reduce_scatter`).
"""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from tests import helpers
from zerojax import analysis, comm
from zerojax import plan as plans


@pytest.fixture(scope="module")
def setup():
  return (zerojax.make_mesh(2, 4), *helpers.reference_case())


def _reductions(plan, mesh, model, params, batch):
  ex = zerojax.Executor(model, optax.sgd(1.0), plan, mesh, accum_steps=batch.shape[0])
  hlo = ex.step_fn().lower(ex.init_from_params(params), jax.device_put(batch, ex.batch_sharding)).compile().as_text()
  return [c for c in analysis.collectives_from_hlo(hlo, mesh) if c.role == "gradient reduction"]


@pytest.mark.parametrize("axes", [("node", "gpu"), ("gpu", "node"), ("gpu",), ("node",)])
def test_all_to_all_reduce_scatter_is_psum_scatter(axes):
  """Every hop structure (two hops, owners not node-major, one hop inside a node or across nodes)
  returns psum_scatter's chunk; in fp32 the sums agree to reassociation."""
  mesh = zerojax.make_mesh(2, 4)
  sizes = tuple(mesh.shape[a] for a in axes)
  x = jax.random.normal(jax.random.key(1), (8, 8 * 6))

  def body(x):
    x = x[0]
    return (comm.reduce.all_to_all_reduce_scatter(x, axes, sizes)[None],
            jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)[None])
  got, want = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P(("node", "gpu")),
                                    out_specs=jax.P(("node", "gpu")), check_vma=False))(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_16bit_gradients_match_jax_grad_within_bf16(setup):
  """bf16 gradients with fp32 sums: relative L2 error of the whole gradient within bf16's precision."""
  mesh, model, params, batch, want = setup
  got, _ = helpers.sharded_grads(plans.zero3(param_dtype="float32", reduce_dtype="bfloat16"), mesh, model,
                                 params, batch)
  err = helpers.rel_l2(got, want)
  assert 1e-4 < err < 1e-2, err


def test_16bit_gradients_are_16bit_across_nodes_in_the_compiled_program(setup):
  """The compiled CPU program's gradient reduction: all-to-alls of raw 16-bit words, inside the node and
  then across nodes, the cross-node hop carrying (N-1)·c 16-bit words per device. The reduce-scatter it
  replaces is widened to fp32 by XLA:CPU (its HLO type), and crosses nodes with G·(N-1)·c words."""
  mesh, model, params, batch, _ = setup
  a2a = _reductions(plans.zero3(reduce_dtype="bfloat16"), mesh, model, params, batch)
  rs = _reductions(plans.zero3(reduce_dtype="bfloat16", reduce_via="reduce_scatter"), mesh, model, params, batch)
  assert {c.op for c in a2a} == {"all-to-all"} and {c.hlo_dtype for c in a2a} == {"u16"}
  assert {c.axes for c in a2a} == {("gpu",), ("node",)}
  for comp in {c.computation for c in a2a}:  # inside the node first, then across nodes
    axes = [c.axes for c in a2a if c.computation == comp]
    assert axes.index(("gpu",)) < axes.index(("node",)), axes
  cross = lambda cs: sum(c.count * c.cross_node_bytes_per_device for c in cs)
  assert all(c.cross_node_bytes_per_device == 0 for c in a2a if c.axes == ("gpu",))
  assert {c.op for c in rs} == {"reduce-scatter"} and {c.hlo_dtype for c in rs} == {"f32"}
  # rs is accounted as a GPU's bf16 ring (the analysis undoes the widening): G = 4 times the 2-hop bytes
  assert cross(a2a) == pytest.approx(cross(rs) / 4, rel=1e-9)
  # per device and call: the node hop sends (N - 1) / N of its [N, c] bf16 slab, c the unit's chunk
  # (XLA lists an all-to-all's operand as one piece per peer)
  for c in a2a:
    if c.axes == ("node",):
      chunk = c.operand_shapes[0][-1]
      assert c.cross_node_bytes_per_device == chunk * 2 * (2 - 1)


@pytest.mark.slow  # 16-bit reduction in the fast suite: the other tests here
def test_fp32_gradients_keep_the_reduce_scatter_bitwise(setup):
  """`reduce_via='auto'` with fp32 gradients is the plain `psum_scatter` of before the field, bit for bit
  (bf16 with `reduce_via='reduce_scatter'` compiles to the reduce-scatter: the test above)."""
  mesh, model, params, batch, _ = setup
  base = plans.zero3(param_dtype="float32", reduce_via="reduce_scatter")
  a, ma = helpers.sharded_grads(base, mesh, model, params, batch)
  b, mb = helpers.sharded_grads(dataclasses.replace(base, reduce_via="auto"), mesh, model, params, batch)
  assert float(ma.loss) == float(mb.loss)
  chex.assert_trees_all_equal(a, b)


def test_reduce_via_refuses_bad_values():
  with pytest.raises(ValueError, match="reduce_via='ring'.*one of"):
    plans.zero3(reduce_via="ring")
  with pytest.raises(ValueError, match="qgZ"):
    plans.zeropp(reduce_via="all_to_all")
  assert plans.zero3(reduce_dtype="float16").reduction.gradient_all_to_all
  assert not plans.zero3().reduction.gradient_all_to_all
  assert jnp.dtype(plans.zero3(reduce_dtype="bfloat16").reduction.reduce_dtype).itemsize == 2
