"""One process of a 2-process x 4-device CPU cluster (gloo) for the checkpoint tests.

Restores the single-process checkpoint in OUT_DIR/single onto this cluster under ZeRO-3 (each process
reads only its own devices' parts) and saves it again to OUT_DIR/multi (each process writes only its
own shards).

Usage: python tests/ckpt_worker.py PROCESS_ID PORT OUT_DIR
"""
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zerojax  # noqa: E402
from zerojax import plan as plans  # noqa: E402
from zerojax.train import checkpoint  # noqa: E402
from tests.train_helpers import STEPS, make_executor  # noqa: E402


def main(pid, port, out):
  zerojax.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
  mesh = zerojax.make_mesh()
  assert mesh.devices.shape == (2, 4) and all(d.process_index == n for n in range(2) for d in mesh.devices[n])
  ex = make_executor(plans.zero3(), mesh)
  with checkpoint.Checkpointer(os.path.join(out, "single"), read_only=True) as c:
    state, meta = c.restore(ex)
  assert int(state.step) == STEPS and meta["process_count"] == 1, meta
  assert not state.params["head"]["w_out"].is_fully_addressable
  with checkpoint.Checkpointer(os.path.join(out, "multi")) as c:
    assert c.save(ex, state, seed=meta["seed"])
  print(f"process {pid} done", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
