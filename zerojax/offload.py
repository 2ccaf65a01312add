"""Optimizer states and fp32 master weights in host memory (`Sharding.offload`), through JAX memory kinds.

ZeRO-Offload (Ren et al. 2021, §4) keeps the optimizer states and the fp32 master weights in host memory,
where they are 12 of mixed-precision Adam's 16 bytes per parameter: the devices keep the 16-bit
parameters, the gradients and the activations. Here the offloaded train-state fields are global arrays
whose shardings have the memory kind "pinned_host" (the same shards as on the device, in each device's
host memory); the step moves them to the device where it reads them and back after the optimizer's update
(`fetch` / `store`, `jax.device_put` to a memory space inside the jitted step), and XLA schedules the
copies. The update itself runs on the device: XLA:GPU runs host computations only experimentally
(docs/offload.md compares the two on the compiled program).

`HostOffload` is the component of `zerojax.components.compile` that decides where each field lives: the
executor's shardings (`place`), the step (`fetch`, `store`), the checkpoint spec (through the shardings)
and `zerojax.memory.memory_report` (`host`) ask it; nothing else names a memory kind.

References:
  ZeRO-Offload: Ren et al. 2021, §4 (what moves to the host), §4.1 (the data flow of one step).
  ZeRO-Infinity: Rajbhandari et al. 2021, §5.
"""
from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding

from zerojax.plan_checks import OFFLOADABLE

HOST = "pinned_host"  # the memory kind of offloaded state: page-locked, so copies to the device are DMA
FIELD = {"opt_state": "opt_state", "master": "params"}  # `Sharding.offload`'s names -> `TrainState` fields
assert set(FIELD) == set(OFFLOADABLE)


@dataclasses.dataclass(frozen=True)
class HostOffload:
  """Which train-state fields live in host memory (`Sharding.offload`), and their moves in the step.

  Attributes:
    fields: the `TrainState` fields held in host memory ("params": the fp32 master weights, "opt_state").
      Only their arrays (ndim >= 1) move; scalars such as Adam's step count stay on the device.
  """
  fields: tuple[str, ...] = ()

  @classmethod
  def of(cls, plan, mesh: Mesh) -> "HostOffload":
    offload = plan.sharding.offload
    if offload:
      check_supported(mesh, f"plan {plan.name!r}: offload={offload}")
    return cls(tuple(FIELD[f] for f in offload))

  def host(self, field: str) -> bool:
    return field in self.fields

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
