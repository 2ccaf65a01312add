"""Optimizer states and fp32 master weights in host memory (`Sharding.offload`), through JAX memory kinds.

ZeRO-Offload (Ren et al. 2021, §4) keeps the optimizer states and the fp32 master weights in host memory,
where they are 12 of mixed-precision Adam's 16 bytes per parameter: the devices keep the 16-bit
parameters, the gradients and the activations. Here the offloaded train-state fields are global arrays
whose shardings have the memory kind "pinned_host" (the same shards as on the device, in each device's
host memory); the step moves them to the device where it reads them and back after the optimizer's update
(`fetch` / `store`, `jax.device_put` to a memory space inside the jitted step), and XLA schedules the
copies. The update runs on the device by default, streamed chunk by chunk; `Sharding.offload_update="host"`
runs it on the host instead (`zerojax.engine.host_update`, `compute_on("device_host")`): only the gradients
go down and the 16-bit parameters come up, ZeRO-Offload's data flow (docs/offload.md compares the two).
The streamed update's arithmetic (an optax update on one chunk) is `zerojax.engine.chunked_update`.

`HostOffload` is the component of `zerojax.engine.components.compile` that decides where each field lives: the
executor's shardings (`place`), the step (`fetch`, `store`), the checkpoint spec (through the shardings)
and `zerojax.executor.memory.memory_report` (`host`) ask it; nothing else names a memory kind.

References:
  ZeRO-Offload: Ren et al. 2021, §4 (what moves to the host), §4.1 (the data flow of one step).
  ZeRO-Infinity: Rajbhandari et al. 2021, §5.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding

from zerojax.engine.host_update import HOST_SPACE, check_host_update, host_call
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
    update: where and how the optimizer's update runs, as the plan decides it (`Plan.update_mode`):
      "device" (nothing offloaded), "streamed" (on the device, chunk by chunk), "bulk" (every state fetched
      at once after the backward: a plan with a component carrying state across steps, or the before of
      docs/offload.md that `benchmarks/bench_offload.py --fit_probe --bulk` measures) or "host" (on the
      host, `host_update`). `zerojax.executor.update` runs each.
    forward: the 16-bit dtype of the master weights' rounding the train state keeps on the device between
      steps for the forward (`TrainState.forward`, `keeping_forward`), or None. The streamed update rounds
      each chunk's new master weights on the device: 4 bytes per parameter less host->device per step.
  """
  fields: tuple[str, ...] = ()
  update: str = "device"
  forward: object = None

  @classmethod
  def of(cls, plan, mesh: Mesh) -> "HostOffload":
    offload = plan.sharding.offload
    if offload:
      check_supported(mesh, f"plan {plan.name!r}: offload={offload}")
      if plan.update_mode == "host":
        check_host_update(mesh, offload, f"plan {plan.name!r}: offload_update='host'")
    return cls(tuple(FIELD[f] for f in offload), update=plan.update_mode)

  @property
  def on_host(self) -> bool:
    """The update runs on the host (`host_update`)."""
    return self.update == "host"

  def host(self, field: str) -> bool:
    return field in self.fields

  def keeping_forward(self, dtype) -> "HostOffload":
    """This offload, keeping the forward's `dtype` rounding of offloaded master weights on the device
    (`forward`) where the update is "streamed" and `dtype` is 16-bit (an fp32 copy would be the master
    weights themselves)."""
    keep = self.host("params") and self.update == "streamed" and jnp.dtype(dtype).itemsize < 4
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


def sharding_kind(sharding: NamedSharding) -> str:
  """The memory kind a sharding names ("device" when it names none)."""
  return sharding.memory_kind or "device"
