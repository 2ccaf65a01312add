"""One process of a 2-process x 4-device CPU cluster (gloo): trains every plan, saves the parameters.

Usage: python tests/mp_worker.py PROCESS_ID PORT OUT_DIR PLAN [PLAN ...]
"""
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import zerojax  # noqa: E402
from zerojax import plan as plans  # noqa: E402
from tests import helpers  # noqa: E402


def main(pid, port, out, names):
  zerojax.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
  mesh = zerojax.make_mesh()
  assert mesh.devices.shape == (2, 4), mesh.devices.shape
  assert all(d.process_index == n for n in range(2) for d in mesh.devices[n])
  opt = helpers.optimizer("sgd")
  for name in names:
    plan = plans.PLANS[name](param_dtype="float32") if name in plans.PLANS else None
    ex = zerojax.Executor(helpers.tiny_gpt(), opt, plan, mesh, accum_steps=2)
    state = ex.init(jax.random.key(0))
    step = ex.step_fn()
    for b in helpers.batches(3, 2):
      batch = jax.make_array_from_callback(b.shape, ex.batch_sharding, lambda idx, b=b: b[idx])
      state, _ = step(state, batch)
    params = multihost_utils.process_allgather(ex.logical_params(state), tiled=True)
    if pid == 0:
      flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
      np.savez(os.path.join(out, f"{name}.npz"), **flat)
  print(f"process {pid} done", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:])
