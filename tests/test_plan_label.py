"""One label per plan (`zerojax.plan.Plan.label`, each value naming its part): every shipped config gets its
own, Radius is named, and the planner's stored ids are spelled from the same pieces. Plans only: nothing is
built or compiled."""
import dataclasses

import pytest

from tests import golden_configs
from zerojax.mesh import factor, make_mesh
from zerojax.plan import Plan, amsp, diloco, dp, mics, radius, zero3, zeropp
from zerojax.planner import auto
from zerojax.planner.space import Point

CONFIGS = {  # every config in configs/ (base.gin aside) and its label, as gin builds its plan
    "auto": "auto", "dp": "dp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
    "zero3_bf16grad": "zero3+grads(bfloat16)", "qwz": "zero3+qwZ(int8)", "hpz": "zero3+hpZ(gpu)",
    "qgz": "zero3+qgZ(int4)", "zeropp": "zero3+qwZ(int8)+hpZ(gpu)+qgZ(int4)",
    "zeropp_int4": "zero3+qwZ(int4,block=64)+hpZ(gpu)+qgZ(int8/int4)", "mics": "mics(group=gpu)",
    "mics_qwz": "mics(group=gpu)+qwZ(int8)", "mics_radius": "mics(group=gpu)+radius(d=0.4,T=20,dense=40)",
    "mics_2node": "mics(group=8)+hier", "mics_hpz": "mics(group=8)+hier+hpZ(gpu)",
    "mics_qgz": "mics(group=8)+hier+qgZ(int8)", "diloco_mics": "mics(group=gpu)+diloco(H=10,lr=0.6,m=0.0)"}


@pytest.fixture(scope="module")
def config_plans():
  return golden_configs.plans()


def on_mesh(plan):
  """The plan as an executor on 2 x 4 devices holds it (`Plan.resolve` on the mesh factored for its groups)."""
  return plan.resolve(factor(make_mesh(2, 4), plan.groups()))


def test_every_shipped_config_has_its_own_label(config_plans):
  labels = {name: plan.label() for name, plan in config_plans.items()}
  assert labels == CONFIGS, "a config was added or its label changed: list it in CONFIGS"
  assert len(set(labels.values())) == len(labels)
  assert labels["mics_radius"].startswith(labels["mics"] + "+radius(")  # Radius §4 is named, on MiCS
  plan = config_plans["diloco_mics"]
  overlapped = dataclasses.replace(plan, sync=dataclasses.replace(
      plan.sync, outer_sync=diloco(every=10, fragments=4, overlap=True)))
  assert overlapped.label() == "mics(group=gpu)+diloco(H=10,F=4,overlap(mix=0.5))"


def test_resolved_configs_keep_distinct_labels(config_plans):
  """What the trainer labels is the executor's plan, resolved on its mesh: a group of 8 on 2 x 4 devices is
  ZeRO-3's sharding, its hierarchical gather still tells it apart."""
  labels = {n: on_mesh(p).label() for n, p in config_plans.items() if n != "auto"}
  assert len(set(labels.values())) == len(labels), labels
  assert labels["mics_2node"] == "zero3+hier" and labels["mics"] == "mics(group=gpu)"
  assert labels["mics_radius"] == CONFIGS["mics_radius"] and labels["zeropp"] == CONFIGS["zeropp"]


@pytest.mark.parametrize("plan,expect", [
    (zero3(), "zero3"),
    (zeropp(), "zero3+qwZ(int8)+hpZ(gpu)+qgZ(int4)"),
    (mics(group_size=4), "mics(group=4)"),
    (mics(replica_sync=radius(density=0.1, period=50)), "mics(group=gpu)+radius(d=0.1,T=50)"),
    (dp(replica_sync=radius()), "dp+radius(d=0.4,T=200)"),
    (amsp(2, 4, 8), "amsp(p=2,g=4,os=8)"),
    (amsp(2, 8, 8, weight_bits=8, grad_bits=4), "amsp(p=2,g=8,os=8)+qwZ(int8)+qgZ(int4)"),
    (Plan(param_axes=("gpu",)), "shard(p=gpu,g=node*gpu,os=node*gpu)"),
    (zeropp(weight_bits=4, weight_block=0, secondary_axes=None, grad_bits=8), "zero3+qwZ(int4,per-shard)+qgZ(int8)"),
    (zeropp(grad_bits=(8, 4), rotate=True, grad_error_feedback=True, stochastic_rounding=True),
     "zero3+qwZ(int8,rot)+hpZ(gpu)+qgZ(int8/int4,rot,ef,sr)"),
    (zero3(weight_format="float8_e4m3fn"), "zero3+gather(float8_e4m3fn)"),
    (zeropp(rotate=True, grad_bits=None, grad_format="float8_e4m3fn"),  # each value names its own rotation:
     "zero3+qwZ(int8,rot)+hpZ(gpu)+qgZ(fp8)"),                          # float8 hops are not rotated
    (zero3(param_dtype="float32", weight_bits=8, quantize_backward_gather=False),
     "zero3+params(float32)+qwZ(int8,fwd-only)"),
    (zero3(reduce_dtype="bfloat16", reduce_via="reduce_scatter"), "zero3+grads(bfloat16,reduce_scatter)"),
    (zero3(prefetch=True, remat="dots", kernel_backend="xla"), "zero3"),  # same sums: not in the label
    (Point(8, 8, 8, hierarchical=True, grad_bits=8).plan(2, 4), "mics(group=8)+hier+qgZ(int8)"),  # groups by size
    (auto(), "auto"),
])
def test_label(plan, expect):
  assert plan.label() == expect


@pytest.mark.parametrize("point,name,resolved", [  # ids as benchmarks/planner.json and the tests store them
    (Point(8, 8, 8, weight_bits=8, hpz=True, grad_bits=4), "zeropp", CONFIGS["zeropp"]),
    (Point(8, 8, 8, hierarchical=True, weight_bits=8, hpz=True, grad_bits=4), "zero3+hier+qwz8+hpz+qgz4",
     "zero3+hier+qwZ(int8)+hpZ(gpu)+qgZ(int4)"),
    (Point(1, 1, 1), "dp", "dp"),
    (Point(1, 8, 8, grad_bits=4), "zero2+qgz4", "zero2+qgZ(int4)"),
    (Point(1, 1, 4, reduce16=True), "amsp-p1-g1-os4+bf16grad", "shard(p=1,g=1,os=gpu)+grads(bfloat16)"),
    (Point(2, 2, 2, weight_bits=8), "mics-2+qwz8", "mics(group=gpu.2)+qwZ(int8)"),
    (Point(4, 4, 4, radius=True), "mics-4+radius", "mics(group=gpu)+radius(d=0.4,T=200)"),
    (Point(8, 8, 8, weight_bits=4, grad_bits=(8, 4)), "zero3+qwz4+qgz8-4", "zero3+qwZ(int4)+qgZ(int8/int4)"),
    (Point(4, 8, 8, hierarchical=True, weight_bits=8, hpz=True, grad_bits=4), "amsp-p4-g8-os8+hier+qwz8+hpz+qgz4",
     None),  # a 4 x 2 cluster's point
    (Point(4, 4, 8, intra=(2, 2, 4)), "amsp-p2x2-g2x2-os4x2", None),
])
def test_planner_ids_keep_their_stored_form(point, name, resolved):
  """The planner's short ids are unchanged, and the label of a point's plan, as the executor resolves it
  on a 2 x 4 mesh, names the same sharding and techniques."""
  assert point.name(8) == name
  if resolved:
    assert on_mesh(point.plan(2, 4)).label() == resolved
