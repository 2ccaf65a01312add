"""`layout.to_flat` of host (numpy) params: each device is sent its own chunk, cut on the host; the result
equals the jitted path's bit for bit (scanned and unscanned leaves, padding, bf16 in)."""
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from zerojax.engine import layout as layout_lib
from zerojax.mesh import make_mesh


def test_host_params_are_cut_per_device_and_equal_the_jitted_path():
  rng = np.random.default_rng(0)
  params = {"embed": {"wte": rng.normal(size=(37, 5)).astype(np.float32)},
            "blocks": {"w": rng.normal(size=(3, 7, 11)).astype(ml_dtypes.bfloat16),
                       "b": rng.normal(size=(3, 13)).astype(np.float32)}}
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  layout = layout_lib.make_layout(shapes, frozenset({"blocks"}), 8 * 4)
  mesh = make_mesh(2, 4)
  host = layout_lib.to_flat(params, layout, mesh, ("node", "gpu"))
  jitted = layout_lib.to_flat(jax.tree.map(jnp.asarray, params), layout, mesh, ("node", "gpu"))
  chex.assert_trees_all_equal(host, jitted, strict=True)  # values and shapes
  for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(jitted)):
    assert a.dtype == b.dtype == jnp.float32 and a.sharding == b.sharding  # chex compares bf16 as float32
    assert all(s.data.shape[-1] == a.shape[-1] // 8 for s in a.addressable_shards)  # a chunk each
