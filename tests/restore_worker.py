"""One process of a 2-process x 4-device CPU cluster (gloo) restoring a checkpoint that only process 1
fails to read (tests/test_restore_faults.py): first an I/O error on every read, then a missing file
once. Prints one JSON line per case: what this process's `resume` returned or raised.

Usage: python tests/restore_worker.py PROCESS_ID PORT CHECKPOINT_FOLDER
"""
import errno
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import orbax.checkpoint as ocp  # noqa: E402

import zerojax  # noqa: E402
from zerojax import plan as plans  # noqa: E402
from zerojax.train import checkpoint  # noqa: E402
from tests.train_helpers import make_executor  # noqa: E402


def main(pid, port, path):
  zerojax.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
  ex = make_executor(plans.zero3(), zerojax.make_mesh())
  real = ocp.StandardCheckpointHandler.restore
  for case, error, times in [("trouble", OSError(errno.EIO, "Input/output error"), None),
                             ("damage", FileNotFoundError(errno.ENOENT, "a file is missing"), 1)]:
    calls = []

    def restore(self, *args, **kwargs):
      calls.append(1)
      if jax.process_index() == 1 and (times is None or len(calls) <= times):
        raise error
      return real(self, *args, **kwargs)

    ocp.StandardCheckpointHandler.restore = restore
    try:
      with checkpoint.Checkpointer(path) as c:
        resumed = checkpoint.resume(ex, c, warn=lambda m: None, tries=2, backoff_s=0)
      out = {"case": case, "step": int(resumed.state.step)}
    except checkpoint.CheckpointError as e:
      out = {"case": case, "error": type(e).__name__}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
