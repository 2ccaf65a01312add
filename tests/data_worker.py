"""One process of a 2-process x 4-device CPU cluster (gloo) reading the training batches of a token file:
prints the rows it read and the checksum of every row it holds.

Usage: python tests/data_worker.py PROCESS_ID PORT TOKEN_FILE
"""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zerojax  # noqa: E402
from zerojax.train import data  # noqa: E402


def main(pid, port, path):
  zerojax.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
  mesh = zerojax.make_mesh()
  ds = data.open_data(path, seq_len=16)
  windows = data.Windows(ds.train, 16, seed=5, vocab_size=ds.vocab_size)
  batches = data.Batches(windows, NamedSharding(mesh, P(None, ("node", "gpu"))), accum_steps=2, batch_size=16)
  held = {}
  for step in range(3):
    arr = batches.at(step)
    for shard in arr.addressable_shards:
      rows = range(*shard.index[1].indices(16))
      for a in range(2):
        for r, row in zip(rows, np.asarray(shard.data)[a]):
          held[f"{step}/{a}/{r}"] = int(row.astype(np.int64).sum())
  print(json.dumps({"process": pid, "rows_read": windows.rows_read, "held": held}), flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
