"""Host offload in the train step compiled for 2 x 4 compile-only H100s (`zerojax.gpu_aot`): the offloaded
leaves are host-memory parameters of the program (layout memory space S(5)), XLA's host arguments are
`memory_report`'s host bytes to the byte, and the device's peak drops by at least 80% of them.

Needs jax's CUDA plugin (`pip install -e '.[gpu-aot]'`); nothing runs on a GPU."""
import re

import gin
import pytest

from zerojax import gpu_aot

pytestmark = pytest.mark.gpu_compile
if not gpu_aot.plugin_installed():
  pytest.skip("compiling for GPUs needs jax's CUDA plugin: pip install -e '.[gpu-aot]'", allow_module_level=True)

from zerojax.cli import compile as compile_cli  # noqa: E402

SMALL = ["model_config.d_model=64", "model_config.seq_len=32", "model_config.num_layers=4", "train.batch_size=8"]
PARAM = re.compile(r"= \S+\{[^}]*?(:S\(5\))?\} parameter\(\d+\).*?op_name=\"(state\.[a-z_]+)")


def compiled(config: str, offload: tuple):
  gin.clear_config()
  try:
    name = config.split("/")[-1][:-4]
    ex, args, cfg = compile_cli.gin_executor([config], SMALL + [f"{name}.offload={offload!r}"], "h100", 2, 4)
    prog, _ = gpu_aot.compile_step(ex, (ex.accum_steps, args["batch_size"], cfg.seq_len + 1))
    return ex, prog
  finally:
    gin.clear_config()


@pytest.mark.parametrize("config, offload", [("configs/zero3.gin", ("opt_state", "master")),
                                             ("configs/mics.gin", ("opt_state",))])
def test_offloaded_leaves_stay_in_host_memory_and_leave_the_device_peak(config, offload):
  ex0, prog0 = compiled(config, ())
  ex, prog = compiled(config, offload)
  # where each argument of the step lives: S(5) is XLA's host memory space
  fields = {"opt_state": "state.opt_state", "master": "state.params"}
  host_fields = {fields[f] for f in offload}
  seen = {}
  for m in PARAM.finditer(prog.as_text()):
    seen.setdefault(m.group(2), set()).add(bool(m.group(1)))
  for field, in_host in seen.items():
    assert in_host == ({True} if field in host_fields else {False}), (field, in_host)
  assert host_fields <= set(seen)
  base, mem = gpu_aot.memory(prog0), gpu_aot.memory(prog)
  host = compile_cli.memory_report(ex)["expected"]["host"]
  assert mem["host"]["argument"] == host > 0 and base["host"]["argument"] == 0
  assert mem["argument"] == base["argument"] - host  # what left the device's arguments is what the host holds
  assert base["device_peak"] - mem["device_peak"] >= 0.8 * host, (base, mem, host)


def test_init_writes_offloaded_states_to_host_memory():
  """`Executor.init`'s last program (the optimizer's states from the master weights) writes the offloaded
  fields to host memory as it makes them: its host outputs are `memory_report`'s host bytes."""
  import jax
  from jax.sharding import NamedSharding

  gin.clear_config()
  try:
    ex, _, _ = compile_cli.gin_executor(["configs/zero3.gin"], SMALL + ["zero3.offload=('opt_state', 'master')"],
                                        "h100", 2, 4)
  finally:
    gin.clear_config()
  flat = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(ex.mesh, s)),
                      ex.flat_shapes(), ex.param_specs)
  prog = jax.jit(ex.init_from_flat, out_shardings=ex.shardings()).lower(flat).compile()
  assert gpu_aot.memory(prog)["host"]["output"] == compile_cli.memory_report(ex)["expected"]["host"] > 0
