"""The planner's whole space: every plan a user picks by name is in it, the techniques are priced so that
ZeRO++ wins where it should, lossy techniques only when allowed, and the pruned search is exact and small."""
import dataclasses
import json

import pytest

import zerojax
from zerojax import mesh as mesh_lib, planner
from zerojax import plan as plans
from zerojax.planner import cost, links, trial
from tests import golden_configs, helpers

def same_plan(a: plans.Plan, b: plans.Plan, mesh) -> bool:
  """Whether two plans shard and communicate alike on `mesh` (names and schedule options aside)."""
  m = mesh_lib.factor(mesh, tuple(sorted(set(a.groups()) | set(b.groups()))))
  ra, rb = a.resolve(m), b.resolve(m)
  sets = lambda p: [frozenset(p.settings()[f] or ()) for f in ("param_axes", "grad_axes", "opt_axes", "secondary_axes")]
  fields = lambda p: (p.gather.hierarchical, p.gather.weight_bits, p.reduction.hop_bits, p.reduction.reduce_dtype,
                     p.sync.replica_sync is not None)
  return sets(ra) == sets(rb) and fields(ra) == fields(rb)


@pytest.fixture(scope="module")
def config_plans():
  """The plan of every shipped config (`configs/*.gin`, as train.py's gin builds it), auto's aside."""
  return {n: p for n, p in golden_configs.plans().items() if n != "auto"}


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_space_contains_every_named_plan(shape, config_plans):
  """Every shipped config's plan is a point of the space (`Point.of`) that runs as the config does."""
  nodes, gpus = shape
  mesh = zerojax.make_mesh(nodes, gpus)
  named = {name: planner.Point.of(p, nodes, gpus) for name, p in config_plans.items()}
  safe, lossy = (set(planner.plan_space(nodes, gpus, techniques=True, lossy=x)) for x in (False, True))
  for name, pt in named.items():
    assert pt in lossy, name
    assert (pt in safe) == (not pt.lossy), name  # int4 weights, Radius and DiLoCo only with lossy
    assert same_plan(pt.plan(nodes, gpus), config_plans[name], mesh), name
  assert named["zeropp"].name(nodes * gpus) == "zeropp" and named["zero3"].name(nodes * gpus) == "zero3"
  assert named["mics"].name(nodes * gpus) == f"mics-{gpus}"
  assert named["mics_radius"].lossy and named["diloco_mics"].lossy and named["zeropp_int4"].lossy
  assert not same_plan(named["zeropp"].plan(nodes, gpus), plans.zero3(), mesh)  # the comparison can fail
  # auto's trials run ZeRO-3, ZeRO++ and MiCS from their constructors: the configs' points
  assert trial.baselines(nodes, gpus) == [named[n] for n in trial.BASELINES]


def test_a_plan_the_cluster_cannot_run_has_no_point(config_plans):
  """The points of one node: hpZ and per-hop bits run as the space spells them there; a group of two nodes
  or DiLoCo across one node is refused."""
  assert planner.Point.of(config_plans["zeropp"], 1, 8) == planner.Point(8, 8, 8, weight_bits=8, grad_bits=4)
  assert planner.Point.of(config_plans["zeropp_int4"], 1, 8) == planner.Point(8, 8, 8, weight_bits=4, grad_bits=8)
  assert planner.Point.of(config_plans["hpz"], 1, 8) == planner.Point(8, 8, 8)
  with pytest.raises(ValueError, match="param_axes=8 is not a valid group of the 1 x 4 mesh"):
    planner.Point.of(config_plans["mics_2node"], 1, 4)
  with pytest.raises(ValueError, match="diloco=True does not apply"):
    planner.Point.of(config_plans["diloco_mics"], 1, 8)


@pytest.mark.slow
def test_a_technique_point_runs_like_the_named_plan():
  """ZeRO++'s techniques with MiCS's hierarchical gather, a combination no named plan has: the gradient
  the optimizer sees is the named ZeRO++'s (the gather's order changes no value), which is single-device
  jax.grad's up to int8 weights and int4 gradients (on this tiny model, within 0.35 relative L2)."""
  model, params, batch, want = helpers.reference_case()
  pt = planner.Point(8, 8, 8, weight_bits=8, hpz=True, hierarchical=True, grad_bits=4)
  assert pt in planner.plan_space(2, 4, techniques=True)
  mesh = zerojax.make_mesh(2, 4)
  got, _ = helpers.sharded_grads(pt.plan(2, 4, param_dtype="float32"), mesh, model, params, batch)
  named, _ = helpers.sharded_grads(plans.zeropp(param_dtype="float32"), mesh, model, params, batch)
  assert helpers.rel_l2(got, named) < 1e-6
  assert helpers.rel_l2(named, want) < 0.35


WORK = cost.Workload(units=((4096 * 64, 1), (65536 * 64, 4), (4096 * 64, 1)), accum=1, compute_s=0.1)


def slow_links(nodes=2, gpus=4, b_node=1e9):
  """NVLink-class links inside a node, 1 GB/s per node between nodes (`planner.links`)."""
  return links.link_profile(nodes, gpus, b_gpu=200e9, b_node=b_node, source="test: slow links between nodes")


def test_zeropp_wins_where_inter_node_links_are_slow():
  """ZeRO++'s regime (ZeRO++ §1, §5): slow links between nodes, one micro-batch per step. Its int8
  forward gather, in-node backward gather and int4 gradients beat every other plan in the space."""
  rows = planner.rank(2, 4, WORK, slow_links(), techniques=True)
  best = planner.choose(rows)
  assert best["plan"] == "zeropp", [r["plan"] for r in rows[:5]]
  degrees = planner.choose(planner.rank(2, 4, WORK, slow_links()))  # AMSP's degrees alone
  by = {r["plan"]: r for r in planner.rank(2, 4, WORK, slow_links(), techniques=True, prune=False)}
  assert best["T_step"] < min(degrees["T_step"], by["zero3"]["T_step"], by["mics-4"]["T_step"])
  # a fast network: quantizing does not pay, ZeRO++ is not chosen
  assert planner.choose(planner.rank(2, 4, WORK, slow_links(b_node=100e9), techniques=True))["plan"] != "zeropp"


def test_quantization_compute_is_charged():
  """qwZ/qgZ's kernels cost time (`Workload.quant_s_per_element`): expensive enough, ZeRO++ loses."""
  zpp = planner.Point.of(plans.zeropp(), 2, 4)
  assert cost.quant_elements(zpp, WORK, 4) > 0 and cost.quant_elements(zpp.base, WORK, 4) == 0
  slow_kernels = dataclasses.replace(WORK, quant_s_per_element=1e-7)
  rows = planner.rank(2, 4, slow_kernels, slow_links(), techniques=True)
  assert rows[0]["plan"] != "zeropp" and rows[0]["T_quant"] < min(r["T_quant"] for r in rows if r["weight_bits"])


def test_lossy_switch():
  """Radius, DiLoCo and int4 weights are ranked only with lossy=True; where the replica all-reduce
  dominates (accumulation 4, slow links) the lossy search takes DiLoCo (the outer gradient once every H
  steps), and Radius is ranked above every safe plan too; the default search can take neither."""
  work = dataclasses.replace(WORK, accum=4)
  safe = planner.rank(2, 4, work, slow_links(), techniques=True)
  lossy = planner.rank(2, 4, work, slow_links(), techniques=True, lossy=True)
  assert not any(r["radius"] or r["diloco"] or r["weight_bits"] == 4 for r in safe)
  assert any(r["weight_bits"] == 4 for r in lossy)
  assert lossy[0]["diloco"] and lossy[0]["T_step"] < safe[0]["T_step"]
  best_radius = next(r for r in lossy if r["radius"])
  assert best_radius["T_step"] < safe[0]["T_step"]
  assert not any(p.lossy for p in planner.plan_space(2, 4, techniques=True))
  assert planner.solve.point_of(lossy[0]).plan(2, 4).sync.outer_sync is not None
  assert planner.solve.point_of(best_radius).plan(2, 4).sync.replica_sync is not None
  assert all(r["s_os"] == 4 and r["s_p"] <= 4 for r in lossy if r["diloco"])  # MiCS with one node per group


def test_a_point_is_its_degrees_and_the_plan_settings_of_its_techniques():
  """A point holds its shard degrees and the `Plan` settings its techniques change (`space.TECHNIQUES`);
  each technique is read from the plan value that owns it, a ranked row spells it as a column, and the
  row, also read back from JSON, gives the same point."""
  pt = planner.Point(8, 8, 8, weight_bits=8, hpz=True, grad_bits=(8, 4))
  assert pt.settings == (("grad_bits", (8, 4)), ("secondary_axes", ("gpu",)), ("weight_bits", 8))
  assert pt == planner.Point(8, 8, 8, secondary_axes=("gpu",), weight_bits=8, grad_bits=[8, 4], hierarchical=False)
  assert (pt.gather.weight_bits, pt.gather.secondary_axes, pt.reduction.hop_bits) == (8, ("gpu",), (8, 4))
  assert pt.with_(hpz=False, radius=True) == planner.Point(8, 8, 8, weight_bits=8, grad_bits=(8, 4),
                                                           replica_sync=plans.radius())
  assert pt.base == planner.Point(8, 8, 8) and pt.base.settings == ()
  with pytest.raises(TypeError, match=r"hpx=True is neither a technique"):
    planner.Point(8, 8, 8, hpx=True)
  every = planner.rank(2, 4, WORK, slow_links(), techniques=True, lossy=True, prune=False)
  cap = sorted(r["bytes_per_device"] for r in every)[len(every) // 2]
  rows = planner.rank(2, 4, WORK, slow_links(), techniques=True, lossy=True, prune=False, memory_cap_bytes=cap)
  points = [planner.solve.point_of(r) for r in rows]
  for r, p in zip(rows, points):
    g, red, sync = p.gather, p.reduction, p.sync
    assert (r["weight_bits"], r["hpz"], r["hierarchical"]) == (g.weight_bits, g.secondary_axes is not None,
                                                               g.hierarchical)
    assert (r["grad_bits"], r["grad_format"], r["reduce16"]) == (red.grad_bits, red.grad_format,
                                                                 red.reduce_dtype == "bfloat16")
    assert (r["radius"], r["diloco"], r["offload"]) == (sync.replica_sync is not None, sync.outer_sync is not None,
                                                        bool(p.sharding.offload))
  assert any(r["offload"] for r in rows) and any(r["diloco"] for r in rows) and any(r["grad_format"] for r in rows)
  back = [planner.solve.point_of(r) for r in json.loads(json.dumps(rows))]
  assert back == points and [p.name(8) for p in back] == [r["plan"] for r in rows]
  assert {p for p in back if not p.sharding.offload} == set(planner.plan_space(2, 4, techniques=True, lossy=True))


@pytest.mark.parametrize("lossy", [False, True])
def test_pruned_search_is_exact(lossy):
  """Pruning keeps the best row under any memory cap: the pruned and the full search choose alike."""
  prof = slow_links()
  for accum in (1, 4):
    work = dataclasses.replace(WORK, accum=accum)
    full = planner.rank(2, 4, work, prof, techniques=True, lossy=lossy, prune=False)
    assert len(full) == len(planner.plan_space(2, 4, techniques=True, lossy=lossy))
    sizes = sorted({r["bytes_per_device"] for r in full})
    for cap in sizes[:: max(1, len(sizes) // 8)]:
      want = planner.choose(planner.rank(2, 4, work, prof, techniques=True, lossy=lossy, prune=False,
                                         memory_cap_bytes=cap), cap)  # with the offload twins of rows over the cap
      got = planner.choose(planner.rank(2, 4, work, prof, techniques=True, lossy=lossy, memory_cap_bytes=cap), cap)
      assert got["T_step"] == want["T_step"] and got["bytes_per_device"] <= cap


def test_search_at_1024_gpus_is_pruned_and_exact():
  """AMSP's cluster, 128 x 8: the space of every technique has thousands of points; the pruned search
  ranks a few hundred and chooses what the full search chooses."""
  prof = links.amsp_a800()
  work = cost.Workload.transformer(layers=32, d_model=4096, d_ff=11008, vocab=32000, accum=1, compute_s=1.0)
  space = planner.plan_space(128, 8, techniques=True, lossy=True)
  rows = planner.rank(128, 8, work, prof, techniques=True, lossy=True)
  full = planner.rank(128, 8, work, prof, techniques=True, lossy=True, prune=False)
  assert len(full) == len(space) > 5000 and len(rows) < len(space) / 10
  assert rows[0]["T_step"] == full[0]["T_step"]
