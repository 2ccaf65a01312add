"""A token file and its sidecar: what `python -m zerojax.cli.tokenize` writes and `--data` reads.

A token file is a flat array of token ids, little-endian: `OUT.bin` (uint16 as nanoGPT writes it, or
uint32) or `OUT.npy`. Its sidecar `OUT.json` (the token file's name with `.json` for its suffix) says
what the ids are: their dtype, the vocabulary and tokenizer that made them, how many tokens and
documents the file holds and the largest id in it. Documents are separated by the tokenizer's EOS id
(each starts with its BOS id where the tokenizer has one), so the file is its own document index:
`documents` counts them, and windows drawn from it cross document boundaries as packed pretraining
batches do (MaxText's and nanoGPT's packing).

A file without a sidecar (nanoGPT's `train.bin`) is read with `train.data_dtype` and checked against
the model's `vocab_size`.
"""
from __future__ import annotations

import dataclasses
import json
import os

FORMAT = "zerojax.tokens/1"
DTYPES = ("uint16", "uint32")
TOKEN_SUFFIXES = (".bin", ".npy")


class DataError(ValueError):
  """Data that cannot be trained on: a bad file, a sidecar that disagrees with it, ids out of range."""


@dataclasses.dataclass(frozen=True)
class Sidecar:
  """The fields of a token file's sidecar (`OUT.json`).

  Attributes:
    dtype: "uint16" or "uint32", little-endian.
    tokens: the number of token ids in the file.
    vocab_size: the tokenizer's vocabulary (every id is below it); the model's `vocab_size` comes from it.
    documents: the number of documents (None: not known).
    max_id: the largest id in the file (None: not known).
    tokenizer: the tokenizer file that made the ids (a SentencePiece `.model` or a `tokenizer.json`).
    tokenizer_kind: "sentencepiece" or "tokenizers".
    bos_id, eos_id: the tokenizer's BOS and EOS ids (None where it has none).
    sources: the inputs the ids were made from.
    format: `FORMAT`.
  """
  dtype: str
  tokens: int
  vocab_size: int
  documents: int | None = None
  max_id: int | None = None
  tokenizer: str | None = None
  tokenizer_kind: str | None = None
  bos_id: int | None = None
  eos_id: int | None = None
  sources: tuple = ()
  format: str = FORMAT

  def __post_init__(self):
    if self.dtype not in DTYPES:
      raise DataError(f"sidecar dtype={self.dtype!r}; use one of {DTYPES}")
    if self.tokens < 0 or self.vocab_size < 1:
      raise DataError(f"sidecar tokens={self.tokens}, vocab_size={self.vocab_size}: need tokens >= 0 and "
                      "vocab_size >= 1")
    if self.max_id is not None and self.max_id >= self.vocab_size:
      raise DataError(f"sidecar max_id={self.max_id} is not below vocab_size={self.vocab_size}; the ids were "
                      "made with another tokenizer: tokenize the corpus again")


def sidecar_path(token_path: str) -> str:
  """`OUT.json` for `OUT.bin` or `OUT.npy`."""
  return os.path.splitext(token_path)[0] + ".json"


def write_sidecar(token_path: str, sidecar: Sidecar) -> str:
  """Writes `sidecar` beside `token_path` (under a temporary name, then renamed); returns its path."""
  path = sidecar_path(token_path)
  fields = dataclasses.asdict(sidecar)
  fields["sources"] = list(fields["sources"])
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(fields, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return path


def read_sidecar(token_path: str) -> Sidecar | None:
  """The sidecar of `token_path`, or None where it has none."""
  path = sidecar_path(token_path)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      fields = json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f"sidecar {path} cannot be read ({e}); write it again with python -m zerojax.cli.tokenize, "
                    "or delete it and set train.data_dtype") from None
  if not isinstance(fields, dict) or fields.get("format") != FORMAT:
    raise DataError(f"{path} is not a zerojax token sidecar (format {fields.get('format') if isinstance(fields, dict) else None!r}, "
                    f"expected {FORMAT!r}); move it away or tokenize again with python -m zerojax.cli.tokenize")
  known = {f.name for f in dataclasses.fields(Sidecar)}
  try:
    return Sidecar(**{k: (tuple(v) if k == "sources" else v) for k, v in fields.items() if k in known})
  except TypeError as e:
    raise DataError(f"sidecar {path}: {e}; tokenize again with python -m zerojax.cli.tokenize") from None
