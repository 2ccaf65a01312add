"""Per-device bytes of model state under a plan: P/s_p + G/s_g + OS/s_os (ZeRO §5, AMSP §3.2), plus the
state of each stateful component the plan uses, as the component counts it (`Stateful.memory_bytes`).

`expected` follows from the plan and the padded layout alone; `measured` reads the shards of a live
train state (master weights and optimizer states) on one device, so the two can be checked against
each other.
"""
from __future__ import annotations

import jax
import numpy as np

from zerojax.engine import layout as layout_lib
from zerojax.mesh import group_size
from zerojax.engine.offload import HOST, sharding_kind
from zerojax.state.train_state import STATEFUL, TrainState


def in_flight(ex, host: int) -> int:
  """The most offloaded bytes per device the step holds on the device at once: with the streamed update
  (docs/offload.md) the three largest chunks' (a unit, or one layer of a scanned unit; a chunk's unit
  fetch waits on the store of the unit two before it), with the bulk fetch all of `host`, with the update
  on the host none (`HostOffload.update`, `Plan.update_mode`)."""
  offload = ex.placement.offload
  if offload.on_host:
    return 0
  if not host or offload.update != "streamed":
    return host
  chunks = []
  for name, tree in ex.layout.tree().items():
    leaves = jax.tree.leaves(tree, is_leaf=layout_lib.is_layout)
    if name in ex.model.scanned:
      chunks += [sum(l.padded for l in leaves)] * max([l.layers or 1 for l in leaves] + [1])
    else:
      chunks.append(sum(l.padded * (l.layers or 1) for l in leaves))
  numel = sum(chunks)
  return host * sum(sorted(chunks)[-3:]) // numel


def memory_report(ex, state: TrainState | None = None) -> dict:
  """Bytes per device of parameters, gradients and optimizer states (master weights included); `host`
  of them in host memory (`Sharding.offload`), `device` the rest.

  Args:
    ex: the executor (plan, mesh, layout).
    state: a live train state; when given, the optimizer-state bytes are measured from its shards.

  Returns:
    `{"expected": {...}, "measured": {...}}` in bytes per device; `measured` only with `state`.
    `expected["host_in_flight"]`: of the `host` bytes, the most on the device at once during the update
    (`in_flight`); `expected["forward_kept"]`: the 16-bit master weights the device keeps between steps with
    them offloaded (`TrainState.forward`), counted in `params`.
  """
  s = lambda axes: group_size(ex.mesh, axes)
  plan, sharding = ex.plan, ex.plan.sharding
  param_dtype = plan.gather.param_dtype
  numel = sum(l.padded * (l.layers or 1) for l in ex.layout.leaves)
  opt_shapes = jax.eval_shape(ex.optimizer.init, ex.flat_shapes())
  opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_shapes) if x.ndim)
  expected = {
      "params": layout_lib.bytes_of(ex.layout, param_dtype) // s(sharding.param_axes),
      "grads": numel * np.dtype(plan.reduction.reduce_dtype).itemsize // s(sharding.grad_axes),
      "master": numel * 4 // s(sharding.opt_axes),
      "optimizer": opt_bytes // s(sharding.opt_axes),
      "param_shard_degree": s(sharding.param_axes), "grad_shard_degree": s(sharding.grad_axes),
      "opt_shard_degree": s(sharding.opt_axes), "numel_padded": numel,
  }
  # hpZ (ZeRO++ §3.2) keeps every unit's secondary shard from its forward to its backward.
  expected["hpz_secondary"] = (layout_lib.bytes_of(ex.layout, param_dtype) // s(plan.gather.secondary_axes)
                               if plan.gather.secondary_axes else 0)
  # State across steps: each kind of stateful component under its name (0 when the plan does not use it).
  for kind in STATEFUL:
    c = ex.stateful.get(kind.name)
    expected[kind.name] = 0 if c is None else c.memory_bytes()
  expected["total"] = sum(expected[k] for k in ("params", "grads", "master", "optimizer", "hpz_secondary",
                                                *(kind.name for kind in STATEFUL)))
  # Host offload (`Sharding.offload`): the offloaded fields' bytes are in host memory, not the device's.
  offload = ex.placement.offload
  expected["host"] = (expected["master"] if offload.host("params") else 0) + (
      expected["optimizer"] if offload.host("opt_state") else 0)
  expected["device"] = expected["total"] - expected["host"]
  expected["host_in_flight"] = in_flight(ex, expected["host"])
  # The 16-bit rounding of offloaded master weights the device keeps between steps (`TrainState.forward`),
  # sharded as they are: the 16-bit parameters of `params`, held from one step to the next.
  kept = offload.forward
  expected["forward_kept"] = 0 if kept is None else expected["master"] // 4 * kept.itemsize
  report = {"plan": plan.name, "expected": expected}
  if state is not None:
    dev = ex.mesh.devices.flat[0]
    on_dev = lambda tree: sum(sh.data.nbytes for x in jax.tree.leaves(tree) if x.ndim
                              for sh in x.addressable_shards if sh.device == dev)
    report["measured"] = {"master": on_dev(state.params), "optimizer": on_dev(state.opt_state)}
    in_host = lambda tree: sum(sh.data.nbytes for x in jax.tree.leaves(tree) if x.ndim and sharding_kind(x.sharding) == HOST
                               for sh in x.addressable_shards if sh.device == dev)
    report["measured"]["host"] = in_host(state.params) + in_host(state.opt_state)
    for name in ex.stateful:
      report["measured"][name] = on_dev(state.stateful[name])
  return report
