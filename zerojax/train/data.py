"""Byte-level language-modelling data: a corpus of bytes, deterministic batches, sharded device arrays.

With no data path the corpus is the `*.py` source of the running Python's standard library, found at
run time, so every machine has real text without downloading anything. Batches are a pure function
of `(seed, step)`: every process draws the same global batch, and a resumed run sees the same data.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sysconfig

import jax
import numpy as np

_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


@dataclasses.dataclass(frozen=True)
class ByteDataset:
  """A byte corpus split into a training part and the held-out tail.

  Attributes:
    train: uint8 tokens for training.
    eval: uint8 tokens of the held-out split (the end of the corpus).
    source: human-readable description of where the bytes came from.
    vocab_size: number of distinct tokens (one per byte value).
  """
  train: np.ndarray
  eval: np.ndarray
  source: str
  vocab_size: int = 256


def _walk(root: str, skip=()) -> list[str]:
  """Returns the files under `root` sorted by relative path, skipping hidden and `skip` entries."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip]
    found += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
  return sorted(found, key=lambda p: os.path.relpath(p, root))


def _read(files: list[str], max_bytes: int | None) -> tuple[bytes, bool]:
  """Concatenates the files' bytes up to `max_bytes`; also says whether anything was left out."""
  chunks, total = [], 0
  for f in files:
    if max_bytes is not None and total >= max_bytes:
      return b"".join(chunks)[:max_bytes], True
    with open(f, "rb") as fh:
      chunks.append(fh.read())
    total += len(chunks[-1])
  cut = max_bytes is not None and total > max_bytes
  return b"".join(chunks)[:max_bytes], cut


def load_bytes(path: str | None = None, *, max_bytes: int | None = 64 * 2**20,
               eval_fraction: float = 0.05, seq_len: int | None = None) -> ByteDataset:
  """Loads a byte corpus and splits off its last `eval_fraction` as the held-out split.

  Args:
    path: a text file, or a folder whose files (recursively, sorted by path, hidden entries skipped)
      are concatenated. None uses the `*.py` files of the Python standard library.
    max_bytes: keep only the first `max_bytes` bytes of the corpus; None keeps everything.
    eval_fraction: fraction of the corpus held out at its end, in (0, 1).
    seq_len: if given, both splits get at least `seq_len + 1` bytes, enough for one window.

  Returns:
    A `ByteDataset`.

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: a bad argument, or a corpus too small to split.
  """
  if max_bytes is not None and max_bytes < 2:
    raise ValueError(f"max_bytes={max_bytes} is too small; use at least 2 bytes or None for no limit")
  if not 0 < eval_fraction < 1:
    raise ValueError(f"eval_fraction={eval_fraction} must be between 0 and 1, e.g. 0.05")
  if seq_len is not None and seq_len < 1:
    raise ValueError(f"seq_len={seq_len} must be a positive number of tokens")
  if path is None:
    root = sysconfig.get_paths()["stdlib"]
    files = [f for f in _walk(root, _SKIP_DIRS) if f.endswith(".py")]
    what = f"python stdlib ({root}), {len(files)} files"
  elif os.path.isdir(path):
    files = _walk(path)
    what = f"folder '{path}', {len(files)} files"
  elif os.path.exists(path):
    files = [path]
    what = f"file '{path}'"
  else:
    raise FileNotFoundError(f"--data path '{path}' does not exist; pass a text file or a folder of text files")
  raw, cut = _read(files, max_bytes)
  data = np.frombuffer(raw, dtype=np.uint8)
  n = data.size
  least = 1 if seq_len is None else seq_len + 1
  n_eval = max(math.ceil(n * eval_fraction), least)
  if n - n_eval < least:
    raise ValueError(f"the corpus from {what} has {n} bytes, too few to split into train and eval "
                     f"splits of at least {least} bytes each; pass more data")
  what += f", {n / 1e6:.1f} MB" + (f" (first {max_bytes} bytes)" if cut else "")
  return ByteDataset(train=data[:n - n_eval], eval=data[n - n_eval:], source=what)


def batch_at(data: np.ndarray, step: int, *, batch_size: int, seq_len: int, seed: int = 0) -> np.ndarray:
  """Returns `batch_size` windows of `seq_len + 1` tokens at random offsets fixed by `(seed, step)`.

  Args:
    data: 1-D token array.
    step: the data position; the same `(seed, step)` gives the same batch on every process.
    batch_size: number of windows.
    seq_len: tokens per input sequence (each window has one more, for the shifted target).
    seed: data seed.

  Returns:
    An int32 array of shape `[batch_size, seq_len + 1]`.
  """
  if batch_size < 1 or seq_len < 1:
    raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must both be positive")
  if step < 0 or seed < 0:
    raise ValueError(f"step={step} and seed={seed} must both be non-negative")
  if data.ndim != 1 or data.size < seq_len + 1:
    raise ValueError(f"data of shape {data.shape} holds no window of seq_len + 1 = {seq_len + 1} tokens; "
                     "use a 1-D array with more tokens or a shorter seq_len")
  rng = np.random.default_rng([seed, step])
  offsets = rng.integers(0, data.size - seq_len, size=batch_size)
  return data[offsets[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def global_batch(dataset_split: np.ndarray, step: int, *, accum_steps: int, batch_size: int,
                 seq_len: int, seed: int = 0) -> np.ndarray:
  """Returns the `[accum_steps, batch_size, seq_len + 1]` batch of one optimizer step.

  Micro-batch `a` of step `s` is `batch_at(..., step=s * accum_steps + a)`.
  """
  if accum_steps < 1:
    raise ValueError(f"accum_steps={accum_steps} must be at least 1")
  return np.stack([
      batch_at(dataset_split, step * accum_steps + a, batch_size=batch_size, seq_len=seq_len, seed=seed)
      for a in range(accum_steps)])


def device_put_batch(batch: np.ndarray, sharding: jax.sharding.NamedSharding) -> jax.Array:
  """Builds the global `jax.Array` of `batch`; each process transfers only its own devices' rows.

  Args:
    batch: the global batch, identical on every process.
    sharding: how the global array is laid out over the mesh.

  Returns:
    A `jax.Array` of `batch.shape` with `sharding`.
  """
  spec = tuple(sharding.spec)
  if len(spec) > batch.ndim:
    raise ValueError(f"partition spec {sharding.spec} has {len(spec)} entries but the batch has only "
                     f"{batch.ndim} dimensions (shape {batch.shape}); use a spec with at most {batch.ndim}")
  for size, axes in zip(batch.shape, spec):
    if axes is None:
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    k = math.prod(sharding.mesh.shape[a] for a in axes)
    if size % k:
      raise ValueError(f"global batch size {size} is not divisible by the {k} devices of the "
                       f"data-parallel mesh; use a multiple of {k}")
  return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def eval_batches(data: np.ndarray, *, num_batches: int, batch_size: int, seq_len: int,
                 seed: int = 1234) -> list[np.ndarray]:
  """Returns `num_batches` fixed `[batch_size, seq_len + 1]` batches of held-out data."""
  return [batch_at(data, i, batch_size=batch_size, seq_len=seq_len, seed=seed) for i in range(num_batches)]
