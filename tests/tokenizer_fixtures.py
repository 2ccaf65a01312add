"""Tiny tokenizers and a corpus, made in the test from text the test writes (nothing is downloaded).

`corpus(dir)` writes a folder of text documents (nested, with hidden files that a tokenizer run skips);
`sentencepiece_model(dir)` trains a SentencePiece model (byte fallback, BOS and EOS) and
`bpe_tokenizer_json(dir)` a byte-level BPE `tokenizer.json` (special tokens "<s>", "</s>", no
post-processor) on it. Both decode their ids back to the exact text. `tiny_tokenizers` is the session
fixture that builds them once: import it into a test module to use it.
"""
from __future__ import annotations

import dataclasses
import os
import random

import pytest

SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "an", "el", "or", "th", "ing", "er")
EXTRAS = ("naïve café", "東京 and 大阪", "emoji 🙂!", "tabs\tand  double  spaces", "x = f(y) + 1;")


def document(rng: random.Random, lines: int) -> str:
  """A document of pseudo-words over `lines` lines (some with non-ASCII text, tabs and repeated spaces)."""
  out = []
  for _ in range(lines):
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
      words.insert(rng.randint(0, len(words)), rng.choice(EXTRAS))
    out.append(" ".join(words) + rng.choice((".", ",", "?", "")))
  return "\n".join(out)


# The corpus's documents: their paths relative to the folder, in the order a folder walk sorts them.
CORPUS_FILES = tuple([f"d{i:02d}.txt" for i in range(8)] + [f"sub/d{i:02d}.md" for i in range(8, 12)]
                     + ["sub/z/d12.txt"])


def corpus_documents(seed: int = 0) -> list[str]:
  """The texts of `CORPUS_FILES`, in order."""
  rng = random.Random(seed)
  return [document(rng, rng.randint(3, 40)) for _ in CORPUS_FILES]


def corpus(dir) -> str:
  """Writes the corpus folder `dir/corpus` (`CORPUS_FILES`, plus hidden files a tokenizer run skips)."""
  folder = os.path.join(str(dir), "corpus")
  for name, text in zip(CORPUS_FILES, corpus_documents()):
    path = os.path.join(folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
  os.makedirs(os.path.join(folder, ".git"), exist_ok=True)
  for hidden in (".notes.txt", ".git/HEAD"):
    with open(os.path.join(folder, hidden), "w") as f:
      f.write("hidden: never tokenized")
  return folder


def training_text(dir) -> str:
  """A text file to train the tokenizers on: the corpus and more documents of the same kind."""
  path = os.path.join(str(dir), "train.txt")
  rng = random.Random(1)
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(corpus_documents() + [document(rng, 20) for _ in range(20)] + list(EXTRAS)) + "\n")
  return path


def sentencepiece_model(dir, vocab_size: int = 400) -> str:
  """Trains a SentencePiece unigram model (BOS 1, EOS 2, byte fallback, no normalization); returns its path."""
  import sentencepiece

  prefix = os.path.join(str(dir), "spm")
  sentencepiece.SentencePieceTrainer.train(
      input=training_text(dir), model_prefix=prefix, vocab_size=vocab_size, model_type="unigram",
      character_coverage=1.0, byte_fallback=True, normalization_rule_name="identity",
      remove_extra_whitespaces=False, add_dummy_prefix=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
      num_threads=1, minloglevel=2)
  return prefix + ".model"


def bpe_tokenizer_json(dir, vocab_size: int = 400, special_tokens=("<s>", "</s>")) -> str:
  """Trains a byte-level BPE `tokenizers` model (special tokens `special_tokens`, no post-processor);
  returns the path of its `tokenizer.json`."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train([training_text(dir)], trainer)
  folder = os.path.join(str(dir), "bpe")
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, "tokenizer.json")
  tok.save(path)
  return path


@dataclasses.dataclass(frozen=True)
class TinyTokenizers:
  """The session's tiny tokenizers and corpus: `sentencepiece` (a `.model`), `tokenizers` (a
  `tokenizer.json`), `corpus` (a folder) and `documents` (its texts, in order)."""
  sentencepiece: str
  tokenizers: str
  corpus: str
  documents: tuple

  def path(self, kind: str) -> str:
    return {"sentencepiece": self.sentencepiece, "tokenizers": self.tokenizers}[kind]


@pytest.fixture(scope="session")
def tiny_tokenizers(tmp_path_factory) -> TinyTokenizers:
  """Both tiny tokenizers and the corpus, built once per session."""
  root = tmp_path_factory.mktemp("tiny_tokenizers")
  return TinyTokenizers(sentencepiece=sentencepiece_model(root), tokenizers=bpe_tokenizer_json(root),
                        corpus=corpus(root), documents=tuple(corpus_documents()))
