"""Optimizer states and fp32 master weights in host memory (`Sharding.offload`), through JAX memory kinds.

ZeRO-Offload (Ren et al. 2021, §4) keeps the optimizer states and the fp32 master weights in host memory,
where they are 12 of mixed-precision Adam's 16 bytes per parameter: the devices keep the 16-bit
parameters, the gradients and the activations. Here the offloaded train-state fields are global arrays
whose shardings have the memory kind "pinned_host" (the same shards as on the device, in each device's
host memory); the step moves them to the device where it reads them and back after the optimizer's update
(`fetch` / `store`, `jax.device_put` to a memory space inside the jitted step), and XLA schedules the
copies. The update runs on the device by default, streamed chunk by chunk; `Sharding.offload_update="host"`
runs it on the host instead (`host_update`, `compute_on("device_host")`): only the gradients go down and the
16-bit parameters come up, ZeRO-Offload's data flow (docs/offload.md compares the two).

`HostOffload` is the component of `zerojax.engine.components.compile` that decides where each field lives: the
executor's shardings (`place`), the step (`fetch`, `store`), the checkpoint spec (through the shardings)
and `zerojax.executor.memory.memory_report` (`host`) ask it; nothing else names a memory kind.

References:
  ZeRO-Offload: Ren et al. 2021, §4 (what moves to the host), §4.1 (the data flow of one step).
  ZeRO-Infinity: Rajbhandari et al. 2021, §5.
"""
from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding

import jax.numpy as jnp
import optax

from zerojax.engine import layout as layout_lib, logical as logical_lib
from zerojax.engine.jaxpr_walk import sub_jaxprs
from zerojax.plan.checks import OFFLOADABLE

HOST = "pinned_host"  # the memory kind of offloaded state: page-locked, so copies to the device are DMA
FIELD = {"opt_state": "opt_state", "master": "params"}  # `Sharding.offload`'s names -> `TrainState` fields
assert set(FIELD) == set(OFFLOADABLE)


@dataclasses.dataclass(frozen=True)
class HostOffload:
  """Which train-state fields live in host memory (`Sharding.offload`), and their moves in the step.

  Attributes:
    fields: the `TrainState` fields held in host memory ("params": the fp32 master weights, "opt_state").
      Only their arrays (ndim >= 1) move; scalars such as Adam's step count stay on the device.
    update: `Sharding.offload_update`: "streamed" (on the device, chunk by chunk, `zerojax.executor.offload_update.StreamedUpdate`),
      "bulk" (every state fetched at once after the backward, as a plan with a stateful component does: the
      before of docs/offload.md, which `benchmarks/bench_offload.py --fit_probe --bulk` measures) or "host"
      (on the host, `host_update`).
    forward: the 16-bit dtype of the master weights' rounding the train state keeps on the device between
      steps for the forward (`TrainState.forward`, `keeping_forward`), or None. The streamed update rounds
      each chunk's new master weights on the device: 4 bytes per parameter less host->device per step.
  """
  fields: tuple[str, ...] = ()
  update: str = "streamed"
  forward: object = None

  @classmethod
  def of(cls, plan, mesh: Mesh) -> "HostOffload":
    offload, update = plan.sharding.offload, plan.sharding.offload_update
    if offload:
      check_supported(mesh, f"plan {plan.name!r}: offload={offload}")
      if update == "host":
        check_host_update(mesh, offload, f"plan {plan.name!r}: offload_update='host'")
    return cls(tuple(FIELD[f] for f in offload), update=update)

  @property
  def stream(self) -> bool:
    """The update runs on the device chunk by chunk."""
    return self.update == "streamed"

  @property
  def on_host(self) -> bool:
    """The update runs on the host (`host_update`)."""
    return bool(self.fields) and self.update == "host"

  def host(self, field: str) -> bool:
    return field in self.fields

  def streams(self, stateful: bool) -> bool:
    """The step updates offloaded states on the device chunk by chunk: the update is "streamed" and no
    stateful component reads the whole step's updates (with one, every state is fetched at once)."""
    return bool(self.fields) and self.stream and not stateful

  def keeping_forward(self, dtype, stateful: bool) -> "HostOffload":
    """This offload, keeping the forward's `dtype` rounding of offloaded master weights on the device
    (`forward`) where the update `streams` and `dtype` is 16-bit (an fp32 copy would be the master weights
    themselves)."""
    keep = self.host("params") and self.streams(stateful) and jnp.dtype(dtype).itemsize < 4
    return dataclasses.replace(self, forward=jnp.dtype(dtype) if keep else None)

  def forward_copy(self, params):
    """Inside a trace: the kept rounding (`forward`) of master weights on the device, or None."""
    if self.forward is None:
      return None
    return jax.tree.map(lambda x: x.astype(self.forward), params)

  def moves(self, state) -> int:
    """The most moves between host and device of one chunk's update: each array of the offloaded fields of
    `state` (a `TrainState` of arrays, shapes or shardings) fetched and stored; 0 with the update on the host.
    `gpu_aot.compiler_options` lets XLA keep that many in flight."""
    if self.on_host:
      return 0
    return 2 * sum(len(jax.tree.leaves(getattr(state, f))) for f in self.fields)

  def forward_params(self, master, dtype, kept=None):
    """Inside the jitted step: the master weights the forward reads (step 0 rounds them to `dtype`): their
    rounding kept on the device (`kept`, `TrainState.forward`) widened to fp32, which XLA folds into step 0's
    rounding; rounded on the host with the update there, so 16 bits cross the link (ZeRO-Offload §4.1); else
    fetched."""
    if kept is not None:
      return jax.tree.map(lambda x: x.astype(jnp.float32), kept)
    if self.on_host:
      master = host_call(lambda t: jax.tree.map(lambda x: x.astype(dtype), t), HOST_SPACE)(master)
    return self.fetch("params", master)

  def place(self, field: str, shardings, shapes):
    """The shardings of `field` (a tree like `shapes`, a tree of arrays or ShapeDtypeStructs): with the
    memory kind `HOST` for the arrays of an offloaded field, as they are otherwise."""
    if not self.host(field):
      return shardings
    return jax.tree.map(lambda s, x: s.with_memory_kind(HOST) if x.ndim else s, shardings, shapes)

  def fetch(self, field: str, tree, after=None):
    """Inside the jitted step: `tree` (the state's `field`) in device memory, where the step reads it.

    With `after` (e.g. the step's gradients) the copies start only once `after` exists
    (`lax.optimization_barrier`): the optimizer's states then reach the device after the backward has
    freed its temporaries, instead of at the step's start, where XLA would otherwise put them and where
    they would add to the step's peak as if they had never left.
    """
    if not self.host(field):
      return tree
    if after is not None:
      _, tree = lax.optimization_barrier((after, tree))
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if x.ndim else x, tree)

  def store(self, field: str, tree):
    """Inside the jitted step: the new `field` back in host memory (the step's output shardings say so
    too)."""
    if not self.host(field):
      return tree
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host) if x.ndim else x, tree)


def check_supported(mesh: Mesh, what: str) -> None:
  """Raises a one-line error unless the mesh's devices have host memory the step can address."""
  device = mesh.devices.flat[0]
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # noqa: BLE001  (a backend without memories: treated as none)
    kinds = set()
  if not kinds and device.platform in ("gpu", "cuda"):
    return  # compile-only GPUs (`zerojax.gpu_aot`) list no memories; XLA:GPU has pinned host memory
  if HOST not in kinds:
    raise ValueError(f"{what} needs the memory kind {HOST!r}, which {device.platform} devices of jax "
                     f"{jax.__version__} do not offer (they have {sorted(kinds) or 'none'}); drop offload, or "
                     "run on GPUs or CPUs (jax >= 0.4.31)")


HOST_SPACE = jax.memory.Space.Host


def host_call_api():
  """`compute_on` in the form that names its outputs' memory: jax 0.11+'s `compute_on(compute_type=...,
  out_memory_spaces=...)`, jax 0.10's `compute_on2` (its `compute_on` is a context manager whose outputs are
  device memory); None where jax has neither."""
  from jax.experimental import compute_on as api
  if "out_memory_spaces" in inspect.signature(api.compute_on).parameters:
    return api.compute_on
  return getattr(api, "compute_on2", None)


def host_call(f, out_spaces):
  """`f` computed on the host (`compute_type="device_host"`), its outputs in `out_spaces` (a memory space,
  or a tree of them like `f`'s outputs). Its inputs must be host memory."""
  return host_call_api()(compute_type="device_host", out_memory_spaces=out_spaces)(f)


def check_host_update(mesh: Mesh, offload: tuple, what: str) -> None:
  """Raises a one-line error unless the update can run on the host: both fields offloaded (the update reads
  the master weights and writes them), a jax with `host_call_api`, CPU or GPU devices (where it compiles:
  docs/offload.md)."""
  if set(offload) != set(OFFLOADABLE):
    raise ValueError(f"{what} updates the master weights and optimizer states where they live, so it needs "
                     f"offload=('opt_state', 'master'), not {offload}; offload both or use offload_update='streamed'")
  if host_call_api() is None:
    raise ValueError(f"{what} needs jax's compute_on with out_memory_spaces, which jax {jax.__version__} lacks; "
                     "use offload_update='streamed' or jax >= 0.10")
  platform = mesh.devices.flat[0].platform
  if platform not in ("cpu", "gpu", "cuda"):
    raise ValueError(f"{what} computes on the host of {platform} devices, which zerojax has not compiled; use "
                     "offload_update='streamed'")


def as_device(tree):
  """Inside `host_call`: `tree` typed as device memory. Jax (0.10.2) types an array made inside the host
  computation (a `zeros_like`, e.g. optax's norm takes `x.imag`) as device memory and refuses to add it to a
  host-typed input ("memory_space of all inputs passed to `add` must be the same"): typed alike, they add."""
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if np.ndim(x) else x, tree)


def host_update(update, keep, grads, opt_state, master, finite):
  """Inside the jitted step: `update(grads, opt_state, master)` (an optax update) and its application, computed
  on the host (ZeRO-Offload, Ren et al. 2021, §4.1: the fp32 Adam step on the CPU). The gradients go down;
  the offloaded states and master weights are read and written in host memory and never reach the device;
  scalars (Adam's count, `finite`) go down and the new ones come back. `keep(finite, new, old)` skips a
  non-finite step. -> (new master, new opt_state), arrays in host memory."""
  space = lambda x: HOST_SPACE if np.ndim(x) else jax.memory.Space.Device
  down = lambda t: jax.tree.map(lambda x: jax.device_put(x, HOST_SPACE), t)

  def step(g, s, p, ok):
    g, s, p = as_device((g, s, p))
    updates, s_new = update(g, s, p)
    return keep(ok, optax.apply_updates(p, updates), p), keep(ok, s_new, s)
  spaces = jax.tree.map(space, (master, opt_state))
  return host_call(step, spaces)(down(grads), down(opt_state), down(master), down(finite))


def sharding_kind(sharding: NamedSharding) -> str:
  """The memory kind a sharding names ("device" when it names none)."""
  return sharding.memory_kind or "device"


# The streamed update (`zerojax.executor.offload_update.StreamedUpdate`): the optimizer runs on one chunk of the state at
# a time (a unit, or one layer of a scanned unit), so only a few chunks' states are on the device at once.
# An optax update is elementwise except for its global statistics (`clip_by_global_norm`'s norm): scalars
# reduced over every gradient. `global_scalars` computes those once, from the whole gradient, before the
# first chunk; `run_chunk` runs the update on one chunk with them in place of the chunk's own.

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
