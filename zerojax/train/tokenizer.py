"""A tokenizer read from a file: a SentencePiece `.model` or a Hugging Face `tokenizer.json`.

`load(path)` reads either (or a folder holding `tokenizer.json` or `tokenizer.model`) and returns a
`Tokenizer`: its vocabulary size, BOS and EOS ids, and `encode_document(text)`, the ids of one document
as a token file holds them (`zerojax/train/token_file.py`): BOS (where the tokenizer has one), the text's
ids with no special tokens added by the library, EOS. A `Tokenizer` pickles as its path, so worker
processes load their own copy.
"""
from __future__ import annotations

import os

from zerojax.train.token_file import DataError

KINDS = ("sentencepiece", "tokenizers")
# Special tokens that begin or end a document, in the order they are looked for in a `tokenizer.json`.
BOS_TOKENS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|bos|>")
EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")
UINT16_VOCAB = 2**16  # ids of a vocabulary up to this size fit in uint16


class TokenizerError(DataError):
  """A tokenizer that cannot be read or cannot delimit documents (no EOS)."""


def token_dtype(vocab_size: int) -> str:
  """The token file dtype for a vocabulary: "uint16" up to 65536 ids, "uint32" above."""
  if vocab_size < 1:
    raise TokenizerError(f"vocab_size={vocab_size}; a tokenizer has at least one token")
  return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


def resolve(path: str) -> tuple[str, str]:
  """`(absolute file, kind)` of a tokenizer path: a `.model`, a `tokenizer.json` (any `.json`) or a folder
  holding `tokenizer.json` (preferred) or `tokenizer.model`."""
  if not os.path.exists(path):
    raise TokenizerError(f"tokenizer {path} does not exist; pass a SentencePiece .model, a tokenizer.json or a "
                         "folder holding one")
  path = os.path.abspath(path)
  if os.path.isdir(path):
    for name, kind in (("tokenizer.json", "tokenizers"), ("tokenizer.model", "sentencepiece")):
      if os.path.isfile(os.path.join(path, name)):
        return os.path.join(path, name), kind
    raise TokenizerError(f"tokenizer folder {path} holds neither tokenizer.json nor tokenizer.model; pass the "
                         "tokenizer file itself")
  if path.endswith(".model"):
    return path, "sentencepiece"
  if path.endswith(".json"):
    return path, "tokenizers"
  with open(path, "rb") as f:
    head = f.read(64).lstrip()
  if head.startswith(b"{"):
    return path, "tokenizers"
  raise TokenizerError(f"tokenizer {path} is of an unknown format (neither a .model nor a .json); pass a "
                       "SentencePiece .model or a Hugging Face tokenizer.json")


def load(path: str) -> "Tokenizer":
  """The tokenizer at `path` (see `resolve`); one-line `TokenizerError`s for a missing file or a bad one."""
  file, kind = resolve(path)
  return Tokenizer(file, kind)


class Tokenizer:
  """A loaded tokenizer.

  Attributes:
    kind: "sentencepiece" or "tokenizers".
    path: the absolute path of the tokenizer file.
    vocab_size: every id is below it (for `tokenizers`, the whole vocabulary with added tokens).
    bos_id, eos_id: the ids that begin and end a document (None where the tokenizer has none).
  """

  def __init__(self, path: str, kind: str):
    if kind not in KINDS:
      raise TokenizerError(f"tokenizer kind={kind!r}; use one of {KINDS}")
    self.path, self.kind = path, kind
    if kind == "sentencepiece":
      self._model = _sentencepiece(path)
      self.vocab_size = self._model.get_piece_size()
      self.bos_id, self.eos_id = (i if i >= 0 else None for i in (self._model.bos_id(), self._model.eos_id()))
    else:
      self._model = _tokenizers(path)
      vocab = self._model.get_vocab(with_added_tokens=True)
      self.vocab_size = max(self._model.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
      self.bos_id, self.eos_id = _special_id(self._model, BOS_TOKENS), _special_id(self._model, EOS_TOKENS)

  def __reduce__(self):
    return Tokenizer, (self.path, self.kind)

  def __repr__(self):
    return (f"Tokenizer(kind={self.kind!r}, path={self.path!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id})")

  def require_eos(self) -> None:
    """Raises a one-line `TokenizerError` where the tokenizer has no EOS: documents cannot be delimited."""
    if self.eos_id is not None:
      return
    if self.kind == "sentencepiece":
      fix = "train it with an EOS piece (spm_train --eos_id=2, the default) or pass another tokenizer"
    else:
      fix = (f"add one of {', '.join(EOS_TOKENS)} as a special token (tokenizer.add_special_tokens(['</s>']), "
             "then tokenizer.save(...)) or pass another tokenizer")
    raise TokenizerError(f"tokenizer {self.path} has no EOS token, so documents cannot be separated; {fix}")

  def encode(self, text: str) -> list[int]:
    """The ids of `text` with no special tokens added."""
    if self.kind == "sentencepiece":
      return self._model.encode(text, out_type=int, add_bos=False, add_eos=False)
    return self._model.encode(text, add_special_tokens=False).ids

  def encode_document(self, text: str) -> list[int]:
    """One document's ids: BOS (where the tokenizer has one), `encode(text)`, EOS."""
    self.require_eos()
    ids = self.encode(text)
    return ([self.bos_id] if self.bos_id is not None else []) + ids + [self.eos_id]

  def decode(self, ids) -> str:
    """The text of `ids` (special tokens left out)."""
    ids = [int(i) for i in ids]
    if self.kind == "sentencepiece":
      return self._model.decode(ids)
    return self._model.decode(ids, skip_special_tokens=True)


def _sentencepiece(path: str):
  try:
    import sentencepiece
  except ImportError:
    raise TokenizerError(f"tokenizer {path} is a SentencePiece model, and sentencepiece is not installed; "
                         "pip install sentencepiece") from None
  model = sentencepiece.SentencePieceProcessor()
  try:
    model.Load(path)
  except (OSError, RuntimeError) as e:
    raise TokenizerError(f"tokenizer {path} is not a SentencePiece model ({_first_line(e)}); pass a "
                         "SentencePiece .model or a Hugging Face tokenizer.json") from None
  return model


def _tokenizers(path: str):
  try:
    import tokenizers
  except ImportError:
    raise TokenizerError(f"tokenizer {path} is a tokenizer.json, and the tokenizers library is not installed; "
                         "pip install tokenizers") from None
  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the library raises a bare Exception for JSON it cannot read
    raise TokenizerError(f"tokenizer {path} is not a Hugging Face tokenizer.json ({_first_line(e)}); pass a "
                         "tokenizer.json saved by the tokenizers library or a SentencePiece .model") from None


def _special_id(model, names: tuple[str, ...]) -> int | None:
  """The id of the first of `names` among the tokenizer's special (then added, then ordinary) tokens."""
  added = {t.content: (i, t.special) for i, t in model.get_added_tokens_decoder().items()}
  for want_special in (True, False):
    for name in names:
      if name in added and added[name][1] == want_special:
        return added[name][0]
  for name in names:
    i = model.token_to_id(name)
    if i is not None:
      return i
  return None


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return text[0] if text else type(e).__name__

