"""The optimizer's update computed on the host (`Sharding.offload_update="host"`): jax's `compute_on` with
its outputs in host memory, and the checks that a run can use it.

ZeRO-Offload's data flow: the gradients go down to host memory, the fp32 Adam step runs on the CPU on the
offloaded states and master weights, and only the 16-bit parameters come up (docs/offload.md compares it
with the update on the device).

References:
  ZeRO-Offload: Ren et al. 2021, §4.1 (the data flow of one step, the update on the CPU).
"""
from __future__ import annotations

import inspect

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from zerojax.plan.checks import OFFLOADABLE

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
