"""The executor's train step compiled ahead of time, for abstract inputs: nothing runs. Beside the executor,
whose step it lowers; the GPUs it compiles for (compile-only or real), their options and the memory of a
compiled program are `zerojax.gpu_aot`'s.

On compile-only GPUs a step with offloaded state (`Sharding.offload`) would lose its inputs' host memory
kind (their devices list no memories), so `compile_step` compiles it as a GPU's jax types it
(`compile_as_on_gpu`): the executor rebuilt on as many CPU devices with the GPU's choices
(`Executor.on_devices(..., gpu=True)`), its step lowered for CUDA and compiled for the GPUs
(docs/offload.md, "Compile-only programs and the real GPU's").
"""
from __future__ import annotations

import time

import jax
import numpy as np

from zerojax import gpu_aot


def abstract_inputs(ex, batch_shape):
  """`ShapeDtypeStruct`s with shardings of the train state of `ex` (an `Executor`) and a token batch
  `[accum, batch, seq + 1]`."""
  state = jax.eval_shape(ex.init, jax.random.key(0))
  state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, ex.shardings(state))
  ex.check_batch(batch_shape)
  return state, jax.ShapeDtypeStruct(batch_shape, np.int32, sharding=ex.batch_sharding)


def compile_step(ex, batch_shape, phase: str | None = None):
  """(compiled train step of `ex`, an `Executor`, seconds to lower and compile) for abstract inputs; nothing
  runs. `phase`: which program of a step with phases (`Executor.step_fn`'s `lower`). On compile-only GPUs a
  step with offloaded state compiles as on a GPU (`compile_as_on_gpu`)."""
  t0 = time.perf_counter()
  if gpu_aot.compile_only(ex.mesh) and ex.components.offload.fields:
    compiled = compile_as_on_gpu(ex, batch_shape, phase)
  else:
    compiled = ex.step_fn().lower(*abstract_inputs(ex, batch_shape), phase=phase).compile()
  return compiled, time.perf_counter() - t0


class _Compiled:
  """A compiled executable seen through the methods `gpu_aot.memory` and the schedule readers use."""

  def __init__(self, exe):
    self.exe = exe

  def memory_analysis(self):
    return self.exe.get_compiled_memory_stats()

  def as_text(self) -> str:
    return self.exe.hlo_modules()[0].to_string()


def cpu_devices(n: int) -> list:
  """`n` CPU devices of this process (one-line error naming the setting where it has fewer)."""
  cpus = jax.devices("cpu")
  if len(cpus) < n:
    raise ValueError(f"compiling offloaded state as on {n} GPUs traces the step on {n} CPU devices, but jax has "
                     f"{len(cpus)}; start the process with XLA_FLAGS=--xla_force_host_platform_device_count={n} "
                     f"(or jax.config.update('jax_num_cpu_devices', {n}) before jax's first use)")
  return cpus[:n]


def compile_as_on_gpu(ex, batch_shape, phase: str | None = None):
  """The train step of `ex` (an executor on compile-only GPUs) as a GPU gets it, its offloaded inputs in host
  memory: the same executor on as many CPU devices (`Executor.on_devices(..., gpu=True)`: the GPU's
  prefetch and kernels) traces the step with its inputs' memory kinds; it is lowered for CUDA (cuDNN's
  attention, the kernels' Triton lowering) and compiled with the GPUs' client, each CPU device standing for
  the GPU at its place in the mesh, with the options a GPU run uses (`Executor.compiler_options`). Returns an object
  with `as_text()` and `memory_analysis()`, as a jax `Compiled` has."""
  from jax._src import compiler  # the lowered module compiled for devices jax does not trace on
  from jax._src.lib import xla_client as xc

  gpus = list(ex.mesh.devices.flat)
  twin = ex.on_devices(cpu_devices(len(gpus)), gpu=True)
  traced = twin.step_fn().trace(*abstract_inputs(twin, batch_shape), phase=phase)
  module = traced.lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
  # The module's device ids are positions in the twin's mesh order, a reshape of the same order as the GPUs'
  client = gpus[0].client
  options = compiler.get_compile_options(num_replicas=1, num_partitions=len(gpus),
                                         device_assignment=np.array(gpus).reshape(1, len(gpus)),
                                         env_options_overrides=ex.compiler_options(), backend=client)
  return _Compiled(compiler.backend_compile_and_load(client, module, xc.DeviceList(tuple(gpus)), options, []))
