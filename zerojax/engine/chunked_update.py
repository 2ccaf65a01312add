"""The streamed update's arithmetic: an optax update run on one chunk of the state at a time, with the
whole gradient's global statistics.

The streamed update (`zerojax.executor.offload_update.Streamed`) runs the optimizer on one chunk of the
state at a time (a unit, or one layer of a scanned unit), so only a few chunks' states are on the device at
once. An optax update is elementwise except for its global statistics (`clip_by_global_norm`'s norm):
scalars reduced over every gradient. `global_scalars` computes those once, from the whole gradient, before
the first chunk (a walk of the update's jaxpr); `run_chunk` runs the update on one chunk with them in place
of the chunk's own; `chunk_optimizer` is the user's optimizer on one chunk's layout.

References:
  ZeRO-Offload: Ren et al. 2021, §4. Megatron-Core's chunked optimizer-state offloader.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.engine import layout as layout_lib, logical as logical_lib
from zerojax.engine.jaxpr_walk import sub_jaxprs

_CALLS = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
          "remat", "checkpoint"}
GRAD, STATE = 1, 2  # what a value is computed from: a gradient array (only), or a state/params array


def _walk(jaxpr, consts, args, flags, on_global):
  """Evaluates `jaxpr` on `args` equation by equation, calls inlined. `flags[i]`: 0, GRAD or STATE for
  input i. An equation of only scalar outputs computed from GRAD arrays is a global statistic: its outputs
  are `on_global(outputs)`'s. Equations computed from STATE arrays are not evaluated when their inputs are
  None (`global_scalars`)."""
  env, flag = {}, {}
  lit = lambda v: type(v).__name__ == "Literal"
  for v, x in zip(jaxpr.constvars, consts):
    env[v], flag[v] = x, 0
  for v, x, f in zip(jaxpr.invars, args, flags):
    env[v], flag[v] = x, f
  for eqn in jaxpr.eqns:
    ins = [v.val if lit(v) else env[v] for v in eqn.invars]
    f = max([0] + [0 if lit(v) else flag[v] for v in eqn.invars])
    scalar = all(getattr(v.aval, "ndim", 1) == 0 for v in eqn.outvars)
    subs = list(sub_jaxprs(eqn))
    if f == STATE and scalar:
      raise ValueError(f"the optimizer reduces its states or parameters to a scalar (`{eqn.primitive.name}`, "
                       "e.g. LAMB's trust ratio), which the streamed offloaded update cannot take from one chunk; "
                       "use an optimizer whose only global statistics are of the gradients, or drop offload")
    if any(x is None for x in ins):
      outs = [None] * len(eqn.outvars)
    elif eqn.primitive.name in _CALLS and len(subs) == 1 and len(subs[0][0].invars) == len(ins):
      inner = [0 if lit(v) else flag[v] for v in eqn.invars]
      outs = _walk(subs[0][0], subs[0][1], ins, inner, on_global)
    else:
      bound = eqn.primitive.get_bind_params(eqn.params)  # jax < 0.7: (subfuns, params); later: params
      subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
      outs = eqn.primitive.bind(*subfuns, *ins, **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
      if f == GRAD and scalar:
        outs = on_global(list(outs))
    for v, x in zip(eqn.outvars, outs):
      if type(v).__name__ != "DropVar":
        env[v], flag[v] = x, f
  return [v.val if lit(v) else env[v] for v in jaxpr.outvars]


def _flags(grads, state, params):
  arr = lambda t, f: [f if np.ndim(x) else 0 for x in jax.tree.leaves(t)]
  return arr(grads, GRAD) + arr(state, STATE) + arr(params, STATE)


def global_scalars(update, grads, state, params) -> list:
  """The global statistics of `update(grads, state, params)` (an optax update), in the order it computes
  them, from the whole `grads`; `state` and `params` give shapes only (arrays or ShapeDtypeStructs); their
  scalar leaves (e.g. Adam's count) are read."""
  sds = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), t)
  closed = jax.make_jaxpr(update)(grads, sds(state), sds(params))
  args = jax.tree.leaves(grads) + [x if not np.ndim(x) else None for x in jax.tree.leaves((state, params))]
  found = []
  _walk(closed.jaxpr, closed.consts, args, _flags(grads, state, params), lambda outs: found.extend(outs) or outs)
  return found


def run_chunk(update, scalars: list, grads, state, params):
  """`update(grads, state, params)` on one chunk of the state, its global statistics replaced by
  `scalars` (`global_scalars` of the whole): the values the whole update gives on this chunk."""
  closed, shapes = jax.make_jaxpr(update, return_shape=True)(grads, state, params)
  left = list(scalars)

  def take(outs):
    if len(left) < len(outs):
      raise ValueError("the optimizer's update on one chunk computes other global statistics than on the "
                       "whole state; the streamed offloaded update needs an elementwise optimizer")
    return [left.pop(0) for _ in outs]
  outs = _walk(closed.jaxpr, closed.consts, jax.tree.leaves((grads, state, params)), _flags(grads, state, params), take)
  if left:
    raise ValueError(f"the optimizer's update on one chunk used {len(scalars) - len(left)} of its "
                     f"{len(scalars)} global statistics; the streamed offloaded update needs an elementwise optimizer")
  return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def chunk_layout(layout: layout_lib.Layout, unit: str, scanned: bool) -> layout_lib.Layout:
  """The layout of one chunk: `unit`'s leaves (one layer of each when `scanned`), every other leaf empty
  (zero elements, its rank kept), so that the optimizer sees the whole tree, its names and ranks."""
  tree = layout.tree()
  empty = lambda l: dataclasses.replace(l, shape=(0,) * len(l.shape), padded=0, layers=None if l.layers is None else 1)
  one = lambda l: dataclasses.replace(l, layers=1) if scanned else l
  chunk = {u: jax.tree.map(one if u == unit else empty, tree[u], is_leaf=layout_lib.is_layout) for u in tree}
  leaves, treedef = jax.tree.flatten(chunk, is_leaf=layout_lib.is_layout)
  return layout_lib.Layout(treedef, tuple(leaves))


def chunk_optimizer(optimizer, layout: layout_lib.Layout, unit: str, scanned: bool, to_user, from_user):
  """(the user's `optimizer` on one chunk of `unit` (`chunk_layout`, through `logical.logical_optimizer`),
  the indices of the optimizer-state leaves that are the unit's, (the chunk's parameter shapes, its state
  leaves' shapes))."""
  lay = chunk_layout(layout, unit, scanned)
  opt = logical_lib.logical_optimizer(optimizer, lay, to_user, from_user)
  shapes = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.flat_shape(), jnp.float32), lay.tree(),
                        is_leaf=layout_lib.is_layout)
  states = jax.tree.leaves(jax.eval_shape(opt.init, shapes))
  return opt, [i for i, x in enumerate(states) if x.ndim and x.size], (shapes, states)
