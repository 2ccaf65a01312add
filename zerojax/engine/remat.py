"""Remat per plan (`Schedule.remat`): what a ZeRO unit keeps from its forward for its backward.

"full" keeps only the unit's inputs and recomputes the whole forward in backward (the unit's `custom_vjp`
does that itself). "offloaded" is "full" with the kept inputs in host memory: each unit's (each layer's)
input goes down to the host as its forward runs and comes back for its backward (`keep_inputs`,
`inputs_back`), so the device holds none of them between the two; the cost is the activations' bytes over
the host link each way, which XLA may overlap with the layers' compute. "dots" and "none" first cut the
unit's forward where its activations start (`split`): the values of the weights alone (the weights, their
casts, transposes and broadcasts) are computed apart and never saved, since the backward re-gathers the
weights (ZeRO-3, hpZ) and computes them again; the rest, every operation of which depends on the unit's
non-weight inputs, runs under `jax.vjp`. "none" keeps every residual that `jax.vjp` keeps, as a plain
jitted step does (the same values, no more: a checkpoint that names its saved values would save the
inputs of what it cannot name, e.g. the fp32 scores before a softmax, 1.25x the temporaries of the plain
step at remat none on a compile-only H100). "dots" runs it under a `jax.checkpoint` that saves only the outputs of matmuls
without batch dimensions (the weight matmuls, as `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`)
and the attention's output (the value named `ATTENTION`, so a fused attention is not run again);
attention scores and elementwise ops are recomputed. So "dots" and "none" trade activation memory, per
layer for the whole backward, for recompute; never gathered weights.

References:
  ZeRO: Rajbhandari et al. 2020, §6.1 (activation checkpointing alongside partitioned parameters).
  Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost" (recompute for memory).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

ACTIVATION = "zerojax_activation"
RECOMPUTE = ("full", "offloaded")  # the modes whose backward recomputes the unit's whole forward
ATTENTION = "attention_out"  # the attention's output (`zerojax.models.attention`): "dots" keeps it


def recomputes(mode: str) -> bool:
  """Whether the backward under `mode` recomputes the unit's whole forward from its inputs."""
  return mode in RECOMPUTE


def keep_inputs(mode: str, args: tuple) -> tuple:
  """What a recomputing mode keeps of a unit's inputs: the inputs, in host memory under "offloaded"
  (`jax.device_put` to the host memory space inside the step; scalars stay)."""
  if mode != "offloaded":
    return args
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host) if jnp.ndim(x) else x, args)


def inputs_back(mode: str, kept: tuple) -> tuple:
  """The inputs `keep_inputs` kept, back in device memory for the backward."""
  if mode != "offloaded":
    return kept
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if jnp.ndim(x) else x, kept)


def _saveable(eqn, mode: str) -> bool:
  if mode == "none":
    return True
  if eqn.primitive.name == "name":
    return eqn.params.get("name") == ATTENTION
  if eqn.primitive.name != "dot_general":
    return False
  (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
  return not lhs_batch and not rhs_batch


def _is_var(v) -> bool:
  return not hasattr(v, "val")  # a Var, not a Literal


def _eval(eqns, env, tag: str | None):
  """Binds `eqns` in order on the values of `env` (updated); with `tag`, every saveable output (`_saveable`)
  is named `ACTIVATION`."""
  read = lambda v: env[v] if _is_var(v) else v.val
  for eqn in eqns:
    params = eqn.primitive.get_bind_params(eqn.params)  # jax < 0.5: (subfuns, params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    outs = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **params)
    outs = outs if eqn.primitive.multiple_results else [outs]
    if tag is not None and _saveable(eqn, tag):
      outs = [checkpoint_name(o, ACTIVATION) for o in outs]
    env.update(zip(eqn.outvars, outs))
  return read


def split(f: Callable, mode: str, tree, *args) -> tuple[Callable, Callable]:
  """`f(tree, *args)` cut where the activations start: `(weights, body)` with `weights(tree)` the
  values of the weights alone that the rest reads (casts, transposes, broadcasts of the weights; the
  weight leaves themselves; constants) and `body(values, *args)` the rest, whose every operation
  depends on `args`. Under "dots" the body names its saveable values `ACTIVATION`."""
  closed, shape = jax.make_jaxpr(f, return_shape=True)(tree, *args)
  jaxpr, n_w = closed.jaxpr, len(jax.tree.leaves(tree))
  acts = set(jaxpr.invars[n_w:])
  weight_eqns, act_eqns = [], []
  for eqn in jaxpr.eqns:
    if any(_is_var(v) and v in acts for v in eqn.invars):
      act_eqns.append(eqn)
      acts.update(eqn.outvars)
    else:
      weight_eqns.append(eqn)
  reads = [v for e in act_eqns for v in e.invars] + list(jaxpr.outvars)
  needed = list(dict.fromkeys(v for v in reads if _is_var(v) and v not in acts))
  out_tree = jax.tree.structure(shape)

  def weights(tree):
    env = dict(zip(jaxpr.invars[:n_w], jax.tree.leaves(tree)))
    env.update(zip(jaxpr.constvars, closed.consts))
    read = _eval(weight_eqns, env, None)
    return [read(v) for v in needed]

  def body(values, *args):
    env = dict(zip(needed, values))
    env.update(zip(jaxpr.invars[n_w:], jax.tree.leaves(args)))
    read = _eval(act_eqns, env, mode if mode == "dots" else None)
    return jax.tree.unflatten(out_tree, [read(v) for v in jaxpr.outvars])
  return weights, body


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class Saved:
  """A forward's `jax.vjp` function without the weights: `leaves` are its residual arrays, with None
  where `slots` names the value of the weights alone (`split`) that goes there, recomputed from the
  re-gathered weights by `vjp_with`."""
  leaves: list
  treedef: Any
  slots: tuple
  weights: Callable

  def tree_flatten(self):
    return [x for x in self.leaves if x is not None], (self.treedef, self.slots, self.weights)

  @classmethod
  def tree_unflatten(cls, aux, children):
    treedef, slots, weights = aux
    it = iter(children)
    return cls([None if s >= 0 else next(it) for s in slots], treedef, slots, weights)

  def vjp_with(self, tree) -> Callable:
    """The forward's vjp function `g -> (tree cotangent, *argument cotangents)`, its values of the
    weights recomputed from the (re-gathered) weights `tree`."""
    values, weights_vjp = jax.vjp(self.weights, tree)
    vjp = jax.tree.unflatten(self.treedef, [values[s] if s >= 0 else x for x, s in zip(self.leaves, self.slots)])

    def pullback(g):
      dvalues, *dargs = vjp(g)
      return (*weights_vjp(dvalues), *dargs)
    return pullback


def forward(f: Callable, mode: str, tree, *args) -> tuple[Any, Saved]:
  """`f(tree, *args)` and what its backward needs under remat `mode` ("dots" or "none"): the residuals
  of the part that depends on `args` (`split`), none of them a value of the weights alone. "none" keeps
  every residual `jax.vjp` keeps (as a plain jitted step does: the same values, no more); "dots" runs it
  under a `jax.checkpoint` that saves only the values named `ACTIVATION`."""
  weights, body = split(f, mode, tree, *args)
  values = weights(tree)
  if mode == "dots":
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.save_only_these_names(ACTIVATION))
  out, vjp = jax.vjp(body, values, *args)
  leaves, treedef = jax.tree.flatten(vjp)
  ids = {id(w): i for i, w in enumerate(values)}
  slots = tuple(ids.get(id(x), -1) for x in leaves)
  return out, Saved([None if s >= 0 else x for x, s in zip(leaves, slots)], treedef, slots, weights)
