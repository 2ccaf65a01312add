"""Tokenizes text into a token file: `python -m zerojax.cli.tokenize --tokenizer T --input PATH... --output OUT.bin`.

Inputs are text files (each file one document), folders (their files, recursively, sorted by path, hidden
ones skipped) and `.jsonl` files (one document per line, its `--text_field`). Each document becomes BOS
(where the tokenizer has one), its ids and EOS (`zerojax/train/tokenizer.py`); the ids are written
little-endian, uint16 for a vocabulary up to 65536 ids and uint32 above, to `OUT.bin`, with its sidecar
`OUT.json` beside it (`zerojax/train/token_file.py`). Documents are encoded in chunks over `--workers`
processes (default: every core), streamed to `OUT.bin.tmp-<pid>` in order and renamed to `OUT.bin` once
complete: an error or Ctrl-C leaves no partial `OUT.bin` (an earlier one is kept). Prints a JSON summary.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
import warnings

import numpy as np
from tqdm import tqdm

from zerojax.train import tokenizer as tokenizer_lib
from zerojax.train.token_file import TOKEN_SUFFIXES, DataError, Sidecar, sidecar_path, write_sidecar

PROG = "zerojax.cli.tokenize"
CHUNK_BYTES = 1 << 19  # text per task handed to a worker (one document may exceed it)
JSONL = ".jsonl"


def input_files(inputs, output: str, tokenizer_path: str | None = None) -> list[str]:
  """The files `inputs` name, in order (a folder's files sorted by relative path, hidden ones skipped);
  raises a one-line `DataError` for a missing input, token ids given as input, or an output (or its
  sidecar) that would overwrite an input or the tokenizer, or land inside an input folder."""
  if not str(output).endswith(".bin"):
    raise DataError(f"--output {output} does not end in .bin; name the token file OUT.bin (its sidecar OUT.json "
                    "is written beside it)")
  out = os.path.realpath(output)
  written = {out, os.path.realpath(sidecar_path(output))}
  if tokenizer_path is not None and os.path.realpath(tokenizer_path) in written:
    raise DataError(f"--output {output} would overwrite the tokenizer {tokenizer_path} (a token file's sidecar is "
                    "OUT.json); name the token file otherwise")
  if os.path.isdir(out):
    raise DataError(f"--output {output} is a folder; name the token file, e.g. {os.path.join(output, 'train.bin')}")
  if not inputs:
    raise DataError("no --input; pass text files, folders or .jsonl files")
  files = []
  for given in inputs:
    given = str(given)
    if not os.path.exists(given):
      raise DataError(f"--input {given} does not exist; pass text files, folders or .jsonl files")
    if os.path.isdir(given):
      root = os.path.realpath(given)
      if out.startswith(root + os.sep):
        raise DataError(f"--output {output} is inside the input folder {given}; write it outside the folder")
      found = _walk(given)
      if not found:
        raise DataError(f"--input folder {given} holds no (non-hidden) files; pass a folder of text files")
    else:
      found = [given]
    for path in found:
      if os.path.realpath(path) in written:
        raise DataError(f"--output {output} would overwrite the input {path}; write the token file elsewhere")
      if path.lower().endswith(TOKEN_SUFFIXES):
        raise DataError(f"--input {path} is already token ids ({os.path.splitext(path)[1]}); pass it to training "
                        "with --data instead of tokenizing it, or pass the text it was made from")
    files += found
  return files


def _walk(root: str) -> list[str]:
  """The non-hidden files under `root`, recursively, sorted by their path relative to `root`."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    found += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
  return sorted(found, key=lambda p: os.path.relpath(p, root))


def documents(files: list[str], text_field: str = "text"):
  """Yields `(text, bytes read)` per document of `files`, in order (a text file is one document, a `.jsonl`
  line one; blank lines yield ""); one-line `DataError`s name the file (and line) that cannot be read."""
  for path in files:
    if not path.lower().endswith(JSONL):
      with open(path, "rb") as f:
        raw = f.read()
      try:
        yield raw.decode("utf-8-sig"), len(raw)
      except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8 or leave "
                        "it out of --input") from None
      continue
    with open(path, "rb") as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          yield "", len(line)
          continue
        yield _jsonl_text(path, n, line, text_field), len(line)


def _jsonl_text(path: str, n: int, line: bytes, field: str) -> str:
  try:
    record = json.loads(line)
  except ValueError as e:
    raise DataError(f"{path}:{n}: not a JSON line ({_reason(e)}); fix or remove the line") from None
  if not isinstance(record, dict) or field not in record:
    found = f"fields {sorted(record)[:8]}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
    raise DataError(f"{path}:{n}: no {field!r} field (found {found}); pass --text_field NAME or fix the line")
  if not isinstance(record[field], str):
    raise DataError(f"{path}:{n}: {field!r} is a {type(record[field]).__name__}, not a string; fix the line")
  return record[field]


def _reason(e: ValueError) -> str:
  return getattr(e, "msg", None) or str(e).splitlines()[0]


def chunks(docs, chunk_bytes: int | None = None):
  """Groups `(text, bytes)` documents into `(texts, bytes)` tasks of about `chunk_bytes` (default
  `CHUNK_BYTES`; empty documents dropped, their bytes counted); the same for any number of workers, so the
  output is too."""
  chunk_bytes = chunk_bytes or CHUNK_BYTES
  texts, size = [], 0
  for text, n in docs:
    size += n
    if text:
      texts.append(text)
    if size >= chunk_bytes:
      yield texts, size
      texts, size = [], 0
  if size:
    yield texts, size


class Encoder:
  """Encodes a task: `(texts, bytes)` -> `(ids as little-endian bytes, tokens, documents, max id, bytes)`."""

  def __init__(self, tok: tokenizer_lib.Tokenizer, dtype: str):
    self.tok, self.dtype = tok, np.dtype(dtype).newbyteorder("<")

  def __call__(self, task):
    texts, size = task
    ids = []
    for text in texts:
      ids += self.tok.encode_document(text)
    arr = np.asarray(ids, dtype=np.int64)
    max_id = int(arr.max()) if arr.size else -1
    if max_id >= self.tok.vocab_size:
      raise DataError(f"tokenizer {self.tok.path} gave id {max_id}, not below its vocab_size={self.tok.vocab_size}; "
                      "the tokenizer file is inconsistent: pass another one")
    return arr.astype(self.dtype).tobytes(), len(ids), len(texts), max_id, size


_worker_encoder: Encoder | None = None


def _init_worker(path: str, kind: str, dtype: str) -> None:
  global _worker_encoder
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates the pool
  signal.signal(signal.SIGTERM, signal.SIG_DFL)  # how the pool terminates a worker (not the CLI's handler)
  _worker_encoder = Encoder(tokenizer_lib.Tokenizer(path, kind), dtype)


def _encode_in_worker(task):
  return _worker_encoder(task)


@contextlib.contextmanager
def encoded(tok: tokenizer_lib.Tokenizer, dtype: str, tasks, workers: int):
  """The encoded `tasks`, in order: in this process (`workers=1`) or over a pool of `workers` forked
  processes. Forked, not spawned: a caller's script needs no `if __name__ == "__main__"` guard, and no
  worker imports anything again; the workers run only the tokenizer, never JAX (whose threads a process
  that has started JAX's backends forks along, and warns of)."""
  if workers == 1:
    yield map(Encoder(tok, dtype), tasks)
    return
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)  # JAX's
    warnings.filterwarnings("ignore", message=r".*multi-threaded, use of fork", category=DeprecationWarning)
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker,
                                                    initargs=(tok.path, tok.kind, dtype))
  with pool:
    yield pool.imap(_encode_in_worker, tasks)


def default_workers() -> int:
  """Every core this process may use."""
  return max(1, getattr(os, "process_cpu_count", os.cpu_count)() or 1)


def tokenize_files(tokenizer_path: str, inputs, output: str, workers: int | None = None, progress: bool = True,
                   text_field: str = "text") -> Sidecar:
  """Tokenizes `inputs` (text files, folders, `.jsonl` files) with the tokenizer at `tokenizer_path` into
  the token file `output` (`.bin`) and its sidecar; returns the sidecar. Nothing is left at `output` (an
  earlier file is kept) if it raises or is interrupted."""
  inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
  tok = tokenizer_lib.load(tokenizer_path)
  tok.require_eos()
  files = input_files(inputs, output, tok.path)
  workers = default_workers() if workers is None else workers
  if not isinstance(workers, int) or workers < 1:
    raise DataError(f"--workers {workers}; use a positive number of processes (default: {default_workers()})")
  dtype = tokenizer_lib.token_dtype(tok.vocab_size)
  total = sum(os.path.getsize(f) for f in files)
  folder = os.path.dirname(os.path.abspath(output))
  os.makedirs(folder, exist_ok=True)
  tmp = f"{output}.tmp-{os.getpid()}"
  tokens = docs = 0
  max_id = -1
  try:
    with open(tmp, "wb") as f, encoded(tok, dtype, chunks(documents(files, text_field)), workers) as results, \
        tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="tokenize", disable=not progress,
             file=sys.stderr) as bar:
      for data, n, d, m, size in results:
        f.write(data)
        tokens, docs, max_id = tokens + n, docs + d, max(max_id, m)
        bar.update(size)
        bar.set_postfix(tokens=tokens, refresh=False)
      f.flush()
      os.fsync(f.fileno())
    if docs == 0:
      raise DataError(f"--input {' '.join(map(str, inputs))} holds no documents (every file or line is empty); "
                      "pass non-empty text")
    sidecar = Sidecar(dtype=dtype, tokens=tokens, vocab_size=tok.vocab_size, documents=docs, max_id=max_id,
                      tokenizer=tok.path, tokenizer_kind=tok.kind, bos_id=tok.bos_id, eos_id=tok.eos_id,
                      sources=tuple(os.path.abspath(str(i)) for i in inputs))
    with contextlib.suppress(FileNotFoundError):
      os.remove(sidecar_path(output))  # a stale sidecar never describes the new ids
    os.replace(tmp, output)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise
  _fsync_folder(folder)
  write_sidecar(output, sidecar)
  return sidecar


def _fsync_folder(folder: str) -> None:
  with contextlib.suppress(OSError):
    fd = os.open(folder, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _interrupt(signum, frame):
  raise KeyboardInterrupt


def error(message: str):
  """Exits with status 2 after one line `zerojax.cli.tokenize: error: message` on stderr."""
  print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
  raise SystemExit(2)


def main(argv=None) -> int:
  """Tokenizes `--input` into `--output` and prints a JSON summary line; user errors exit with status 2."""
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokenizer", required=True, help="a SentencePiece .model, a Hugging Face tokenizer.json, "
                      "or a folder holding tokenizer.json or tokenizer.model")
  parser.add_argument("--input", required=True, nargs="+", help="text files, folders (recursive) and .jsonl files")
  parser.add_argument("--output", required=True, help="the token file to write, OUT.bin (and its sidecar OUT.json)")
  parser.add_argument("--workers", type=int, default=None, help="processes that encode (default: every core)")
  parser.add_argument("--text_field", default="text", help="the field of a .jsonl line that holds its text")
  parser.add_argument("--no_progress", action="store_true", help="no progress bar")
  args = parser.parse_args(argv)
  signal.signal(signal.SIGTERM, _interrupt)
  # Ctrl-C stops it even where it started with SIGINT ignored (a `cmd &` of a script, a parent that ignores
  # it): Python then installs no handler of its own
  signal.signal(signal.SIGINT, signal.default_int_handler)
  start = time.perf_counter()
  try:
    sidecar = tokenize_files(args.tokenizer, args.input, args.output, workers=args.workers,
                             progress=not args.no_progress, text_field=args.text_field)
  except DataError as e:
    error(str(e))
  except OSError as e:
    error(f"{e.filename or ''}: {e.strerror or e}; check the path and its permissions")
  except KeyboardInterrupt:
    print(f"{PROG}: interrupted; {args.output} was not written", file=sys.stderr)
    return 130
  seconds = time.perf_counter() - start
  print(json.dumps({"output": os.path.abspath(args.output), "tokens": sidecar.tokens, "documents": sidecar.documents,
                    "dtype": sidecar.dtype, "vocab_size": sidecar.vocab_size, "seconds": round(seconds, 3),
                    "tokens_per_s": round(sidecar.tokens / max(seconds, 1e-9), 1)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
