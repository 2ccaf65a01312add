"""The sub-jaxprs of a jaxpr equation, for the checks that read a traced function.

A control-flow or call primitive (`pjit`, `scan`, `cond`, `while`, `custom_vjp_call`, `remat`, ...) holds
its body in its params as a `Jaxpr` or a `ClosedJaxpr` (a jaxpr with its constants), alone or in a tuple
(the branches of `cond`). The checks of a unit's collectives (`zerojax.engine.unit.check_collectives`), of the
uses of parameter shards and of the optimizer's update (`zerojax.engine.logical`) descend through them with
`sub_jaxprs`.
"""
from __future__ import annotations


def sub_jaxprs(eqn):
  """Yields `(jaxpr, consts)` for every jaxpr in `eqn`'s params (`consts` is `()` for an open jaxpr)."""
  for v in eqn.params.values():
    for j in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(j, "eqns"):
        yield j, ()
      elif hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
        yield j.jaxpr, getattr(j, "consts", ())
