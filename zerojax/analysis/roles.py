"""Roles of a train step's collectives, read from the JAX source paths in the HLO metadata."""
from __future__ import annotations

import dataclasses
import math
import re

from zerojax.analysis.hlo_text import Collective, Instr, Module


ROLES = ("forward all-gather", "backward all-gather", "gradient reduction", "replica sync",
         "parameter update gather", "metrics", "other")


def op_name(attrs: str) -> str:
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
  if c.op == "all-reduce" and backward:  # the unit reduces by reduce-scatter / all-to-all; an all-reduce
    return "replica sync"                # in backward is the replica sync overlapped with it (sync_in_backward)
  if backward or (c.op == "reduce-scatter" and in_step):
    return "gradient reduction"
  if c.op == "all-reduce" and in_step:
    return "replica sync"
  return "other"


def _forward(op_name: str) -> bool:
  return "jvp(" in op_name and "transpose(" not in op_name


def feeds_forward(mod: Module, comp: str, value: Instr, depth: int = 16) -> bool:
  """Whether the result reaches, through instructions without a source path, forward-pass code."""
  frontier, seen = [value], {value.name}
  for _ in range(depth):
    nxt = []
    for instr in frontier:
      for user in mod.users[comp].get(instr.name, []):
        name = op_name(user.attrs)
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
    replica sync             all-reduce of gradients over the replica axes (DP, MiCS), after the
                             micro-batches or inside the last one's backward
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

