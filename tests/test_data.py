"""Tests for zerojax.train.data: sources, epochs of windows, per-process rows, the prefetcher, bad input."""
import os
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.train import data
from zerojax.train.token_file import DataError, Sidecar, write_sidecar


def token_file(path, ids, dtype="uint16", vocab=None, **fields):
  np.asarray(ids, dtype).tofile(path)
  if vocab is not None:
    write_sidecar(str(path), Sidecar(dtype=dtype, tokens=len(ids), vocab_size=vocab, **fields))
  return str(path)


class StubTokenizer:
  path, vocab_size = "/tok/tokenizer.json", 1000


def test_stdlib_default_is_bytes_read_by_offset():
  ds = data.open_data(seq_len=64)
  assert ds.kind == "bytes" and ds.vocab_size == 256 and ds.source.startswith("bytes from python stdlib (")
  assert len(ds.train) + len(ds.eval) > 5 * 2**20  # the whole library: no silent cut
  assert all(isinstance(p, data.FileIds) for p in ds.train.parts)  # read by offset, not loaded
  assert b"def " in ds.train.read(0, 100_000).astype(np.uint8).tobytes()


def test_text_folder_in_path_order_and_tail_held_out(tmp_path):
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "z.txt").write_bytes(b"second-" * 10)
  (tmp_path / "a.txt").write_bytes(b"first-" * 10)
  (tmp_path / "c.txt").write_bytes(b"third-" * 10)
  (tmp_path / ".hidden").write_bytes(b"skipped")
  ds = data.open_data(str(tmp_path), seq_len=8, eval_fraction=0.25)
  whole = np.concatenate([ds.train.read(0, len(ds.train)), ds.eval.read(0, len(ds.eval))])
  assert whole.astype(np.uint8).tobytes() == b"first-" * 10 + b"second-" * 10 + b"third-" * 10
  assert len(ds.eval) == 48 and "3 files" in ds.source


def test_token_bin_without_sidecar_takes_data_dtype(tmp_path):
  ids = np.arange(1000) % 700
  ds = data.open_data(token_file(tmp_path / "t.bin", ids, "uint32"), seq_len=16, data_dtype="uint32")
  assert ds.kind == "tokens" and ds.vocab_size is None
  np.testing.assert_array_equal(np.concatenate([ds.train.read(0, len(ds.train)), ds.eval.read(0, len(ds.eval))]), ids)
  with pytest.raises(DataError, match="not a multiple of uint32's 4"):
    np.zeros(1001, np.uint16).tofile(tmp_path / "odd.bin")
    data.open_data(str(tmp_path / "odd.bin"), seq_len=16, data_dtype="uint32")


def test_sidecar_gives_the_vocabulary_and_must_match_the_file(tmp_path):
  path = token_file(tmp_path / "t.bin", np.arange(2000) % 500, vocab=512, max_id=499)
  ds = data.open_data(path, seq_len=16)
  assert ds.vocab_size == 512 and ds.sidecar.max_id == 499
  data.check_vocab(ds, 512)
  data.check_vocab(ds, 640)  # a padded vocabulary
  with pytest.raises(DataError, match="model_config.vocab_size=256 is smaller than the data's vocabulary of 512"):
    data.check_vocab(ds, 256)
  np.zeros(1999, np.uint16).tofile(path)  # truncated
  with pytest.raises(DataError, match="says 2000 tokens but .* holds 1999"):
    data.open_data(path, seq_len=16)


def test_npy_and_folder_of_shards_read_as_one_stream(tmp_path):
  a, b = np.arange(0, 300), np.arange(300, 700)
  np.save(tmp_path / "s0.npy", a.astype(np.uint16))
  np.save(tmp_path / "s1.npy", b.astype(np.uint16))
  ds = data.open_data(str(tmp_path), seq_len=10, data_dtype="uint16")
  assert len(ds.train) + len(ds.eval) == 700
  np.testing.assert_array_equal(ds.train.read(290, 20), np.arange(290, 310))  # across the shards
  np.save(tmp_path / "bad.npy", np.zeros((3, 4), np.uint16))
  with pytest.raises(DataError, match="1-D array of unsigned integers"):
    data.open_data(str(tmp_path / "bad.npy"), seq_len=2)


def test_bad_sources_one_line_each(tmp_path):
  (tmp_path / "mix").mkdir()
  token_file(tmp_path / "mix" / "a.bin", np.arange(100))
  (tmp_path / "mix" / "b.txt").write_text("text")
  (tmp_path / "doc.txt").write_text("some text " * 100)
  cases = [
      (lambda: data.open_data("/no/such/corpus", seq_len=8), "--data path '/no/such/corpus' does not exist"),
      (lambda: data.open_data(str(tmp_path / "mix"), seq_len=8), "mixes token files"),
      (lambda: data.open_data(str(tmp_path / "doc.txt"), seq_len=8, tokenizer=StubTokenizer()),
       "is text but train.tokenizer is set: tokenize it first: python -m zerojax.cli.tokenize --tokenizer "
       "/tok/tokenizer.json --input"),
      (lambda: data.open_data(token_file(tmp_path / "v.bin", np.arange(100), vocab=512), seq_len=8,
                              tokenizer=StubTokenizer()), "vocabulary of 512 ids .* has 1000"),
      (lambda: data.open_data(token_file(tmp_path / "small.bin", np.arange(20)), seq_len=32), "fewer than one window"),
  ]
  for call, message in cases:
    with pytest.raises(DataError, match=message) as e:
      call()
    assert "\n" not in str(e.value)


def test_eval_data_is_a_separate_file(tmp_path):
  train = token_file(tmp_path / "train.bin", np.arange(1000) % 300, vocab=300)
  held = token_file(tmp_path / "val.bin", np.arange(200) % 300, vocab=300)
  ds = data.open_data(train, eval_path=held, seq_len=16)
  assert len(ds.train) == 1000 and len(ds.eval) == 200 and "held out: file" in ds.source
  other = token_file(tmp_path / "other.bin", np.arange(200), vocab=301)
  with pytest.raises(DataError, match="is not made like --data"):
    data.open_data(train, eval_path=other, seq_len=16)


def corpus_of(n):
  return data.Corpus.of([np.arange(n, dtype=np.uint32)])


def test_an_epoch_visits_every_window_once_and_the_next_epoch_reorders():
  w = data.Windows(corpus_of(8 * 50 + 1), 8, seed=3)
  assert w.count == 50
  first = w.rows(0, 50)[:, 0] // 8
  second = w.rows(50, 50)[:, 0] // 8
  assert sorted(first) == list(range(50)) and sorted(second) == list(range(50))
  assert list(first) != list(second) and list(first) != list(range(50))
  rows = w.rows(7, 3)  # consecutive tokens, the target shifted by one
  assert (np.diff(rows, axis=1) == 1).all() and rows.dtype == np.int32 and rows.shape == (3, 9)


def test_a_batch_is_a_pure_function_of_seed_and_step():
  a = data.Windows(corpus_of(5000), 16, seed=7)
  b = data.Windows(corpus_of(5000), 16, seed=7)
  c = data.Windows(corpus_of(5000), 16, seed=8)
  np.testing.assert_array_equal(a.rows(1000, 4), b.rows(1000, 4))
  assert not np.array_equal(a.rows(1000, 4), c.rows(1000, 4))


def test_ids_beyond_the_vocabulary_stop_with_the_sample():
  w = data.Windows(corpus_of(1000), 8, vocab_size=500, what="the training data")
  with pytest.raises(DataError, match="token id .* is not below the model's vocab_size=500"):
    for g in range(0, 200, 4):
      w.rows(g, 4)


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "gpu"))


def test_batches_hold_each_step_and_read_each_row_once(mesh):
  w = data.Windows(corpus_of(20_000), 8, seed=1)
  b = data.Batches(w, NamedSharding(mesh, P(None, ("node", "gpu"))), accum_steps=2, batch_size=16)
  arr = b.at(3)
  assert w.rows_read == 2 * 16  # each row once
  assert arr.shape == (2, 16, 9) and len(arr.sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(arr), b.host(3))
  np.testing.assert_array_equal(b.host(3)[1], w.rows((3 * 2 + 1) * 16, 16))
  with pytest.raises(DataError, match="fewer than one global batch of 64"):
    data.Batches(data.Windows(corpus_of(400), 8), b.sharding, accum_steps=4, batch_size=16)


def test_only_the_addressable_rows_are_read(mesh):
  """Each device's rows are asked for once, by device (a process asks only for its own devices': the
  2-process test below)."""
  w = data.Windows(corpus_of(20_000), 8, seed=1)
  b = data.Batches(w, NamedSharding(mesh, P(None, ("node", "gpu"))), accum_steps=1, batch_size=16)
  asked = []
  b.host = (lambda host: lambda step, rows=None: (asked.append(rows), host(step, rows))[1])(b.host)
  b.at(0)
  assert sorted(asked) == [(2 * i, 2 * i + 2) for i in range(8)]  # one pair of rows per device


def test_eval_arrays_are_fixed(mesh):
  sharding = NamedSharding(mesh, P(("node", "gpu")))
  e1 = data.eval_arrays(corpus_of(3000), sharding, num_batches=2, batch_size=8, seq_len=16)
  e2 = data.eval_arrays(corpus_of(3000), sharding, num_batches=2, batch_size=8, seq_len=16)
  assert all(np.array_equal(x, y) for x, y in zip(e1, e2)) and e1[0].shape == (8, 17)
  assert not np.array_equal(e1[0], e1[1])


def test_prefetcher_keeps_ahead_in_order_and_raises_the_makers_error():
  made = []

  def make(step):
    made.append(step)
    if step == 6:
      raise DataError("bad step 6")
    return step * 10

  p = data.Prefetcher(make, 3, 10, depth=2)
  time.sleep(0.2)
  assert made == [3, 4, 5]  # two queued, one waiting to be queued
  assert [p.get(s)[0] for s in (3, 4, 5)] == [30, 40, 50]
  with pytest.raises(DataError, match="bad step 6"):
    p.get(6)
  p.close()
  p = data.Prefetcher(lambda s: s, 0, 1000, depth=2)
  p.close()
  assert not any(t.name == "zerojax-data" and t.is_alive() for t in threading.enumerate())


@pytest.mark.multiprocess
def test_each_of_two_processes_reads_only_its_own_rows(tmp_path):
  """2 processes x 4 devices: each reads the rows of its 4 devices (half of every batch), and together they
  hold exactly the batch one process computes alone."""
  import json
  import subprocess
  import sys
  from tests.helpers import free_port
  from tests.train_helpers import outputs_of
  path = token_file(tmp_path / "t.bin", np.random.default_rng(0).integers(0, 900, 50_000), vocab=1000)
  port, worker = free_port(), os.path.join(os.path.dirname(__file__), "data_worker.py")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, worker, str(i), str(port), path], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
  outs = outputs_of(procs, timeout=300)
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  reports = [json.loads(next(l for l in out.splitlines() if l.startswith("{"))) for out in outs]
  assert [r["rows_read"] for r in reports] == [3 * 2 * 8, 3 * 2 * 8]  # half of 3 steps x 2 x 16 rows each
  assert not set(reports[0]["held"]) & set(reports[1]["held"])
  held = {**reports[0]["held"], **reports[1]["held"]}
  ds = data.open_data(path, seq_len=16)
  alone = data.Batches(data.Windows(ds.train, 16, seed=5), None, accum_steps=2, batch_size=16)
  expected = {f"{s}/{a}/{r}": int(row.astype(np.int64).sum())
              for s in range(3) for a, rows in enumerate(alone.host(s)) for r, row in enumerate(rows)}
  assert held == expected
