"""Registers the plan constructors with gin, so configs can say `train.plan = @zero3()`, and Radius's
replica sync (`mics.replica_sync = @radius()`, `radius.density = 0.1`) and DiLoCo's outer sync
(`mics.outer_sync = @diloco()`, `diloco.every = 50`).

The run's settings (`param_dtype`, `compute_dtype`, `pad_multiple`) are set once by `train.param_dtype`,
`train.compute_dtype` and `train.pad_multiple` for every plan (the planner's included): the constructors
refuse them in gin, so no setting is silently replaced by another."""
import gin

from zerojax import plan, planner

RUN_SETTINGS = ["param_dtype", "compute_dtype", "pad_multiple"]

for _name, _fn in plan.PLANS.items():
  gin.external_configurable(_fn, name=_name, denylist=RUN_SETTINGS)

gin.external_configurable(plan.amsp, name="amsp", denylist=RUN_SETTINGS)
gin.external_configurable(planner.auto, name="auto")
gin.external_configurable(plan.radius, name="radius")
gin.external_configurable(plan.diloco, name="diloco")
