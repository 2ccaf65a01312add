"""Training data: token files or byte-level text, read by offset; epochs of windows; each process its own rows.

Sources (`open_data`, `train.py --data`):
- a token file (`OUT.bin`: little-endian uint16 or uint32; `OUT.npy`) with its sidecar `OUT.json`
  (`zerojax.train.token_file`, written by `python -m zerojax.cli.tokenize`), or without one (nanoGPT's
  `train.bin`: `train.data_dtype` gives the dtype, the model's `vocab_size` the vocabulary);
- a folder of such files (shards, read in path order as one stream);
- text: a file or a folder of files, read as bytes (vocabulary 256); by default the `*.py` source of the
  running Python's standard library, found at run time, so every machine has real text without downloading.

No file is read whole: a window's ids are read by offset when a batch needs them (`FileIds`), so a 100 GB
corpus costs no more memory or start-up time than a 100 MB one (benchmarks/bench_data.py).
The held-out split is `--eval_data` where given, else the corpus's last `eval_fraction`.

Batches (`Windows`): the training split is cut into windows of `seq_len + 1` tokens starting every
`seq_len` tokens (each token is a target once per epoch; windows cross document and file boundaries, as
packed pretraining batches do). Each epoch visits every window once in an order drawn from the seed
(grain's index shuffle: O(1) memory, a new permutation per epoch); sample `g` of the run is window
`order[g]`, and row `r` of micro-batch `a` of step `s` is sample `(s * accum + a) * batch + r`. So a
batch is a pure function of `(seed, step)` and a resumed run sees the very batches it would have seen.
Each process reads only the rows of its own devices (`Batches.at`: `jax.make_array_from_callback` asks
for the addressable rows only), and `Prefetcher` builds the next steps' arrays on a thread while the
device computes.

References:
  nanoGPT's `train.bin` (uint16 token ids); Megatron-LM's memory-mapped indexed datasets; grain's
  `MapDataset.shuffle` (a Feistel index shuffle, per-epoch seeds), as MaxText's input pipeline uses it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import queue
import sysconfig
import threading
import time
from typing import Any, Callable

import grain
import jax
import numpy as np

from zerojax.train.token_file import DTYPES, TOKEN_SUFFIXES, DataError, Sidecar, read_sidecar, sidecar_path

_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
BYTES = 256  # the byte-level vocabulary


def tokenize_command(tokenizer: str | None, path: str) -> str:
  """The command that turns the text at `path` into a token file."""
  out = os.path.splitext(path.rstrip(os.sep))[0] + ".bin"
  return f"python -m zerojax.cli.tokenize --tokenizer {tokenizer or 'TOKENIZER'} --input {path} --output {out}"


# -- a stream of tokens over files read by offset ----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Corpus:
  """Tokens read as one stream from several 1-D arrays or files (`FileIds`), between `start` and `stop`.

  Attributes:
    parts: the arrays or files, in order.
    start, stop: the stream's span of the concatenated arrays.
  """
  parts: tuple
  start: int
  stop: int

  @classmethod
  def of(cls, parts) -> "Corpus":
    parts = tuple(p for p in parts if p.size)
    return cls(parts, 0, sum(p.size for p in parts))

  def __len__(self) -> int:
    return self.stop - self.start

  @property
  def _ends(self) -> np.ndarray:
    return np.cumsum([p.size for p in self.parts])

  def read(self, at: int, n: int) -> np.ndarray:
    """Tokens `[at, at + n)` of this stream as int32."""
    if at < 0 or at + n > len(self):
      raise IndexError(f"tokens [{at}, {at + n}) outside a corpus of {len(self)}")
    at += self.start
    ends = self._ends
    i = int(np.searchsorted(ends, at, side="right"))
    out, begin = [], at - (ends[i - 1] if i else 0)
    while n > 0:
      chunk = self.parts[i][begin:begin + n]
      out.append(chunk)
      n -= chunk.size
      i, begin = i + 1, 0
    return np.concatenate(out).astype(np.int32) if len(out) > 1 else out[0].astype(np.int32)

  def split(self, at: int) -> tuple["Corpus", "Corpus"]:
    """`(tokens [0, at), tokens [at, len))`, both views of the same files."""
    return (Corpus(self.parts, self.start, self.start + at), Corpus(self.parts, self.start + at, self.stop))


@dataclasses.dataclass(frozen=True)
class Dataset:
  """The training and held-out streams, their vocabulary and where they came from.

  Attributes:
    train, eval: the streams.
    vocab_size: the data's vocabulary (256 for bytes; the sidecar's or tokenizer's for token files).
    source: a one-line description for the log and `summary.json`.
    kind: "tokens" or "bytes".
    sidecar: the training file's sidecar, where it has one.
  """
  train: Corpus
  eval: Corpus
  vocab_size: int | None
  source: str
  kind: str
  sidecar: Sidecar | None = None


def _walk(root: str, skip=()) -> list[str]:
  """The files under `root` sorted by relative path, hidden entries and `skip` folders left out."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip]
    found += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
  return sorted(found, key=lambda p: os.path.relpath(p, root))


def _is_tokens(path: str) -> bool:
  return path.endswith(TOKEN_SUFFIXES)


@dataclasses.dataclass(frozen=True)
class FileIds:
  """A file's ids from byte `offset` on, read by offset (`os.pread`) when asked: never loaded whole, and no
  page of it counts in the process's memory (a memory map's touched pages would: the kernel maps
  megabytes of page cache around each fault)."""
  path: str
  dtype: Any
  offset: int
  size: int  # ids

  @classmethod
  def of(cls, path: str, dtype, offset: int = 0) -> "FileIds":
    dtype = np.dtype(dtype)
    return cls(path, dtype, offset, (os.path.getsize(path) - offset) // dtype.itemsize)

  def __getitem__(self, span: slice) -> np.ndarray:
    start, stop, _ = span.indices(self.size)
    item = self.dtype.itemsize
    fd = os.open(self.path, os.O_RDONLY)
    try:
      raw = os.pread(fd, (stop - start) * item, self.offset + start * item)
    finally:
      os.close(fd)
    if len(raw) != (stop - start) * item:
      raise DataError(f"{self.path} ended while reading ids [{start}, {stop}): it was truncated after it was opened")
    return np.frombuffer(raw, self.dtype)


def _map_bytes(path: str) -> FileIds:
  return FileIds.of(path, np.uint8)


def _map_tokens(path: str, data_dtype: str | None) -> tuple[np.ndarray, Sidecar | None]:
  """A token file's ids (read by offset) and its sidecar, checked against each other."""
  side = read_sidecar(path)
  if path.endswith(".npy"):
    try:  # the header only; the ids are read by offset
      with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
        offset = f.tell()
    except ValueError as e:
      raise DataError(f"{path} is not a .npy array ({e}); write it with numpy.save") from None
    if len(shape) != 1 or dtype.kind not in "ui":
      raise DataError(f"{path} holds a {dtype} array of shape {shape}; token ids are a 1-D array of "
                      "unsigned integers (numpy.save(path, ids.astype(numpy.uint16)))")
    ids = FileIds(path, dtype, offset, shape[0])
    if side is not None and ids.dtype != np.dtype(side.dtype):
      raise DataError(f"{path} holds {ids.dtype} ids but its sidecar {sidecar_path(path)} says {side.dtype}; "
                      "tokenize again or delete the sidecar")
  else:
    dtype = side.dtype if side is not None else (data_dtype or "uint16")
    if dtype not in DTYPES:
      raise DataError(f"train.data_dtype={dtype!r}; use one of {DTYPES}")
    size, item = os.path.getsize(path), np.dtype(dtype).itemsize
    if size % item:
      raise DataError(f"{path} has {size} bytes, not a multiple of {dtype}'s {item}: not a {dtype} token file "
                      f"(set train.data_dtype to the dtype it was written with, or tokenize it again)")
    ids = FileIds.of(path, np.dtype(dtype).newbyteorder("<"))
  if side is not None and side.tokens != ids.size:
    raise DataError(f"sidecar {sidecar_path(path)} says {side.tokens} tokens but {path} holds {ids.size}; the "
                    "file is truncated or not the one the sidecar describes: tokenize it again")
  return ids, side


def sources(path: str | None, data_dtype: str | None = None, what: str = "--data"):
  """`(arrays, kind, sidecars, description)` of a `--data` path (None: the standard library's sources)."""
  if path is None:
    root = sysconfig.get_paths()["stdlib"]
    files = [f for f in _walk(root, _SKIP_DIRS) if f.endswith(".py")]
    return [_map_bytes(f) for f in files], "bytes", [], f"python stdlib ({root}), {len(files)} files"
  if not os.path.exists(path):
    raise DataError(f"{what} path '{path}' does not exist; pass a token file (.bin, .npy), a folder of them, "
                    "or text (a file or a folder)")
  files = _walk(path) if os.path.isdir(path) else [path]
  files = [f for f in files if not (os.path.isdir(path) and f.endswith(".json") and
                                    os.path.exists(os.path.splitext(f)[0] + ".bin"))]  # sidecars
  tokens = [f for f in files if _is_tokens(f)]
  if tokens and len(tokens) != len(files):
    text = next(f for f in files if not _is_tokens(f))
    raise DataError(f"{what} folder '{path}' mixes token files ({tokens[0]}) and text ({text}); keep one kind "
                    "per folder")
  where = f"folder '{path}', {len(files)} files" if os.path.isdir(path) else f"file '{path}'"
  if not files:
    raise DataError(f"{what} folder '{path}' holds no files; pass a token file, a folder of them, or text")
  if not tokens:
    return [_map_bytes(f) for f in files], "bytes", [], where
  mapped = [_map_tokens(f, data_dtype) for f in files]
  sides = [s for _, s in mapped if s is not None]
  if sides and len(sides) != len(mapped):
    raise DataError(f"{what} folder '{path}': some token files have a sidecar and some not; tokenize every shard "
                    "with python -m zerojax.cli.tokenize")
  if len({(s.dtype, s.vocab_size, s.tokenizer) for s in sides}) > 1:
    raise DataError(f"{what} folder '{path}': the shards' sidecars name different dtypes, vocabularies or "
                    "tokenizers; tokenize every shard with one tokenizer")
  return [a for a, _ in mapped], "tokens", sides, where


def open_data(path: str | None = None, *, eval_path: str | None = None, seq_len: int,
              eval_fraction: float = 0.05, data_dtype: str | None = None, tokenizer=None) -> Dataset:
  """Opens the training data (and the held-out data): sizes and sidecars are read, no ids.

  Args:
    path: a token file, a folder of token files, a text file or folder of text; None uses the `*.py`
      files of the Python standard library (bytes).
    eval_path: a separate held-out source (same kinds); None holds out the last `eval_fraction` of `path`.
    seq_len: tokens per input sequence; each split needs a window of `seq_len + 1`.
    eval_fraction: the fraction held out at the end of `path` when `eval_path` is None, in (0, 1).
    data_dtype: the dtype of `.bin` files without a sidecar ("uint16", nanoGPT's, or "uint32").
    tokenizer: a loaded tokenizer (`zerojax.train.tokenizer.load`) the token files must have been made
      with (their sidecar's vocabulary), or None. Text given with a tokenizer is refused with the
      command that tokenizes it.

  Returns:
    A `Dataset`; `vocab_size` is None for token files with neither sidecar nor tokenizer (the model's
    `vocab_size` then says it).

  Raises:
    DataError: a missing path, a file that is not what its name or sidecar says, text given with a
      tokenizer, too little data for one window (each one line naming the value and the fix).
  """
  if not 0 < eval_fraction < 1:
    raise DataError(f"eval_fraction={eval_fraction} must be between 0 and 1, e.g. 0.05")
  if seq_len < 1:
    raise DataError(f"seq_len={seq_len} must be a positive number of tokens")
  parts, kind, sides, where = sources(path, data_dtype, "--data")
  if kind == "bytes" and tokenizer is not None:
    raise DataError(f"--data {path or 'default (the Python stdlib)'} is text but train.tokenizer is set: "
                    f"tokenize it first: {tokenize_command(tokenizer.path, path or 'TEXT_FOLDER')}")
  vocab = BYTES if kind == "bytes" else (sides[0].vocab_size if sides else None)
  if tokenizer is not None:
    if vocab is not None and vocab != tokenizer.vocab_size:
      raise DataError(f"--data {path} was made with a vocabulary of {vocab} ids (its sidecar) but train.tokenizer "
                      f"{tokenizer.path} has {tokenizer.vocab_size}; tokenize it again with this tokenizer: "
                      f"{tokenize_command(tokenizer.path, 'TEXT')}")
    vocab = tokenizer.vocab_size
  corpus = Corpus.of(parts)
  least = seq_len + 1
  if eval_path is not None:
    eparts, ekind, esides, ewhere = sources(eval_path, data_dtype, "--eval_data")
    if ekind != kind or (esides and sides and (esides[0].vocab_size, esides[0].tokenizer) !=
                         (sides[0].vocab_size, sides[0].tokenizer)):
      raise DataError(f"--eval_data {eval_path} ({ekind}) is not made like --data {path} ({kind}); tokenize both "
                      "with the same tokenizer")
    train, held = corpus, Corpus.of(eparts)
    where += f"; held out: {ewhere}"
  else:
    n_eval = max(math.ceil(len(corpus) * eval_fraction), least)
    train, held = corpus.split(max(len(corpus) - n_eval, 0))
  for split, n in (("training", len(train)), ("held-out", len(held))):
    if n < least:
      raise DataError(f"the {split} split of {where} has {n} tokens, fewer than one window of seq_len + 1 = "
                      f"{least}; pass more data (or a shorter model_config.seq_len)")
  what = f"{kind} from {where}, {len(corpus):,} tokens" if kind == "tokens" else \
      f"bytes from {where}, {len(corpus) / 1e6:.1f} MB"
  return Dataset(train, held, vocab, what, kind, sides[0] if sides else None)


def identity(data: Dataset) -> dict:
  """What a checkpoint records of its data (`zerojax.train.config.DATA`): where it came from, its size, and a
  fingerprint of its first and last 64 Ki ids with the parts' sizes (cheap, and changed by any edit of the
  ends or any change of size)."""
  import hashlib
  n, k = len(data.train), min(len(data.train), 1 << 16)
  h = hashlib.sha1(np.asarray([p.size for p in data.train.parts] + [len(data.eval)], np.int64).tobytes())
  h.update(data.train.read(0, k).tobytes())
  h.update(data.train.read(n - k, k).tobytes())
  return {"data.source": data.source, "data.tokens": n + len(data.eval), "data.fingerprint": h.hexdigest()[:16]}


def check_vocab(data: Dataset, model_vocab: int) -> None:
  """Refuses a model whose vocabulary cannot hold the data's ids (a larger, padded one is fine)."""
  if data.vocab_size is not None and model_vocab < data.vocab_size:
    raise DataError(f"model_config.vocab_size={model_vocab} is smaller than the data's vocabulary of "
                    f"{data.vocab_size} ({data.source}); leave model_config.vocab_size unset to take the data's")
  top = data.sidecar.max_id if data.sidecar is not None else None
  if top is not None and top >= model_vocab:
    raise DataError(f"the data's largest id {top} is not below model_config.vocab_size={model_vocab}; leave "
                    "model_config.vocab_size unset to take the data's")


# -- windows, epochs, batches ----------------------------------------------------------------------------

class Windows:
  """Epochs over a corpus's windows of `seq_len + 1` tokens (every `seq_len`), in a seeded order.

  `rows(first, n)` are samples `first .. first + n - 1` of the run: sample `g` is window
  `order(g)`, where `order` visits every window once per epoch (grain's index shuffle, seeded by `seed`
  and the epoch: O(1) memory whatever the corpus's size).
  """

  def __init__(self, corpus: Corpus, seq_len: int, seed: int = 0, vocab_size: int | None = None,
               what: str = "the data"):
    if seq_len < 1 or seed < 0:
      raise ValueError(f"seq_len={seq_len} and seed={seed}: seq_len must be positive and seed non-negative")
    self.corpus, self.seq_len, self.vocab_size, self.what = corpus, seq_len, vocab_size, what
    self.count = (len(corpus) - 1) // seq_len
    if self.count < 1:
      raise DataError(f"{what} has {len(corpus)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
    self.order = grain.MapDataset.range(self.count).shuffle(seed=seed)
    self.rows_read = 0  # rows this process has read (tests count them)

  def window(self, g: int) -> int:
    return int(self.order[g])

  def rows(self, first: int, n: int) -> np.ndarray:
    """Samples `first .. first + n - 1` as an int32 `[n, seq_len + 1]` array, ids checked against the
    vocabulary."""
    if first < 0:
      raise ValueError(f"sample {first} must be non-negative")
    out = np.stack([self.corpus.read(self.window(g) * self.seq_len, self.seq_len + 1)
                    for g in range(first, first + n)])
    self.rows_read += n
    if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
      g = first + int(np.argmax(out.max(axis=1)))
      raise DataError(f"{self.what}: token id {int(out.max())} in sample {g} (window {self.window(g)}) is not "
                      f"below the model's vocab_size={self.vocab_size}; the data was made with another tokenizer "
                      "(tokenize it again) or set model_config.vocab_size to the tokenizer's")
    return out


def _rows_of(index: tuple, size: int) -> tuple[int, int]:
  s = index[1] if len(index) > 1 else slice(None)
  start, stop, _ = s.indices(size)
  return start, stop


class Batches:
  """The step's `[accum, batch, seq_len + 1]` global arrays, each process reading only its own rows.

  Args:
    windows: the samples.
    sharding: the batch's sharding (`Executor.batch_sharding`: the batch axis over the data axes).
    accum_steps: micro-batches per step.
    batch_size: the global micro-batch.
  """

  def __init__(self, windows: Windows, sharding, *, accum_steps: int, batch_size: int):
    if accum_steps < 1 or batch_size < 1:
      raise ValueError(f"accum_steps={accum_steps} and batch_size={batch_size} must both be at least 1")
    self.windows, self.sharding, self.accum, self.batch = windows, sharding, accum_steps, batch_size
    self.shape = (accum_steps, batch_size, windows.seq_len + 1)
    if windows.count < accum_steps * batch_size:
      raise DataError(f"{windows.what} holds {windows.count} windows of {windows.seq_len + 1} tokens, fewer than "
                      f"one global batch of {accum_steps * batch_size} (train.accum_steps x train.batch_size); "
                      "pass more data or a smaller batch")

  def host(self, step: int, rows: tuple[int, int] | None = None) -> np.ndarray:
    """Rows `[lo, hi)` (default all) of every micro-batch of `step`, as numpy."""
    lo, hi = rows or (0, self.batch)
    return np.stack([self.windows.rows((step * self.accum + a) * self.batch + lo, hi - lo)
                     for a in range(self.accum)])

  def at(self, step: int) -> jax.Array:
    """The global array of `step`; only the addressable devices' rows are read."""
    cache = {}

    def rows(index):
      key = _rows_of(index, self.batch)
      if key not in cache:
        cache[key] = self.host(step, key)
      return cache[key][(slice(None), slice(None)) + tuple(index[2:])]

    return jax.make_array_from_callback(self.shape, self.sharding, rows)


def eval_arrays(corpus: Corpus, sharding, *, num_batches: int, batch_size: int, seq_len: int,
                vocab_size: int | None = None, seed: int = 1234) -> list[jax.Array]:
  """`num_batches` fixed held-out `[batch, seq_len + 1]` arrays (windows in a seeded order)."""
  windows = Windows(corpus, seq_len, seed, vocab_size, "the held-out data")
  out = []
  for i in range(num_batches):
    def rows(index, i=i):
      lo, hi = _rows_of((slice(None),) + tuple(index), batch_size)
      return windows.rows(i * batch_size + lo, hi - lo)[(slice(None),) + tuple(index[1:])]
    out.append(jax.make_array_from_callback((batch_size, seq_len + 1), sharding, rows))
  return out


class Prefetcher:
  """`make(step)` for steps `start, start + 1, ...` built `depth` ahead on a thread.

  `get(step)` returns `(value, seconds waited)`; an exception raised by `make` is raised there. The thread
  stops at `stop` or `close()`.
  """

  def __init__(self, make: Callable[[int], Any], start: int, stop: int, depth: int = 2):
    self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self._closed = threading.Event()
    self._next = start
    self._thread = threading.Thread(target=self._run, args=(make, start, stop), daemon=True,
                                    name="zerojax-data")
    self._thread.start()

  def _run(self, make, start, stop):
    for step in range(start, stop):
      try:
        item = (step, make(step), None)
      except BaseException as e:  # noqa: BLE001 - handed to the consumer
        item = (step, None, e)
      while not self._closed.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if self._closed.is_set() or item[2] is not None:
        return

  def get(self, step: int):
    if step != self._next:
      raise ValueError(f"the prefetcher is at step {self._next}, asked for {step}")
    t0 = time.perf_counter()
    got, value, error = self._queue.get()
    waited = time.perf_counter() - t0
    if error is not None:
      raise error
    assert got == step, (got, step)
    self._next += 1
    return value, waited

  def close(self) -> None:
    self._closed.set()
    self._thread.join(timeout=5)
