"""AMSP: the plan space runs, the cost and memory models agree with what the executor does, the solver
picks what the profile says is fastest among the plans that fit."""
import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

import zerojax
from zerojax import planner
from zerojax.executor.memory import memory_report
from zerojax.planner import cost
from zerojax.planner.solve import point_of
from tests import helpers


def test_space_holds_the_known_plans_and_only_nested_points():
  pts = planner.plan_space(2, 4)
  names = {p.name(8) for p in pts}
  assert {"dp", "zero1", "zero2", "zero3", "mics-2", "mics-4"} <= names
  assert len(pts) == 16  # pairs s_p | s_os over {1, 2, 4, 8}: 10, six of them with s_g ∈ {s_p, s_os} distinct
  for p in pts:
    assert p.s_g % p.s_p == 0 and p.s_os % p.s_g == 0 and p.s_g in (p.s_p, p.s_os)
  assert planner.degrees(4, 2) == [1, 2, 4, 8]
  assert planner.degrees(3, 4) == [1, 2, 4, 12]
  full = planner.plan_space(2, 4, techniques=True)
  assert full[0] == pts[0] and {p.base for p in full} == set(pts) and len(set(full)) == len(full)
  assert len({p.name(8) for p in full}) == len(full)


@pytest.fixture(scope="module")
def ref():
  return helpers.reference_case()


SPACE_2x4 = planner.plan_space(2, 4)
FAST_POINTS = [pt for pt in SPACE_2x4 if pt.name(8) == "amsp-p2-g4-os4"]  # s_p < s_g = s_os


@pytest.mark.parametrize("pt", helpers.sweep(SPACE_2x4, FAST_POINTS), ids=lambda p: p.name(8))
def test_every_point_runs_and_matches_single_device_grad(pt, ref):
  model, params, batch, want = ref
  plan = pt.plan(2, 4, param_dtype="float32")
  got, _ = helpers.sharded_grads(plan, zerojax.make_mesh(2, 4), model, params, batch)
  assert helpers.rel_l2(got, want) < 1e-5


@pytest.mark.parametrize("pt", helpers.sweep([planner.Point(1, 1, 1), planner.Point(2, 2, 8), planner.Point(8, 8, 8),
                                              planner.Point(4, 8, 8)], [planner.Point(4, 8, 8)]), ids=lambda p: p.name(8))
def test_memory_formula_matches_the_executor_and_the_compiled_program(pt, ref):
  """AMSP §IV-D: the formula's fp32 master + Adam moments per device equal the live state's shards
  (padding aside) and the compiled step's argument bytes (which add the batch and two scalars)."""
  model, params, batch, _ = ref
  ex = zerojax.Executor(model, optax.adam(1e-3), pt.plan(2, 4), zerojax.make_mesh(2, 4), accum_steps=2)
  state = ex.init_from_params(params)
  work = planner.workload(ex)
  mem = cost.model_state_bytes(pt, work, 4)
  live = memory_report(ex, state)["measured"]
  numel_padded = sum(l.padded * (l.layers or 1) for l in ex.layout.leaves)
  assert work.opt_bytes_per_param == 8
  assert live["master"] + live["optimizer"] == 12 * numel_padded // pt.s_os
  assert abs(mem["optimizer"] - (live["master"] + live["optimizer"])) <= 0.02 * mem["optimizer"]  # padding only
  compiled = ex.step_fn().lower(state, jax.device_put(batch, ex.batch_sharding)).compile()
  args = compiled.memory_analysis().argument_size_in_bytes
  batch_bytes = batch.nbytes // 8
  assert args - batch_bytes - (live["master"] + live["optimizer"]) in range(0, 64)  # step, skipped, Adam count


def synthetic_profile(nodes, gpus, *, intra=1e-9, inter=1e-7, alpha=1e-4):
  """α-β fits where a group that spans nodes is `inter / intra` times slower per byte."""
  world = nodes * gpus
  groups = {}
  for pt in planner.plan_space(nodes, gpus, techniques=True, lossy=True):
    for _, k, s in cost.groups_needed(pt, world, gpus):
      beta = inter if k * s > gpus else intra
      groups[cost.group_key(k, s)] = {op: {"alpha": alpha, "beta": beta} for op in cost.OPS}
  return {"mesh": {"nodes": nodes, "gpus": gpus}, "groups": groups}


def test_solver_follows_the_profile_and_the_cap():
  work = cost.Workload(units=((4096, 1), (65536, 4), (4096, 1)), accum=4, compute_s=0.1, activation_bytes=10**6)
  fast = planner.rank(2, 4, work, synthetic_profile(2, 4, inter=1e-9))    # flat network: no penalty to span
  slow = planner.rank(2, 4, work, synthetic_profile(2, 4, inter=1e-6))    # slow links between nodes
  best_slow = planner.choose(slow)
  # with slow links, per-micro-step traffic must stay inside a node: s_p and s_g within the node
  assert best_slow["s_p"] <= 4 and best_slow["s_g"] <= 4, best_slow
  assert best_slow["T_step"] <= min(r["T_step"] for r in slow if r["plan"] == "zero3")
  assert [r["T_step"] for r in slow] == sorted(r["T_step"] for r in slow)
  assert fast[0]["T_comm"] < best_slow["T_comm"]
  # a cap below the fastest plan's memory: the choice fits, and is the fastest that does
  cap = (slow[0]["bytes_per_device"] + min(r["bytes_per_device"] for r in slow)) / 2
  capped = planner.rank(2, 4, work, synthetic_profile(2, 4, inter=1e-6), memory_cap_bytes=cap)
  pick = planner.choose(capped, cap)
  assert pick["bytes_per_device"] <= cap and pick is [r for r in capped if r["fits"]][0]
  with pytest.raises(planner.PlanError, match=r"no plan fits .* the smallest, zero3\+offload, needs"):
    planner.choose(planner.rank(2, 4, work, synthetic_profile(2, 4), memory_cap_bytes=1.0), 1.0)


def test_offload_counts_device_bytes_against_the_cap_and_pays_the_host_link():
  """Under a cap, each plan over it is ranked again with its master weights and optimizer states in host
  memory: the device's bytes drop by exactly them, the step pays 2 x their bytes over the host link."""
  work = cost.Workload(units=((4096, 1), (65536, 4), (4096, 1)), accum=1, compute_s=0.1, activation_bytes=10**6,
                       host_link_bytes_per_s=1e9)
  plain = {r["plan"]: r for r in planner.rank(2, 4, work, synthetic_profile(2, 4))}
  assert not any(r["offload"] for r in plain.values())  # no cap: no offload rows
  cap = plain["dp"]["bytes_per_device"] - 1
  rows = planner.rank(2, 4, work, synthetic_profile(2, 4), memory_cap_bytes=cap)
  off = {r["plan"]: r for r in rows if r["offload"]}
  assert "dp+offload" in off and all(not r["fits"] for r in rows if r["plan"] + "+offload" in off)
  d, o = plain["dp"], off["dp+offload"]
  states = 12 * work.numel  # fp32 master + AdamW's two moments, unsharded under dp
  assert d["bytes_per_device"] - o["bytes_per_device"] == o["host_bytes_per_device"] == states
  # the step pays the streamed update's copies (the 16-bit weights stay on the device between steps): the two
  # directions at once, so more than one direction's bytes and less than both one after the other
  assert o["T_step"] - d["T_step"] == pytest.approx(o["T_offload"]) and o["T_offload"] > 0
  assert states / 1e9 < o["T_offload"] < 2 * states / 1e9
  assert o["fits"] and point_of(o).plan(2, 4).sharding.offload == ("opt_state", "master")


def test_offload_cost_by_hand():
  """`cost.offload_time` on a 4-chunk model (an embedding of 100 parameters, a scanned unit of 2 layers of
  1,000, a head of 100) at 1,000 bytes/s each way and 1 ms of update per parameter, computed by hand."""
  work = cost.Workload(units=((100, 1), (1000, 2), (100, 1)), accum=1, host_link_bytes_per_s=1e3,
                       update_s_per_param=1e-3, host_update_params_per_s=1e3)
  dp = planner.Point(1, 1, 1)
  both, states = dp.with_(offload=True), ("opt_state", "master")
  # streamed, master + moments (12 bytes per parameter each way): fetch = store = 1.2, 12, 12, 1.2 s and
  # update 0.1, 1, 1, 0.1 s per chunk. Chunk j's fetch waits on the fetch before it and the store of j - 2;
  # its update on its fetch and the update before; its store on its update and the store before:
  #   chunk 1: fetch ends 1.2, update 1.3, store 2.5
  #   chunk 2: fetch 1.2 + 12 = 13.2, update 14.2, store 26.2
  #   chunk 3: fetch max(13.2, 2.5) + 12 = 25.2, update 26.2, store 38.2
  #   chunk 4: fetch max(25.2, 26.2) + 1.2 = 27.4, update 27.5, store 38.2 + 1.2 = 39.4
  # less the update's own 2.2 s (in the plan's compute): 37.2 s. The 16-bit weights stay on the device between
  # steps; with fp32 weights the master's fetch before the forward (4 x 2,200 bytes: 8.8 s) adds to it, as it
  # does to the bulk fetch, one direction after the other: 8.8 + 2 x 26.4 = 61.6 s.
  assert cost.offload_time(both, work) == pytest.approx(39.4 - 2.2)
  fp32 = dataclasses.replace(work, param_bytes=4)
  assert cost.offload_time(both, fp32) == pytest.approx(39.4 - 2.2 + 8.8)
  assert cost.offload_time(both.with_(offload_update="bulk"), work) == pytest.approx(8.8 + 2 * 26.4)
  # the moments only (8 bytes each way): fetch = store = 0.8, 8, 8, 0.8 s; stores end 1.7, 17.8, 25.8, 26.6;
  # no master to fetch before the forward
  assert cost.offload_time(dp.with_(offload=("opt_state",)), work) == pytest.approx(26.6 - 2.2)
  # on the host: the 16-bit weights come (2 x 2,200 bytes: 4.4 s), the fp32 gradients go (8.8 s), the host
  # updates 2,200 parameters at 1,000/s (2.2 s) where the device's 2.2 s of update no longer run
  host = dp.with_(offload=True, offload_update="host")
  assert cost.offload_bytes(host, work)["to_device"] == 0
  assert cost.offload_time(host, work) == pytest.approx(4.4 + 8.8 + 2.2 - 2.2)
  # sharded over 8 devices, each moves and updates 1/8 of it
  z3 = planner.Point(8, 8, 8, offload=True)
  assert cost.offload_bytes(z3, work)["to_host"] == pytest.approx(12 * 2200 / 8)
  assert cost.offload_time(z3, work) == pytest.approx(cost.offload_time(both, work) / 8)
  assert cost.offload_time(dp, work) == 0 and point_of({"s_p": 1, "s_g": 1, "s_os": 1, "offload": True}) == both
  assert both.sharding.offload == states


def test_offload_is_ranked_only_where_memory_forces_it_or_it_costs_nothing():
  """A plan that fits the cap is not ranked with offload while offload costs time, and where it costs
  nothing (host memory that is the device's own: an infinite host link) its offloaded twin comes after it;
  a plan over the cap gets its offloaded twin, and on one device that twin is the choice."""
  work = cost.Workload(units=((4096, 1), (65536, 4), (4096, 1)), accum=1, compute_s=0.1, activation_bytes=10**6)
  plain = planner.rank(2, 4, work, synthetic_profile(2, 4))
  cap = sorted(r["bytes_per_device"] for r in plain)[len(plain) // 2]  # about half the plans fit
  for techniques in (False, True):
    rows = planner.rank(2, 4, work, synthetic_profile(2, 4), memory_cap_bytes=cap, techniques=techniques)
    names = [r["plan"] for r in rows]
    twins = [r for r in rows if r["offload"]]
    base = {r["plan"]: r for r in rows if not r["offload"]}
    assert twins and all(not base[r["plan"][:-len("+offload")]]["fits"] for r in twins)
    assert {n + "+offload" for n, r in base.items() if not r["fits"]} <= set(names)
  free = dataclasses.replace(work, host_link_bytes_per_s=float("inf"), update_s_per_param=0.0)
  rows = planner.rank(2, 4, free, synthetic_profile(2, 4))  # no cap: every plan fits
  names = [r["plan"] for r in rows]
  twins = [r for r in rows if r["offload"]]
  assert len(twins) == len(rows) // 2 and all(r["T_offload"] == 0 for r in twins)
  assert all(names.index(r["plan"][:-len("+offload")]) < names.index(r["plan"]) for r in twins)
  assert planner.choose(rows) is rows[0] and not rows[0]["offload"]
  # one device: one plan (its name on one device: zero3), over a cap that its offloaded twin fits
  one = planner.rank(1, 1, work, {"mesh": {"nodes": 1, "gpus": 1}, "groups": {}})
  dp = one[0]
  capped = planner.rank(1, 1, work, {"mesh": {"nodes": 1, "gpus": 1}, "groups": {}},
                        memory_cap_bytes=dp["bytes_per_device"] - 1)
  assert len(one) == 1 and [r["plan"] for r in capped] == [dp["plan"], dp["plan"] + "+offload"]
  assert planner.choose(capped, dp["bytes_per_device"] - 1) is capped[1] and capped[1]["offload"]


def test_cost_terms_follow_amsp_formulas():
  prof = synthetic_profile(2, 4, intra=1e-9, inter=1e-9, alpha=0.0)
  work = cost.Workload(units=((1000, 2),), accum=3)
  z3 = cost.comm_time(planner.Point(8, 8, 8), work, prof, 4)
  assert z3["T_p"] == pytest.approx(3 * 2 * 2 * (2 * 1000) * 1e-9)      # M x calls x (fwd + bwd) x 2 Φ_i
  assert z3["T_g"] == pytest.approx(3 * 2 * (4 * 1000) * 1e-9)          # M x calls x 4 Φ_i
  assert z3["T_os0"] == 0 and z3["T_os1"] == 0
  z1 = cost.comm_time(planner.Point(1, 1, 8), work, prof, 4)
  assert z1["T_p"] == 0 and z1["T_g"] == 0
  assert z1["T_os0"] == pytest.approx(4 * 2000 * 1e-9)                  # reduce-scatter of 4Φ over 8
  assert z1["T_os1"] == pytest.approx(2 * 2000 * 1e-9)                  # gather of 2Φ over 8
  dp = cost.comm_time(planner.Point(1, 1, 1), work, prof, 4)
  assert dp["T_os0"] == pytest.approx(4 * 2000 * 1e-9)                  # all-reduce of 4Φ over 8


def test_profile_from_another_cluster_is_refused(tmp_path):
  path = tmp_path / "p.json"
  path.write_text(json.dumps({"mesh": {"nodes": 4, "gpus": 2}, "groups": {}}))
  with pytest.raises(planner.PlanError, match=r"measured on 4 nodes x 2 gpus, but this cluster is 2 x 4"):
    planner.load_profile(str(path), 2, 4)


def test_profiler_measures_every_group_on_this_mesh():
  from zerojax.planner import profile as profile_lib
  mesh = zerojax.make_mesh(2, 4)
  prof = profile_lib.profile(mesh, [4096, 65536], reps=1)
  needed = {cost.group_key(k, s) for pt in planner.plan_space(2, 4, techniques=True, lossy=True)
            for _, k, s in cost.groups_needed(pt, 8, 4)}
  assert set(prof["groups"]) == needed
  for g in prof["groups"].values():
    for op in cost.OPS:
      assert g[op]["alpha"] >= 0 and g[op]["beta"] >= 0 and len(g[op]["points"]) == 2
  assert prof["groups"]["4@2"]["axes"] == ["node", "gpu.4"]  # replicas of a degree-2 shard: stride 2
  work = cost.Workload(units=((4096, 1),), accum=1)
  rows = planner.rank(2, 4, work, prof)
  assert len(rows) == 16 and all(np.isfinite(r["T_step"]) for r in rows)


@pytest.mark.slow  # auto's choice in the fast suite: test_planner_space.py
def test_auto_in_the_trainer_picks_a_plan_from_the_profile_and_a_plan_under_the_cap(tmp_path, capsys):
  """`train.plan = @auto()`: the trainer builds the planner's choice (here: a profile whose cross-node
  links are 1000x slower keeps every per-micro-step collective inside the node)."""
  import gin
  from zerojax.train import trainer
  path = tmp_path / "profile.json"
  path.write_text(json.dumps(synthetic_profile(2, 4, intra=1e-10, inter=1e-7)))
  gin.clear_config()
  gin.parse_config(["model_config.d_model = 32", "model_config.num_layers = 2", "model_config.seq_len = 16"])
  try:
    built = trainer.build(planner.auto(profile=str(path), compute="uniform", techniques=False, trials=0), 2,
                          accum_steps=2, batch_size=8)
    ex, rows = built.executor, built.planner_rows
    assert ex.plan.name == rows[0]["plan"] and rows == sorted(rows, key=lambda r: r["T_step"])
    assert rows[0]["s_g"] <= 4 and rows[0]["s_p"] <= 4
    assert all(a in ex.mesh.axis_names for a in ex.plan.sharding.grad_axes)
    # the memory-cap demo: a cap just below MiCS's (group = node) need; auto picks a plan that fits and says
    # which faster plans the cap ruled out
    mics = next(r for r in rows if r["plan"] == "mics-4")
    cap_gb = mics["bytes_per_device"] * (1 - 1e-6) / 2**30
    capsys.readouterr()
    capped = trainer.build(planner.auto(profile=str(path), memory_cap_gb=cap_gb, compute="uniform",
                                        techniques=False, trials=0), 2, accum_steps=2, batch_size=8)
    capped_plan = capped.executor.plan
  finally:
    gin.clear_config()
  log = capsys.readouterr().out
  pick = next(r for r in capped.planner_rows if r["plan"] == capped_plan.name)
  assert pick["fits"] and pick["bytes_per_device"] <= cap_gb * 2**30 and capped_plan.name != "mics-4"
  assert pick is next(r for r in capped.planner_rows if r["fits"])
  line = next(m for m in log.splitlines() if m.startswith("zerojax: auto chose"))
  assert f"auto chose {capped_plan.name}: fastest predicted step" in line and "over the cap" in line
  # the line names the faster plans over the cap (with the cap, plans over it are also ranked with offload:
  # here an offloaded twin, whose host link costs this tiny model nothing, is the fastest that fits)
  ruled_out = [r for r in capped.planner_rows[:capped.planner_rows.index(pick)] if not r["fits"]]
  assert ruled_out and all(r["bytes_per_device"] > cap_gb * 2**30 for r in ruled_out)
  assert all(f"{r['plan']} {r['bytes_per_device'] / 2**30:.4f} GiB" in line for r in ruled_out[:4]), line


@pytest.mark.slow  # the ranking in the fast suite: test_planner_space.py
def test_plan_command_ranks_a_gin_config(tmp_path, capsys):
  import gin
  from zerojax.cli import plan as plan_cli
  path = tmp_path / "profile.json"
  path.write_text(json.dumps(synthetic_profile(2, 4, intra=1e-10, inter=1e-7)))
  gin.clear_config()
  try:
    plan_cli.main(["--gin_file=configs/zero3.gin", "--compute=anchors", "--gin_param=model_config.d_model=32",
                   "--gin_param=model_config.num_layers=2", "--gin_param=model_config.seq_len=16",
                   "--gin_param=train.batch_size=8", f"--profile={path}", "--json", "--degrees_only"])
  finally:
    gin.clear_config()
  out = json.loads(capsys.readouterr().out)
  table = out["compute"]
  assert table["mode"] == "anchors" and set(table["measured"]) == {"dp", "zero1", "zero2", "zero3"}
  assert table["dp_s"] > 0 and all(v > 0 for v in table["temp_bytes"].values()) and len(out["rows"]) == 16
  assert out["chosen"] == out["rows"][0]["plan"]
  lo, hi = min(table["measured"].values()), max(table["measured"].values())
  for r in out["rows"]:  # fitted on the four anchors (exact on them unless a coefficient came out negative)
    assert lo / 2 <= r["compute_s"] <= 2 * hi
    assert r["T_step"] == pytest.approx(r["compute_s"] + r["T_comm"])
    assert r["T_step_uniform"] >= table["dp_s"]


def test_eq7_option_changes_the_space_as_the_paper_counts():
  """AMSP §V-B, Eq. 7: on 128 x 8 the rule leaves 121 of the 688 nested points with s_g ∈ {s_p, s_os}."""
  on, off = planner.plan_space(128, 8), planner.plan_space(128, 8, eq7=False)
  assert (len(on), len(off)) == (121, 688) and off[:121] == on
  for pt in off[121:]:
    meshes = pt.meshes(8)
    assert any(s1 > 1 and s0 < 8 for s0, s1 in meshes), pt   # breaks Eq. 7
    for k in (0, 1):                                          # nested per mesh axis (§IV-B)
      assert meshes[2][k] % meshes[1][k] == 0 and meshes[1][k] % meshes[0][k] == 0
  extra = planner.plan_space(2, 4, eq7=False)[16:]
  assert len(extra) == 14 and "amsp-p2x1-g2x2-os2x2" in {p.name(8) for p in extra}
  with pytest.raises(ValueError, match=r"amsp-p2x1-g2x2-os2x2 breaks AMSP's node-spanning rule \(Eq. 7\)"):
    next(p for p in extra if p.name(8) == "amsp-p2x1-g2x2-os2x2").plan(2, 4)


def test_compute_anchor_fit_and_the_step_combination():
  from zerojax.planner import compute

  work = cost.Workload(units=((1000, 2), (500, 1)), accum=3)
  coef = np.array([0.5, 1e-4, 2e-6, 3e-6])
  pts = planner.plan_space(2, 4)
  measured = {p: compute.predict(coef, p, work) for p in compute.anchors(8)}
  fitted = compute.fit(measured, work)
  for p in pts:   # a compute that is linear in the features is recovered from the four anchors alone
    assert compute.predict(fitted, p, work) == pytest.approx(compute.predict(coef, p, work), rel=1e-6)
  assert compute.predict(coef, planner.Point(2, 2, 8), work) > compute.predict(coef, planner.Point(1, 1, 8), work)
  assert cost.step_time(2.0, 0.5) == 2.5 and cost.step_time(2.0, 0.5, "full") == 2.0
  with pytest.raises(ValueError, match="overlap='some'"):
    cost.step_time(1.0, 1.0, "some")
  with pytest.raises(ValueError, match="compute mode 'fast'"):
    compute.per_plan(None, pts, 2, 4, work, None, mode="fast")
  # a compute measured in this process holds the collectives inside a node: only node-spanning ones are added
  prof = synthetic_profile(2, 4, intra=1e-9, inter=1e-7)
  mics = cost.comm_time(planner.Point(4, 4, 4), work, prof, 4, spanning_only=True)
  assert mics["T_p"] == 0 and mics["T_g"] == 0 and mics["T_os1"] == 0 and mics["T_os0"] > 0
  full = cost.comm_time(planner.Point(4, 4, 4), work, prof, 4)
  assert full["T_p"] > 0 and full["T_os0"] == mics["T_os0"]


def test_paper_cluster_profile_and_table_iv_choices_are_reproducible():
  """The A800 profile is the link-figure model's output, and the planner's LLaMA choices on it are fixed."""
  import importlib.util
  import pathlib

  from zerojax.planner import links
  path = pathlib.Path(planner.__file__).parent / "profiles" / "amsp_a800_128x8.json"
  assert json.loads(path.read_text()) == json.loads(json.dumps(links.amsp_a800()))
  with pytest.raises(planner.PlanError, match=r"measured on 128 nodes x 8 gpus, but this cluster is 2 x 4"):
    planner.load_profile(str(path), 2, 4)
  g = links.amsp_a800()["groups"]
  assert g["8@1"]["all_gather"]["beta"] == pytest.approx(7 / 8 / 200e9)          # NVLink ring inside a node
  assert g["128@8"]["all_reduce"]["beta"] == pytest.approx(2 * 8 * 127 / 128 / 100e9)  # 8 rings share 4 x HDR
  spec = importlib.util.spec_from_file_location("bench_amsp_paper", pathlib.Path(__file__).parents[1] /
                                                "benchmarks" / "bench_amsp_paper.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  for model, want in (("LLaMA-7B", 6.74e9), ("LLaMA-13B", 13.0e9), ("LLaMA-30B", 32.5e9)):
    assert bench.workload(model, 1024).numel == pytest.approx(want, rel=0.01)
  rep = bench.report(1024, planner.load_profile(str(path), 128, 8))
  assert rep == bench.report(1024, planner.load_profile(str(path), 128, 8))
  chosen = {m: r["chosen"]["degrees"] for m, r in rep["models"].items()}
  assert chosen == {"LLaMA-7B": "(1,1,64)", "LLaMA-13B": "(1,16,16)", "LLaMA-30B": "(1,64,64)"}
  for r in rep["models"].values():
    assert r["chosen"]["fits"] and r["chosen"]["bytes_per_device"] <= 80e9
    assert r["chosen"]["T_step"] <= r["paper"]["T_step"] and r["paper"]["fits"]
  md = bench.markdown([rep])
  assert all(f"| 1024 | {m} | {c} |" in md for m, c in chosen.items())
