"""Collective accounting from compiled HLO: parsing, replica groups, bytes under the ring model."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from zerojax.analysis import collectives_from_hlo, parse_replica_groups, summarize
from zerojax.cli import account

GPU_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
NODE_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))
ALL_GROUPS = ((0, 1, 2, 3, 4, 5, 6, 7),)
# axes -> (replica groups, group size k, spanned axes, cross-node fraction of a device's peers)
AXES = {
    "gpu": (GPU_GROUPS, 4, ("gpu",), 0.0),
    "node": (NODE_GROUPS, 2, ("node",), 1.0),
    ("node", "gpu"): (ALL_GROUPS, 8, ("node", "gpu"), 4 / 7),
}


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()).reshape(2, 4), ("node", "gpu"))


def _hlo(mesh, body, x):
  spec = P(("node", "gpu"))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
  return f.lower(x).compile().as_text()


def _x(dtype=jnp.float32):
  return jnp.ones((64, 16), dtype)  # per device f32[8, 16]: 512 bytes


def _expected(op, k):
  """(operand shapes, result shapes, bytes per device) of one collective on f32[8, 16] per device."""
  b = 8 * 16 * 4
  if op == "all-gather":
    return ((8, 16),), ((8 * k, 16),), (k - 1) / k * b * k
  if op == "reduce-scatter":
    return ((8, 16),), ((8 // k, 16),), (k - 1) / k * b
  if op == "all-reduce":
    return ((8, 16),), ((8, 16),), 2 * (k - 1) / k * b
  chunks = ((8 // k, 16),) * k  # all-to-all: the CPU HLO passes k chunks as a tuple
  return chunks, chunks, (k - 1) / k * b


BODIES = {
    "all-gather": lambda ax: lambda a: lax.all_gather(a, ax, axis=0, tiled=True),
    "reduce-scatter": lambda ax: lambda a: lax.psum_scatter(a, ax, scatter_dimension=0, tiled=True),
    "all-reduce": lambda ax: lambda a: lax.psum(a, ax),
    "all-to-all": lambda ax: lambda a: lax.all_to_all(a, ax, 0, 0, tiled=True),
}


@pytest.mark.parametrize("axes", list(AXES), ids=str)
@pytest.mark.parametrize("op", list(BODIES))
def test_single_collective(mesh, op, axes):
  groups, k, spanned, cross_fraction = AXES[axes]
  found = collectives_from_hlo(_hlo(mesh, BODIES[op](axes), _x()), mesh)
  assert len(found) == 1, found
  c = found[0]
  operands, results, nbytes = _expected(op, k)
  assert (c.op, c.hlo_op, c.dtype, c.hlo_dtype) == (op, op, "f32", "f32")
  assert c.operand_shapes == operands
  assert c.result_shapes == results
  assert c.replica_groups == groups
  assert c.axes == spanned
  assert c.count == 1
  assert c.bytes_per_device == pytest.approx(nbytes)
  assert c.cross_node_bytes_per_device == pytest.approx(cross_fraction * nbytes)


def test_collective_in_scan_found_once_in_while_body(mesh):
  def body(a):
    def step(carry, _):
      return carry + lax.all_gather(carry, "gpu", axis=0, tiled=True)[:8], None
    return lax.scan(step, a, None, length=3)[0]

  text = _hlo(mesh, body, _x())
  while_body = re.search(r"\bwhile\(.*\bbody=%?([^\s,]+)", text).group(1)
  found = collectives_from_hlo(text, mesh)
  assert [c.op for c in found] == ["all-gather"]
  assert found[0].computation == while_body
  assert found[0].count == 3
  assert summarize(found)["total"]["bytes_per_device"] == pytest.approx(3 * 3 * 512)


def test_several_psums_add_up(mesh):
  # The CPU pipeline combines these into one all-reduce with a tuple operand.
  found = collectives_from_hlo(_hlo(mesh, lambda a: lax.psum(a, "gpu") + lax.psum(2 * a, "gpu"), _x()), mesh)
  assert {c.op for c in found} == {"all-reduce"}
  assert sum(len(c.operand_shapes) for c in found) == 2
  assert sum(c.bytes_per_device for c in found) == pytest.approx(2 * 2 * 3 / 4 * 512)


@pytest.mark.parametrize("op", list(BODIES))
def test_bf16_moved_as_f32_on_cpu_is_counted_as_bf16(mesh, op):
  found = collectives_from_hlo(_hlo(mesh, BODIES[op]("gpu"), _x(jnp.bfloat16)), mesh)
  assert len(found) == 1
  c = found[0]
  assert c.hlo_dtype in ("f32", "bf16")  # f32 where the backend promotes
  assert c.dtype == "bf16"
  assert c.bytes_per_device == pytest.approx(_expected(op, 4)[2] / 2)


def test_explicit_f32_all_gather_stays_f32(mesh):
  body = lambda a: lax.all_gather(a.astype(jnp.float32), "gpu", axis=0, tiled=True)  # noqa: E731
  (c,) = collectives_from_hlo(_hlo(mesh, body, _x(jnp.bfloat16)), mesh)
  assert c.dtype == "f32"
  assert c.bytes_per_device == pytest.approx(3 * 512)  # f32[8, 16] from each of 3 peers


def test_int8_all_gather(mesh):
  body = lambda a: lax.all_gather(a, "node", axis=0, tiled=True)  # noqa: E731
  (c,) = collectives_from_hlo(_hlo(mesh, body, _x(jnp.int8)), mesh)
  assert (c.dtype, c.axes, c.result_shapes) == ("s8", ("node",), ((16, 16),))
  assert c.bytes_per_device == c.cross_node_bytes_per_device == pytest.approx(128)


@pytest.mark.parametrize("axis,pairs,cross", [("node", [(0, 1), (1, 0)], 512.0),
                                              ("gpu", [(i, (i + 1) % 4) for i in range(4)], 0.0)])
def test_ppermute(mesh, axis, pairs, cross):
  (c,) = collectives_from_hlo(_hlo(mesh, lambda a: lax.ppermute(a, axis, pairs), _x()), mesh)
  assert (c.op, c.axes) == ("collective-permute", (axis,))
  assert len(c.replica_groups) == 8
  assert c.bytes_per_device == pytest.approx(512)
  assert c.cross_node_bytes_per_device == pytest.approx(cross)


def test_replica_groups_are_device_ids_of_a_permuted_mesh():
  devices = np.array(jax.devices())[::-1].reshape(2, 4)
  mesh = Mesh(devices, ("node", "gpu"))
  (c,) = collectives_from_hlo(_hlo(mesh, lambda a: lax.psum(a, "gpu"), _x()), mesh)
  assert c.replica_groups == ((7, 6, 5, 4), (3, 2, 1, 0))
  assert c.axes == ("gpu",)


@pytest.mark.parametrize("spec,groups", [
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{}", ()),
    ("[2,4]<=[8]", GPU_GROUPS),
    ("[4,2]<=[2,4]T(1,0)", NODE_GROUPS),
    ("[1,8]<=[8]", ALL_GROUPS),
    ("[4,2]<=[2,2,2]T(0,2,1)", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("[2,4]<=[2,2,2]T(1,0,2)", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", GPU_GROUPS),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", NODE_GROUPS),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", ALL_GROUPS),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("mesh[x=8] {x:(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
])
def test_parse_replica_groups(spec, groups):
  assert parse_replica_groups(spec) == groups


ASYNC_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %add = bf16[] add(bf16[] %x, bf16[] %y)
}

%async_rs (p0: bf16[64,16]) -> bf16[8,16] {
  %p0 = bf16[64,16]{1,0} parameter(0)
  ROOT %rs = bf16[8,16]{1,0} reduce-scatter(bf16[64,16]{1,0} %p0), channel_id=4, replica_groups={}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[8,16], q: bf16[64,16], s: f32[]) -> (f32[32,16], f32[8,16], f32[], f32[8,16], bf16[8,16]) {
  %p = f32[8,16]{1,0} parameter(0)
  %q = bf16[64,16]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %ags = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(f32[8,16]{1,0} %p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[32,16]{1,0} all-gather-done((f32[8,16]{1,0}, f32[32,16]{1,0}) %ags)
  %ars = (f32[8,16]{1,0}, f32[]) all-reduce-start(f32[8,16]{1,0} %p, f32[] %s), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %ard = (f32[8,16]{1,0}, f32[]) all-reduce-done((f32[8,16]{1,0}, f32[]) %ars)
  %gte0 = f32[8,16]{1,0} get-tuple-element((f32[8,16]{1,0}, f32[]) %ard), index=0
  %gte1 = f32[] get-tuple-element((f32[8,16]{1,0}, f32[]) %ard), index=1
  %cps = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(f32[8,16]{1,0} %p), channel_id=3, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %cpd = f32[8,16]{1,0} collective-permute-done((f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) %cps)
  %rss = ((bf16[64,16]{1,0}), bf16[8,16]{1,0}, u32[]) async-start(bf16[64,16]{1,0} %q), calls=%async_rs
  %rsd = bf16[8,16]{1,0} async-done(((bf16[64,16]{1,0}), bf16[8,16]{1,0}, u32[]) %rss), calls=%async_rs
  ROOT %out = (f32[32,16]{1,0}, f32[8,16]{1,0}, f32[], f32[8,16]{1,0}, bf16[8,16]{1,0}) tuple(%agd, %gte0, %gte1, %cpd, %rsd)
}
"""


@pytest.mark.parametrize("percent", [True, False])
def test_async_pairs_counted_once(mesh, percent):
  text = ASYNC_HLO if percent else ASYNC_HLO.replace("%", "")
  found = {c.op: c for c in collectives_from_hlo(text, mesh)}
  assert len(found) == 4 and set(found) == {"all-gather", "all-reduce", "collective-permute", "reduce-scatter"}
  ag, ar, cp, rs = (found[op] for op in ("all-gather", "all-reduce", "collective-permute", "reduce-scatter"))
  assert (ag.hlo_op, ag.result_shapes, ag.replica_groups, ag.axes) == ("all-gather", ((32, 16),), GPU_GROUPS, ("gpu",))
  assert ag.bytes_per_device == pytest.approx(3 / 4 * 2048) and ag.cross_node_bytes_per_device == 0
  assert (ar.operand_shapes, ar.result_shapes, ar.replica_groups) == (((8, 16), ()), ((8, 16), ()), NODE_GROUPS)
  assert ar.bytes_per_device == ar.cross_node_bytes_per_device == pytest.approx(516)
  assert (cp.result_shapes, cp.axes, cp.bytes_per_device) == (((8, 16),), ("node",), 512)
  assert (rs.dtype, rs.replica_groups, rs.axes, rs.computation) == ("bf16", ALL_GROUPS, ("node", "gpu"), "main")
  assert rs.bytes_per_device == pytest.approx(7 / 8 * 2048)
  assert rs.cross_node_bytes_per_device == pytest.approx(4 / 7 * 7 / 8 * 2048)
  assert all(c.computation == "main" and c.count == 1 for c in found.values())


def test_all_reduce_then_dynamic_slice_reads_as_reduce_scatter(mesh):
  text = """\
HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%ds (a: f32[8,32], o: s32[]) -> f32[8,8] {
  %a = f32[8,32]{1,0} parameter(0)
  %o = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %d = f32[8,8]{1,0} dynamic-slice(%a, %z, %o), dynamic_slice_sizes={8,8}
}

ENTRY %main (p: f32[8,32], o: s32[]) -> f32[8,8] {
  %p = f32[8,32]{1,0} parameter(0)
  %o = s32[] parameter(1)
  %ar = f32[8,32]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %f = f32[8,8]{1,0} fusion(%ar, %o), kind=kLoop, calls=%ds
}
"""
  (c,) = collectives_from_hlo(text, mesh)
  assert (c.op, c.hlo_op, c.operand_shapes, c.result_shapes) == ("reduce-scatter", "all-reduce", ((8, 32),), ((8, 8),))
  assert c.bytes_per_device == pytest.approx(3 / 4 * 1024)


def test_replica_groups_modes(mesh):
  # pmap style: 8 replicas, no channel id -> the groups are replica ids.
  text = """\
HloModule m, replica_count=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%p), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}
"""
  (c,) = collectives_from_hlo(text, mesh)
  assert (c.replica_groups, c.axes) == (NODE_GROUPS, ("node",))
  # channel id without use_global_device_ids: groups of replicas, each with all its partitions.
  text = text.replace("replica_count=8", "num_partitions=8").replace(
      "replica_groups={{0,4},{1,5},{2,6},{3,7}}", "channel_id=1, replica_groups={{0}}")
  (c,) = collectives_from_hlo(text, mesh)
  assert c.replica_groups == ALL_GROUPS
  with pytest.raises(ValueError, match="8"):
    collectives_from_hlo(text.replace("num_partitions=8", "num_partitions=16"), mesh)


def test_summarize(mesh):
  def body(a):
    g = lax.all_gather(a, "gpu", axis=0, tiled=True)
    return lax.psum_scatter(g, "node", scatter_dimension=0, tiled=True)[:8] + lax.psum(a, ("node", "gpu"))

  found = collectives_from_hlo(_hlo(mesh, body, _x()), mesh)
  out = summarize(found, model_bytes=1024.0)
  ag = 3 * 512
  rs = 1 / 2 * 4 * 512
  ar = 2 * 7 / 8 * 512
  assert out["by_op"]["all-gather"]["bytes_per_device"] == pytest.approx(ag)
  assert out["by_op_axes"]["reduce-scatter"]["node"]["cross_node_bytes_per_device"] == pytest.approx(rs)
  assert out["by_op_axes"]["all-reduce"]["node,gpu"]["cross_node_bytes_per_device"] == pytest.approx(4 / 7 * ar)
  total = out["total"]
  assert total["count"] == 3
  assert total["bytes_per_device"] == pytest.approx(ag + rs + ar)
  assert total["intra_node_bytes_per_device"] == pytest.approx(ag + 3 / 7 * ar)
  assert total["bytes_per_device_over_model"] == pytest.approx((ag + rs + ar) / 1024)
  assert out["model_bytes"] == 1024.0
  json.dumps(out)


def test_cli(tmp_path, capsys):
  path = tmp_path / "step.hlo"
  path.write_text(ASYNC_HLO)
  account.main(["--hlo", str(path), "--mesh", "2x4", "--model_bytes", "2048", "--json"])
  out = json.loads(capsys.readouterr().out)
  assert out["total"]["count"] == 4
  assert out["by_op"]["reduce-scatter"]["bytes_per_device_over_model"] == pytest.approx(7 / 8)
  assert len(out["collectives"]) == 4
