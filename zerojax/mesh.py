"""The ("node", "gpu") device mesh, for one process, one per node or one per GPU, and its factorings.

Every plan in zerojax is a choice of axes of this mesh (docs/DESIGN.md). The `node` axis is the slow one
(inter-node links); `gpu` enumerates the devices inside a node. Device (n, g) is at `mesh.devices[n, g]`
and has rank n * G + g. A group of k consecutive ranks (a MiCS partition group, an hpZ secondary group,
an AMSP shard group) that divides a node or spans whole nodes becomes a set of mesh axes once the mesh
is factored at k (`factor`, `group_axes`): one mechanism for all of them.

References:
  MiCS: Zhang et al. 2022, §3.2 (partition groups of consecutive ranks, replication groups strided).
  ZeRO++: Wang et al. 2023, §3.2 (hpZ secondary groups). AMSP: Chen et al. 2023, §3 (shard degrees).
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import socket

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("node", "gpu")


def make_mesh(num_nodes: int | None = None, gpus_per_node: int | None = None, *, devices=None,
              nodes_of: tuple[int, ...] | None = None) -> Mesh:
  """Builds the `("node", "gpu")` mesh.

  With several processes the node axis is the hosts: the processes of one node (`process_nodes`: the
  cluster's node id, or the host name) form one node, whatever the number of processes per host, and
  `gpu` enumerates that node's devices (process by process). `num_nodes` must then equal the number of
  nodes. With one process, `num_nodes` x `gpus_per_node` local devices are arranged node-major. Plans that
  shard over groups smaller or larger than a node factor this mesh themselves (`factor`).

  Args:
    num_nodes: number of nodes; defaults to the number of nodes the processes run on (1 for one process).
    gpus_per_node: devices per node; defaults to all devices divided by `num_nodes`.
    devices: devices to use (default `jax.devices()`).
    nodes_of: the node of each process index (default `process_nodes()` with several processes).

  Returns:
    A `jax.sharding.Mesh` with axes `("node", "gpu")`.
  """
  devices = list(jax.devices() if devices is None else devices)
  procs = sorted({d.process_index for d in devices})
  nprocs = len(procs)
  if nprocs > 1:
    if nodes_of is None and jax.process_count() > 1:
      nodes_of = process_nodes()
    # devices of other processes than this run's (a compile-only GPU topology): each process is a node
    node = {p: nodes_of[p] if nodes_of is not None else p for p in procs}
    nnodes = len(set(node.values()))
    if num_nodes is None:
      num_nodes = nnodes
    if num_nodes != nnodes:
      raise ValueError(f"the {nprocs} processes run on {nnodes} nodes (hosts), and the node axis is the nodes: "
                       f"num_nodes must be {nnodes}, got {num_nodes}")
    order = {n: i for i, n in enumerate(dict.fromkeys(node[p] for p in procs))}  # nodes by their first process
    devices.sort(key=lambda d: (order[node[d.process_index]], d.process_index, d.id))
    sizes = {n: sum(node[d.process_index] == n for d in devices) for n in order}
    if len(set(sizes.values())) > 1:
      raise ValueError(f"the nodes hold different numbers of devices ({sizes}); give every node the same "
                       "number of processes and devices")
  elif num_nodes is None:
    num_nodes = 1
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
  if nprocs == 1:
    devices.sort(key=lambda d: d.id)
  return Mesh(np.array(devices, dtype=object).reshape(num_nodes, gpus_per_node), AXES)


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
  original order (docs/DESIGN.md, "Parameter layout").
  """
  return jax.lax.axis_index(tuple(axes))


def base_shape(mesh) -> tuple[int, int]:
  """(nodes, gpus per node) of a `("node", "gpu")` mesh or of any factoring of it."""
  sizes = axis_sizes(mesh)
  nodes = math.prod(v for a, v in sizes.items() if is_node_axis(a))
  return nodes, math.prod(sizes.values()) // nodes


def is_node_axis(name: str) -> bool:
  """Whether a mesh axis is `node` or one of its factors (it tells nodes apart)."""
  return name == "node" or name.startswith("node.")


def check_group(group: int, nodes: int, gpus: int, what: str = "group") -> None:
  """Raises unless `group` consecutive devices form a valid group: a divisor of a node's devices, or a
  whole number of nodes dividing the cluster."""
  world = nodes * gpus
  if group >= 1 and ((gpus % group == 0) or (group % gpus == 0 and nodes % (group // gpus) == 0)):
    return
  allowed = sorted({d for d in range(1, gpus + 1) if gpus % d == 0} |
                   {gpus * m for m in range(1, nodes + 1) if nodes % m == 0})
  raise ValueError(f"{what}={group} is not a valid group of the {nodes} x {gpus} mesh: use one of {allowed} "
                   f"(a divisor of the {gpus} devices of a node, or whole nodes dividing the {world} devices)")


def factor(mesh: Mesh, groups=()) -> Mesh:
  """The mesh with its axes factored so that every group of `groups` consecutive devices is a set of axes.

  Groups are consecutive ranks (rank = node * G + gpu), as in MiCS §3.2 and DeepSpeed; the devices of
  equal position in their groups (the replicas) are then the remaining axes. A group size k that divides
  G cuts `gpu` into factors, one that is m whole nodes cuts `node`. Factors are named by the group they
  complete: with G = 4 and k = 2, `gpu` becomes `("gpu.4", "gpu.2")` of sizes (2, 2), and the group of
  2 is the axis `gpu.2`; with N = 4 nodes and k = 2 nodes, `node` becomes `("node.4", "node.2")`.
  Device order is unchanged: the factored grid is a reshape of the node-major one.
  """
  nodes, gpus = base_shape(mesh)
  for k in groups:
    check_group(k, nodes, gpus)
  gpu_cuts = sorted({k for k in groups if 1 < k < gpus})
  node_cuts = sorted({k // gpus for k in groups if gpus < k < nodes * gpus})
  names, shape = [], []
  for axis, size, cuts in (("node", nodes, node_cuts), ("gpu", gpus, gpu_cuts)):
    chain = cuts + [size]
    for a, b in zip(chain, chain[1:]):
      if b % a:
        raise ValueError(f"groups {sorted(groups)} do not nest: a group of {a} {axis}s cannot tile one of {b}; "
                         "use group sizes that divide one another")
    if not cuts:
      names.append(axis)
      shape.append(size)
      continue
    for hi, lo in zip(reversed(chain), list(reversed(chain))[1:] + [1]):
      names.append(f"{axis}.{hi}")
      shape.append(hi // lo)
  grid = np.asarray(mesh.devices).reshape(shape)
  if tuple(names) == tuple(mesh.axis_names):
    return mesh
  return Mesh(grid, tuple(names))


def group_axes(mesh: Mesh, group: int) -> tuple[str, ...]:
  """The axes of `mesh` (factored by `factor(mesh, [group])`) whose devices form groups of `group`
  consecutive devices, major first; () for a group of one."""
  nodes, gpus = base_shape(mesh)
  sizes = axis_sizes(mesh)
  out, covered = [], 1
  for a in reversed(mesh.axis_names):  # minor first: gpu factors, then node factors
    if covered * sizes[a] > group:
      break
    out.append(a)
    covered *= sizes[a]
  if covered != group:
    raise ValueError(f"a group of {group} devices is not a set of axes of the mesh {dict(sizes)}; factor it "
                     f"with zerojax.mesh.factor(mesh, [{group}])")
  return tuple(reversed(out))


def request_cpu_devices(n: int) -> None:
  """Asks for `n` simulated CPU devices; a no-op once the backend has started (e.g. under pytest)."""
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    pass


# Environment variables that say how many processes a launcher started (Slurm, Open MPI, MPICH / PMI,
# and JAX's own, which examples/k8s sets): a job that names more than one and comes up as one stops.
LAUNCHERS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "JAX_NUM_PROCESSES")
# The node (host) a process runs on, where the launcher says it: zerojax's own, then Slurm's.
NODE_IDS = ("ZEROJAX_NODE_ID", "SLURM_NODEID")


def launched_processes() -> int:
  """How many processes the job's launcher started (1 when none says)."""
  for var in LAUNCHERS:
    if os.environ.get(var, "").strip().isdigit():
      return int(os.environ[var])
  return 1


def processes_on_this_node() -> int:
  """How many processes the launcher started on this node (1 when none says)."""
  for var in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE",
              "MPI_LOCALNRANKS"):
    value = os.environ.get(var, "").split("(")[0].split(",")[0].strip()
    if value.isdigit():
      return int(value)
  return 1


def local_rank() -> int:
  for var in ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK"):
    if os.environ.get(var, "").strip().isdigit():
      return int(os.environ[var])
  return 0


def local_gpu_ids(visible: int) -> list[int] | None:
  """The GPUs this process drives out of the `visible` ones (None: no GPU). One process per node drives
  them all; with one process per GPU each drives the one of its local rank, unless the launcher already
  made only one visible to it (`--gpus-per-task=1`, `CUDA_VISIBLE_DEVICES` per task). JAX's own default
  under Slurm, `[SLURM_LOCALID]`, would leave one process per node with a single GPU."""
  if visible < 1:
    return None
  per_node = processes_on_this_node()
  if per_node > 1 and visible == per_node:
    return [local_rank()]
  return list(range(visible))


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, visible_gpus: int = 0, **options) -> None:
  """Starts JAX's distributed runtime (NCCL on GPU, gloo on CPU), one process per node or one per GPU.

  With no arguments, `jax.distributed.initialize` detects Slurm, Open MPI and similar launchers; JAX's
  variables `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` (what a Kubernetes JobSet
  sets, examples/k8s) stand for the three arguments. `visible_gpus`: the GPUs this process sees, divided
  among the node's processes by `local_gpu_ids`. `options` go to `jax.distributed.initialize` (timeouts).
  On CPU the cross-process collectives go through gloo over TCP.
  """
  coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  if num_processes is None and os.environ.get("JAX_NUM_PROCESSES", "").isdigit():
    num_processes = int(os.environ["JAX_NUM_PROCESSES"])
  if process_id is None and os.environ.get("JAX_PROCESS_ID", "").isdigit():
    process_id = int(os.environ["JAX_PROCESS_ID"])
  if num_processes == 1 and coordinator is None:
    return
  explicit = (coordinator, num_processes, process_id)
  if any(a is not None for a in explicit) and not all(a is not None for a in explicit):
    raise ValueError("--coordinator, --num_processes and --process_id go together (got "
                     f"{coordinator!r}, {num_processes!r}, {process_id!r}); give all three or none "
                     "(or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
  if num_processes == 1:
    return
  if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  gpus = local_gpu_ids(visible_gpus)
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id, **({"local_device_ids": gpus} if gpus else {}), **options)


def node_name() -> str:
  """This process's node: the launcher's node id (`NODE_IDS`) where set, else the host name on an
  accelerator; on CPUs without a node id each process is a node of its own (the emulated cluster)."""
  for var in NODE_IDS:
    if os.environ.get(var):
      return f"{var}={os.environ[var]}"
  if jax.default_backend() == "cpu":
    return f"process {jax.process_index()}"
  return f"host {socket.gethostname()}"


@functools.cache
def process_nodes() -> tuple[int, ...]:
  """The node of every process (by process index): processes of the same `node_name` share one, numbered
  in the order of their first process. A collective across the processes (computed once)."""
  if jax.process_count() == 1:
    return (0,)
  from jax.experimental import multihost_utils
  mine = np.frombuffer(hashlib.sha1(node_name().encode()).digest()[:8], np.uint8)
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
  keys = [bytes(row) for row in every]
  first = {k: i for i, k in enumerate(dict.fromkeys(keys))}
  return tuple(first[k] for k in keys)
