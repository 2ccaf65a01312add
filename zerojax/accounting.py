"""Collective accounting: which collectives a compiled program runs, and how many bytes they move.

`collectives_from_hlo` reads the optimized HLO text of a compiled program
(`jax.jit(f).lower(...).compile().as_text()`) and returns one `Collective` per collective instruction;
`summarize` totals them per op, mesh axes and role, split into intra-node and cross-node bytes.

Algorithm model. Every collective is charged as a ring algorithm over its replica group. For a group of
`k` devices and a per-device full buffer of `B` bytes, each device sends

  all-gather          (k-1)/k * B_out   (B_out: the gathered result)
  reduce-scatter      (k-1)/k * B_in    (B_in: the full input)
  all-reduce          2(k-1)/k * B      (reduce-scatter then all-gather)
  all-to-all          (k-1)/k * B       (B: the whole input; 1/k of it stays local)
  collective-permute  B for each device that sends to another device

Sizes of tuple operands (collectives XLA combined into one instruction) are added up. Numbers are
averaged over all devices of the mesh. Two cross-node figures (another coordinate along `node_axis`):

  * `cross_node_bytes_per_device`, the uniform-peer model: the fraction of a device's peers in its
    group that sit on another node: 0 for groups inside a node, all of it for groups that span only
    the node axis, and e.g. 4/7 for a group of 2 nodes x 4 devices. Exact for all-to-all and
    collective-permute; for ring collectives it is what a ring in a random device order would send.
  * `node_egress_bytes`, the ring-order model: bytes each node sends to other nodes, with every ring
    collective run as one ring in its group's listed order (node-major for the mesh's groups, as
    NCCL's and gloo's rings are). A group over n nodes crosses a node boundary on n of its k ring
    edges, each carrying (k-1)/k * B (twice for all-reduce), so a flat all-gather of the model over
    2 nodes x 4 devices costs each node 7/8 M rather than 4 devices x 4/7 x 7/8 M. This is ZeRO++
    Table 1's model and what a node's link counters measure (gloo's reduce-scatter is halving-doubling
    plus a bit-reversal exchange: 3/4 instead of 7/8 of B_in on 2 nodes x 4 devices).

Reading the HLO:
  * Async pairs (`all-gather-start`/`-done`, `all-reduce-start`, `collective-permute-start`, and
    `async-start` wrapping a collective) are counted once; the result shape comes from the `-done`.
  * Replica groups in the explicit (`{{0,1},{2,3}}`), empty (`{}`: all devices), iota
    (`[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`) and mesh-axes (`mesh['a'=2,'b'=4] {'b'}`) forms are
    expanded, then mapped through the group mode that `channel_id` and `use_global_device_ids` select.
  * The ids in HLO are positions in the executable's device assignment, which for a program sharded
    over `mesh` is `mesh.devices.flat`. `Collective.replica_groups` holds the corresponding `device.id`s
    (positions when `mesh` is an `AbstractMesh`).
  * A collective inside a while loop with a known trip count gets `count` = the trip count.

Rewrites undone (the HLO's own op and element type stay in `hlo_op` and `hlo_dtype`):
  * The CPU backend moves bf16 collectives in f32 (and f8 ones in f16): a convert up before, a convert
    back after. When every operand comes from such an up-convert and every use of the result ends in a
    convert back to the same narrow type, `dtype` is the narrow type and bytes are counted with it, as a
    GPU would send them.
  * An all-reduce whose only use is a dynamic-slice keeping 1/k of it (the SPMD partitioner's
    reduce-scatter, which GPU backends turn back into one) is reported as a reduce-scatter.
  (So a bf16 step run on CPU sends twice the bytes counted here; configs/base.gin's fp32 does not.)

Train steps. `step_collectives(executor)` compiles an `Executor`'s train step for abstract inputs;
every collective gets a role (`label_roles`: forward / backward all-gather, gradient reduction, replica
sync, parameter update gather, metrics), and `step_report` lays the step out as ZeRO++ Table 1 relative
to M = parameters x 2 bytes. From the shell:

  python -m zerojax.accounting --gin_file configs/zero3.gin [--gin_param ...] [--mesh 2x4] [--dump_hlo F]
  python -m zerojax.accounting --hlo step.hlo --mesh 2x4 [--model-bytes M] [--list]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import inspect
import json
import math
import os
import re
import sys

import jax
import numpy as np

OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_MOVES = frozenset({"bitcast", "reshape", "copy", "get-tuple-element", "slice", "concatenate", "transpose",
                    "dynamic-slice"})
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(=]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program.

  Attributes:
    op: "all-gather", "reduce-scatter", "all-reduce", "all-to-all" or "collective-permute".
    dtype: element type of the operands, e.g. "f32", "bf16", "s8" (comma-joined when mixed).
    operand_shapes: per-device input shapes, one tuple per array.
    result_shapes: per-device output shapes, one tuple per array.
    replica_groups: groups of device ids; source-target pairs for a collective-permute.
    axes: mesh axes the groups span, in mesh order, e.g. ("gpu",) or ("node", "gpu").
    computation: name of the HLO computation holding it (a while body for a loop).
    bytes_per_device: bytes each device sends per execution under the ring model.
    cross_node_bytes_per_device: the part of it that crosses a node boundary.
    name: the HLO instruction name.
    hlo_op: the op as written in the HLO (differs from `op` for a recognized rewrite).
    hlo_dtype: the element type in the HLO (differs from `dtype` for an undone promotion).
    count: executions per program run (trip counts of enclosing loops; 1 when unknown).
    node_egress_bytes: bytes each node sends to other nodes per execution (mean over nodes) under the
      ring-order model; what ZeRO++ Table 1 counts and a node's link counters measure.
    op_name: the JAX source path from the HLO metadata (`.../jvp()/...`, `.../transpose(jvp())/...`).
    role: what the collective does in a train step (see `ROLES` and `label_roles`).
  """
  op: str
  dtype: str
  operand_shapes: tuple
  result_shapes: tuple
  replica_groups: tuple
  axes: tuple
  computation: str
  bytes_per_device: float
  cross_node_bytes_per_device: float
  name: str = ""
  hlo_op: str = ""
  hlo_dtype: str = ""
  count: int = 1
  node_egress_bytes: float = 0.0
  op_name: str = ""
  role: str = ""


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: list
  inline_shapes: list
  attrs: str
  computation: str
  root: bool


# ------------------------------------------------------------------------------------------- text utils


def _close(s: str, i: int) -> int:
  """Index just past the bracket that closes the one at `s[i]`."""
  depth = 0
  for j in range(i, len(s)):
    if s[j] in "([{":
      depth += 1
    elif s[j] in ")]}":
      depth -= 1
      if depth == 0:
        return j + 1
  raise ValueError(f"unbalanced brackets in {s!r}")


def _split_top(s: str) -> list[str]:
  """Splits at commas outside brackets."""
  parts, depth, start = [], 0, 0
  for j, ch in enumerate(s):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(s[start:j].strip())
      start = j + 1
  if s[start:].strip():
    parts.append(s[start:].strip())
  return parts


def _ints(s: str | None) -> list[int]:
  return [int(v) for v in re.findall(r"-?\d+", s or "")]


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(element type, dims) of every array in a (possibly tuple) shape string."""
  out = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype == "token":
      continue
    out.append((dtype, tuple(int(d) for d in re.findall(r"\d+", dims))))
  return out


def _bits(dtype: str) -> int:
  if dtype == "pred":
    return 8
  m = re.search(r"\d+", dtype)
  if not m:
    raise ValueError(f"unknown element type {dtype!r}")
  return int(m.group())


def _nbytes(arrays, dtype: str | None = None) -> float:
  return sum(math.prod(dims) * _bits(dtype or t) / 8 for t, dims in arrays)


def _attr(attrs: str, key: str) -> str | None:
  """The value of `key=` in an attribute string, brackets included."""
  m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", attrs)
  if not m:
    return None
  i = m.end()
  if attrs[i:i + 1] in ("{", "[", "("):
    return attrs[i:_close(attrs, i)]
  return re.match(r"[^,\s]*", attrs[i:]).group()


# ------------------------------------------------------------------------------------------ replica groups


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  return ids.transpose(perm or range(len(reshape))).reshape(-1)


def _device_order(spec: str | None, n: int) -> np.ndarray:
  """Flat device list of a mesh-axes replica group: iota `[2,4]T(1,0)` / `[8]<=[2,4]T(1,0)` or ids."""
  if spec is None:
    return np.arange(n)
  spec = spec.strip().split("<=", 1)[-1]
  m = re.fullmatch(r"\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?", spec)
  if m:
    return _iota(_ints(m.group(1)), _ints(m.group(2)) or None)
  return np.array(_ints(re.sub(r"^\[[\d,\s]*\]", "", spec)))


def _mesh_axes_groups(spec: str) -> tuple[tuple[int, ...], ...]:
  """Expands `mesh['a'=2,'b'=4](, device_ids=(...))? {'b'}` (sub-axes written `'b':(pre)size`)."""
  m = re.fullmatch(r"mesh\[(.*?)\]\s*(?:,\s*device_ids=\((.*)\))?\s*\{(.*)\}", spec.strip(), re.S)
  if not m:
    raise ValueError(f"cannot parse replica groups {spec!r}")
  axes = re.findall(r"['\"]?([^'\"=,\s]+)['\"]?\s*=\s*(\d+)", m.group(1))
  names = [a for a, _ in axes]
  sizes = [int(s) for _, s in axes]
  ids = _device_order(m.group(2), math.prod(sizes))
  refs = []  # (mesh dim, pre-size, size)
  for tok in _split_top(m.group(3)):
    r = re.fullmatch(r"['\"]?([^'\":]+)['\"]?\s*(?::\((\d+)\)(\d+))?", tok.strip())
    dim = names.index(r.group(1))
    refs.append((dim, int(r.group(2)), int(r.group(3))) if r.group(2) else (dim, 1, sizes[dim]))
  groups = {}
  for pos in range(math.prod(sizes)):
    coord = list(np.unravel_index(pos, sizes))
    digits = []
    for dim, pre, size in refs:
      minor = sizes[dim] // (pre * size)
      digit = coord[dim] // minor % size
      coord[dim] -= digit * minor
      digits.append(digit)
    rank = np.ravel_multi_index(digits, [size for _, _, size in refs]) if refs else 0
    groups.setdefault(tuple(coord), {})[rank] = int(ids[pos])
  return tuple(tuple(g[r] for r in sorted(g)) for _, g in sorted(groups.items()))


def parse_replica_groups(spec: str) -> tuple[tuple[int, ...], ...]:
  """Expands the value of an HLO `replica_groups=` attribute into explicit groups.

  Args:
    spec: `{{0,1},{2,3}}`, `{}` (no groups: all devices), the iota form `[G,K]<=[dims]T(perm)`
      (`iota(prod(dims))` reshaped to `dims`, transposed by `perm`, cut into G groups of K), or the
      mesh-axes form `mesh['a'=2,'b'=4] {'b'}` (devices that differ only along the listed axes).

  Returns:
    A tuple of groups of ids as written in the HLO (positions in the device assignment).
  """
  spec = spec.strip()
  if spec.startswith("mesh"):
    return _mesh_axes_groups(spec)
  m = re.fullmatch(r"\[([\d,\s]+)\]\s*<=\s*\[([\d,\s]+)\]\s*(?:T\(([\d,\s]+)\))?", spec)
  if m:
    shape = _ints(m.group(1))
    ids = _iota(_ints(m.group(2)), _ints(m.group(3)) or None)
    return tuple(tuple(int(i) for i in g) for g in ids.reshape(-1, shape[-1]))
  if spec.startswith("{"):
    return tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", spec[1:-1]))
  raise ValueError(f"cannot parse replica groups {spec!r}")


def _global_groups(groups, mode: str, replicas: int, partitions: int):
  """Maps groups of replica or partition ids to groups of flattened ids (replica * P + partition)."""
  r_all, p_all = tuple(range(replicas)), tuple(range(partitions))
  if mode == "flattened":
    return list(groups) or [tuple(range(replicas * partitions))]
  if mode == "cross_partition":
    return [tuple(r * partitions + p for p in g) for r in r_all for g in (groups or [p_all])]
  if mode == "cross_replica":
    return [tuple(r * partitions + p for r in g) for p in p_all for g in (groups or [r_all])]
  return [tuple(r * partitions + p for r in g for p in p_all) for g in (groups or [r_all])]


# ------------------------------------------------------------------------------------------------ module


class _Module:
  """The computations and instructions of an HLO text."""

  def __init__(self, text: str):
    header = re.search(r"^HloModule[^\n]*", text, re.M)
    header = header.group() if header else ""
    rc = re.search(r"replica_count=(\d+)", header)
    np_ = re.search(r"num_partitions=(\d+)", header)
    self.replicas = int(rc.group(1)) if rc else None
    self.partitions = int(np_.group(1)) if np_ else None
    self.comps: dict[str, list[_Instr]] = {}
    self.entry = None
    comp = None
    for line in text.splitlines():
      line = re.sub(r"/\*.*?\*/", "", line).rstrip()
      if comp is None:
        m = _HEADER.match(line)
        if m and not line.startswith("HloModule"):
          comp = m.group(2)
          self.comps[comp] = []
          if m.group(1):
            self.entry = comp
        continue
      if line.strip() == "}":
        comp = None
        continue
      instr = _parse_instr(line, comp)
      if instr:
        self.comps[comp].append(instr)
    self.by_name = {c: {i.name: i for i in instrs} for c, instrs in self.comps.items()}
    self.users = {c: collections.defaultdict(list) for c in self.comps}
    self.callers = collections.defaultdict(list)  # callee -> [(caller instr, factor)]
    self._counts = {}
    for c, instrs in self.comps.items():
      for instr in instrs:
        for op in instr.operands:
          self.users[c][op].append(instr)
        if instr.opcode in ("async-done", "async-update"):
          continue
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
        for key in ("body", "condition", "calls", "to_apply", "true_computation", "false_computation",
                    "branch_computations"):
          value = _attr(instr.attrs, key)
          for callee in re.findall(r"%?([^\s{},%]+)", value or ""):
            factor = int(trip.group(1)) if trip and key in ("body", "condition") else 1
            self.callers[callee].append((instr, factor))

  def shape_of(self, comp: str, name: str) -> str | None:
    instr = self.by_name[comp].get(name)
    return instr.shape if instr else None

  def count(self, comp: str, _seen=()) -> int:
    """Executions of a computation per run: products of known trip counts along the call chain."""
    if comp not in self._counts:
      if comp == self.entry or not self.callers.get(comp) or comp in _seen:
        self._counts[comp] = 1
      else:
        self._counts[comp] = sum(f * self.count(i.computation, _seen + (comp,)) for i, f in self.callers[comp])
    return self._counts[comp]

  def home(self, comp: str) -> str:
    """The computation to report: the caller's for the body of an `async-start`."""
    callers = self.callers.get(comp, [])
    if callers and all(i.opcode.startswith("async-start") for i, _ in callers):
      return self.home(callers[0][0].computation)
    return comp

  def callee_root(self, instr: _Instr) -> tuple[str, _Instr] | None:
    callee = re.match(r"%?([^\s,{}]+)", _attr(instr.attrs, "calls") or "")
    roots = [i for i in self.comps.get(callee.group(1), []) if i.root] if callee else []
    return (callee.group(1), roots[0]) if roots else None


def _parse_instr(line: str, comp: str) -> _Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  name, rest = m.group(2), m.group(3).strip()
  if rest.startswith("("):
    end = _close(rest, 0)
  else:
    end = len(rest.split(" ", 1)[0])
  shape, rest = rest[:end], rest[end:].strip()
  om = re.match(r"([\w\-]+)\(", rest)
  if not om:
    return None
  start = om.end() - 1
  end = _close(rest, start)
  operands, inline = [], []
  for tok in _split_top(rest[start + 1:end - 1]):
    parts = tok.rsplit(None, 1)
    operands.append(parts[-1].lstrip("%"))
    inline.append(parts[0] if len(parts) == 2 else None)
  return _Instr(name, shape, om.group(1), operands, inline, rest[end:].lstrip(", "), comp, bool(m.group(1)))


def _groups_attr(attrs: str) -> str:
  """The `replica_groups=` value in any of its forms; `{}` when absent."""
  m = re.search(r"(?:^|[\s,])replica_groups=(mesh\[.*?\{[^}]*\}|\[[\d,\s]*\]<=\[[\d,\s]*\](?:T\([\d,\s]*\))?)",
                attrs)
  if m:
    return m.group(1)
  return _attr(attrs, "replica_groups") or "{}"


def _mode(op: str, attrs: str, has_header: bool) -> str:
  if not has_header:
    return "flattened"
  if not re.search(r"channel_id=\d+", attrs):
    return "cross_replica"
  if op in ("all-reduce", "all-gather", "reduce-scatter"):
    return "flattened" if "use_global_device_ids=true" in attrs else "cross_replica_and_partition"
  return "cross_partition"


# --------------------------------------------------------------------------------------- rewrites undone


def _dtype(shape: str) -> str | None:
  types = {t for t, _ in _arrays(shape)}
  return types.pop() if len(types) == 1 else None


def _narrow_source(mod: _Module, comp: str, name: str) -> str | None:
  """The narrower float type that value `name` was up-converted from, if it is such a convert."""
  instr = mod.by_name[comp].get(name)
  for _ in range(64):  # through fusions and pure data movement (e.g. bitcast(convert(x)))
    if instr is None:
      return None
    if instr.opcode == "fusion":
      root = mod.callee_root(instr)
      if root is None:
        return None
      comp, instr = root
    elif instr.opcode in ("bitcast", "reshape", "copy") and instr.operands:
      instr = mod.by_name[comp].get(instr.operands[0])
    else:
      break
  if instr is None or instr.opcode != "convert":
    return None
  src, dst = mod.shape_of(comp, instr.operands[0]), _dtype(instr.shape)
  src = src and _dtype(src)
  floats = all(t and re.fullmatch(r"b?f\d.*", t) for t in (src, dst))
  return src if floats and _bits(src) < _bits(dst) else None


def _narrowed_to(mod: _Module, comp: str, instr: _Instr, dtype: str) -> bool:
  """Whether every use of `instr` ends, through data movement only, in a convert to `dtype`."""
  users = mod.users[comp].get(instr.name, [])
  if not users:
    return False
  for user in users:
    if user.opcode == "convert":
      ok = _dtype(user.shape) == dtype
    elif user.opcode in _MOVES:
      ok = _narrowed_to(mod, comp, user, dtype)
    elif user.opcode == "fusion" and mod.callee_root(user):
      callee = mod.callee_root(user)[0]
      params = [i for i in mod.comps[callee] if i.opcode == "parameter"
                and _ints(i.operands[0])[0] in [j for j, o in enumerate(user.operands) if o == instr.name]]
      ok = bool(params) and all(_narrowed_to(mod, callee, p, dtype) for p in params)
    else:
      ok = False
    if not ok:
      return False
  return True


def _slice_user(mod: _Module, comp: str, instr: _Instr) -> _Instr | None:
  """The only user of `instr` when it is a dynamic-slice (or a fusion holding one)."""
  users = mod.users[comp].get(instr.name, [])
  if len(users) != 1:
    return None
  user = users[0]
  if user.opcode == "dynamic-slice":
    return user
  root = mod.callee_root(user) if user.opcode == "fusion" else None
  if root and any(i.opcode == "dynamic-slice" for i in mod.comps[root[0]]):
    return user
  return None


# ----------------------------------------------------------------------------------------------- parsing


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
  mod = _Module(hlo_text)
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
  out, feeds_forward = [], []
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
      mode = _mode(hlo_op, instr.attrs, has_header)
      if hlo_op == "collective-permute":
        pairs = parse_replica_groups(_attr(instr.attrs, "source_target_pairs") or "{}")
        groups = [g for pair in pairs for g in _global_groups([pair], mode, replicas, partitions)]
      else:
        groups = _global_groups(parse_replica_groups(_groups_attr(instr.attrs)), mode, replicas, partitions)
      if max((max(g) for g in groups if g), default=0) >= len(ids):
        raise ValueError(f"{instr.name}: device ids {groups} exceed the mesh's {len(ids)} devices")
      op = hlo_op
      if hlo_op == "all-reduce" and value is not None:
        sliced = _sliced_result(mod, comp, value, groups, out_arrays)
        if sliced:
          op, out_arrays = "reduce-scatter", sliced
      bytes_, cross, egress = _ring_bytes(op, groups, in_arrays, out_arrays, dtype, node_ids)
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
          op_name=_op_name(instr.attrs),
      ))
      feeds_forward.append(value is not None and _feeds_forward(mod, comp, value))
  return label_roles(out, feeds_forward)


def _operands_and_results(mod: _Module, comp: str, instr: _Instr, value: _Instr | None, op: str):
  """(dtype, dims) of the operand arrays and of the result arrays (from the `-done` when async)."""
  in_arrays = []
  for name, inline in zip(instr.operands, instr.inline_shapes):
    in_arrays += _arrays(inline or mod.shape_of(comp, name) or "")
  if value is not None:
    return in_arrays, _arrays(value.shape)
  if op == "all-reduce":
    return in_arrays, _arrays(instr.shape)
  k = len(in_arrays)  # a `-start` without `-done`: (operands, results, ...)
  return in_arrays, _arrays(instr.shape)[k:2 * k]


def _promoted_from(mod: _Module, comp: str, instr: _Instr, value: _Instr | None) -> str | None:
  """The narrow type a backend promoted this collective from (convert up before, back after)."""
  narrow = {_narrow_source(mod, comp, name) for name in instr.operands}
  if value is None or len(narrow) != 1 or None in narrow:
    return None
  dtype = narrow.pop()
  return dtype if _narrowed_to(mod, comp, value, dtype) else None


def _sliced_result(mod: _Module, comp: str, value: _Instr, groups, out_arrays):
  """The kept slice's arrays when an all-reduce's only use keeps 1/k of it, else None."""
  user = _slice_user(mod, comp, value)
  sizes = {len(g) for g in groups}
  if user is None or len(out_arrays) != 1 or len(sizes) != 1:
    return None
  k = sizes.pop()
  sliced = _arrays(user.shape)
  if k > 1 and len(sliced) == 1 and math.prod(sliced[0][1]) * k == math.prod(out_arrays[0][1]):
    return sliced
  return None


def _ring_bytes(op, groups, in_arrays, out_arrays, dtype, node_ids) -> tuple[float, float, float]:
  """Bytes sent per device (mean over the mesh), their cross-node part, and bytes leaving a node.

  The last is under the ring-order model (module docstring): a ring collective crosses a node boundary
  on the ring edges between consecutive group members on different nodes; all-to-all and
  collective-permute send every byte straight to its destination.
  """
  n, nodes = len(node_ids), len(set(node_ids.tolist()))
  node_of = lambda i: int(node_ids[i])  # noqa: E731
  total = cross = egress = 0.0
  if op == "collective-permute":
    size = _nbytes(in_arrays, dtype)
    for src, dst in groups:
      if src != dst:
        total += size
        if node_of(src) != node_of(dst):
          cross += size
    return float(total / n), float(cross / n), float(cross / nodes)
  size = _nbytes(out_arrays if op == "all-gather" else in_arrays, dtype)
  for g in groups:
    k = len(g)
    if k < 2:
      continue
    sent = (2 if op == "all-reduce" else 1) * (k - 1) / k * size
    total += k * sent
    per_node = collections.Counter(node_of(i) for i in g)
    group_cross = sum(sent * c * (k - c) / (k - 1) for c in per_node.values())
    cross += group_cross
    if op == "all-to-all":
      egress += group_cross
    else:
      edges = sum(node_of(g[j]) != node_of(g[(j + 1) % k]) for j in range(k))
      egress += edges * sent
  return float(total / n), float(cross / n), float(egress / nodes)


# ------------------------------------------------------------------------------------------------- roles

ROLES = ("forward all-gather", "backward all-gather", "gradient reduction", "replica sync",
         "parameter update gather", "metrics", "other")


def _op_name(attrs: str) -> str:
  m = re.search(r'op_name="([^"]*)"', attrs)
  return m.group(1) if m else ""


def _role(c: Collective) -> str:
  scalars = all(math.prod(dims) <= 1 for dims in c.operand_shapes)
  if c.op == "all-reduce" and scalars:
    return "metrics"
  name = c.op_name
  backward = "transpose(" in name
  forward = _forward(name)
  in_step = "shard_map" in name
  if not name:  # no metadata: only what the op itself implies
    return "gradient reduction" if c.op in ("reduce-scatter", "all-to-all") else "other"
  if c.op == "all-gather":
    if forward or backward:
      return "forward all-gather" if forward else "backward all-gather"
    return "parameter update gather" if in_step else "other"
  if backward or (c.op == "reduce-scatter" and in_step):
    return "gradient reduction"
  if c.op == "all-reduce" and in_step:
    return "replica sync"
  return "other"


def _forward(op_name: str) -> bool:
  return "jvp(" in op_name and "transpose(" not in op_name


def _feeds_forward(mod: _Module, comp: str, value: _Instr, depth: int = 16) -> bool:
  """Whether the result reaches, through instructions without a source path, forward-pass code."""
  frontier, seen = [value], {value.name}
  for _ in range(depth):
    nxt = []
    for instr in frontier:
      for user in mod.users[comp].get(instr.name, []):
        name = _op_name(user.attrs)
        if name and _forward(name):
          return True
        if not name and user.name not in seen:
          seen.add(user.name)
          nxt.append(user)
    frontier = nxt
  return False


def label_roles(collectives: list[Collective], feeds_forward: list[bool] | None = None) -> list[Collective]:
  """Labels each collective with its role in a train step of the executor (one of `ROLES`).

  The role comes from the JAX source path in the HLO metadata: the forward pass of `value_and_grad`
  runs under `jvp(...)`, the backward under `transpose(jvp(...))`, the executor's own collectives
  (parameter gather before the micro-batches, boundary reduce-scatter, replica all-reduce) inside the
  `shard_map` but outside both, and the gradient norm outside the `shard_map`:

    forward all-gather       all-gather under jvp (ZeRO-3 / qwZ weight gather)
    backward all-gather      all-gather under transpose (ZeRO-3 re-gather, hpZ secondary gather)
    gradient reduction       reduce-scatter / all-to-all in backward (ZeRO-2/3, qgZ), or the
                             reduce-scatter at the accumulation boundary (ZeRO-1)
    replica sync             all-reduce of gradients over the replica axes (DP, MiCS)
    parameter update gather  all-gather of the updated master shard into the parameter shard
    metrics                  all-reduce of scalars only (mean loss, gradient norm)
    other                    anything else

  A backward all-gather whose result also feeds forward-pass code has been merged by XLA with its
  identical forward twin (the CPU pipeline drops optimization barriers before CSE, so a unit whose
  forward and backward run back to back, like the GPT head, gathers once): it is sent once, in
  forward, and labelled "forward all-gather". Without metadata only reduce-scatters and all-to-alls
  (gradient reduction) and all-reduces of scalars (metrics) are labelled.

  Args:
    collectives: as found in one program, with `op_name` filled in.
    feeds_forward: per collective, whether its result feeds forward-pass code (see above).

  Returns:
    The collectives with `role` set, in the same order.
  """
  feeds_forward = feeds_forward or [False] * len(collectives)
  roles = []
  for c, fwd in zip(collectives, feeds_forward):
    role = _role(c)
    roles.append("forward all-gather" if role == "backward all-gather" and fwd else role)
  return [dataclasses.replace(c, role=r) for c, r in zip(collectives, roles)]


# --------------------------------------------------------------------------------------------- summaries


def summarize(collectives, *, model_bytes: float | None = None) -> dict:
  """Totals bytes per device, per op and per (op, axes), split into intra- and cross-node.

  Each collective counts `count` times (loop trip counts).

  Args:
    collectives: `Collective`s, e.g. from `collectives_from_hlo`.
    model_bytes: the model's size M in bytes; adds `*_over_model` ratios to every entry.

  Returns:
    A JSON-ready dict: `total`, `by_op` (op -> entry), `by_op_axes` (op -> "node,gpu" -> entry) and
    `by_role` (role -> entry, for labelled collectives), each entry with `count`, `bytes_per_device`,
    `intra_node_bytes_per_device`, `cross_node_bytes_per_device` and `node_egress_bytes` (see the
    module docstring); plus `model_bytes` when given.
  """
  def entry():
    return {"count": 0, "bytes_per_device": 0.0, "intra_node_bytes_per_device": 0.0,
            "cross_node_bytes_per_device": 0.0, "node_egress_bytes": 0.0}

  total, by_op, by_op_axes, by_role = entry(), {}, {}, {}
  for c in collectives:
    axes = ",".join(c.axes) or "-"
    entries = [total, by_op.setdefault(c.op, entry()), by_op_axes.setdefault(c.op, {}).setdefault(axes, entry())]
    if c.role:
      entries.append(by_role.setdefault(c.role, entry()))
    for e in entries:
      e["count"] += c.count
      e["bytes_per_device"] += c.count * c.bytes_per_device
      e["cross_node_bytes_per_device"] += c.count * c.cross_node_bytes_per_device
      e["intra_node_bytes_per_device"] += c.count * (c.bytes_per_device - c.cross_node_bytes_per_device)
      e["node_egress_bytes"] += c.count * c.node_egress_bytes
  out = {"total": total, "by_op": by_op, "by_op_axes": by_op_axes, "by_role": by_role}
  if model_bytes:
    entries = [total, *by_op.values(), *(e for d in by_op_axes.values() for e in d.values()), *by_role.values()]
    for e in entries:
      for key in ("bytes_per_device", "intra_node_bytes_per_device", "cross_node_bytes_per_device",
                  "node_egress_bytes"):
        e[key + "_over_model"] = e[key] / model_bytes
    out["model_bytes"] = model_bytes
  return out


# ------------------------------------------------------------------------------------------ train steps

TABLE1_ROLES = ("forward all-gather", "backward all-gather", "gradient reduction")


def step_hlo(executor, batch_shape: tuple[int, int, int] | None = None) -> str:
  """Lowers and compiles `executor.step_fn()` for abstract inputs; returns the optimized HLO text.

  Args:
    executor: a `zerojax.Executor`.
    batch_shape: `[accum_steps, global_batch, seq_len + 1]`; default one 1-token sequence per device.
      The collectives of a data-parallel step do not depend on it; pass the real shape to compile
      exactly the program that trains.
  """
  state = jax.eval_shape(executor.init, jax.random.key(0))
  state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state,
                       executor.shardings(state))
  batch_shape = tuple(batch_shape or (executor.accum_steps, executor.world, 2))
  executor.check_batch(batch_shape)
  batch = jax.ShapeDtypeStruct(batch_shape, np.int32, sharding=executor.batch_sharding)
  return executor.step_fn().lower(state, batch).compile().as_text()


def step_collectives(executor, batch_shape: tuple[int, int, int] | None = None, *,
                     hlo_text: str | None = None) -> list[Collective]:
  """The collectives of one compiled train step of `executor`, with roles (see `step_hlo`).

  Args:
    executor: a `zerojax.Executor`.
    batch_shape: see `step_hlo`.
    hlo_text: the step's optimized HLO when already compiled (skips compiling).

  Returns:
    One `Collective` per collective instruction; `count` is executions per optimizer step.
  """
  return collectives_from_hlo(hlo_text or step_hlo(executor, batch_shape), executor.mesh)


def model_parameters(executor) -> int:
  """Number of model parameters (without the layout's padding)."""
  return sum(leaf.size * (leaf.layers or 1) for leaf in executor.layout.leaves)


def step_report(executor, collectives: list[Collective]) -> dict:
  """JSON-ready accounting of one train step, relative to M = model parameters x 2 bytes.

  Returns:
    `model_parameters`, `model_bytes` (M), `nodes`, `gpus_per_node`; `collectives` (each also with
    `step_*` figures: per execution x `count`); `summary` (`summarize`, with `by_role`); `table1`:
    ZeRO++ Table 1's columns (forward all-gather, backward all-gather, gradient reduction) and the
    step's total, each as bytes a node sends to other nodes per step (`node_egress_bytes`, ring-order
    model), as a multiple of M (`over_model`), and under the uniform-peer model per device; and
    `cross_node_bytes_per_node`: the step's total `node_egress_bytes`, the figure a node's link
    counters measure.
  """
  sizes = dict(zip(executor.mesh.axis_names, executor.mesh.devices.shape))
  m = 2.0 * model_parameters(executor)
  listed = []
  for c in collectives:
    d = dataclasses.asdict(c)
    d["step_bytes_per_device"] = c.count * c.bytes_per_device
    d["step_cross_node_bytes_per_device"] = c.count * c.cross_node_bytes_per_device
    d["step_node_egress_bytes"] = c.count * c.node_egress_bytes
    listed.append(d)
  summary = summarize(collectives, model_bytes=m)
  table = {}
  for role in TABLE1_ROLES + ("total",):
    e = summary["total"] if role == "total" else summary["by_role"].get(role, {})
    egress = e.get("node_egress_bytes", 0.0)
    table[role] = {"count": e.get("count", 0), "node_egress_bytes": egress, "over_model": egress / m,
                   "cross_node_bytes_per_device": e.get("cross_node_bytes_per_device", 0.0)}
  return {
      "model_parameters": model_parameters(executor), "model_bytes": m,
      "nodes": sizes.get("node", 1), "gpus_per_node": sizes.get("gpu", 1),
      "collectives": listed, "summary": summary, "table1": table,
      "cross_node_bytes_per_node": summary["total"]["node_egress_bytes"],
  }


def _gin_executor(gin_files: list[str], gin_params: list[str], nodes: int):
  """Parses the gin config as `train.py` does and builds its executor; returns it with `train`'s args."""
  import gin

  from zerojax import gin_registry, trainer  # noqa: F401  (registers the gin configurables)

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  gin.add_config_file_search_path(root)
  for f in gin_files:
    if not os.path.exists(f) and not os.path.exists(os.path.join(root, f)):
      raise FileNotFoundError(f"--gin_file {f!r} does not exist (configs are in configs/)")
  gin.parse_config_files_and_bindings([f if os.path.exists(f) else os.path.join(root, f) for f in gin_files],
                                      gin_params)
  args = {k: v.default for k, v in inspect.signature(trainer.train).parameters.items()
          if v.default is not inspect.Parameter.empty}
  args.update(gin.get_bindings(trainer.train))
  if args.get("plan", gin.REQUIRED) is gin.REQUIRED:
    raise ValueError("the gin config sets no plan; bind train.plan (e.g. include configs/zero3.gin)")
  shared = [k for k in inspect.signature(trainer.build).parameters if k not in ("plan", "num_nodes") and k in args]
  ex = trainer.build(args["plan"], nodes, **{k: args[k] for k in shared})
  return ex, args, trainer.model_config()


def _set_cpu_devices(n: int) -> None:
  """Asks for `n` CPU devices when the backend has not started yet (no-op otherwise)."""
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    pass


def main(argv=None) -> None:
  """Prints the JSON accounting of an HLO dump (`--hlo`) or of a gin config's train step (`--gin_file`)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--hlo", help="optimized HLO text file ('-' for stdin)")
  source.add_argument("--gin_file", action="append", help="gin config of train.py (repeatable)")
  parser.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. train.accum_steps=2")
  parser.add_argument("--mesh", default=None, help="NODESxGPUS, e.g. 2x4 (axes 'node', 'gpu'); default 2x4 "
                      "for --gin_file")
  parser.add_argument("--model-bytes", type=float, default=None, help="model size M in bytes (--hlo)")
  parser.add_argument("--list", action="store_true", help="also list every collective (--hlo)")
  parser.add_argument("--dump_hlo", default=None, help="also write the compiled step's HLO here (--gin_file)")
  args = parser.parse_args(argv)
  if args.hlo and args.mesh is None:
    parser.error("--hlo needs --mesh NODESxGPUS")
  try:
    nodes, gpus = (int(v) for v in (args.mesh or "2x4").lower().split("x"))
  except ValueError:
    parser.error(f"--mesh {args.mesh!r} is not NODESxGPUS, e.g. 2x4")
  if args.hlo:
    mesh = jax.sharding.AbstractMesh((nodes, gpus), ("node", "gpu"))
    text = sys.stdin.read() if args.hlo == "-" else open(args.hlo).read()
    found = collectives_from_hlo(text, mesh)
    out = summarize(found, model_bytes=args.model_bytes)
    if args.list:
      out["collectives"] = [dataclasses.asdict(c) for c in found]
  else:
    _set_cpu_devices(nodes * gpus)
    if jax.device_count() < nodes * gpus:
      raise SystemExit(f"a {nodes}x{gpus} mesh needs {nodes * gpus} devices, but jax has {jax.device_count()}")
    ex, train_args, cfg = _gin_executor(args.gin_file, args.gin_param, nodes)
    if ex.mesh.size != nodes * gpus:
      raise SystemExit(f"the mesh is {dict(ex.mesh.shape)}, not {nodes}x{gpus}; run with exactly "
                       f"{nodes * gpus} devices")
    text = step_hlo(ex, (ex.accum_steps, train_args["batch_size"], cfg.seq_len + 1))
    if args.dump_hlo:
      with open(args.dump_hlo, "w") as f:
        f.write(text)
    out = {"config": {"gin_files": args.gin_file, "gin_params": args.gin_param, "plan": ex.plan.name,
                      "mesh": {k: int(v) for k, v in ex.mesh.shape.items()}, "param_dtype": ex.plan.param_dtype,
                      "reduce_dtype": ex.plan.reduce_dtype, "accum_steps": ex.accum_steps,
                      "batch_size": train_args["batch_size"], "seq_len": cfg.seq_len}}
    out.update(step_report(ex, step_collectives(ex, hlo_text=text)))
  json.dump(out, sys.stdout, indent=2)
  sys.stdout.write("\n")


if __name__ == "__main__":
  main()
