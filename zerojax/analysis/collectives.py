"""Which collectives a compiled program runs, and how many bytes they move.

`collectives_from_hlo` reads the optimized HLO text of a compiled program
(`jax.jit(f).lower(...).compile().as_text()`) and returns one `Collective` per collective instruction,
with its bytes under the ring model of `zerojax.analysis.wire_model` and its role in a train step
(`zerojax.analysis.roles`). It knows nothing of the executor or the trainer.

  * Async pairs (`all-gather-start`/`-done`, `all-reduce-start`, `collective-permute-start`, and
    `async-start` wrapping a collective) are counted once; the result shape comes from the `-done`.
  * The ids in HLO are positions in the executable's device assignment, which for a program sharded
    over `mesh` is `mesh.devices.flat`. `Collective.replica_groups` holds the corresponding `device.id`s
    (positions when `mesh` is an `AbstractMesh`).
  * A collective inside a while loop with a known trip count gets `count` = the trip count.
  * bf16 collectives the CPU backend widened to f32 are reported (and counted) in bf16, as a GPU sends
    them; the HLO's own op and type stay in `hlo_op` and `hlo_dtype`.
"""
from __future__ import annotations

import math

import jax
import numpy as np

from zerojax.analysis.hlo_text import (OPS, Collective, Instr, Module, arrays, attr, global_groups, groups_attr,
                                       group_mode, narrow_source, narrowed_to, slice_user, parse_replica_groups)
from zerojax.analysis.roles import feeds_forward, label_roles, op_name
from zerojax.analysis.wire_model import ring_bytes



def _mesh_layout(mesh) -> tuple[tuple[str, ...], tuple[int, ...], list[int]]:
  names = tuple(mesh.axis_names)
  shape = tuple(mesh.shape[a] for a in names)
  if isinstance(mesh, jax.sharding.Mesh):
    ids = [d.id for d in mesh.devices.flat]
  else:
    ids = list(range(math.prod(shape)))
  return names, shape, ids


def collectives_from_hlo(hlo_text: str, mesh, *, node_axis: str = "node") -> list[Collective]:
  """Lists the collectives of an optimized HLO text with their bytes under the ring model.

  Args:
    hlo_text: `jax.jit(f).lower(...).compile().as_text()` of a program sharded over `mesh`.
    mesh: the `jax.sharding.Mesh` (or an `AbstractMesh` of the same shape); HLO device positions are
      positions in `mesh.devices.flat`.
    node_axis: the mesh axis whose coordinate tells nodes apart (with its factors `node_axis.*`).

  Returns:
    One `Collective` per collective instruction (async pairs once), in text order. See the module
    docstring for the byte model and the rewrites that are undone.

  Raises:
    ValueError: the HLO addresses more devices than the mesh has.
  """
  names, shape, ids = _mesh_layout(mesh)
  mod = Module(hlo_text)
  has_header = mod.replicas is not None or mod.partitions is not None
  replicas = mod.replicas or 1
  partitions = mod.partitions or (1 if has_header else len(ids))
  if replicas * partitions != len(ids):
    raise ValueError(f"the HLO runs on {replicas * partitions} devices but the mesh has {len(ids)}")
  coords = np.array(np.unravel_index(np.arange(len(ids)), shape)).T
  # The node of a device: its coordinates along `node_axis` or its factors (`node.group`, `node.member`).
  node_dims = [d for d, a in enumerate(names) if a == node_axis or a.startswith(node_axis + ".")]
  node_ids = np.ravel_multi_index(tuple(coords[:, d] for d in node_dims), [shape[d] for d in node_dims]) \
      if node_dims else np.zeros(len(ids), int)
  out, fwd = [], []
  for comp, instrs in mod.comps.items():
    for instr in instrs:
      start = instr.opcode.endswith("-start")
      hlo_op = instr.opcode[:-len("-start")] if start else instr.opcode
      if hlo_op not in OPS:
        continue
      value = instr
      if start:
        done = [u for u in mod.users[comp].get(instr.name, []) if u.opcode.endswith("-done")]
        value = done[0] if done else None
      in_arrays, out_arrays = _operands_and_results(mod, comp, instr, value, hlo_op)
      hlo_dtypes = ",".join(sorted({t for t, _ in in_arrays + out_arrays}))
      dtype = _promoted_from(mod, comp, instr, value)
      mode = group_mode(hlo_op, instr.attrs, has_header)
      if hlo_op == "collective-permute":
        pairs = parse_replica_groups(attr(instr.attrs, "source_target_pairs") or "{}")
        groups = [g for pair in pairs for g in global_groups([pair], mode, replicas, partitions)]
      else:
        groups = global_groups(parse_replica_groups(groups_attr(instr.attrs)), mode, replicas, partitions)
      if max((max(g) for g in groups if g), default=0) >= len(ids):
        raise ValueError(f"{instr.name}: device ids {groups} exceed the mesh's {len(ids)} devices")
      op = hlo_op
      if hlo_op == "all-reduce" and value is not None:
        sliced = _sliced_result(mod, comp, value, groups, out_arrays)
        if sliced:
          op, out_arrays = "reduce-scatter", sliced
      bytes_, cross, egress = ring_bytes(op, groups, in_arrays, out_arrays, dtype, node_ids)
      spanned = {d for g in groups for d in range(len(names)) if len({coords[i][d] for i in g}) > 1}
      out.append(Collective(
          op=op,
          dtype=dtype or hlo_dtypes,
          operand_shapes=tuple(dims for _, dims in in_arrays),
          result_shapes=tuple(dims for _, dims in out_arrays),
          replica_groups=tuple(tuple(ids[i] for i in g) for g in groups),
          axes=tuple(names[d] for d in sorted(spanned)),
          computation=mod.home(comp),
          bytes_per_device=bytes_,
          cross_node_bytes_per_device=cross,
          node_egress_bytes=egress,
          name=instr.name,
          hlo_op=hlo_op,
          hlo_dtype=hlo_dtypes,
          count=mod.count(comp),
          op_name=op_name(instr.attrs),
      ))
      fwd.append(value is not None and feeds_forward(mod, comp, value))
  return label_roles(out, fwd)


def _operands_and_results(mod: Module, comp: str, instr: Instr, value: Instr | None, op: str):
  """(dtype, dims) of the operand arrays and of the result arrays (from the `-done` when async)."""
  in_arrays = []
  for name, inline in zip(instr.operands, instr.inline_shapes):
    in_arrays += arrays(inline or mod.shape_of(comp, name) or "")
  if value is not None:
    return in_arrays, arrays(value.shape)
  if op == "all-reduce":
    return in_arrays, arrays(instr.shape)
  k = len(in_arrays)  # a `-start` without `-done`: (operands, results, ...)
  return in_arrays, arrays(instr.shape)[k:2 * k]


def _promoted_from(mod: Module, comp: str, instr: Instr, value: Instr | None) -> str | None:
  """The narrow type a backend promoted this collective from (convert up before, back after)."""
  narrow = {narrow_source(mod, comp, name) for name in instr.operands}
  if value is None or len(narrow) != 1 or None in narrow:
    return None
  dtype = narrow.pop()
  return dtype if narrowed_to(mod, comp, value, dtype) else None


def _sliced_result(mod: Module, comp: str, value: Instr, groups, out_arrays):
  """The kept slice's arrays when an all-reduce's only use keeps 1/k of it, else None."""
  user = slice_user(mod, comp, value)
  sizes = {len(g) for g in groups}
  if user is None or len(out_arrays) != 1 or len(sizes) != 1:
    return None
  k = sizes.pop()
  sliced = arrays(user.shape)
  if k > 1 and len(sliced) == 1 and math.prod(sliced[0][1]) * k == math.prod(out_arrays[0][1]):
    return sliced
  return None

