"""Schedule.prefetch: the same numbers as without it, and in the compiled program each layer loop's
collectives (the next layer's gather, the previous layer's gradient reduction) neither wait for nor feed
the same iteration's compute, with one gathered layer in the loop carry."""
import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from tests import flax_models as fm
from tests import helpers
from zerojax.engine import layout as layout_lib
from zerojax.analysis.hlo_text import OPS, Module, arrays, attr, nbytes
from zerojax.models.gpt import GPTConfig, gpt


@functools.cache
def case(layers: int):
  """(model, params, batch of 2 micro-batches, jax.grad reference, reference loss)."""
  model = gpt(GPTConfig(seq_len=16, d_model=32, num_heads=2, num_layers=layers))
  params = jax.jit(model.init)(jax.random.key(0))
  batch = helpers.batches(1, 2)[0]
  loss = float(jnp.mean(jax.vmap(lambda t: model.loss(params, t))(batch)))
  return model, params, batch, helpers.reference_grads(model, params, batch), loss


@functools.cache
def step(plan: zerojax.Plan, layers: int = 4):
  """(gradient the optimizer gets, loss, optimized HLO, executor) of one step of `plan`. Four layers
  keep both layer loops in the compiled program (XLA removes a loop of one trip and may unroll two)."""
  model, params, batch, _, _ = case(layers)
  ex = zerojax.Executor(model, helpers.capture_grads(), plan, zerojax.make_mesh(2, 4), accum_steps=2)
  state, b = ex.init_from_params(params), ex.shard_batch(batch)
  program = ex.step_fn().lower(state, b).compile()
  state, m = program(state, b)
  return layout_lib.to_logical(state.opt_state, ex.layout), float(m.loss), program.as_text(), ex


F32 = {"param_dtype": "float32"}
EXACT = {"zero3": (zerojax.zero3(**F32), 4), "mics-sync": (zerojax.mics(sync_in_backward=True, **F32), 1),
         "zero2": (zerojax.zero2(**F32), 2)}  # no gathers: the backward's reduction of layer i+1 runs ahead
QUANTIZED = {"zeropp": (zerojax.zeropp(**F32), 4),  # qwZ, hpZ, qgZ
             "qwz-hierarchical-qgz": (zerojax.zeropp(secondary_axes=None, hierarchical=True, **F32), 2)}


@pytest.mark.parametrize("name", helpers.sweep(list(EXACT), ["zero3"]))
def test_prefetch_matches_single_device_grad(name):
  """Unquantized plans against `jax.grad` (4 layers, and 1: the loops' peeled cases)."""
  plan, layers = EXACT[name]
  grads, loss, _, _ = step(dataclasses.replace(plan, prefetch=True), layers)
  _, _, _, ref, ref_loss = case(layers)
  assert helpers.rel_l2(grads, ref) < 1e-5
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


@pytest.mark.slow  # prefetch against jax.grad in the fast suite: test_prefetch_matches_single_device_grad[zero3]
def test_prefetch_equals_the_per_layer_path():
  got, loss, _, _ = step(dataclasses.replace(EXACT["zero3"][0], prefetch=True))
  want, want_loss, _, _ = step(EXACT["zero3"][0])
  assert helpers.max_rel_diff(got, want) < 1e-5 and loss == pytest.approx(want_loss, rel=1e-6)


@pytest.mark.parametrize("name", helpers.sweep(list(QUANTIZED), []))
def test_prefetch_equals_the_per_layer_path_when_quantized(name):
  """The same collectives on the same values: ZeRO++ bitwise equal. With the quantized backward gather
  (no hpZ) XLA fuses the layer's VJP differently (~1e-8 apart before qgZ), and a value that lands on
  another int4 step moves the gradient by one quantization step of its block: 1e-3 bounds that."""
  plan, layers = QUANTIZED[name]
  got, loss, _, _ = step(dataclasses.replace(plan, prefetch=True), layers)
  want, want_loss, _, _ = step(plan, layers)
  assert loss == pytest.approx(want_loss, rel=1e-6)
  if name == "zeropp":
    assert loss == want_loss
    chex.assert_trees_all_equal(got, want)
  else:
    assert helpers.rel_l2(got, want) < 1e-3
  assert helpers.rel_l2(got, case(layers)[3]) < 0.5  # int4 qgZ noise (bounded in test_zeropp.py), not garbage


# ----------------------------------------------------------------------------------- compiled program

def _callees(mod, instr):
  names = []
  for key in ("calls", "to_apply", "body", "condition", "true_computation", "false_computation",
              "branch_computations"):
    names += re.findall(r"%?([^\s{},%]+)", attr(instr.attrs, key) or "")
  return [c for c in names if c in mod.comps]


def _computes(mod, instr) -> bool:
  """A dot or convolution, or something calling one (fusions, oneDNN matmul calls)."""
  if instr.opcode in ("dot", "convolution"):
    return True
  if instr.opcode == "custom-call" and re.search(r"matmul|conv", instr.attrs):
    return True
  return any(_computes(mod, i) for c in _callees(mod, instr) for i in mod.comps[c])


def _reach(mod, comp, instr, up: bool) -> list:
  """The instructions of `comp` that `instr` depends on (up) or that depend on it."""
  seen, todo, names = set(), [instr.name], mod.by_name[comp]
  while todo:
    n = todo.pop()
    for m in (names[n].operands if up else [u.name for u in mod.users[comp][n]]):
      if m in names and m not in seen:
        seen.add(m)
        todo.append(m)
  return [names[m] for m in seen]


def layer_loops(text: str):
  """(while instruction, body name, module) of each innermost loop holding collectives: the layers."""
  mod = Module(text)
  for instrs in list(mod.comps.values()):
    for w in instrs:
      if w.opcode == "while":
        body = re.match(r"%?([^\s,{}]+)", attr(w.attrs, "body")).group(1)
        inner = mod.comps[body]
        if any(_collective(i) for i in inner) and not any(i.opcode == "while" for i in inner):
          yield w, body, mod


def _collective(instr) -> bool:
  return instr.opcode.removesuffix("-start") in OPS


def overlap_free(text: str) -> list[bool]:
  """Per collective of each layer loop: neither depends on nor feeds that iteration's compute."""
  out = []
  for _, body, mod in layer_loops(text):
    instrs = mod.comps[body]
    assert any(_computes(mod, i) for i in instrs)
    for c in filter(_collective, instrs):
      out.append(not any(_computes(mod, i) for i in _reach(mod, body, c, True) + _reach(mod, body, c, False)))
  return out


@pytest.mark.parametrize("name", helpers.sweep(["zero3", "zeropp"], ["zero3"]))
def test_gathers_and_reductions_are_independent_of_the_layer_compute(name):
  plan = (EXACT if name in EXACT else QUANTIZED)[name][0]
  free = overlap_free(step(dataclasses.replace(plan, prefetch=True))[2])
  assert len(free) >= 3 and all(free)  # forward gather; backward gather and reduction (qgZ: 2 hops)
  # Without prefetch each layer gathers the weights its own compute uses.
  assert not all(overlap_free(step(plan)[2]))


def test_one_gathered_layer_in_the_loop_carry():
  """Forward: the carry gains one gathered layer; backward: one gathered layer and one unreduced
  gradient. So at most two gathered layers are alive (the carried one and the one arriving)."""
  plan = EXACT["zero3"][0]
  with_pf, without = (step(dataclasses.replace(plan, prefetch=p))[2] for p in (True, False))
  carry = lambda text: [nbytes(arrays(w.shape)) for w, _, _ in layer_loops(text)]
  ex = step(plan)[3]
  layer_bytes = 4 * sum(l.padded for l in jax.tree.leaves(ex.layout.tree()["blocks"],
                                                          is_leaf=layout_lib.is_layout))
  (fwd, bwd), (fwd0, bwd0) = carry(with_pf), carry(without)
  assert 0 < fwd - fwd0 <= layer_bytes
  assert 0 < bwd - bwd0 <= 2 * layer_bytes
  gathers = [sum(i.opcode.startswith("all-gather") for i in mod.comps[b]) for _, b, mod in layer_loops(with_pf)]
  assert gathers == [1, 1]


# ------------------------------------------------------------------------------------------- refusals

def test_prefetch_refuses_layers_called_one_by_one():
  """A flax nn.scan stack calls its unit layer by layer: prefetch cannot wrap it, and says so."""
  net = fm.Net()
  model = zerojax.from_linen(net, jax.tree.map(lambda x: x[:2], fm.batch()), fm.loss_fn, units=(fm.Block,),
                             mutable=("batch_stats",), rngs=("dropout",))
  ex = zerojax.Executor(model, helpers.optimizer("sgd"), zerojax.zero3(prefetch=True), zerojax.make_mesh(2, 4))
  state = ex.init(jax.random.key(0))
  with pytest.raises(ValueError, match="scan_layers"):
    ex.step_fn().lower(state, ex.shard_batch(fm.batch(16)))


def test_default_prefetch_never_breaks_a_flax_scan_model(monkeypatch):
  """The GPU default (prefetch=None resolved on for a GPU mesh, emulated here) is not applied to a unit
  whose layers flax calls one by one: it trains per layer, the same bits as prefetch=False, and the
  executor names the unit; only an explicit prefetch=True refuses (above)."""
  net = fm.Net()
  model = zerojax.from_linen(net, jax.tree.map(lambda x: x[:2], fm.batch()), fm.loss_fn, units=(fm.Block,),
                             mutable=("batch_stats",), rngs=("dropout",))
  mesh, batch = zerojax.make_mesh(2, 4), fm.batch(16)

  def one_step(plan):
    ex = zerojax.Executor(model, helpers.optimizer("sgd"), plan, mesh)
    state, m = ex.step_fn()(ex.init(jax.random.key(0)), ex.shard_batch(batch))
    return ex, float(m.loss), jax.tree.map(np.asarray, state.params)

  _, loss_off, params_off = one_step(zerojax.zero3(prefetch=False))
  from zerojax import gpu_aot
  monkeypatch.setattr(gpu_aot, "is_gpu", lambda mesh: True)
  ex, loss, params = one_step(zerojax.zero3())
  assert ex.plan.schedule.prefetch and ex.components.prefetch  # the GPU default is on ...
  assert list(ex.prefetch_fallbacks()) == [u for u in ex.model.scanned]  # ... and this unit runs per layer
  assert "called one by one" in next(iter(ex.prefetch_fallbacks().values()))
  assert loss == loss_off
  chex.assert_trees_all_equal(params, params_off)


def test_prefetch_must_be_a_bool():
  with pytest.raises(ValueError, match="prefetch"):
    zerojax.zero3(prefetch="yes")


def test_prefetch_leaves_remat_as_it_is():
  """Prefetch is a schedule of the unit's engine: `remat` resolves as without it, and every mode is valid."""
  for prefetch in (False, True):
    assert zerojax.zero3(prefetch=prefetch).remat_mode == "full"
    assert zerojax.dp(prefetch=prefetch).remat_mode == "none"
  assert zerojax.zero3(prefetch=True, remat="dots").remat_mode == "dots"


# ------------------------------------------------------------- every combination of the unit's engine

REMAT = {"zero3": zerojax.zero3(**F32), "hpz": zerojax.zero3(secondary_axes=("gpu",), **F32),
         "mics-sync": zerojax.mics(sync_in_backward=True, **F32)}


@pytest.mark.parametrize("name,mode,layers", helpers.sweep(
    [("zero3", "none", 4), ("zero3", "dots", 4), ("zero3", "none", 1), ("hpz", "none", 4), ("hpz", "dots", 2),
     ("mics-sync", "none", 4), ("mics-sync", "dots", 1), ("zero3", "offloaded", 4), ("mics-sync", "offloaded", 2)],
    []))  # each ~12 s of CPU: all slow
def test_prefetch_with_remat_modes_matches_single_device_grad(name, mode, layers):
  """remat "dots" / "none" under prefetch: each layer's backward reuses its saved activations with the
  prefetched weights ("offloaded": recomputes from its input brought back from host memory);
  `jax.grad`'s gradient up to float reassociation."""
  plan = dataclasses.replace(REMAT[name], remat=mode, prefetch=True)
  grads, loss, _, _ = step(plan, layers)
  _, _, _, ref, ref_loss = case(layers)
  assert helpers.rel_l2(grads, ref) < 1e-5
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


@functools.cache
def step_state(plan: zerojax.Plan, layers: int = 4):
  """(gradient the optimizer gets, loss, train state) after one step of `plan` (two micro-batches)."""
  model, params, batch, _, _ = case(layers)
  ex = zerojax.Executor(model, helpers.capture_grads(), plan, zerojax.make_mesh(2, 4), accum_steps=2)
  state, m = ex.step_fn()(ex.init_from_params(params), ex.shard_batch(batch))
  return layout_lib.to_logical(state.opt_state, ex.layout), float(m.loss), state


QGZ_STATE = {"feedback": {"grad_error_feedback": True}, "rounding": {"stochastic_rounding": True},
             "both-dots": {"grad_error_feedback": True, "stochastic_rounding": True, "remat": "dots"},
             "feedback-8-4-no-hpz": {"grad_error_feedback": True, "grad_bits": (8, 4), "secondary_axes": None}}


@pytest.mark.parametrize("name", helpers.sweep(list(QGZ_STATE), []))  # two steps compiled each: all slow
def test_prefetch_carries_qgz_state_per_layer(name):
  """qgZ's error feedback and stochastic rounding under prefetch: each layer's reduction takes its own
  error buffers and seed, so the gradient and the new error buffers are those of the per-layer path
  (bitwise with hpZ; within int4 noise of a value moved by reassociation without it, as in
  `test_prefetch_equals_the_per_layer_path_when_quantized`), and near `jax.grad` as qgZ is."""
  plan = zerojax.zeropp(**F32, **QGZ_STATE[name])
  got, loss, state = step_state(dataclasses.replace(plan, prefetch=True))
  want, want_loss, want_state = step_state(dataclasses.replace(plan, prefetch=False))
  assert loss == pytest.approx(want_loss, rel=1e-6)
  errors = (jax.tree.leaves(state.stateful.get("grad_error")), jax.tree.leaves(want_state.stateful.get("grad_error")))
  assert len(errors[0]) == (2 * 3 if plan.reduction.grad_error_feedback else 0)  # (e_send, e_node) of each unit
  if plan.gather.secondary_axes:
    assert loss == want_loss
    chex.assert_trees_all_equal((got, errors[0]), (want, errors[1]))
  else:
    assert helpers.rel_l2(got, want) < 1e-3
    assert helpers.rel_l2(errors[0], errors[1]) < 1e-3  # measured 3e-5 (gradients 2e-6)
  assert all(float(jnp.abs(e).max()) > 0 for e in errors[0])  # the second micro-step fed back the first's
  assert helpers.rel_l2(got, case(4)[3]) < 0.5  # int4 qgZ noise (bounded in test_zeropp.py), not garbage


@pytest.mark.slow  # the overlap of the layer loops in the fast suite: test_gathers_and_reductions_are_...
def test_collectives_stay_independent_of_the_compute_with_remat_and_qgz_state():
  """Saved activations and per-layer error buffers ride in the loops without tying a collective to the
  same iteration's compute."""
  plan = zerojax.zeropp(grad_error_feedback=True, remat="none", prefetch=True, **F32)
  free = overlap_free(step(plan)[2])
  assert len(free) >= 3 and all(free)
