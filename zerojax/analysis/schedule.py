"""What a scheduled GPU program runs while each collective is in flight, and which gathered weights live.

XLA:GPU splits a collective into `-start` and `-done` (or `async-start`/`async-done` around it); its
latency-hiding scheduler places other instructions between them, which run while the collective moves
data. In the optimized text of a scheduled module (`is_scheduled=true`) instructions appear in schedule
order, so what lies between a start and its done is what overlaps the transfer. Nothing between them can
use the collective's result, so a gather overlaps only compute that does not need the weights it brings
(another layer's, ZeRO §7's prefetch), and a gradient reduction only compute its layer's gradient does
not depend on.

`schedule_from_hlo` lists, per collective of a train step (`collectives_from_hlo`, with its role):
whether it is async, whether it runs inside a layer loop (a `while` of the model's forward or backward,
i.e. one under `jvp(`), and how many matmuls and kernels (fusions, custom calls) the schedule runs
between its start and done. XLA:GPU's combiners pack several collectives into one buffer and drop their
source paths, which stay on the slices that unpack the result: such a collective gets the role its parts
have (`recovered_role`), so that every collective of a step has one (the in-backward replica all-reduce
of MiCS is "replica sync", the partial sums of the gradient norm "metrics"). `gathered_alive` reads the
live ranges of the gathered weights.

References:
  ZeRO: Rajbhandari et al. 2020, §5.3 and §7 (prefetch and overlap of the parameter gathers).
  ZeRO++: Wang et al. 2023, §4 (overlapping communication with compute).
"""
from __future__ import annotations

import dataclasses
import re

from zerojax.analysis.collectives import Collective, collectives_from_hlo
from zerojax.analysis.hlo_text import (Instr, Module, arrays, async_start_of, attr, callees, done_of, enclosing_loops,
                                       nbytes)
from zerojax.analysis.roles import label_roles, op_name

LAYER_ROLES = ("forward all-gather", "backward all-gather", "gradient reduction")
_ALIASES = ("get-tuple-element", "bitcast", "tuple", "copy")
_MOVES = frozenset({"parameter", "constant", "slice", "dynamic-slice", "bitcast", "bitcast-convert", "reshape",
                    "transpose", "copy", "convert", "concatenate", "tuple", "get-tuple-element", "broadcast"})
_LOOPS = ("while", "call", "conditional")
_NOT_KERNELS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
                          "replica-id", "after-all", "opt-barrier", "add-dependency"})
_MATMUL_TARGETS = re.compile(r"gemm|matmul|conv", re.I)


@dataclasses.dataclass(frozen=True)
class Scheduled:
  """One collective of a scheduled program.

  Attributes:
    collective: the `Collective` (op, dtype, role, bytes, ...).
    is_async: split into start and done (False: it blocks the stream it runs on).
    in_layer_loop: inside a `while` loop of the model's forward or backward (a scanned layer stack).
    loops: enclosing `while` loops.
    matmuls: matmuls (gemm fusions, cuBLAS calls, dots) scheduled between its start and done.
    kernels: kernels (fusions, custom calls) scheduled between its start and done, matmuls included.
  """
  collective: Collective
  is_async: bool
  in_layer_loop: bool
  loops: int
  matmuls: int
  kernels: int

  def to_json(self) -> dict:
    c = self.collective
    return {"name": c.name, "op": c.op, "dtype": c.dtype, "role": c.role, "axes": list(c.axes),
            "result_shapes": [list(s) for s in c.result_shapes], "count": c.count, "async": self.is_async,
            "in_layer_loop": self.in_layer_loop, "loops": self.loops, "matmuls_between": self.matmuls,
            "kernels_between": self.kernels, "computation": c.computation, "op_name": c.op_name}


def kernels(mod: Module, instr: Instr, _depth: int = 0) -> tuple[int, int]:
  """(matmuls, kernels) an instruction launches: a fusion, custom call or unfused op is one kernel, a
  matmul when it holds a dot or convolution (a gemm fusion, a cuBLAS/cuDNN call); loops and calls count
  their bodies' (one iteration)."""
  op = instr.opcode
  if op in _NOT_KERNELS or op.endswith(("-start", "-done", "-update")) or _depth > 8:
    return 0, 0
  if op in ("dot", "convolution"):
    return 1, 1
  if op == "custom-call":
    target = attr(instr.attrs, "custom_call_target") or ""
    return int(bool(_MATMUL_TARGETS.search(target))), 1
  if op == "fusion":
    return int(_holds_dot(mod, instr, _depth)), 1
  if op in ("while", "call", "conditional"):
    m = k = 0
    for c in callees(instr):
      for i in mod.comps.get(c, []):
        dm, dk = kernels(mod, i, _depth + 1)
        m, k = m + dm, k + dk
    return m, k
  return 0, 1


def _holds_dot(mod: Module, instr: Instr, depth: int) -> bool:
  for c in callees(instr):
    for i in mod.comps.get(c, []):
      if i.opcode in ("dot", "convolution") or (i.opcode == "fusion" and depth < 8 and _holds_dot(mod, i, depth + 1)):
        return True
      if i.opcode == "custom-call" and _MATMUL_TARGETS.search(attr(i.attrs, "custom_call_target") or ""):
        return True
  return False


def _start(mod: Module, c: Collective):
  """(computation, start instruction) of a collective as scheduled: its `-start`, the `async-start` that
  wraps it, or the collective itself when it is synchronous."""
  for comp, instrs in mod.comps.items():
    instr = mod.by_name[comp].get(c.name)
    if instr is None:
      continue
    wrapper = async_start_of(mod, comp)
    if wrapper is not None:
      return wrapper.computation, wrapper
    return comp, instr
  raise ValueError(f"collective {c.name} is not in the HLO")


_SLICES = frozenset({"slice", "get-tuple-element", "bitcast"})


def _parts(mod: Module, comp: str, value: Instr) -> list[Instr]:
  """The instructions that unpack a combined collective's result into its parts (slices, or a fusion
  of slices, tuple elements); empty when something else uses it whole."""
  users = mod.users[comp].get(value.name, [])
  unpack = lambda u: u.opcode in _SLICES or (u.opcode == "fusion" and all(
      i.opcode in _SLICES | {"parameter"} for c in callees(u) for i in mod.comps.get(c, [])))
  return users if users and all(unpack(u) for u in users) else []


def recovered_role(mod: Module, comp: str, c: Collective, value: Instr, depth: int = 8) -> str:
  """The role of a collective that has no source path of its own (`c.op_name` empty): labelled
  (`roles.label_roles`) with the source paths of the nearest users of its result that carry one, as
  parts of the shapes its result is unpacked into (a combined all-reduce of two scalar partial sums is
  "metrics", as each scalar's would be); the role those paths agree on most, `c.role` when none says.

  Args:
    mod, comp: the module and the computation holding the collective.
    c: the collective as read (role from the op alone).
    value: the instruction holding its result (the `-done` of an async pair).
  """
  parts = _parts(mod, comp, value)
  shapes = tuple(dims for p in parts for _, dims in arrays(p.shape)) or c.operand_shapes
  names, frontier, seen = [], [value], {value.name}
  for _ in range(depth):
    nxt = []
    for instr in frontier:
      for user in mod.users[comp].get(instr.name, []):
        name = op_name(user.attrs)
        if name:
          names.append(name)
        elif user.name not in seen:
          seen.add(user.name)
          nxt.append(user)
    if names or not nxt:
      break
    frontier = nxt
  if not names:
    return c.role
  found = [r.role for r in label_roles([dataclasses.replace(c, op_name=n, operand_shapes=shapes) for n in names])]
  named = [r for r in found if r != "other"] or found
  return max(sorted(set(named)), key=named.count)


def schedule_from_hlo(hlo_text: str, mesh, *, collectives: list[Collective] | None = None) -> list[Scheduled]:
  """Each collective of an optimized, scheduled HLO text with what overlaps it (see the module docstring).

  Args:
    hlo_text: `compiled.as_text()` of a program sharded over `mesh`.
    mesh: its mesh (as for `collectives_from_hlo`).
    collectives: the program's collectives when already read.

  Returns:
    One `Scheduled` per collective, in the order read; a collective without a source path of its own
    carries the role recovered from its users (`recovered_role`).
  """
  mod = Module(hlo_text)
  out = []
  for c in collectives if collectives is not None else collectives_from_hlo(hlo_text, mesh):
    comp, start = _start(mod, c)
    done = done_of(mod, comp, start) if start.opcode.endswith("-start") else None
    if not c.op_name:
      c = dataclasses.replace(c, role=recovered_role(mod, comp, c, done or start))
    loops = enclosing_loops(mod, comp)
    m = k = 0
    if done is not None:
      order = mod.comps[comp]
      i, j = order.index(start), order.index(done)
      for instr in order[i + 1:j]:
        dm, dk = kernels(mod, instr)
        m, k = m + dm, k + dk
    in_layer = any("jvp(" in op_name(w.attrs) for w in loops)
    out.append(Scheduled(c, done is not None, in_layer, len(loops), m, k))
  return out


def overlap_summary(scheduled: list[Scheduled]) -> dict:
  """Per role (every role found in the layer loops: the three of `LAYER_ROLES`, MiCS's in-backward
  "replica sync", ...), the layer-loop collectives, and those with at least one matmul between start and
  done."""
  out = {}
  for s in scheduled:
    if s.in_layer_loop:
      e = out.setdefault(s.collective.role, {"in_loop": 0, "overlapped": 0})
      e["in_loop"] += 1
      e["overlapped"] += int(s.matmuls > 0)
  return out


# ------------------------------------------------------------------------------------- gathered weights


def gathered_alive(hlo_text: str, scheduled: list[Scheduled]) -> dict:
  """The most gathered weights (arrays gathered by forward or backward all-gathers) alive at once.

  A gathered array lives from its collective's start to its last use through data movement (tuples,
  bitcasts, copies, fusions that only slice or convert it into its leaves); carried by a loop, through
  the loop (counted at the size of the gathered buffer). A loop or call adds the most
  alive in its body at the point it runs.

  Returns:
    `{"arrays": most gathered arrays (or leaves split from them) alive at once, "bytes": most of their
    bytes alive at once, "layer_loops": per layer loop (forward or backward), the most bytes alive while
    it runs and `outside_bytes`, those gathered outside it and alive across it (another unit's weights)}`.
  """
  mod = Module(hlo_text)
  roots = {}
  for s in scheduled:
    if s.collective.role not in ("forward all-gather", "backward all-gather"):
      continue
    comp, start = _start(mod, s.collective)
    done = done_of(mod, comp, start) if start.opcode.endswith("-start") else start
    if done is not None:
      roots.setdefault(comp, []).append((start, done))
  memo, loops_at = {}, []

  def alive(comp: str, depth: int = 0) -> tuple[int, int]:
    if comp in memo or depth > 16:
      return memo.get(comp, (0, 0))
    memo[comp] = (0, 0)
    order = mod.comps[comp]
    pos = {i.name: n for n, i in enumerate(order)}
    intervals = []  # (first, last, units, bytes); `last` excludes a loop that takes the value in
    carried = set()
    root = next((i for i in order if i.root), None)
    for start, done in roots.get(comp, []):
      last, reaches_root = last_use(mod, comp, done, pos)
      size = arrays(done.shape)
      if reaches_root:
        last = len(order)
        carried |= _root_positions(mod, comp, done, root)
      intervals.append((pos[start.name], last, len(size), nbytes(size)))
    loops = enclosing_loops(mod, comp)
    if loops and carried:  # the same arrays enter the next iteration through the body's parameter
      for instr in order:
        if instr.opcode == "get-tuple-element" and mod.by_name[comp].get(instr.operands[0], instr).opcode == \
            "parameter" and _index(instr) in carried:
          last, _ = last_use(mod, comp, instr, pos)
          size = arrays(instr.shape)
          intervals.append((0, last, len(size), nbytes(size)))
    best = (0, 0)
    for n, instr in enumerate(order):
      units = sum(u for a, b, u, _ in intervals if a <= n < b or (a <= n == b and instr.opcode not in _LOOPS))
      size = sum(s for a, b, _, s in intervals if a <= n < b or (a <= n == b and instr.opcode not in _LOOPS))
      if instr.opcode in _LOOPS:
        outside = size
        inner = [alive(c, depth + 1) for c in callees(instr) if c in mod.comps]
        units += max((u for u, _ in inner), default=0)
        size += max((s for _, s in inner), default=0)
        name = op_name(instr.attrs)
        if instr.opcode == "while" and "jvp(" in name:
          loops_at.append({"loop": instr.name, "direction": "backward" if "transpose(" in name else "forward",
                           "arrays": units, "bytes": size, "outside_bytes": outside})
      best = max(best, (units, size))
    memo[comp] = best
    return best

  units, size = alive(mod.entry)
  return {"arrays": units, "bytes": size, "layer_loops": loops_at}


def _index(instr) -> int:
  m = re.search(r"index=(\d+)", instr.attrs)
  return int(m.group(1)) if m else -1


def _moves(mod: Module, instr) -> bool:
  """Whether `instr` only moves or converts data: an alias, or a fusion of slices, converts, ... (the
  gathered buffer split into its leaves): its result is still the gathered weights."""
  if instr.opcode in _ALIASES:
    return True
  return instr.opcode == "fusion" and all(i.opcode in _MOVES for c in callees(instr) for i in mod.comps.get(c, []))


def last_use(mod: Module, comp: str, value, pos: dict) -> tuple[int, bool]:
  """(position of the last use of `value` through data movement, whether it reaches the root)."""
  last, root, frontier, seen = pos[value.name], value.root, [value], {value.name}
  while frontier:
    instr = frontier.pop()
    for user in mod.users[comp].get(instr.name, []):
      if instr.opcode == "tuple" and user.opcode == "get-tuple-element" and \
          instr.operands[_index(user)] not in seen:
        continue  # another element of a tuple that holds the value (e.g. an activation beside it)
      last = max(last, pos[user.name])
      root = root or user.root
      # A tuple is revisited each time another of its elements turns out to hold the value.
      if _moves(mod, user) and (user.name not in seen or user.opcode == "tuple"):
        seen.add(user.name)
        frontier.append(user)
  return last, root


def _root_positions(mod: Module, comp: str, value, root) -> set[int]:
  """Positions of the root tuple that hold `value` (through aliases)."""
  if root is None or root.opcode != "tuple":
    return set()
  names, frontier = {value.name}, [value]
  while frontier:
    instr = frontier.pop()
    for user in mod.users[comp].get(instr.name, []):
      if _moves(mod, user) and user.opcode != "tuple" and user.name not in names:
        names.add(user.name)
        frontier.append(user)
  return {n for n, o in enumerate(root.operands) if o in names}


def kernel_counts(hlo_text: str) -> dict:
  """Kernels the program launches, by kind: fusions by their backend kind (`__triton_gemm`, `__triton`,
  ... or the fusion kind `kLoop`/`kInput`), custom calls by target (Triton kernels of Pallas and
  jax-triton are `__gpu$xla.gpu.triton`)."""
  mod = Module(hlo_text)
  fused = {c for instrs in mod.comps.values() for i in instrs if i.opcode == "fusion" for c in callees(i)}
  out = {}
  for comp, instrs in mod.comps.items():
    if comp in fused:
      continue
    for i in instrs:
      if i.opcode == "fusion":
        m = re.search(r'"kind":"(__[a-z_]+)"', i.attrs)
        key = "fusion " + (m.group(1) if m else (re.search(r"kind=(k\w+)", i.attrs) or [None, "?"])[1])
      elif i.opcode == "custom-call":
        key = "custom-call " + (attr(i.attrs, "custom_call_target") or "?").strip('"')
      else:
        continue
      out[key] = out.get(key, 0) + 1
  return dict(sorted(out.items()))


def merged_backward_gathers(scheduled: list[Scheduled], hlo_text: str) -> list[str]:
  """Backward all-gathers outside the layer loops that start before the forward's layer loop ends (a
  unit's backward gather hoisted into the forward, e.g. merged with an earlier unit's forward gather)."""
  mod = Module(hlo_text)
  out = []
  for s in scheduled:
    c = s.collective
    if c.op != "all-gather" or "transpose(" not in c.op_name or s.in_layer_loop:
      continue
    comp, start = _start(mod, c)
    order = mod.comps[comp]
    fwd_loops = [n for n, i in enumerate(order) if i.opcode == "while" and "jvp(" in op_name(i.attrs)
                 and "transpose(" not in op_name(i.attrs)]
    if fwd_loops and order.index(start) < max(fwd_loops):
      out.append(c.name)
  return out
