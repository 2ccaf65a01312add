"""Compile-only GPUs: the train step compiled for H100s or A100s on a machine without any GPU.

With jax's CUDA plugin installed (`pip install -e '.[gpu-aot]'`) and the host backend the CPU,
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=..., topology="1xNxG")`
returns N x G devices of the GPU described by a `GpuTargetConfigProto` (the files in
`zerojax/gpu_targets/`). A program sharded over them lowers and compiles with XLA's GPU pipeline
(latency-hiding scheduler, async collectives, Triton fusions for the target's compute capability);
nothing runs. `compiled.as_text()` is the scheduled GPU program, `compiled.memory_analysis()` its
per-device memory (`zerojax.executor.aot.compile_step` compiles an executor's train step for abstract
inputs, `memory` reads the bytes).

The executor compiles its step for GPU meshes (real or compile-only) with `GPU_COMPILER_OPTIONS`, so
the program `zerojax.cli.compile` reads is the one a GPU run gets (`compiler_options`); an option the
user sets in `XLA_FLAGS` wins over zerojax's (`options_report`). `device_memory` is what a device can
allocate, for `remat="auto"` (`zerojax.planner.remat`).

Compile-only GPUs list no memories, so jax drops the memory kind of their shardings: a step with offloaded
state (`Sharding.offload`) traced on them has no input in host memory, and XLA schedules its moves unlike a
GPU's (the bulk fetch of a 4.09 B GPT: a 35.9 GB device peak against the real H100's 60.1 GB,
docs/offload.md). `zerojax.executor.aot.compile_step` therefore compiles such a step as a GPU's jax types
it (`compile_as_on_gpu`): traced on as many CPU devices (which have "pinned_host", like GPUs) with the
GPU's choices (an executor built with `gpu=True`), lowered for CUDA and compiled for the compile-only GPUs
(62.7 GB for that step, 4% over the GPU's allocation). Other steps compile on the GPUs' own mesh.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import jax

TARGETS = {"h100": "h100.txtpb", "a100": "a100.txtpb"}
PIP = "pip install -e '.[gpu-aot]'"

# XLA options for GPU programs. XLA:GPU keeps one collective in flight by default, so a layer's gradient
# reduce-scatter waits for the next layer's prefetched gather (or the gather for the reduction) and one
# of them runs with nothing beside it; two in flight let both overlap the layer's compute
# (`zerojax.analysis.schedule`, tests/test_gpu_compile.py).
GPU_COMPILER_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
# XLA:GPU runs each move between host and device memory inside a loop (a dynamic slice of a host array into
# device memory, a `dynamic_update_slice` of a device array into a host one) as an async computation, and
# its scheduler keeps two of those in flight by default. A step with offloaded state moves each array of a
# chunk both ways (`zerojax.engine.offload_stream.stream_layers`): with two in flight, a layer's 3 x (its arrays)
# fetches ran one after another and its stores after them, the link's two directions never at once. The
# limit is raised to every move of the offloaded state's arrays (`compiler_options`' `host_moves`).
ASYNC_MOVES = "xla_gpu_experimental_parallel_async_compute_limit"


class PluginMissing(RuntimeError):
  pass


def target_config(target: str) -> str:
  """The `GpuTargetConfigProto` text of `target` ("h100": H100 SXM 80 GB, sm_90; "a100": A100/A800 SXM
  80 GB, sm_80)."""
  if target not in TARGETS:
    raise ValueError(f"target {target!r} is not one of {sorted(TARGETS)}; use e.g. --target=h100")
  with open(os.path.join(os.path.dirname(__file__), "gpu_targets", TARGETS[target])) as f:
    return f.read()


def plugin_installed() -> bool:
  """Whether jax's CUDA plugin (the `gpu-aot` extra) is installed."""
  try:
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))
  except ModuleNotFoundError:  # no jax_plugins package at all
    return False


def check_plugin() -> None:
  """Raises `PluginMissing` (one line naming the pip command) when jax's CUDA plugin is not installed."""
  if not plugin_installed():
    raise PluginMissing(f"compiling for GPUs needs jax's CUDA plugin (jax-cuda12-plugin, jax-cuda12-pjrt "
                        f"{jax.__version__} and nvidia-cuda-nvcc-cu12); install it with: {PIP}")


def compile_only_host() -> None:
  """Prepares this process to compile for compile-only GPUs: its own backend stays the CPU (unless
  `jax_platforms` is set) and the CUDA plugin must be installed (`PluginMissing` otherwise)."""
  if not jax.config.jax_platforms:
    jax.config.update("jax_platforms", "cpu")
  check_plugin()


def devices(target: str, nodes: int, gpus: int) -> list:
  """`nodes` x `gpus` compile-only devices of `target` (topology "1 x nodes x gpus")."""
  from jax.experimental import topologies

  if nodes < 1 or gpus < 1:
    raise ValueError(f"a mesh of {nodes}x{gpus} GPUs: use positive NODESxGPUS, e.g. 2x4")
  check_plugin()
  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                        topology=f"1x{nodes}x{gpus}")
  except Exception as e:  # the plugin's errors are XlaRuntimeErrors of several kinds
    raise PluginMissing(f"jax's CUDA plugin could not describe {nodes}x{gpus} {target} GPUs ({e}); run with "
                        f"JAX_PLATFORMS=cpu and the plugin of jax {jax.__version__} ({PIP})") from None
  return list(topo.devices)


def target_field(target: str, name: str) -> str:
  """The value of field `name` in `target`'s description (`target_config`), unquoted: "device_description_str"
  is the device kind (e.g. "NVIDIA H100 80GB HBM3"), "device_memory_size" its bytes."""
  return next(line.split(":", 1)[1].strip().strip('"') for line in target_config(target).splitlines()
              if line.strip().startswith(name))


@contextlib.contextmanager
def lowering_for(target: str):
  """Inside it, kernels lower for `target`'s GPU ("h100", "a100") on a host with no GPU attached. From jax
  0.12 on, Pallas's Triton lowering reads the GPU's compute capability from the abstract mesh's device,
  which a `shard_map` over GPU devices sets but a plain `jit` of inputs on compile-only GPUs or a
  `jax.export` for CUDA does not; this sets it (a mesh of no axes). Earlier jax reads the target from the
  lowering; there it changes nothing."""
  kind = target_field(target, "device_description_str")
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
    yield


def is_gpu(mesh_) -> bool:
  """Whether a mesh's devices are GPUs (real or compile-only). An executor built with `gpu=True` makes the
  GPU's choices on any devices (`Plan.resolve`, `components.compile`: their `gpu` argument)."""
  devs = getattr(mesh_, "devices", None)
  return devs is not None and hasattr(devs, "flat") and next(iter(devs.flat)).platform in ("gpu", "cuda")


def compile_only(mesh_) -> bool:
  """Whether a mesh's devices are compile-only GPUs (`devices`): GPUs that list no memories."""
  if not is_gpu(mesh_) or next(iter(mesh_.devices.flat)).platform not in ("gpu", "cuda"):
    return False
  try:
    return not next(iter(mesh_.devices.flat)).addressable_memories()
  except Exception:  # noqa: BLE001 - a device without memories may also raise
    return True


def user_xla_flags(env=None) -> dict:
  """`{name: value}` of the XLA options set in the `XLA_FLAGS` environment variable (`--name=value`)."""
  out = {}
  for item in (env if env is not None else os.environ).get("XLA_FLAGS", "").split():
    name, _, value = item.lstrip("-").partition("=")
    out[name] = value
  return out


def compiler_options(mesh_, env=None, host_moves: int = 0) -> dict:
  """The XLA options the executor compiles with on `mesh_`: `GPU_COMPILER_OPTIONS` on GPUs, and where the step
  moves `host_moves` > 2 arrays between host and device memory (offloaded state) `ASYNC_MOVES` at that many,
  less any the user set in `XLA_FLAGS` (theirs wins: `options_report`); none elsewhere."""
  if not is_gpu(mesh_):
    return {}
  user = user_xla_flags(env)
  ours = {**GPU_COMPILER_OPTIONS, **({ASYNC_MOVES: host_moves} if host_moves > 2 else {})}
  return {k: v for k, v in ours.items() if k not in user}


def options_report(mesh_, env=None, host_moves: int = 0) -> dict:
  """What the step compiles with on `mesh_`: `{"applied": zerojax's options, "user": the user's XLA_FLAGS
  settings of the same options, which win}`."""
  user = user_xla_flags(env)
  names = [*GPU_COMPILER_OPTIONS, ASYNC_MOVES]
  return {"applied": compiler_options(mesh_, env, host_moves),
          "user": {k: user[k] for k in names if k in user} if is_gpu(mesh_) else {}}


def device_memory(mesh_, env=None) -> int | None:
  """Bytes a device of `mesh_` can allocate: a GPU's allocator limit (`memory_stats()["bytes_limit"]`), a
  compile-only GPU's `device_memory_size` (its target description) times jax's preallocated fraction
  (`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 by default); None where the device reports neither (CPUs)."""
  device = next(iter(mesh_.devices.flat))
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 - compile-only devices and some platforms have none
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  if not is_gpu(mesh_):
    return None
  kind = device.device_kind.lower()
  target = next((t for t in TARGETS if t in kind), None)
  if target is None:
    return None
  size = int(target_field(target, "device_memory_size"))
  fraction = float((env if env is not None else os.environ).get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
  return int(size * fraction)


def memory(compiled) -> dict | None:
  """Per-device bytes of the compiled program (`compiled.memory_analysis()`); None where the platform
  analyses no memory, 0 for a figure it does not report."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - not every platform implements it
    return None
  if m is None:
    return None
  size = lambda name: int(getattr(m, name, 0) or 0)
  out = {k: size(k + "_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
  out["peak"] = size("peak_memory_in_bytes") or out["argument"] + out["output"] - out["alias"] + out["temp"]
  if out["peak"] < out["temp"]:  # the CPU backend's peak leaves its temporaries out: not a peak
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  # Host memory (offloaded state, `Sharding.offload`): XLA counts its arguments, outputs and temporaries
  # apart from the device's, but its peak (a simulation of every buffer's live range) counts the host
  # buffers too: with the same step's state offloaded it is unchanged. Arguments live through the whole
  # program, so the device's peak is at most that peak less the host arguments (and less the host
  # outputs that are not aliased to them, with no host temporaries); it is also at most the device's
  # arguments + outputs - aliased + temporaries. `device_peak` is the smaller bound.
  h = {k: size(f"host_{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
  out["host"] = h
  bounds = [out["argument"] + out["output"] - out["alias"] + out["temp"]]
  if not h["temp"]:
    bounds.append(out["peak"] - h["argument"] - (h["output"] - h["alias"]))
  out["device_peak"] = min(out["peak"], *bounds)
  return out
