"""`python -m zerojax.cli.tokenize` and `zerojax.train.tokenizer`: text to a token file and its sidecar.

Tiny tokenizers trained here on text the test writes (`tests/tokenizer_fixtures.py`): the token file decodes
back to the documents, each BOS + ids + EOS; the sidecar counts them; workers change nothing; errors are one
line; a failed run leaves no partial output.
"""
from __future__ import annotations

import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.tokenizer_fixtures import tiny_tokenizers  # noqa: F401  (the session fixture)
from zerojax.cli import tokenize
from zerojax.train import tokenizer as tokenizer_lib
from zerojax.train.token_file import DataError, read_sidecar

ROOT = pathlib.Path(__file__).resolve().parent.parent
KINDS = ("sentencepiece", "tokenizers")
JSONL_DOCS = ("first line document", "naïve café\nsecond line\n", "  leading spaces and a tab\t")


def write_jsonl(path, lines) -> str:
  with open(path, "w", encoding="utf-8") as f:
    f.write("".join(line + "\n" for line in lines))
  return str(path)


def jsonl(dir) -> str:
  """A `.jsonl` of `JSONL_DOCS` with a blank line, an empty text (both skipped) and an extra field."""
  lines = [json.dumps({"text": JSONL_DOCS[0]}), "", json.dumps({"text": ""}),
           json.dumps({"id": 7, "text": JSONL_DOCS[1]}), json.dumps({"text": JSONL_DOCS[2]})]
  return write_jsonl(os.path.join(str(dir), "docs.jsonl"), lines)


def read_ids(path: str) -> np.ndarray:
  return np.fromfile(path, dtype=np.dtype(read_sidecar(path).dtype).newbyteorder("<"))


def split_documents(ids: np.ndarray, tok) -> list[str]:
  """The documents of a token file: each BOS (where the tokenizer has one) + ids + EOS, decoded."""
  ends = np.flatnonzero(ids == tok.eos_id)
  assert ends.size and ends[-1] == ids.size - 1, "the file does not end with EOS"
  docs, start = [], 0
  for end in ends:
    body = ids[start:end]
    if tok.bos_id is not None:
      assert body[0] == tok.bos_id
      body = body[1:]
    assert tok.eos_id not in body and tok.bos_id not in body
    docs.append(tok.decode(body))
    start = end + 1
  return docs


def test_load_reads_both_kinds_a_folder_and_pickles_by_path(tiny_tokenizers, tmp_path):
  sp = tokenizer_lib.load(tiny_tokenizers.sentencepiece)
  assert (sp.kind, sp.vocab_size, sp.bos_id, sp.eos_id) == ("sentencepiece", 400, 1, 2)
  bpe = tokenizer_lib.load(os.path.dirname(tiny_tokenizers.tokenizers))  # the folder holding tokenizer.json
  assert (bpe.kind, bpe.path, bpe.vocab_size) == ("tokenizers", tiny_tokenizers.tokenizers, 400)
  assert (bpe.bos_id, bpe.eos_id) == (bpe.encode("<s>")[0], bpe.encode("</s>")[0])  # specials: one id each
  os.makedirs(tmp_path / "spm")
  (tmp_path / "spm" / "tokenizer.model").write_bytes(pathlib.Path(tiny_tokenizers.sentencepiece).read_bytes())
  assert tokenizer_lib.load(str(tmp_path / "spm")).kind == "sentencepiece"  # a folder holding tokenizer.model
  for tok in (sp, bpe):
    copy = pickle.loads(pickle.dumps(tok))
    text = tiny_tokenizers.documents[0]
    assert copy.encode_document(text) == tok.encode_document(text)
    ids = tok.encode_document(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.decode(ids[1:-1]) == text


def test_a_tokenizer_without_bos_writes_eos_only(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers

  tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "<|endoftext|>": 3}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<|endoftext|>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  loaded = tokenizer_lib.load(str(tmp_path / "tokenizer.json"))
  assert (loaded.bos_id, loaded.eos_id) == (None, 3)
  assert loaded.encode_document("a b a") == [1, 2, 1, 3]


def test_the_dtype_is_uint16_up_to_65536_ids_and_uint32_above():
  assert tokenizer_lib.token_dtype(400) == tokenizer_lib.token_dtype(65536) == "uint16"
  assert tokenizer_lib.token_dtype(65537) == tokenizer_lib.token_dtype(128256) == "uint32"


@pytest.mark.parametrize("kind", KINDS)
def test_a_folder_and_a_jsonl_decode_back_to_their_documents(tiny_tokenizers, tmp_path, kind):
  out = str(tmp_path / "out" / "train.bin")
  sidecar = tokenize.tokenize_files(tiny_tokenizers.path(kind), [tiny_tokenizers.corpus, jsonl(tmp_path)], out,
                                    workers=1, progress=False)
  tok = tokenizer_lib.load(tiny_tokenizers.path(kind))
  ids = read_ids(out)
  expect = list(tiny_tokenizers.documents) + list(JSONL_DOCS)  # hidden files, blank lines and "" left out
  assert split_documents(ids, tok) == expect
  assert read_sidecar(out) == sidecar
  assert (sidecar.dtype, sidecar.tokens, sidecar.documents, sidecar.max_id) == ("uint16", ids.size, len(expect),
                                                                                  int(ids.max()))
  assert os.path.getsize(out) == 2 * ids.size
  assert (sidecar.vocab_size, sidecar.tokenizer, sidecar.tokenizer_kind) == (400, tok.path, kind)
  assert (sidecar.bos_id, sidecar.eos_id) == (tok.bos_id, tok.eos_id)
  assert sidecar.sources == (tiny_tokenizers.corpus, str(tmp_path / "docs.jsonl"))
  assert sorted(os.listdir(tmp_path / "out")) == ["train.bin", "train.json"]  # no temporary file left


def test_a_vocabulary_over_65536_ids_writes_uint32(tiny_tokenizers, tmp_path):
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(tiny_tokenizers.tokenizers)
  tok.add_tokens([f"<extra_{i}>" for i in range(65600)])
  path = str(tmp_path / "big" / "tokenizer.json")
  os.makedirs(os.path.dirname(path))
  tok.save(path)
  text = "ka lo <extra_65599> mi <extra_3>"
  out = str(tmp_path / "big.bin")
  sidecar = tokenize.tokenize_files(path, [write_jsonl(tmp_path / "d.jsonl", [
      json.dumps({"text": text})])], out, workers=1, progress=False)
  ids = np.fromfile(out, dtype="<u4")
  assert (sidecar.dtype, sidecar.vocab_size, sidecar.max_id) == ("uint32", 66000, 65999)
  assert ids.max() == 65999 and ids[0] == 0 and ids[-1] == 1
  assert tokenizer_lib.load(path).decode(ids[1:-1]) == text


@pytest.mark.parametrize("kind", KINDS)
def test_two_workers_write_bitwise_what_one_writes(tiny_tokenizers, tmp_path, monkeypatch, kind):
  monkeypatch.setattr(tokenize, "CHUNK_BYTES", 1024)  # many tasks, so the pool's order matters
  inputs = [tiny_tokenizers.corpus, jsonl(tmp_path)]
  one = tokenize.tokenize_files(tiny_tokenizers.path(kind), inputs, str(tmp_path / "one.bin"), workers=1,
                                progress=False)
  two = tokenize.tokenize_files(tiny_tokenizers.path(kind), inputs, str(tmp_path / "two.bin"), workers=2,
                                progress=False)
  assert one == two
  assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()


def run_main(argv, capsys) -> str:
  """`main(argv)`'s one error line; asserts it exits with status 2 and prints one line."""
  with pytest.raises(SystemExit) as exit_info:
    tokenize.main(list(argv) + ["--no_progress"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("zerojax.cli.tokenize: error: "), err
  return err[0]


def no_eos_tokenizer(dir) -> str:
  from tokenizers import Tokenizer, models

  path = os.path.join(str(dir), "noeos.json")
  Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(path)
  return path


def bpe_copy(dir, tiny) -> str:
  path = os.path.join(str(dir), "tokenizer.json")
  pathlib.Path(path).write_text(pathlib.Path(tiny.tokenizers).read_text())
  return path


ERRORS = {  # name: (argv from (tmp, tiny), what the one line says)
    "missing tokenizer": (lambda t, k: ["--tokenizer", f"{t}/none.model", "--input", k.corpus, "--output",
                                        f"{t}/o.bin"], "none.model does not exist"),
    "unknown format": (lambda t, k: ["--tokenizer", write_jsonl(f"{t}/tok.txt", ["hello"]), "--input", k.corpus,
                                     "--output", f"{t}/o.bin"], "unknown format"),
    "bad model": (lambda t, k: ["--tokenizer", write_jsonl(f"{t}/bad.model", ["hello"]), "--input", k.corpus,
                                "--output", f"{t}/o.bin"], "is not a SentencePiece model"),
    "no eos": (lambda t, k: ["--tokenizer", no_eos_tokenizer(t), "--input", k.corpus, "--output", f"{t}/o.bin"],
               "has no EOS token"),
    "bin input": (lambda t, k: ["--tokenizer", k.sentencepiece, "--input", write_jsonl(f"{t}/ids.bin", ["x"]),
                                "--output", f"{t}/o.bin"], "ids.bin is already token ids"),
    "output is input": (lambda t, k: ["--tokenizer", k.sentencepiece, "--input", write_jsonl(f"{t}/x.bin", ["x"]),
                                      "--output", f"{t}/x.bin"], "would overwrite the input"),
    "output is the sidecar of an input": (lambda t, k: ["--tokenizer", k.sentencepiece, "--input",
                                                        write_jsonl(f"{t}/x.json", ["x"]), "--output", f"{t}/x.bin"],
                                          "would overwrite the input"),
    "output overwrites the tokenizer": (lambda t, k: ["--tokenizer", bpe_copy(t, k), "--input", k.corpus, "--output",
                                                      f"{t}/tokenizer.bin"], "would overwrite the tokenizer"),
    "output in input folder": (lambda t, k: ["--tokenizer", k.sentencepiece, "--input", k.corpus, "--output",
                                             f"{k.corpus}/o.bin"], "inside the input folder"),
    "output not bin": (lambda t, k: ["--tokenizer", k.sentencepiece, "--input", k.corpus, "--output", f"{t}/o.npy"],
                       "does not end in .bin"),
    "missing input": (lambda t, k: ["--tokenizer", k.sentencepiece, "--input", f"{t}/nowhere", "--output",
                                    f"{t}/o.bin"], "nowhere does not exist"),
    "bad jsonl line": (lambda t, k: ["--tokenizer", k.sentencepiece, "--input", write_jsonl(
        f"{t}/b.jsonl", ['{"text": "ok"}', '{"text": "ok"', '{"text": "ok"}']), "--output", f"{t}/o.bin"],
        "b.jsonl:2: not a JSON line"),
    "jsonl without the field": (lambda t, k: ["--tokenizer", k.sentencepiece, "--input", write_jsonl(
        f"{t}/c.jsonl", ['{"body": "ok"}']), "--output", f"{t}/o.bin"], "c.jsonl:1: no 'text' field"),
    "zero workers": (lambda t, k: ["--tokenizer", k.sentencepiece, "--input", k.corpus, "--output", f"{t}/o.bin",
                                   "--workers", "0"], "--workers 0"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_user_errors_exit_2_with_one_line(tiny_tokenizers, tmp_path, capsys, name):
  argv, says = ERRORS[name]
  line = run_main(argv(tmp_path, tiny_tokenizers), capsys)
  assert says in line, line
  assert not [p for p in os.listdir(tmp_path) if p.startswith("o.bin")]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_line_late_leaves_the_earlier_output_and_no_partial_file(tiny_tokenizers, tmp_path, monkeypatch,
                                                                        workers):
  monkeypatch.setattr(tokenize, "CHUNK_BYTES", 512)  # several tasks are written before the bad line is read
  out = str(tmp_path / "out" / "train.bin")
  tokenize.tokenize_files(tiny_tokenizers.sentencepiece, [jsonl(tmp_path)], out, workers=workers, progress=False)
  before = {p: (tmp_path / "out" / p).read_bytes() for p in os.listdir(tmp_path / "out")}
  lines = [json.dumps({"text": f"document {i}: " + tiny_tokenizers.documents[i % 5]}) for i in range(40)]
  bad = write_jsonl(tmp_path / "late.jsonl", lines[:37] + ["{not json"] + lines[37:])
  with pytest.raises(DataError, match=r"late\.jsonl:38: not a JSON line"):
    tokenize.tokenize_files(tiny_tokenizers.sentencepiece, [tiny_tokenizers.corpus, bad], out, workers=workers,
                            progress=False)
  assert {p: (tmp_path / "out" / p).read_bytes() for p in os.listdir(tmp_path / "out")} == before


def test_an_interrupt_leaves_no_output(tiny_tokenizers, tmp_path, monkeypatch):
  real = tokenize.documents

  def interrupted(files, text_field="text"):
    for i, doc in enumerate(real(files, text_field)):
      if i == 5:
        raise KeyboardInterrupt
      yield doc

  monkeypatch.setattr(tokenize, "documents", interrupted)
  monkeypatch.setattr(tokenize, "CHUNK_BYTES", 256)
  with pytest.raises(KeyboardInterrupt):
    tokenize.tokenize_files(tiny_tokenizers.sentencepiece, [tiny_tokenizers.corpus], str(tmp_path / "o.bin"),
                            workers=1, progress=False)
  assert os.listdir(tmp_path) == []


def test_ctrl_c_stops_the_command_and_leaves_no_output(tiny_tokenizers, tmp_path):
  """The command blocks reading a named pipe (its temporary file already open); SIGINT ends it with status 130,
  also when it was started with SIGINT ignored (as a script's background job is, or the child of a process
  that ignores it)."""
  fifo = str(tmp_path / "pipe.txt")
  os.mkfifo(fifo)
  out = tmp_path / "out"
  ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child inherits SIGINT ignored
  try:
    proc = subprocess.Popen([sys.executable, "-m", "zerojax.cli.tokenize", "--tokenizer", tiny_tokenizers.sentencepiece,
                             "--input", tiny_tokenizers.corpus, fifo, "--output", str(out / "o.bin"), "--workers", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  finally:
    signal.signal(signal.SIGINT, ignored)
  try:
    deadline = time.monotonic() + 60
    while not (out.exists() and os.listdir(out)) and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    assert [p.startswith("o.bin.tmp-") for p in os.listdir(out)] == [True]
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 130, err[-2000:]
  assert "zerojax.cli.tokenize: interrupted" in err
  assert os.listdir(out) == []


def test_the_command_prints_a_summary_and_writes_what_the_function_writes(tiny_tokenizers, tmp_path):
  inputs = [tiny_tokenizers.corpus, jsonl(tmp_path)]
  out = str(tmp_path / "cli.bin")
  run = subprocess.run([sys.executable, "-m", "zerojax.cli.tokenize", "--tokenizer", tiny_tokenizers.tokenizers,
                        "--input", *inputs, "--output", out, "--workers", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  summary = json.loads(run.stdout.strip().splitlines()[-1])
  expect = tokenize.tokenize_files(tiny_tokenizers.tokenizers, inputs, str(tmp_path / "fn.bin"), workers=1,
                                   progress=False)
  assert (summary["tokens"], summary["documents"]) == (expect.tokens, expect.documents)
  assert summary["seconds"] > 0 and summary["tokens_per_s"] > 0
  assert (tmp_path / "cli.bin").read_bytes() == (tmp_path / "fn.bin").read_bytes()
  assert read_sidecar(out) == expect
