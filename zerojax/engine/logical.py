"""The user's view of a sharded model: the optimizer sees the original tree, and misuse fails early.

ZeRO stores every parameter as a flat, zero-padded shard (Rajbhandari et al. 2020, §5; FSDP's flat
parameters). The optimizer still runs on sharded global arrays under `jit`, but it is handed:

- the user's own tree (flax's `params` structure, `Model.to_user`), so masks, labels and per-leaf
  hyper-parameters chosen by *name* see the names the user wrote;
- each leaf reshaped, at no cost, to a *view* of the leaf's logical rank: `[1, ..., 1, padded]` (with the
  layer axis in front for a scanned unit). A mask chosen by `ndim` ("no weight decay on biases and
  norms") is therefore evaluated on the logical rank.

What the view cannot show is the logical shape itself. `check_optimizer` traces the optimizer on the
logical shapes and on the views and refuses, naming the transform's source, one whose behaviour depends
on more than the rank (a mask by `shape[0]`, a hyper-parameter by fan-in) or that computes across a
leaf's axes (Adafactor's factored moments, Muon's orthogonalisation): on a flat shard it would be
silently wrong, and gathering each leaf for it would cost a full copy of that leaf per step.

`unit_calls` reads the units' calls from a traced loss and refuses one that uses a parameter shard
outside a unit (e.g. an L2 penalty on `jax.tree.leaves(params)`), whose gradient would otherwise silently
be zero.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
import optax

from zerojax.engine import layout as layout_lib
from zerojax.engine.jaxpr_walk import sub_jaxprs

_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax",
           "argmin"}
_STRUCTURAL = {"transpose", "rev", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k",
               "slice", "dynamic_slice", "dynamic_update_slice", "gather", "scatter", "scatter-add",
               "scatter_add", "concatenate", "pad", "conv_general_dilated", "squeeze", "expand_dims", "split"}


def view_shape(lay: layout_lib.LeafLayout) -> tuple[int, ...]:
  """The optimizer's view of a flat leaf: its logical rank, all but the last axis of length 1."""
  lead = (lay.layers,) if lay.layers is not None else ()
  return lead + (1,) * max(len(lay.shape) - 1, 0) + (lay.padded,)


def _where(eqn) -> str:
  """`file:line (function)` of the user or optax frame that emitted `eqn`."""
  try:
    frames = list(eqn.source_info.traceback.frames)
  except Exception:  # noqa: BLE001  (jax's source info is internal; the message does without it)
    return "unknown source"
  for fr in frames:
    if "/jax/" not in fr.file_name and "/zerojax/" not in fr.file_name and "/jaxlib/" not in fr.file_name:
      return f"{fr.file_name.split('site-packages/')[-1]}:{fr.line_num} ({fr.function_name})"
  return "unknown source"


def _signature(jaxpr, consts=()) -> list:
  """`(primitive, literal values, equation)` of a jaxpr, recursively, without shapes."""
  out = [("const", repr(np.asarray(c).tolist()), None) for c in consts
         if np.ndim(c) == 0 and not hasattr(c, "aval")]
  for eqn in jaxpr.eqns:
    lits = tuple(repr(np.asarray(v.val).tolist()) for v in eqn.invars if type(v).__name__ == "Literal")
    out.append((eqn.primitive.name, lits, eqn))
    for sub, c in sub_jaxprs(eqn):
      out.extend(_signature(sub, c))
  return out


def _leaf_wise(jaxpr, views: set) -> Any:
  """The first equation that computes across the axes of a leaf-shaped array, or None."""
  tracked = lambda v: hasattr(v, "aval") and hasattr(v.aval, "shape") and tuple(v.aval.shape) in views
  for eqn in jaxpr.eqns:
    subs = list(sub_jaxprs(eqn))
    if subs:
      for sub, _ in subs:
        bad = _leaf_wise(sub, views)
        if bad is not None:
          return bad
      continue
    ins = [v for v in eqn.invars if tracked(v)]
    if not ins:
      continue
    name, ok = eqn.primitive.name, True
    if name in _REDUCE:
      ok = all(sorted(eqn.params.get("axes", ())) == list(range(v.aval.ndim)) for v in ins)
    elif name == "reshape":
      ok = eqn.outvars[0].aval.ndim == 1 or tuple(eqn.outvars[0].aval.shape) == tuple(ins[0].aval.shape)
    elif name == "dot_general":
      (lc, rc), _ = eqn.params["dimension_numbers"]
      ok = all(sorted(c) == list(range(v.aval.ndim)) for v, c in zip(eqn.invars, (lc, rc)) if tracked(v))
    elif name in _STRUCTURAL:
      ok = False
    else:  # elementwise: every non-scalar operand and result has one shape
      shapes = {tuple(v.aval.shape) for v in list(eqn.invars) + list(eqn.outvars)
                if hasattr(v, "aval") and getattr(v.aval, "ndim", 0)}
      ok = len(shapes) <= 1
    if not ok:
      return eqn
  return None


def check_optimizer(optimizer: optax.GradientTransformation, logical: Any, views: Any) -> None:
  """Raises unless `optimizer` behaves the same on the logical shapes and on the rank-preserving views,
  and keeps every non-scalar state leaf in a parameter's shape (so it is stored and sharded as one).

  Args:
    optimizer: the user's optax transformation.
    logical: the user's tree of `ShapeDtypeStruct`s in the logical shapes.
    views: the same tree in the view shapes (`view_shape`).
  """
  refuse = ("zerojax runs the optimizer on ZeRO's flat shards, seen with each leaf's logical rank but not "
            "its shape, so factored optimizers (adafactor) and matrix optimizers (muon) are refused rather "
            "than computed on the wrong shape; use an elementwise optimizer (adamw, lion, sgd, lamb, "
            "clipping) with masks by name or ndim, or a mask tree built from `Executor.user_layout()`")
  s_log, s_view = jax.eval_shape(optimizer.init, logical), jax.eval_shape(optimizer.init, views)
  if jax.tree.structure(s_log) != jax.tree.structure(s_view):
    raise ValueError(f"the optimizer's state depends on the parameters' shapes beyond their rank (its "
                     f"structure differs: {jax.tree.structure(s_log)} vs {jax.tree.structure(s_view)}); "
                     + refuse)
  pairs = {(tuple(a.shape), tuple(b.shape)) for a, b in zip(jax.tree.leaves(logical), jax.tree.leaves(views))}
  shapes = {b for _, b in pairs}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(s_log), jax.tree.leaves(s_view)):
    if ((b.ndim and tuple(b.shape) not in shapes)
        or (tuple(a.shape) != tuple(b.shape) and (tuple(a.shape), tuple(b.shape)) not in pairs)):
      raise ValueError(f"optimizer state {jax.tree_util.keystr(path)} has shape {tuple(a.shape)}, which is "
                       f"not the shape of a parameter; "
                       + refuse)
  j_log = jax.make_jaxpr(optimizer.update)(logical, s_log, logical)
  j_view = jax.make_jaxpr(optimizer.update)(views, s_view, views)
  bad = _leaf_wise(j_view.jaxpr, {tuple(v.shape) for v in jax.tree.leaves(views)})
  if bad is not None:
    raise ValueError(f"the optimizer computes `{bad.primitive.name}` across the axes of a parameter at "
                     f"{_where(bad)}: it needs the parameter's logical shape (factored moments, matrix "
                     f"orthogonalisation such as muon or adafactor); " + refuse)
  sig_log, sig_view = _signature(j_log.jaxpr, j_log.consts), _signature(j_view.jaxpr, j_view.consts)
  if [a[:2] for a in sig_log] != [b[:2] for b in sig_view]:
    a, b = next(((a, b) for a, b in zip(sig_log + [None], sig_view + [None]) if a is None or b is None
                 or a[:2] != b[:2]))
    where = _where(a[2]) if a is not None and a[2] is not None else "the end of the update"
    raise ValueError(f"the optimizer's update depends on the parameters' shapes beyond their rank (it "
                     f"differs at {where}: {a and a[:2]} on the logical shapes, {b and b[:2]} on the "
                     f"shards); " + refuse)


def param_owners(names: tuple[str, ...], params: list, fits: Callable) -> list:
  """The parameters an optimizer-state leaf may belong to, found by its path.

  Optax states mirror the params' tree (`mu`, `nu`, masked or chained), so a state leaf belongs to the
  parameter whose path ends its path; the longest such path wins (("last", "bias") over ("bias",)).

  Args:
    names: the state leaf's path (`layout.path_names`).
    params: `(path names, LeafLayout)` of every parameter in the user's tree.
    fits: which parameters the leaf's shape admits.

  Returns:
    The `LeafLayout`s that fit and whose path ends `names`, the longest only; failing that, all that fit.
  """
  ends = [(len(p), lay) for p, lay in params if fits(lay) and names[-len(p):] == p]
  longest = max((n for n, _ in ends), default=None)
  return [lay for n, lay in ends if n == longest] or [lay for _, lay in params if fits(lay)]


def logical_optimizer(optimizer: optax.GradientTransformation, layout: layout_lib.Layout,
                      to_user: Callable, from_user: Callable) -> optax.GradientTransformationExtraArgs:
  """Wraps `optimizer` to take and return trees of flat leaves (`{unit: ...}`), running it on the
  user's tree of rank-preserving views. Optimizer states shaped like a parameter's view are stored flat,
  so they shard, checkpoint and restore like the parameters (see `zerojax.train.state_spec`)."""
  lays = layout.tree()
  user_params = [(layout_lib.path_names(p), l) for p, l in jax.tree_util.tree_flatten_with_path(
      to_user(lays), is_leaf=layout_lib.is_layout)[0]]
  view = lambda tree: to_user(jax.tree.map(lambda x, l: x.reshape(view_shape(l)), tree, lays))
  flat = lambda tree: jax.tree.map(lambda x, l: x.reshape(l.flat_shape()), from_user(tree), lays)
  sds = lambda shape: jax.ShapeDtypeStruct(shape, np.float32)
  logical = to_user(jax.tree.map(lambda l: sds(l.logical_shape), lays, is_leaf=layout_lib.is_layout))
  views = to_user(jax.tree.map(lambda l: sds(view_shape(l)), lays, is_leaf=layout_lib.is_layout))
  check_optimizer(optimizer, logical, views)
  state_views = jax.eval_shape(optimizer.init, views)
  owners = []  # per state leaf: (view shape, flat shape) of the parameter it belongs to, or None
  for path, x in jax.tree_util.tree_leaves_with_path(state_views):
    shape = tuple(x.shape)
    match = param_owners(layout_lib.path_names(path), user_params, lambda l, shape=shape: view_shape(l) == shape)
    owners.append((shape, match[0].flat_shape()) if x.ndim and match else None)

  def store(state):
    leaves, tree = jax.tree.flatten(state)
    return jax.tree.unflatten(tree, [x.reshape(o[1]) if o else x for x, o in zip(leaves, owners)])

  def load(state):
    leaves, tree = jax.tree.flatten(state)
    return jax.tree.unflatten(tree, [x.reshape(o[0]) if o else x for x, o in zip(leaves, owners)])

  def init(params):
    return store(optimizer.init(view(params)))

  def update(updates, state, params=None, **extra):
    new, state = optax.with_extra_args_support(optimizer).update(
        view(updates), load(state), None if params is None else view(params), **extra)
    return flat(new), store(state)

  return optax.GradientTransformationExtraArgs(init, update)


def unit_calls(jaxpr, shards: dict) -> dict:
  """`{unit: (the rank of the shards each of its calls takes, ...)}`: the unit calls (`custom_vjp_call`s
  that take a unit's parameter shards) of a loss, read through its control flow. A scanned unit's layers
  called one by one (in a `lax.scan`) take shards without the layer axis.

  Args:
    jaxpr: the loss of one micro-batch, traced with the shards as inputs.
    shards: `{unit: the input variables holding its parameter shards}`.

  Raises:
    ValueError: a parameter shard is used other than by a unit's call.
  """
  calls = {u: [] for u in shards}
  bad = _outside_units(jaxpr, {v: u for u, vs in shards.items() for v in vs}, calls)
  if bad is not None:
    raise ValueError(
        f"the loss uses parameters outside a ZeRO unit (`{bad.primitive.name}` at {_where(bad)}), whose "
        "gradient would be silently zero: compute every use of a parameter inside zerojax.unit(f) (e.g. an "
        "L2 penalty as a unit of its own), or for a flax model include the module that reads it in `units`")
  return {u: tuple(c) for u, c in calls.items()}


def _outside_units(jaxpr, tainted: dict, calls: dict):
  """The first equation of `jaxpr` that uses a variable of `tainted` (`{var: unit}`) other than in a
  unit's call, or None; each call appends the rank of its unit's shards to `calls[unit]`."""
  for eqn in jaxpr.eqns:
    ins = [i for i, v in enumerate(eqn.invars) if type(v).__name__ != "Literal" and v in tainted]
    if not ins:
      continue
    if eqn.primitive.name.startswith("custom_vjp_call"):
      for u in dict.fromkeys(tainted[eqn.invars[i]] for i in ins):
        calls[u].append(min(eqn.invars[i].aval.ndim for i in ins if tainted[eqn.invars[i]] == u))
      continue
    subs = [s for s, _ in sub_jaxprs(eqn)]
    if not subs:
      return eqn
    for sub in subs:
      offset = len(eqn.invars) - len(sub.invars)
      if offset < 0:
        return eqn
      inner = {sub.invars[i - offset]: tainted[eqn.invars[i]] for i in ins if i >= offset}
      bad = _outside_units(sub, inner, calls)
      if bad is not None:
        return bad
      passed = [inner[v] for v in sub.outvars if v in inner]
      if passed:
        tainted.update(dict.fromkeys(eqn.outvars, passed[0]))
  return None
