"""qgZ's hops in float8 (`Reduction.grad_format`): the wire format added as one type
(`comm.formats.BlockFloat8`, the float8 gather's format), used by the same qgZ code as int8 and int4.

Each hop moves float8_e4m3fn codes with an fp32 scale per block (FP8-LM, Peng et al. 2023, §2.1): one
byte per gradient element like int8 qgZ, a relative rounding error of at most 2^-4 per element (2^-10 of
the block's scale where the scaled value is subnormal).
"""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax import analysis, plan as plans
from zerojax.comm import formats, qgz
from tests import helpers

FP8 = "float8_e4m3fn"
BLOCK = 32


def test_the_setting_validates_itself():
  plan = plans.zero3(grad_format=FP8, grad_block=64)
  assert plan.reduction.quantized and plan.alignment == 64
  assert plan.reduction.hop_formats == (formats.BlockFloat8(64),) * 2 and plan.reduction.hop_bits == (8, 8)
  with pytest.raises(ValueError, match=r"grad_format='e5m2'; use one of"):
    plans.zero3(grad_format="e5m2")
  with pytest.raises(ValueError, match="grad_format='float8_e4m3fn' and grad_bits=4 both quantize"):
    plans.zeropp(grad_format=FP8)
  with pytest.raises(ValueError, match="rounds to nearest without rotation"):
    plans.zero3(grad_format=FP8, stochastic_rounding=True)
  with pytest.raises(ValueError, match="grad_axes is empty"):
    plans.zero1(grad_format=FP8)


def _fp8_error_bound(x, block):
  """Per element: e4m3's half step relative to the value, or half its subnormal spacing."""
  amax = np.repeat(np.abs(x.reshape(*x.shape[:-1], -1, block)).max(-1), block, axis=-1)
  return np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * amax / 448)


@pytest.mark.parametrize("nodes", [2, 1])
def test_qgz_in_float8_matches_psum_scatter_within_the_format_bound(nodes):
  """The 2-hop all-to-all with float8 hops against the exact sum: each device's quantization, plus (two
  nodes) the requantization of each node's partial sum (bounded from the exact partial plus hop 1's error)."""
  gpus = 8 // nodes
  mesh = zerojax.make_mesh(nodes, gpus)
  x = helpers.data((8, 8 * 2 * BLOCK), seed=7)
  spec = P(("node", "gpu"))
  run = lambda f: np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))(x))
  exact = x.sum(0).reshape(8, -1)
  got = run(lambda g: qgz.qgz_reduce_scatter(g[0], axes=("node", "gpu"), sizes=(nodes, gpus),
                                             formats=formats.BlockFloat8(BLOCK))).reshape(8, -1)
  hop1 = _fp8_error_bound(x, BLOCK)                                  # [D, n], in the owners' order
  if nodes > 1:
    node_sums = x.reshape(nodes, gpus, -1).sum(1)
    hop1_nodes = hop1.reshape(nodes, gpus, -1).sum(1)
    hop2 = _fp8_error_bound(np.abs(node_sums) + hop1_nodes, BLOCK)
    bound = hop1.sum(0) + hop2.sum(0)
  else:
    bound = hop1.sum(0)
  err = np.abs(got.reshape(-1) - exact.reshape(-1))
  assert np.all(err <= bound * (1 + 1e-5) + 1e-6), float((err / bound).max())
  assert err.max() > 0  # it did quantize


def test_gradient_against_jax_grad_within_the_float8_bound():
  """One step of ZeRO-3 with float8 qgZ against single-device `jax.grad`: relative L2 error below 10%
  (measured 3.5% on this tiny model; int8 qgZ's 1.3%, int4's 28.7%), above 1e-4 (it did quantize); a finite
  loss."""
  mesh, model, params, batch, want = zerojax.make_mesh(2, 4), *helpers.reference_case()
  got, metrics = helpers.sharded_grads(plans.zero3(param_dtype="float32", grad_format=FP8), mesh, model, params,
                                       batch)
  err = helpers.rel_l2(got, want)
  assert 1e-4 < err < 0.1, err
  assert np.isfinite(float(metrics.loss))


def test_compiled_step_moves_one_byte_per_gradient_element():
  """In the compiled step qgZ's all-to-alls move uint8, as many bytes as int8 qgZ's on the same layout
  (one byte per element plus a 4-byte scale per block): the wire format, read from the program."""
  mesh, model, params, batch, _ = zerojax.make_mesh(2, 4), *helpers.reference_case()

  def gradient_hops(plan):
    ex = zerojax.Executor(model, optax.sgd(0.1), dataclasses.replace(plan, pad_multiple=256), mesh,
                          accum_steps=batch.shape[0])
    hlo = ex.step_fn().lower(ex.init_from_params(params), jax.device_put(batch, ex.batch_sharding)).compile().as_text()
    return [c for c in analysis.collectives_from_hlo(hlo, mesh) if c.op == "all-to-all"]

  fp8 = gradient_hops(plans.zero3(param_dtype="float32", grad_format=FP8))
  int8 = gradient_hops(plans.zero3(param_dtype="float32", grad_bits=8))
  assert fp8 and {c.dtype for c in fp8} == {"u8"}, {c.dtype for c in fp8}
  assert sum(c.bytes_per_device * c.count for c in fp8) == sum(c.bytes_per_device * c.count for c in int8)


def test_the_planner_ranks_float8_hops_beside_int8_and_labels_them():
  """The planner's space holds float8 hops on every point that shards gradients; the cost model prices
  them at int8's wire bytes (the same time); the plan it builds and its label name the format."""
  from zerojax.planner import space
  from zerojax.planner.cost import Workload, comm_time
  from zerojax.planner.links import link_profile

  z3 = space.Point(8, 8, 8)
  options = space.grad_options(z3, world=8, gpus=4)
  assert {"grad_bits": None, "grad_format": FP8, "reduce16": False, "radius": False, "diloco": False} in options
  fp8 = space.Point(8, 8, 8, grad_format=FP8)
  assert fp8.name(8) == "zero3+qgzfp8" and fp8.quantized and not fp8.lossy
  plan = fp8.plan(2, 4)
  assert plan.reduction.grad_format == FP8 and plan.label() == "mics(group=8)+qgZ(fp8)"
  assert plans.zero3(grad_format=FP8).label() == "zero3+qgZ(fp8)"
  work = Workload(units=((1 << 20, 4),), accum=1, param_bytes=2, opt_bytes_per_param=8, compute_s=0.1)
  prof = link_profile(2, 4, b_gpu=100e9, b_node=12.5e6, source="test")
  int8 = comm_time(space.Point(8, 8, 8, grad_bits=8), work, prof, 4)["T_g"]
  int4 = comm_time(space.Point(8, 8, 8, grad_bits=4), work, prof, 4)["T_g"]
  assert comm_time(fp8, work, prof, 4)["T_g"] == pytest.approx(int8) and int4 < int8
