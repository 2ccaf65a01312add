"""Fine-tuning a Hugging Face Llama with train.py: a folder written by transformers' `save_pretrained` is
the starting point under zero3, zeropp, mics, diloco_mics and host offload (its first loss is transformers'
loss on the same batch), a killed run resumes bitwise, and the exported folder scores in transformers
what `cli.evaluate` scores."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import transformers

from tests.tokenizer_fixtures import corpus_documents, tiny_tokenizers  # noqa: F401  (the session fixture)
from tests.train_helpers import ROOT, clean_env, records, saved_steps
from zerojax.cli.tokenize import tokenize_files
from zerojax.train import data as data_lib

SEQ, BATCH, STEPS = 32, 8, 8
PARAMS = [f"llama_config.seq_len={SEQ}", f"train.batch_size={BATCH}", f"train.steps={STEPS}", "train.eval_every=4",
          "train.eval_batches=1", "train.progress=False", "train.checkpoint_every=4", "train.param_dtype='float32'",
          "make_optimizer.warmup_steps=2"]


@pytest.fixture(scope="module")
def setup(tiny_tokenizers, tmp_path_factory):  # noqa: F811
  """A tiny random Llama (GQA, untied) saved by transformers, and train / held-out token files."""
  root = tmp_path_factory.mktemp("llama_train")
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
  model = transformers.LlamaForCausalLM(config)
  model.save_pretrained(root / "hf")
  train = tokenize_files(tiny_tokenizers.sentencepiece, [tiny_tokenizers.corpus], str(root / "train.bin"),
                         workers=1, progress=False)
  held = root / "held"
  held.mkdir()
  for i, doc in enumerate(corpus_documents(seed=1)[:20]):
    (held / f"{i:03d}.txt").write_text(doc)
  tokenize_files(tiny_tokenizers.sentencepiece, [str(held)], str(root / "val.bin"), workers=1, progress=False)
  assert train.vocab_size == 400
  return root, model


def run(workdir, root, config, *params, wait=True):
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--gin_file=configs/{config}.gin", f"--workdir={workdir}",
         f"--data={root / 'train.bin'}"] + [f"--gin_param={p}" for p in
                                            PARAMS + [f"train.init_from='{root / 'hf'}'", *params]]
  if not wait:
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
  r = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return {step: loss for step, loss, _ in records(workdir)}


def torch_loss(model, rows) -> float:
  x = torch.tensor(np.asarray(rows, np.int64))
  with torch.no_grad():
    logits = model(x[:, :-1]).logits
  return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))


@pytest.mark.e2e
def test_finetune_from_hf_under_each_plan_resume_export_and_evaluate(setup, tmp_path):
  root, model = setup
  ds = data_lib.open_data(str(root / "train.bin"), seq_len=SEQ)
  first_batch = data_lib.Batches(data_lib.Windows(ds.train, SEQ, 0), None, accum_steps=1, batch_size=BATCH).host(0)[0]
  expected = torch_loss(model, first_batch)

  losses = {c: run(tmp_path / c, root, c) for c in ("zero3", "zeropp", "mics", "diloco_mics")}
  losses["offload"] = run(tmp_path / "offload", root, "zero3", "zero3.offload=('opt_state', 'master')")
  for config, got in losses.items():
    assert sorted(got) == list(range(1, STEPS + 1)), config
    bound = 2e-2 if config == "zeropp" else 1e-4  # ZeRO++ gathers int8 weights (qwZ)
    assert abs(got[1] - expected) <= bound * expected, (config, got[1], expected)
    assert got[STEPS] < got[1] - 0.1, (config, got)  # it learns
  assert losses["offload"] == losses["zero3"]  # the update on the host is the device's, bitwise
  summary = json.load(open(tmp_path / "zero3" / "summary.json"))
  assert summary["architecture"] == "llama" and summary["init_from"] == str(root / "hf")

  killed = tmp_path / "killed"
  proc = run(killed, root, "zero3", wait=False)
  deadline = time.time() + 300
  while not saved_steps(killed) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert saved_steps(killed) and max(saved_steps(killed)) < STEPS
  assert run(killed, root, "zero3") == losses["zero3"]  # resumed from the checkpoint, not the folder: bitwise

  out = tmp_path / "exported"
  r = subprocess.run([sys.executable, "-m", "zerojax.cli.export", f"--workdir={tmp_path / 'zero3'}", "--to=hf",
                      f"--output={out}", "--dtype=float32"], cwd=ROOT, env=clean_env(), capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads(r.stdout.splitlines()[-1])["tokenizer_files"] == []
  scored = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  ids = np.fromfile(root / "val.bin", np.uint16).astype(np.int64)
  n = (ids.size - 1) // SEQ
  reference = torch_loss(scored, np.stack([ids[i * SEQ:i * SEQ + SEQ + 1] for i in range(n)]))
  for source in (f"--workdir={tmp_path / 'zero3'}", f"--init_from={out}"):
    r = subprocess.run([sys.executable, "-m", "zerojax.cli.evaluate", source, f"--data={root / 'val.bin'}",
                        f"--seq_len={SEQ}", "--batch_size=16"], cwd=ROOT, env=clean_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["windows"] == n and got["tokens"] == n * SEQ
    assert abs(got["loss"] - reference) <= 1e-3 * reference, (source, got, reference)
