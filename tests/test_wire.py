"""The wire: collective accounting of real compiled train steps (ZeRO++ Table 1) and the cluster emulator."""
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess

import gin
import jax
import pytest

import zerojax
from zerojax import analysis, plan as plans
from zerojax.models.gpt import GPTConfig, gpt
from zerojax.train.optim import make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = GPTConfig(seq_len=16, d_model=64, num_heads=2, num_layers=2)
NODES, GPUS = 2, 4
# Table 1's comparison: 16-bit weights and gradients on the wire for ZeRO-3, the gradients by one ring
# reduce-scatter (`reduce_via="reduce_scatter"`) as in the paper's Table 1 and DeepSpeed on GPUs. XLA:CPU
# widens that bf16 reduce-scatter to fp32; the analysis counts it in bf16, as a GPU sends it.
ZERO3 = dict(param_dtype="bfloat16", reduce_dtype="bfloat16")


def executor(plan, mesh=None, accum_steps=1, cfg=CFG):
  mesh = mesh or zerojax.make_mesh(NODES, GPUS)
  return zerojax.Executor(gpt(cfg), make_optimizer(total_steps=10), dataclasses.replace(plan, pad_multiple=256),
                          mesh, accum_steps=accum_steps)


_CACHE = {}


def step(name, plan, accum_steps=1):
  """(executor, collectives of its compiled step), compiled once per test session."""
  if name not in _CACHE:
    ex = executor(plan, accum_steps=accum_steps)
    _CACHE[name] = ex, analysis.step_collectives(ex, (accum_steps, 16, CFG.seq_len + 1))
  return _CACHE[name]


def zero3():
  return step("zero3", plans.zero3(**ZERO3, reduce_via="reduce_scatter"))


def zero3_16bit():
  """ZeRO-3 with 16-bit gradients as the executor runs it by default (`reduce_via="auto"`)."""
  return step("zero3_16bit", plans.zero3(**ZERO3))


def zeropp():
  return step("zeropp", plans.zeropp(param_dtype="bfloat16"))


def by_role(found, role):
  return [c for c in found if c.role == role]


def one_node(groups):
  return all(len({d // GPUS for d in g}) == 1 for g in groups)


def unit_chunks(ex):
  """Packed per-device chunk length of each unit (elements): tells a unit's collectives apart."""
  chunks = {}
  for unit, tree in ex.layout.tree().items():
    chunks[unit] = sum(l.padded // ex.world for l in jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "padded")))
  assert len(set(chunks.values())) == len(chunks), chunks
  return chunks


@pytest.mark.slow  # Table 1 structure in the fast suite: test_zeropp_table1_structure
def test_zero3_table1_structure():
  _, found = zero3()
  fwd, bwd, red = (by_role(found, r) for r in analysis.TABLE1_ROLES)
  assert fwd and bwd and red
  assert {c.op for c in fwd + bwd} == {"all-gather"} and {c.op for c in red} == {"reduce-scatter"}
  for c in fwd + bwd + red:
    assert c.axes == ("node", "gpu") and c.replica_groups == (tuple(range(8)),), c
    # bf16 parameters travel as their raw 16-bit words (comm.all_gather_raw); gradients as bf16
    assert c.dtype == ("u16" if c.op == "all-gather" else "bf16"), c
  assert {c.role for c in found} <= {*analysis.TABLE1_ROLES, "metrics"}


def test_zero3_one_gather_each_way_and_one_reduce_scatter_per_unit():
  """Per unit: one forward all-gather, one backward all-gather and one reduce-scatter (per layer for
  the scanned blocks), with two exceptions that XLA is right to make: the embedding's backward needs
  no weights (its VJP scatters the cotangent), so its re-gather is dead code; and the CPU pipeline
  drops optimization barriers before CSE, so the head's identical forward and backward gathers,
  which run back to back, may become one (counted once, in forward)."""
  ex, found = zero3()
  layers = CFG.num_layers
  for unit, chunk in unit_chunks(ex).items():
    mine = [c for c in found if c.result_shapes in (((8, chunk),), ((chunk,),))]
    count = lambda role: sum(c.count for c in mine if c.role == role)  # noqa: E731
    n = layers if unit == "blocks" else 1
    assert count("forward all-gather") == n, (unit, mine)
    assert count("gradient reduction") == n, (unit, mine)
    if unit == "blocks":
      assert count("backward all-gather") == layers
      loops = {c.computation for c in mine}
      assert len(loops) == 2, loops  # the forward scan's loop, and the backward's
    elif unit == "embed":
      assert count("backward all-gather") == 0
    else:
      assert count("backward all-gather") <= 1


def scale_share(found, integer=("s8", "u8")):
  """(integer-typed bytes, fp32 bytes) of some collectives: quantized values and their scales travel
  either packed into one uint8 buffer or as separate int and fp32 collectives."""
  assert {c.dtype for c in found} <= {*integer, "f32"}, {c.dtype for c in found}
  ints = sum(c.count * c.bytes_per_device for c in found if c.dtype in integer)
  return ints, sum(c.count * c.bytes_per_device for c in found if c.dtype == "f32")


def test_zeropp_table1_structure():
  _, found = zeropp()
  fwd, bwd, red = (by_role(found, r) for r in analysis.TABLE1_ROLES)
  # qwZ: int8 values and their fp32 block scales (one per 256 values), gathered over all 8 devices.
  assert fwd and {c.op for c in fwd} == {"all-gather"}
  assert all(c.replica_groups == (tuple(range(8)),) for c in fwd)
  ints, floats = scale_share(fwd)
  assert ints > 0 and floats <= (ints + floats) * 4 / (256 + 4) * (1 + 1e-9)
  # hpZ: the backward all-gather stays inside a node.
  assert bwd and all(c.op == "all-gather" and c.axes == ("gpu",) and one_node(c.replica_groups) for c in bwd)
  assert all(c.node_egress_bytes == 0 and c.cross_node_bytes_per_device == 0 for c in bwd)
  # qgZ: all-to-all inside the node, then across nodes; no reduce-scatter at all.
  assert {c.op for c in red} == {"all-to-all"} and "reduce-scatter" not in {c.op for c in found}
  for comp in {c.computation for c in red}:
    axes = [c.axes for c in found if c.computation == comp and c.op == "all-to-all"]
    assert axes.index(("gpu",)) < axes.index(("node",)), axes
  assert {c.axes for c in red} == {("gpu",), ("node",)}
  # No floating-point gradient data crosses nodes: only int4 values packed in uint8, and at most their
  # fp32 scales (4 bytes per 256-element block of 128 bytes).
  ints, floats = scale_share([c for c in red if c.axes == ("node",)], integer=("u8",))
  assert ints > 0 and floats <= (ints + floats) * 4 / (128 + 4) * (1 + 1e-9)


def test_zeropp_over_zero3_cross_node_bytes():
  """Table 1: ZeRO++ sends 0.5x ZeRO-3's forward all-gather, nothing for the backward one, and its
  gradient all-to-all moves int4 instead of 16-bit values (0.25x), of which each node sends (N-1)/N
  while ZeRO-3's ring sends (W-1)/W; all up to the fp32 scales."""
  _, f3 = zero3()
  _, fpp = zeropp()
  egress = lambda found, role: sum(c.count * c.node_egress_bytes for c in by_role(found, role))  # noqa: E731
  fwd3, bwd3, red3 = (egress(f3, r) for r in analysis.TABLE1_ROLES)
  fwdpp, bwdpp, redpp = (egress(fpp, r) for r in analysis.TABLE1_ROLES)
  assert fwdpp / fwd3 == pytest.approx(0.5 * (1 + 4 / 256))
  assert bwd3 > 0 and bwdpp == 0
  w = NODES * GPUS
  assert redpp / red3 == pytest.approx(0.25 * (1 + 4 / 128) * ((NODES - 1) / NODES) / ((w - 1) / w))
  ratio = (fwdpp + bwdpp + redpp) / (fwd3 + bwd3 + red3)
  assert ratio <= 0.27, ratio
  # The uniform-peer model gives the same verdict.
  uniform = lambda found: sum(c.count * c.cross_node_bytes_per_device  # noqa: E731
                              for r in analysis.TABLE1_ROLES for c in by_role(found, r))
  assert uniform(fpp) / uniform(f3) <= 0.27


def test_zeropp_over_16bit_zero3_gradient_bytes():
  """ZeRO-3's default 16-bit reduction runs qgZ's two hops with raw 16-bit words (nothing widened to fp32
  on CPU, nothing crossing nodes on the first hop): each node sends (N-1)/N of its gradient across nodes,
  against the ring's (W-1)/W. qgZ then differs from it only by int4 values and their fp32 scales."""
  _, f16 = zero3_16bit()
  _, f3 = zero3()
  _, fpp = zeropp()
  red16, red3, redpp = (by_role(f, "gradient reduction") for f in (f16, f3, fpp))
  assert {c.op for c in red16} == {"all-to-all"} and {c.hlo_dtype for c in red16} == {"u16"}
  assert {c.axes for c in red16} == {("gpu",), ("node",)}
  egress = lambda found: sum(c.count * c.node_egress_bytes for c in found)
  assert all(c.node_egress_bytes == 0 for c in red16 if c.axes == ("gpu",))
  w = NODES * GPUS
  assert egress(red16) / egress(red3) == pytest.approx(((NODES - 1) / NODES) / ((w - 1) / w))
  assert egress(redpp) / egress(red16) == pytest.approx(0.25 * (1 + 4 / 128))
  # the weight gathers are the same program
  for role in analysis.TABLE1_ROLES[:2]:
    assert egress(by_role(f16, role)) == egress(by_role(f3, role))


def test_step_report_relative_to_model_bytes():
  ex, found = zero3()
  report = analysis.step_report(ex, found)
  params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(gpt(CFG).init, jax.random.key(0))))
  assert report["model_parameters"] == params and report["model_bytes"] == 2 * params
  padded = sum(l.padded * (l.layers or 1) for l in ex.layout.leaves)
  fwd = report["table1"]["forward all-gather"]
  assert fwd["node_egress_bytes"] == pytest.approx(7 / 8 * 2 * padded)  # every unit's weights, once
  assert fwd["over_model"] == pytest.approx(7 / 8 * padded / params)
  total = report["table1"]["total"]["node_egress_bytes"]
  assert report["cross_node_bytes_per_node"] == total
  json.dumps(report)


@pytest.mark.slow  # compiled collectives per plan in the fast suite: the other tests here
def test_dp_has_only_all_reduces():
  _, found = step("dp", plans.dp(param_dtype="bfloat16"))
  assert {c.op for c in found} == {"all-reduce"}
  sync = by_role(found, "replica sync")
  # once per step: one all-reduce per unit (per layer of the scanned one), inside the backward pass
  assert sync and all(c.axes == ("node", "gpu") and c.count <= CFG.num_layers for c in sync)
  assert sum(c.count for c in sync) <= CFG.num_layers + 2


def test_mics_stays_inside_the_node_and_syncs_once_per_window():
  _, found = step("mics", plans.mics(param_dtype="bfloat16"), accum_steps=2)
  gathers = [c for c in found if c.op in ("all-gather", "reduce-scatter")]
  assert gathers and all(c.axes == ("gpu",) and one_node(c.replica_groups) for c in gathers)
  # Gradients are reduced inside the node every micro-batch (the weight gathers of the unscanned units
  # are loop-invariant, and XLA may hoist them out of the micro-batch loop).
  # one reduce-scatter per unit call: (layers + embed + head) x 2 micro-batches
  assert sum(c.count for c in gathers if c.op == "reduce-scatter") == 2 * (CFG.num_layers + 2)
  sync = by_role(found, "replica sync")  # once per window, inside the last micro-batch's backward
  assert sync and all(c.op == "all-reduce" and c.axes == ("node",) and c.count <= CFG.num_layers for c in sync)
  assert sum(c.count for c in sync) <= CFG.num_layers + 2
  crossing = [c for c in found if c.node_egress_bytes > 0 and c.role != "metrics"]
  assert crossing == sync


def test_cli_accounts_a_gin_config(tmp_path, capsys, monkeypatch):
  """`python -m zerojax.cli.account ...`, called in this process (`main(argv)`)."""
  from zerojax.cli import account
  hlo = tmp_path / "step.hlo"
  monkeypatch.chdir(ROOT)
  gin.clear_config()
  try:
    account.main(["--json", "--gin_file", "configs/zeropp.gin", "--mesh", "2x4",
                  "--gin_param", "model_config.num_layers=1", "--gin_param", "model_config.d_model=32",
                  "--gin_param", "model_config.seq_len=16", "--gin_param", "train.batch_size=8",
                  "--dump_hlo", str(hlo)])
  finally:
    gin.clear_config()
  report = json.loads(capsys.readouterr().out)
  assert report["config"]["plan"] == "zeropp" and report["config"]["mesh"] == {"node": 2, "gpu": 4}
  assert report["config"]["wire_formats"] == {"gather": "int8", "grad_hops": ["int4", "int4"]}
  assert set(report["table1"]) == {*analysis.TABLE1_ROLES, "total"}
  assert report["table1"]["backward all-gather"]["node_egress_bytes"] == 0
  roles = {c["role"] for c in report["collectives"]}
  assert {"forward all-gather", "backward all-gather", "gradient reduction"} <= roles
  assert "HloModule" in hlo.read_text()


# ------------------------------------------------------------------------------------------- emulator


def _cluster_module():
  spec = importlib.util.spec_from_file_location("cluster", os.path.join(ROOT, "benchmarks", "cluster.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _can_make_namespaces(cluster) -> str | None:
  why = cluster.check_environment()
  if why:
    return why
  name = f"zjx{os.getpid()}n99"
  r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
  if r.returncode:
    return f"cannot create a network namespace here: {r.stderr.strip()}"
  subprocess.run(["ip", "netns", "del", name], capture_output=True)
  return None


def _leftovers() -> list[str]:
  tag = f"zjx{os.getpid()}"
  names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
  return [w for w in (names + links).replace(":", " ").replace("@", " ").split() if w.startswith(tag)]


TINY_GIN = ["model_config.num_layers=1", "model_config.d_model=32", "model_config.seq_len=16",
            "model_config.num_heads=2", "train.batch_size=8",
            "train.eval_batches=1"]


@pytest.mark.multiprocess
def test_emulated_cluster_measures_the_link(tmp_path):
  cluster = _cluster_module()
  why = _can_make_namespaces(cluster)
  if why:
    pytest.skip(f"cluster emulator: {why}")
  args = cluster.parser().parse_args(
      ["--gin_file", "configs/zero3.gin", "--nodes", "2", "--devices", "2", "--steps", "14", "--rate", "1gbit",
       "--workdir", str(tmp_path / "run"), *[f"--gin_param={p}" for p in TINY_GIN]])
  out = cluster.run(args)
  assert _leftovers() == []
  assert out["plan"] == "zero3" and out["rate"] == "1gbit" and out["window"]["steps"] == 11
  assert out["median_step_time_s"] > 0 and out["tokens_per_s"] > 0
  assert len(out["links"]) == 2
  # The counters are read when a step appears in metrics.jsonl, by then the next step's traffic may have begun:
  # a window of 11 steps keeps that lag (at most about a step per end) within the bounds below on a busy machine.
  # The same step on a 2 x 2 mesh in this process (with configs/base.gin's bf16 parameters on the wire):
  # the link carries what the accounting predicts, plus TCP/IP headers and the coordinator's heartbeats.
  mesh = zerojax.make_mesh(2, 2, devices=jax.devices()[:4])
  ex = executor(plans.zero3(param_dtype="bfloat16", compute_dtype="float32"), mesh=mesh,
                cfg=GPTConfig(seq_len=16, d_model=32, num_heads=2, num_layers=1))
  predicted = analysis.step_report(ex, analysis.step_collectives(ex, (1, 8, 17)))["cross_node_bytes_per_node"]
  for link in out["links"]:
    assert 0.8 * predicted < link["sent_payload_bytes_per_step"] < 1.5 * predicted, (link, predicted)


@pytest.mark.multiprocess
def test_emulator_cleans_up_after_a_failed_run(tmp_path):
  cluster = _cluster_module()
  why = _can_make_namespaces(cluster)
  if why:
    pytest.skip(f"cluster emulator: {why}")
  args = cluster.parser().parse_args(
      ["--gin_file", "configs/zero3.gin", "--nodes", "2", "--devices", "1", "--steps", "4", "--rate", "100mbit",
       "--gin_param=train.no_such_parameter=1", "--workdir", str(tmp_path / "run")])
  with pytest.raises(cluster.ClusterError, match="no_such_parameter"):
    cluster.run(args)
  assert _leftovers() == []


def test_emulator_refuses_bad_arguments():
  cluster = _cluster_module()
  with pytest.raises(ValueError, match="100mbit"):
    cluster.parse_rate("fast")
  with pytest.raises(ValueError, match="1ms"):
    cluster.parse_delay("soon")
  assert cluster.parse_rate("none") is None and cluster.parse_delay("0") is None
  if shutil.which("ip") and os.geteuid() != 0:
    assert "root" in cluster.check_environment()
