"""Registers the plan constructors with gin, so configs can say `train.plan = @zero3()`, and Radius's
replica sync (`mics.replica_sync = @radius()`, `radius.density = 0.1`)."""
import gin

from zerojax import plan, planner

for _name, _fn in plan.PLANS.items():
  gin.external_configurable(_fn, name=_name)

gin.external_configurable(plan.amsp, name="amsp")
gin.external_configurable(planner.auto, name="auto")
gin.external_configurable(plan.radius, name="radius")
