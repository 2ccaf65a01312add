"""One channel per setting: the run's precision is `train.param_dtype` / `train.compute_dtype` for every
plan (the plan constructors refuse it in gin), the hpZ group is the plan's `secondary_axes`, and a plan
built in Python that sets another precision than the run's is refused, never silently replaced."""
import gin
import pytest

from zerojax import plan as plans
from zerojax.cli.train import parameters_help
from zerojax.train import config as config_lib, trainer


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.mark.parametrize("binding,field", [("zero3.param_dtype = 'float32'", "param_dtype"),
                                           ("mics.compute_dtype = 'bfloat16'", "compute_dtype"),
                                           ("zeropp.pad_multiple = 4", "pad_multiple")])
def test_a_plan_constructor_refuses_a_run_setting_in_gin(binding, field):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.parse(["configs/zero3.gin"], [binding])
  msg = str(e.value)
  assert "\n" not in msg and f"denylisted kwarg '{field}'" in msg and f"set train.{field}" in msg


def test_the_hpz_group_is_the_plans_own_field():
  with pytest.raises(config_lib.ConfigError, match="train.*secondary_group"):
    config_lib.parse(["configs/zeropp.gin"], ["train.secondary_group = 2"])
  config_lib.parse(["configs/zeropp.gin"], ["zeropp.secondary_axes = 2"])
  assert gin.query_parameter("zeropp.secondary_axes") == 2


def test_the_runs_precision_applies_to_a_plan_that_leaves_it_at_its_default():
  p = trainer.with_run_settings(plans.zero3(), "bfloat16", "float32")
  assert (p.gather.param_dtype, p.gather.compute_dtype) == ("bfloat16", "float32")
  assert trainer.with_run_settings(plans.mics(compute_dtype="float32"), None, None).gather.compute_dtype == "float32"
  assert trainer.with_run_settings(plans.mics(compute_dtype="float32"), None, "float32").gather.compute_dtype == "float32"


def test_a_conflict_between_plan_and_run_is_a_one_line_error():
  with pytest.raises(ValueError) as e:
    trainer.with_run_settings(plans.zero3(param_dtype="float32"), "bfloat16", None)
  msg = str(e.value)
  assert "\n" not in msg and "param_dtype='float32'" in msg and "train.param_dtype='bfloat16'" in msg


def test_help_advertises_no_plan_precision_and_no_secondary_group():
  text = parameters_help()
  assert "train.param_dtype" in text and "train.compute_dtype" in text and "PLAN.reduce_dtype" in text
  assert "PLAN.param_dtype" not in text and "PLAN.compute_dtype" not in text and "secondary_group" not in text
  assert "train.pad_multiple" in text and "PLAN.pad_multiple" not in text  # a run setting


def test_the_runs_padding_is_the_plans_one_alignment():
  """`train.pad_multiple` reaches the plan's `Sharding.pad_multiple`; `Plan.alignment`, the layout's one
  input, is its lcm with the quantization blocks; a plan that sets its own is refused, not overridden."""
  assert trainer.with_run_settings(plans.zero3(), pad_multiple=256).alignment == 256
  assert trainer.with_run_settings(plans.zeropp(weight_block=64, grad_block=32, qgz_stages=3),
                                   pad_multiple=5).alignment == 5 * 192
  with pytest.raises(ValueError) as e:
    trainer.with_run_settings(plans.zero3(pad_multiple=3), pad_multiple=256)
  assert "\n" not in str(e.value) and "pad_multiple=3" in str(e.value) and "train.pad_multiple=256" in str(e.value)
  with pytest.raises(ValueError, match=r"pad_multiple=0 must be a whole number >= 1"):
    plans.zero3(pad_multiple=0)
