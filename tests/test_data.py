"""Tests for zerojax.train.data: corpus loading, deterministic batches, sharded device arrays."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.train import data


@pytest.fixture(scope="module")
def stdlib():
  return data.load_bytes(max_bytes=8 * 2**20)


def test_stdlib_found_and_large(stdlib):
  assert stdlib.source.startswith("python stdlib (")
  assert stdlib.train.dtype == np.uint8 and stdlib.eval.dtype == np.uint8
  assert stdlib.train.size + stdlib.eval.size == 8 * 2**20
  assert stdlib.vocab_size == 256
  assert b"def " in stdlib.train[:100_000].tobytes()


def test_stdlib_full_is_several_megabytes():
  full = data.load_bytes(max_bytes=None)
  assert full.train.size + full.eval.size > 5 * 2**20
  assert "files" in full.source and "MB" in full.source


def test_split_is_disjoint_tail(tmp_path):
  text = bytes(range(256)) * 40
  (tmp_path / "a.txt").write_bytes(text)
  ds = data.load_bytes(str(tmp_path / "a.txt"), eval_fraction=0.1)
  assert ds.eval.size == 1024 and ds.train.size == len(text) - 1024
  assert np.concatenate([ds.train, ds.eval]).tobytes() == text
  assert ds.source.startswith(f"file '{tmp_path / 'a.txt'}'")


def test_eval_split_holds_one_window(tmp_path):
  (tmp_path / "a.txt").write_bytes(b"x" * 1000)
  ds = data.load_bytes(str(tmp_path / "a.txt"), seq_len=99)
  assert ds.eval.size == 100
  with pytest.raises(ValueError, match="1000 bytes"):
    data.load_bytes(str(tmp_path / "a.txt"), seq_len=600)


def test_folder_is_read_recursively_in_path_order(tmp_path):
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "z.txt").write_bytes(b"second-" * 10)
  (tmp_path / "a.txt").write_bytes(b"first-" * 10)
  (tmp_path / "c.txt").write_bytes(b"third-" * 10)
  (tmp_path / ".hidden").write_bytes(b"skipped")
  ds = data.load_bytes(str(tmp_path), eval_fraction=0.25)
  whole = np.concatenate([ds.train, ds.eval]).tobytes()
  assert whole == b"first-" * 10 + b"second-" * 10 + b"third-" * 10
  assert "3 files" in ds.source


def test_max_bytes_truncates(tmp_path):
  (tmp_path / "a.txt").write_bytes(b"abcd" * 100)
  (tmp_path / "b.txt").write_bytes(b"efgh" * 100)
  ds = data.load_bytes(str(tmp_path), max_bytes=100)
  assert ds.train.size + ds.eval.size == 100
  assert "first 100 bytes" in ds.source


def test_missing_path_error():
  with pytest.raises(FileNotFoundError, match="--data path '/no/such/corpus' does not exist; pass a text file"):
    data.load_bytes("/no/such/corpus")


def test_empty_corpus_error(tmp_path):
  (tmp_path / "empty.txt").write_bytes(b"")
  with pytest.raises(ValueError, match="has 0 bytes"):
    data.load_bytes(str(tmp_path / "empty.txt"))


def test_batch_at_is_deterministic(stdlib):
  a = data.batch_at(stdlib.train, 7, batch_size=4, seq_len=32, seed=3)
  b = data.batch_at(stdlib.train, 7, batch_size=4, seq_len=32, seed=3)
  assert a.shape == (4, 33) and a.dtype == np.int32
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, data.batch_at(stdlib.train, 8, batch_size=4, seq_len=32, seed=3))
  assert not np.array_equal(a, data.batch_at(stdlib.train, 7, batch_size=4, seq_len=32, seed=4))


def test_batch_windows_are_contiguous_slices():
  tokens = np.arange(200, dtype=np.uint8)
  batch = data.batch_at(tokens, 0, batch_size=16, seq_len=10)
  np.testing.assert_array_equal(np.diff(batch, axis=1), np.ones((16, 10), np.int32))
  assert batch.min() >= 0 and batch.max() < 200


def test_batch_at_covers_whole_range_and_rejects_short_data():
  tokens = np.arange(5, dtype=np.uint8)
  batch = data.batch_at(tokens, 0, batch_size=3, seq_len=4)
  np.testing.assert_array_equal(batch, np.tile(np.arange(5, dtype=np.int32), (3, 1)))
  with pytest.raises(ValueError, match="seq_len"):
    data.batch_at(tokens, 0, batch_size=1, seq_len=5)


def test_global_batch_micro_batches(stdlib):
  g = data.global_batch(stdlib.train, 5, accum_steps=3, batch_size=2, seq_len=16, seed=9)
  assert g.shape == (3, 2, 17) and g.dtype == np.int32
  for a in range(3):
    np.testing.assert_array_equal(g[a], data.batch_at(stdlib.train, 15 + a, batch_size=2, seq_len=16, seed=9))


def test_eval_batches_fixed(stdlib):
  e1 = data.eval_batches(stdlib.eval, num_batches=3, batch_size=2, seq_len=16)
  e2 = data.eval_batches(stdlib.eval, num_batches=3, batch_size=2, seq_len=16)
  assert len(e1) == 3 and all(b.shape == (2, 17) for b in e1)
  for x, y in zip(e1, e2):
    np.testing.assert_array_equal(x, y)


def _mesh():
  return Mesh(np.array(jax.devices()).reshape(2, 4), ("node", "gpu"))


def test_device_put_batch_rows_match_numpy(stdlib):
  sharding = NamedSharding(_mesh(), P(None, ("node", "gpu")))
  batch = data.global_batch(stdlib.train, 0, accum_steps=2, batch_size=16, seq_len=8, seed=0)
  arr = data.device_put_batch(batch, sharding)
  assert arr.shape == batch.shape and arr.sharding == sharding
  np.testing.assert_array_equal(np.asarray(arr), batch)
  devices = list(_mesh().devices.flat)
  for shard in arr.addressable_shards:
    k = devices.index(shard.device)
    np.testing.assert_array_equal(np.asarray(shard.data), batch[:, 2 * k:2 * k + 2])


def test_device_put_batch_non_divisible():
  sharding = NamedSharding(_mesh(), P(None, ("node", "gpu")))
  batch = np.zeros((1, 12, 5), np.int32)
  msg = ("global batch size 12 is not divisible by the 8 devices of the data-parallel mesh; "
         "use a multiple of 8")
  with pytest.raises(ValueError, match=msg):
    data.device_put_batch(batch, sharding)
