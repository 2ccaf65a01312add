"""Axes of size 1 move nothing: on a 1 x 1 mesh every plan runs what dp runs (docs/DESIGN.md, "Components").

`components.compile` keeps only the axes of size > 1 for every collective, quantization and prefetch: on one
device ZeRO-3, ZeRO++ and MiCS train exactly as dp does (same loss, gradient norm and parameters, bitwise,
under the same dtypes and remat mode) and their compiled step holds no collective and no quantized array;
on a mesh with a size-1 axis no collective runs over a group of one device; on 2 x 4 the collectives are
all there.
"""
import dataclasses
import re

import jax
import numpy as np
import pytest

import zerojax
from tests import helpers
from zerojax.analysis import collectives_from_hlo, quantized_arrays
from zerojax.engine.components import GradReduction
from zerojax.models.gpt import gpt

COLLECTIVES = re.compile(r"\b(all-gather|reduce-scatter|all-to-all|all-reduce|collective-permute)(-start)?\(")
DTYPES = {"param_dtype": "bfloat16", "compute_dtype": "float32"}  # the shipped configs' on CPUs (configs/base.gin)
PLANS = {"zero3": zerojax.zero3, "zeropp": zerojax.zeropp, "mics": zerojax.mics}
_cache = {}


def mesh(nodes, gpus):
  return zerojax.make_mesh(nodes, gpus, devices=jax.devices()[:nodes * gpus])


def one_step(plan, nodes=1, gpus=1):
  """(loss, gradient norm, logical params after one step of two micro-batches, the step's optimized HLO)."""
  key = (plan.name, repr(sorted(plan.settings().items())), nodes, gpus)
  if key not in _cache:
    model = helpers.tiny_gpt()
    ex = zerojax.Executor(model, helpers.optimizer(), plan, mesh(nodes, gpus), accum_steps=2)
    state = ex.init_from_params(jax.jit(model.init)(jax.random.key(0)))
    batch = jax.device_put(helpers.batches(1, 2)[0], ex.batch_sharding)
    compiled = ex.step_fn().lower(state, batch).compile()
    state, m = compiled(state, batch)
    _cache[key] = (float(m.loss), float(m.grad_norm), jax.device_get(ex.logical_params(state)), compiled.as_text(),
                   ex)
  return _cache[key]


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("remat", ["full", "none"])
def test_one_device_trains_exactly_as_dp(name, remat):
  """Same dtypes and remat mode: the loss, gradient norm and every parameter after a step are dp's,
  bitwise (zeropp's qwZ and qgZ do not quantize: nothing leaves the device)."""
  loss, norm, params, _, _ = one_step(PLANS[name](remat=remat, **DTYPES))
  want_loss, want_norm, want, _, _ = one_step(zerojax.dp(remat=remat, **DTYPES))
  assert (loss, norm) == (want_loss, want_norm)
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    np.testing.assert_array_equal(x, _at(want, path), err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


@pytest.mark.parametrize("name", sorted(PLANS))
def test_one_device_program_has_no_collective_and_no_quantization(name):
  *_, hlo, ex = one_step(PLANS[name](remat="full", **DTYPES))  # the sharded plans' default remat
  assert not COLLECTIVES.findall(hlo), sorted({m[0] for m in COLLECTIVES.findall(hlo)})
  assert not quantized_arrays(hlo), quantized_arrays(hlo)
  c = ex.components
  assert (c.gather.axes, c.gather.to_param, c.reduction.order, c.sync.to_opt, c.sync.replicas) == ((),) * 5
  assert (c.gather.wire_format, c.gather.secondary, c.reduction.hop_formats, c.prefetch, c.mean_axes) == (None, None, None, False, ())
  assert c.gather.shard_dtype == "float32"  # rounded to bf16 and widened once per step, not at every call


def test_one_device_with_qgz_error_feedback_and_eval():
  """qgZ's error feedback on one device: nothing is quantized, so nothing is dropped (the state stays
  zero); the forward-only eval program averages over no device either."""
  plan = zerojax.zeropp(grad_error_feedback=True, stochastic_rounding=True, remat="full", **DTYPES)
  loss, _, _, hlo, ex = one_step(plan)
  assert loss == one_step(zerojax.zeropp(remat="full", **DTYPES))[0]
  assert not COLLECTIVES.findall(hlo) and not quantized_arrays(hlo)
  model = helpers.tiny_gpt()
  state = ex.init_from_params(jax.jit(model.init)(jax.random.key(0)))
  step = ex.step_fn()
  state, _ = step(state, helpers.batches(1, 2)[0])
  assert all(not np.any(np.asarray(e)) for e in jax.tree.leaves(state.stateful["grad_error"]))
  eval_hlo = jax.jit(ex.eval_fn()).lower(state.params, helpers.batches(1, 1)[0][0]).compile().as_text()
  assert not COLLECTIVES.findall(eval_hlo)


@pytest.mark.parametrize("nodes,gpus", [(1, 4), (2, 1)])
@pytest.mark.parametrize("name", ["zero3", "zeropp", "mics"])
def test_no_collective_over_a_group_of_one_device(name, nodes, gpus):
  """A mesh with one axis of size 1: every collective's groups hold more than one device (zeropp on 2 x 1:
  qwZ and qgZ across the two nodes, hpZ's secondary group of one keeps the gathered weights and gathers
  nothing in the backward; mics on 2 x 1: its group is one device, so only the replica all-reduce)."""
  plan = PLANS[name](**DTYPES)
  loss, _, _, hlo, ex = one_step(plan, nodes, gpus)
  found = collectives_from_hlo(hlo, ex.mesh)
  assert found
  assert all(len(g) > 1 for c in found for g in c.replica_groups), [(c.op, c.replica_groups) for c in found]
  assert np.isfinite(loss)
  if name == "zeropp" and (nodes, gpus) == (2, 1):
    assert ex.components.gather.secondary == () and quantized_arrays(hlo)
    assert not any(c.op == "all-gather" and "transpose(" in c.op_name for c in found)  # hpZ: no backward gather


@pytest.mark.parametrize("name", sorted(PLANS))
def test_two_by_four_keeps_its_collectives(name):
  *_, hlo, ex = one_step(PLANS[name](**DTYPES), 2, 4)
  ops = {m[0] for m in COLLECTIVES.findall(hlo)}
  assert {"all-gather"} <= ops
  assert ("all-to-all" if name == "zeropp" else "reduce-scatter") in ops
  if name == "mics":
    assert "all-reduce" in ops  # the replica sync across the two nodes
  if name == "zeropp":
    wire = [c.name for c in collectives_from_hlo(hlo, ex.mesh) if set(c.hlo_dtype.split(",")) & {"s8", "u8"}]
    assert wire and set(wire) <= {q.name for q in quantized_arrays(hlo)}, wire
  assert ex.components.gather.moves and ex.components.mean_axes == ("node", "gpu")


def _bf16_step(name, accum, monkeypatch=None):
  """(loss, gradient norm, logical params, temp bytes, HLO) after one bf16-compute step on one device; with
  `monkeypatch` the gradient sinks are kept in `reduce_dtype` (fp32), as they were before
  `GradReduction.kept_in`."""
  if monkeypatch is not None:
    monkeypatch.setattr(GradReduction, "kept_in", lambda self, dtype: self)
  model = helpers.tiny_gpt()
  ex = zerojax.Executor(model, helpers.optimizer(), PLANS.get(name, zerojax.dp)(compute_dtype="bfloat16"),
                        mesh(1, 1), accum_steps=accum)
  state = ex.init_from_params(jax.jit(model.init)(jax.random.key(0)))
  batch = jax.device_put(helpers.batches(1, accum)[0], ex.batch_sharding)
  compiled = ex.step_fn().lower(state, batch).compile()
  state, m = compiled(state, batch)
  return (float(m.loss), float(m.grad_norm), jax.device_get(ex.logical_params(state)),
          compiled.memory_analysis().temp_size_in_bytes, _without_metadata(compiled.as_text()))


def _without_metadata(hlo: str) -> str:
  """The optimized HLO without source locations (newer jax lists the Python frames of every op)."""
  # the tables of source files, functions, locations and stack frames, each to the next empty line
  hlo = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*\n?", "", hlo, flags=re.M)
  return re.sub(r", (metadata|stack_frame_id)=(\{[^}\n]*\}|\d+)", "", hlo)


@pytest.mark.parametrize("name", ["dp", "zero3"])
def test_one_device_keeps_16bit_gradients(name, monkeypatch):
  """Nothing reduced or accumulated (one device, one micro-step, bf16 compute): the gradient stays in bf16
  until the step divides it, so the step holds less than with fp32 sinks, with the same bits. With two
  micro-steps the window accumulates in fp32: the program is the fp32-sink one."""
  loss, norm, params, _, hlo = _bf16_step(name, 1)
  want_loss, want_norm, want, _, want_hlo = _bf16_step(name, 1, monkeypatch)
  assert (loss, norm) == (want_loss, want_norm)
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    np.testing.assert_array_equal(x, _at(want, path), err_msg=jax.tree_util.keystr(path))
  assert hlo != want_hlo  # a program of its own (what it holds is measured where it matters: a GPU's)
  monkeypatch.undo()
  accumulated = _bf16_step(name, 2)[4]
  assert accumulated == _bf16_step(name, 2, monkeypatch)[4]


@pytest.mark.gpu_compile
def test_16bit_gradients_hold_less_on_a_compile_only_h100(monkeypatch):
  """The same step compiled for one H100: the 16-bit gradients hold fewer temporary bytes than fp32 sinks
  (the 737M GPT's figures: `benchmarks/gpu/step_compile_h100.json`, docs/gpu.md)."""
  from zerojax import gpu_aot
  from zerojax.executor import aot
  gpu_aot.compile_only_host()
  gpu = zerojax.make_mesh(1, devices=gpu_aot.devices("h100", 1, 1))
  cfg = dataclasses.replace(helpers.TINY, num_layers=4, d_model=256, num_heads=4)
  temp = {}
  for wide in (False, True):
    if wide:
      monkeypatch.setattr(GradReduction, "kept_in", lambda self, dtype: self)
    ex = zerojax.Executor(gpt(cfg), helpers.optimizer(), zerojax.zero3(compute_dtype="bfloat16"), gpu)
    temp[wide] = gpu_aot.memory(aot.compile_step(ex, (1, 8, cfg.seq_len + 1))[0])["temp"]
  layers = 4 * 12 * 256 * 256  # the scanned blocks' weights: their gradients' width halves
  assert temp[True] - temp[False] >= layers, temp
