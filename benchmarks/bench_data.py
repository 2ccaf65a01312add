"""The data loader's cost: tokens/s per process, resident memory by corpus size, and the step's data wait.

  python benchmarks/bench_data.py [--big_gb 4] [--out benchmarks/data.json]

1. Loader throughput and memory. Token files of 10 MB and `--big_gb` GB (uint16, random ids, written here
   once under --tmp), each opened and read for `--batches` batches of the default shape (32 x 129) and of
   a GPU-sized one (8 x 2049), in a fresh process each (so one's pages do not count in the other's RSS).
   Each process reports its open time, host tokens/s (rows read and stacked, ids checked) and its
   resident memory after reading: anonymous (what the loader allocates) and file-backed (the mapped
   pages touched, reclaimable page cache).
2. The step's data wait: train.py on the default model and config (`configs/zero3.gin`, 8 CPU devices),
   `data_wait_s` of metrics.jsonl (the time the loop waited for the prefetched batch) over `step_time_s`.

Prints JSON. What should hold: RSS of the 4 GB file within 100 MB of the 10 MB file's, and the data wait
below 2% of the step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_and_save, spread  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_tokens(path: str, nbytes: int, vocab: int = 32000) -> None:
  """A uint16 token file of `nbytes` random ids with its sidecar (written once, chunk by chunk)."""
  import numpy as np
  from zerojax.train.token_file import Sidecar, write_sidecar
  if os.path.exists(path) and os.path.getsize(path) == nbytes:
    return
  rng, chunk = np.random.default_rng(0), 32 * 2**20
  with open(path + ".tmp", "wb") as f:
    for start in range(0, nbytes, chunk):
      rng.integers(0, vocab, min(chunk, nbytes - start) // 2, dtype=np.uint16).tofile(f)
  os.replace(path + ".tmp", path)
  write_sidecar(path, Sidecar(dtype="uint16", tokens=nbytes // 2, vocab_size=vocab, max_id=vocab - 1))


def _status_kb(field: str) -> int:
  for line in open("/proc/self/status"):
    if line.startswith(field + ":"):
      return int(line.split()[1])
  return 0


def read_once(path: str, batch: int, seq_len: int, batches: int) -> dict:
  """In this process: open `path`, read `batches` batches of `batch` windows; time and memory."""
  t0 = time.perf_counter()
  from zerojax.train import data
  t_import = time.perf_counter()
  ds = data.open_data(path, seq_len=seq_len)
  t_open = time.perf_counter()
  b = data.Batches(data.Windows(ds.train, seq_len, 0, ds.vocab_size), None, accum_steps=1, batch_size=batch)
  times = []
  for step in range(batches):
    s = time.perf_counter()
    b.host(step)
    times.append(time.perf_counter() - s)
  per_batch = statistics.median(times)
  return {"file_bytes": os.path.getsize(path), "batch": batch, "seq_len": seq_len, "batches": batches,
          "import_s": t_import - t0, "open_s": t_open - t_import,
          "batch_ms": spread([1e3 * t for t in times]),
          "tokens_per_s": batch * (seq_len + 1) / per_batch,
          "rss_mb": _status_kb("VmRSS") / 1024, "rss_anon_mb": _status_kb("RssAnon") / 1024,
          "rss_file_mb": _status_kb("RssFile") / 1024}


def loader(files: dict, batches: int) -> list[dict]:
  rows = []
  for shape in ((32, 128), (8, 2048)):
    for name, path in files.items():
      try:
        out = subprocess.run([sys.executable, __file__, "--read_one", path, str(shape[0]), str(shape[1]), str(batches)],
                             capture_output=True, text=True, timeout=900, cwd=ROOT)
        row = json.loads(out.stdout.strip().splitlines()[-1])
      except Exception as e:  # noqa: BLE001 - recorded, the benchmark goes on
        row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      rows.append({"file": name, **row})
      print(f"{name} {shape}: {json.dumps(row)}", file=sys.stderr, flush=True)
  return rows


def data_wait(steps: int) -> dict:
  """train.py's default run for `steps` steps: the data wait against the step time."""
  with tempfile.TemporaryDirectory() as work:
    cmd = [sys.executable, "train.py", "--gin_file=configs/zero3.gin", f"--workdir={work}",
           f"--gin_param=train.steps={steps}", "--gin_param=train.progress=False", "--gin_param=train.eval_every=0",
           "--gin_param=train.checkpoint_every=0"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if out.returncode:
      return {"error": out.stderr[-600:]}
    recs = [json.loads(l) for l in open(os.path.join(work, "metrics.jsonl"))][1:]  # step 1 compiles
  waits, steps_s = [r["data_wait_s"] for r in recs], [r["step_time_s"] for r in recs]
  return {"steps": len(recs), "data_wait_ms": spread([1e3 * w for w in waits]),
          "step_time_ms": spread([1e3 * s for s in steps_s]),
          "wait_fraction_of_step": statistics.median(waits) / statistics.median(steps_s),
          "total_wait_fraction": sum(waits) / sum(steps_s)}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--big_gb", type=float, default=4)
  ap.add_argument("--batches", type=int, default=200)
  ap.add_argument("--steps", type=int, default=60, help="train.py steps for the data wait")
  ap.add_argument("--tmp", default=os.path.join(tempfile.gettempdir(), "zerojax_bench_data"))
  ap.add_argument("--out", default=None)
  ap.add_argument("--read_one", nargs=4, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.read_one:
    path, batch, seq, n = args.read_one
    print(json.dumps(read_once(path, int(batch), int(seq), int(n))))
    return
  os.makedirs(args.tmp, exist_ok=True)
  files = {"10MB": os.path.join(args.tmp, "small.bin"), f"{args.big_gb:g}GB": os.path.join(args.tmp, "big.bin")}
  t0 = time.perf_counter()
  write_tokens(files["10MB"], 10 * 2**20)
  write_tokens(files[f"{args.big_gb:g}GB"], int(args.big_gb * 2**30) // 2 * 2)
  print(f"token files ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
  rows = loader(files, args.batches)
  by = {(r["file"], r.get("batch")): r for r in rows}
  small, big = by.get(("10MB", 32), {}), by.get((f"{args.big_gb:g}GB", 32), {})
  result = {"loader": rows, "data_wait": data_wait(args.steps),
            "rss_difference_mb": (big.get("rss_mb", 0) - small.get("rss_mb", 0)) if big and small else None,
            "rss_anon_difference_mb": (big.get("rss_anon_mb", 0) - small.get("rss_anon_mb", 0)) if big and small
            else None,
            "machine": f"{os.cpu_count()} cores", "command": " ".join(["python", "benchmarks/bench_data.py"] +
                                                                       sys.argv[1:])}

  def summary(r):
    w = r["data_wait"]
    return (f"RSS 4 GB - 10 MB: {r['rss_difference_mb']:.1f} MB (anonymous {r['rss_anon_difference_mb']:.1f}); "
            f"data wait {100 * w.get('wait_fraction_of_step', float('nan')):.2f}% of the step")
  print_and_save(result, summary, args.out)


if __name__ == "__main__":
  main()
