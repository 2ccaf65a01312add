"""Remat per plan (`Schedule.remat`): what a ZeRO unit keeps from its forward for its backward.

"full" keeps only the unit's inputs and recomputes the whole forward in backward (the unit's
`custom_vjp` does that itself). "dots" and "none" run the forward under `jax.vjp` of a `jax.checkpoint`
whose policy saves the unit's *activations*, the values that depend on its non-weight inputs: every one
("none"), or only the outputs of matmuls without batch dimensions and the attention's output ("dots", the
weight matmuls, as `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`, and the value named
`ATTENTION`, so a fused attention is not run again; attention scores and elementwise ops are
recomputed). A value computed from the weights alone (a transpose, a cast, a broadcast of a scale) is
never saved, and the weights themselves, inputs of the checkpoint, are dropped from the residuals
(`Saved`): the backward re-gathers them (ZeRO-3, hpZ) and puts them back. So "dots" and "none" trade
activation memory, per layer for the whole backward, for recompute; never gathered weights.

References:
  ZeRO: Rajbhandari et al. 2020, §6.1 (activation checkpointing alongside partitioned parameters).
  Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (recompute for memory).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

MODES = ("full", "dots", "none")
ACTIVATION = "zerojax_activation"
ATTENTION = "attention_out"  # the attention's output (`zerojax.models.attention`): "dots" keeps it


def _saveable(eqn, mode: str) -> bool:
  if mode == "none":
    return True
  if eqn.primitive.name == "name":
    return eqn.params.get("name") == ATTENTION
  if eqn.primitive.name != "dot_general":
    return False
  (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
  return not lhs_batch and not rhs_batch


def _tag_activations(f: Callable, mode: str) -> Callable:
  """`f(tree, *args)` re-evaluated from its jaxpr, with every saveable value that depends on `args`
  named `ACTIVATION` (a value of the weights alone stays unnamed, so the checkpoint recomputes it)."""
  def tagged(tree, *args):
    closed, shape = jax.make_jaxpr(f, return_shape=True)(tree, *args)
    jaxpr, n_w = closed.jaxpr, len(jax.tree.leaves(tree))
    env, acts = {}, set()
    read = lambda v: v.val if hasattr(v, "val") else env[v]  # a Literal, or a Var
    for i, (v, x) in enumerate(zip(jaxpr.invars, jax.tree.leaves((tree, args)))):
      env[v] = x
      if i >= n_w:
        acts.add(v)
    env.update(zip(jaxpr.constvars, closed.consts))
    for eqn in jaxpr.eqns:
      params = eqn.primitive.get_bind_params(eqn.params)  # jax < 0.5: (subfuns, params)
      subfuns, params = params if isinstance(params, tuple) else ((), params)
      outs = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
      act = any(not hasattr(v, "val") and v in acts for v in eqn.invars)
      if act and _saveable(eqn, mode):
        outs = [checkpoint_name(o, ACTIVATION) for o in outs]
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
        if act:
          acts.add(v)
    return jax.tree.unflatten(jax.tree.structure(shape), [read(v) for v in jaxpr.outvars])
  return tagged


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class Saved:
  """A forward's `jax.vjp` function without the weights: `leaves` are its residual arrays, with None
  where `slots` names the weight leaf that goes there (filled again by `vjp_with`)."""
  leaves: list
  treedef: Any
  slots: tuple

  def tree_flatten(self):
    return [x for x in self.leaves if x is not None], (self.treedef, self.slots)

  @classmethod
  def tree_unflatten(cls, aux, children):
    treedef, slots = aux
    it = iter(children)
    return cls([None if s >= 0 else next(it) for s in slots], treedef, slots)

  def vjp_with(self, tree) -> Callable:
    """The forward's vjp function, with the (re-gathered) weights `tree` in the weights' places."""
    weights = jax.tree.leaves(tree)
    return jax.tree.unflatten(self.treedef, [weights[s] if s >= 0 else x for x, s in zip(self.leaves, self.slots)])


def forward(f: Callable, mode: str, tree, *args) -> tuple[Any, Saved]:
  """`f(tree, *args)` and what its backward needs under remat `mode` ("dots" or "none"), the weights
  `tree` excluded."""
  policy = jax.checkpoint_policies.save_only_these_names(ACTIVATION)
  out, vjp = jax.vjp(jax.checkpoint(_tag_activations(f, mode), policy=policy), tree, *args)
  leaves, treedef = jax.tree.flatten(vjp)
  ids = {id(w): i for i, w in enumerate(jax.tree.leaves(tree))}
  slots = tuple(ids.get(id(x), -1) for x in leaves)
  return out, Saved([None if s >= 0 else x for x, s in zip(leaves, slots)], treedef, slots)
