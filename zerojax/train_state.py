"""The train state: what every run carries, plus one field per stateful component (`zerojax.stateful`).

docs/DESIGN.md, "State across steps". `STATEFUL` lists the kinds of component that carry state across
steps; each owns the `TrainState` field of its `name` (None when the plan does not use it), and
`stateful_components` gives the ones a plan uses. The executor, the checkpoint spec and the memory report
iterate over those.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax

from zerojax.fidelity import ErrorFeedback
from zerojax.outer_sync import OuterSync
from zerojax.radius_sync import RadiusSync

STATEFUL = (RadiusSync, ErrorFeedback, OuterSync)  # the kinds of stateful component, in the order of their fields


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any            # fp32 master weights: flat padded leaves sharded over A_os (with a component's
                         # `replica_axes`: a leading replica axis `[replicas, ...]` sharded over them)
  opt_state: Any         # optimizer states, sharded like the master weights
  skipped: jax.Array     # steps skipped for non-finite loss or gradients (total; per replica `[replicas]`)
  rng: Any = None        # uint32 key data of the run's rng (models with `Model.rng`), replicated
  mutable: Any = None    # the model's mutable collections (`Model.init_state`), replicated
  # -- one field per kind of `STATEFUL`, named by it: its state, or None when the plan does not use it
  radius: Any = None      # `RadiusSync`: `zerojax.radius_sync.RadiusState`
  grad_error: Any = None  # `ErrorFeedback`: {unit: (e_send, e_node)} (`zerojax.fidelity`)
  outer: Any = None       # `OuterSync`: `zerojax.outer_sync.OuterState` (DiLoCo's outer parameters, momentum)


def stateful_components(plan, mesh, layout, metas) -> dict:
  """`{name: component}` of the stateful components a resolved `plan` uses, in `STATEFUL`'s order."""
  out = {}
  for kind in STATEFUL:
    c = kind.of(plan, mesh, layout, metas)
    if c is not None:
      out[kind.name] = c
  return out
