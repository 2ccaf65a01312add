"""The ("node", "gpu") device mesh, for one process or one process per node.

Every plan in zerojax is a choice of axes of this mesh (DESIGN.md). The `node` axis is the slow one
(inter-node links); `gpu` enumerates the devices inside a node. Device (n, g) is at `mesh.devices[n, g]`.
"""
from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("node", "gpu")


def make_mesh(num_nodes: int | None = None, gpus_per_node: int | None = None, *, devices=None,
              secondary_group: int | None = None) -> Mesh:
  """Builds the `("node", "gpu")` mesh, optionally with one axis factored for hpZ groups.

  With several processes (one per host, `jax.process_count() > 1`) the node axis is the process axis
  and `gpu` enumerates each process's local devices; `num_nodes` must then equal the process count.
  With one process, `num_nodes` x `gpus_per_node` local devices are arranged node-major.

  Args:
    num_nodes: number of nodes; defaults to the process count (1 for a single process).
    gpus_per_node: devices per node; defaults to all devices divided by `num_nodes`.
    devices: devices to use (default `jax.devices()`).
    secondary_group: devices per hpZ secondary group (ZeRO++ §3.2) when it is not one node. A divisor k
      of `gpus_per_node` factors `gpu` into `("gpu.group", "gpu.member")` of sizes (G/k, k); a multiple
      k of it factors `node` into `("node.group", "node.member")` of sizes (N·G/k, k/G). Plans name the
      whole axis (`"gpu"`), which resolves to its factors (`Plan.resolve`); hpZ then uses
      `secondary_axes=("gpu.member",)` or `("node.member", "gpu")`. Device order is unchanged.

  Returns:
    A `jax.sharding.Mesh` with axes `("node", "gpu")` (or their factors).
  """
  devices = list(jax.devices() if devices is None else devices)
  nprocs = len({d.process_index for d in devices})
  if num_nodes is None:
    num_nodes = nprocs
  if num_nodes < 1 or (gpus_per_node is not None and gpus_per_node < 1):
    raise ValueError(f"num_nodes={num_nodes} and gpus_per_node={gpus_per_node} must be positive")
  if len(devices) % num_nodes:
    raise ValueError(f"{len(devices)} devices cannot form {num_nodes} nodes of equal size; "
                     f"use a number of nodes that divides {len(devices)}")
  if gpus_per_node is None:
    gpus_per_node = len(devices) // num_nodes
  if num_nodes * gpus_per_node != len(devices):
    raise ValueError(f"a mesh of {num_nodes} nodes x {gpus_per_node} gpus needs {num_nodes * gpus_per_node} "
                     f"devices, but {len(devices)} are available; set gpus_per_node={len(devices) // num_nodes}")
  devices.sort(key=lambda d: (d.process_index, d.id))
  if nprocs > 1 and num_nodes != nprocs:
    raise ValueError(f"with {nprocs} processes the node axis is the process axis: num_nodes must be "
                     f"{nprocs}, got {num_nodes}")
  grid = np.array(devices, dtype=object).reshape(num_nodes, gpus_per_node)
  k = secondary_group
  if k is None or k == gpus_per_node:
    return Mesh(grid, AXES)
  if k > 0 and gpus_per_node % k == 0:
    return Mesh(grid.reshape(num_nodes, gpus_per_node // k, k), ("node", "gpu.group", "gpu.member"))
  if k > 0 and k % gpus_per_node == 0 and num_nodes % (k // gpus_per_node) == 0:
    m = k // gpus_per_node
    return Mesh(grid.reshape(num_nodes // m, m, gpus_per_node), ("node.group", "node.member", "gpu"))
  raise ValueError(f"secondary_group={k} must divide the {gpus_per_node} devices of a node or be a whole "
                   f"number of nodes dividing the {num_nodes} nodes (e.g. {gpus_per_node // 2 or 1} or "
                   f"{2 * gpus_per_node})")


def axis_sizes(mesh) -> dict[str, int]:
  """`{axis name: size}` of a `Mesh` or `AbstractMesh`, in mesh order."""
  return {a: int(mesh.shape[a]) for a in mesh.axis_names}


def group_size(mesh, axes) -> int:
  """Devices in one group along `axes` (1 for no axes): the shard degree of a component over them."""
  sizes = axis_sizes(mesh)
  return math.prod(sizes[a] for a in axes)


def owner_index(axes) -> jax.Array:
  """Inside `shard_map`: this device's chunk along `axes`, node-major (device (n, g) owns n * G + g).

  A tiled all-gather over `axes` concatenates the chunks in this order, so it returns a leaf in its
  original order (DESIGN.md, "Parameter layout").
  """
  return jax.lax.axis_index(tuple(axes))


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Starts JAX's distributed runtime: one process per node (NCCL on GPU, gloo on CPU).

  With no arguments, `jax.distributed.initialize` detects SLURM, Open MPI and similar launchers. On CPU
  the cross-process collectives go through gloo over TCP.
  """
  if num_processes == 1 and coordinator is None:
    return
  explicit = (coordinator, num_processes, process_id)
  if any(a is not None for a in explicit) and not all(a is not None for a in explicit):
    raise ValueError("--coordinator, --num_processes and --process_id go together (got "
                     f"{coordinator!r}, {num_processes!r}, {process_id!r}); give all three or none")
  if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)
