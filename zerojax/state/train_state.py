"""The train state: what every run carries, plus the states of the plan's stateful components
(`zerojax.state.stateful`) in one mapping.

docs/DESIGN.md, "State across steps". `STATEFUL` lists the kinds of component that carry state across
steps (registering a new kind is one entry); each keeps its state under its `name` in
`TrainState.stateful`, and `stateful_components` gives the ones a plan uses. The executor, the checkpoint
spec and the memory report iterate over those.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax

from zerojax.state.error_feedback import ErrorFeedback
from zerojax.state.diloco import OuterSync
from zerojax.state.radius import RadiusSync

STATEFUL = [RadiusSync, ErrorFeedback, OuterSync]  # the kinds of stateful component, in the order they are built


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any            # fp32 master weights: flat padded leaves sharded over A_os (with a component's
                         # replicas trained apart: a leading replica axis `[replicas, ...]` sharded over them)
  opt_state: Any         # optimizer states, sharded like the master weights
  skipped: jax.Array     # steps skipped for non-finite loss or gradients (total; per replica `[replicas]`)
  rng: Any = None        # uint32 key data of the run's rng (models with `Model.rng`), replicated
  mutable: Any = None    # the model's mutable collections (`Model.init_state`), replicated
  stateful: Any = None   # {name: state} of the plan's stateful components (`STATEFUL`), e.g. "radius":
                         # `RadiusState`, "grad_error": {unit: (e_send, e_node)}, "outer": `OuterState`
  forward: Any = None    # with the master weights in host memory and the update streamed: their 16-bit
                         # rounding, kept on the device between steps for the forward (`HostOffload.forward`);
                         # derived, not stored: a restore rebuilds it (`TrainStates.derive`)


def stateful_components(plan, mesh, layout, metas) -> dict:
  """`{name: component}` of the stateful components a resolved `plan` uses, in `STATEFUL`'s order."""
  out = {}
  for kind in STATEFUL:
    c = kind.of(plan, mesh, layout, metas)
    if c is not None:
      out[kind.name] = c
  return out
