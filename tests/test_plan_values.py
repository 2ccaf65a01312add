"""A plan is five values (`zerojax.plan.values`) plus the rules between them (`Plan._check_across`):
settings round-trip through their flat names, each value refuses its own bad settings, and a setting two
values hold is one setting."""
import dataclasses

import pytest

import zerojax
from zerojax import plan as plans
from zerojax.plan.values import Gather, Reduction, Schedule, Sharding

VARIANTS = [plans.dp(), plans.zero1(), plans.zero2(), plans.zero3(), plans.mics(), plans.mics(group_size=8),
            plans.zeropp(), plans.zeropp(grad_bits=(8, 4), weight_bits=4, rotate=True, grad_error_feedback=True),
            plans.zeropp(rotate=True, grad_bits=None), plans.zeropp(rotate=True, weight_bits=None),
            plans.zero3(weight_format="float8_e4m3fn", kernel_backend="pallas", remat="dots", prefetch=True),
            plans.amsp(2, 4, 4, replica_sync=plans.radius(density=0.1), sync_in_backward=True, pad_multiple=256),
            plans.amsp(2, 4, 8, remat="none"),
            plans.zero3(reduce_dtype="bfloat16", reduce_via="reduce_scatter", compute_dtype="float32")]


@pytest.mark.parametrize("plan", VARIANTS, ids=lambda p: p.name)
def test_settings_round_trip(plan):
  """`Plan(name, **plan.settings())` is the same plan, and `dataclasses.replace` changes one setting only."""
  assert plans.Plan(plan.name, **plan.settings()) == plan
  again = dataclasses.replace(plan, prefetch=not plan.schedule.prefetch)
  assert again.schedule.prefetch is (not plan.schedule.prefetch)
  assert {k: v for k, v in again.settings().items() if k != "prefetch"} == \
      {k: v for k, v in plan.settings().items() if k != "prefetch"}


def test_values_and_settings_compose():
  """Values build a plan directly; settings given beside them win over the values' fields."""
  plan = plans.Plan("mine", sharding=Sharding(param_axes=("gpu",), grad_axes=("gpu",), opt_axes=("gpu",)),
                    gather=Gather(weight_bits=8), reduction=Reduction(grad_bits=4), schedule=Schedule(remat="dots"),
                    grad_block=64)
  assert plan.gather.weight_bits == 8 and plan.reduction.grad_block == 64 and plan.schedule.remat == "dots"
  assert plan.sharding.replica_axes(zerojax.make_mesh(2, 4)) == ("node",)


def test_a_shared_setting_is_one_setting():
  """`rotate` (where both values quantize) and `kernel_backend` live in two values; values that disagree
  are refused, so copying a plan through its settings cannot change either."""
  with pytest.raises(ValueError, match=r"plan 'x': Gather\(rotate=True\) but Reduction\(rotate=False\); rotate is one"):
    plans.Plan("x", gather=Gather(weight_bits=8, rotate=True), reduction=Reduction(grad_bits=4))
  with pytest.raises(ValueError, match=r"Gather\(kernel_backend='pallas'\) but Reduction\(kernel_backend=None\)"):
    plans.Plan("x", gather=Gather(kernel_backend="pallas"))
  one = plans.Plan("x", gather=Gather(weight_bits=8, rotate=True), reduction=Reduction(rotate=False))
  assert dataclasses.replace(one, prefetch=True).reduction.rotate is False  # nothing to rotate there


@pytest.mark.parametrize("kw,match", [
    ({"kernel_backend": "cuda"}, r"plan 'zeropp': kernel_backend='cuda'; use one of \('xla', 'pallas', 'triton'\)"),
    ({"kernel_backend": "triton", "stochastic_rounding": True}, r"stochastic_rounding=True is not in the triton"),
    ({"pad_multiple": 0}, r"pad_multiple=0 must be a whole number >= 1"),
    ({"weight_bits": None, "weight_format": "float8_e4m3fn", "remat": "some"}, r"remat='some'; use one of"),
    ({"nonsense": 1}, r"unknown setting 'nonsense'"),
])
def test_each_value_refuses_its_own_settings_in_one_line(kw, match):
  with pytest.raises((ValueError, TypeError), match=match) as e:
    plans.zeropp(**kw)
  assert "\n" not in str(e.value)


def test_sync_in_backward_needs_gradients_sharded_like_the_optimizer_states():
  """It all-reduces the reduced gradient shard in the backward; with A_os finer than A_g the window's
  reduce-scatter must come first, so the setting would be ignored: refused instead."""
  for make in (lambda: plans.zero1(sync_in_backward=True), lambda: plans.amsp(2, 4, 8, sync_in_backward=True)):
    with pytest.raises(ValueError, match=r"sync_in_backward=True .* shard finer than grad_axes"):
      make()
  assert plans.mics(group_size=4, sync_in_backward=True).sync.sync_in_backward
  assert plans.dp(sync_in_backward=True).sync.sync_in_backward


def test_a_quantized_gather_names_its_own_setting_without_sharded_parameters():
  with pytest.raises(ValueError, match=r"plan 'dp': weight_format quantizes the parameter all-gather"):
    plans.dp(weight_format="float8_e4m3fn")
