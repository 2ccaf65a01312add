"""train.py on a tokenized corpus: the vocabulary from the sidecar, a killed run resumed bitwise, and
2 processes x 4 devices with the losses of 1 process x 8."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import free_port
from tests.tokenizer_fixtures import tiny_tokenizers  # noqa: F401  (the session fixture)
from tests.train_helpers import ROOT, TINY, clean_env, error_line, outputs_of, records, saved_steps, train
from zerojax.cli.tokenize import tokenize_files

STEPS = 12
PARAMS = TINY + [f"train.steps={STEPS}", "train.checkpoint_every=4", "train.eval_every=6", "make_optimizer.warmup_steps=2"]


@pytest.fixture(scope="module")
def token_files(tiny_tokenizers, tmp_path_factory):  # noqa: F811
  out = tmp_path_factory.mktemp("tokens")
  return {kind: tokenize_files(tiny_tokenizers.path(kind), [tiny_tokenizers.corpus], str(out / f"{kind}.bin"),
                               workers=1, progress=False) and str(out / f"{kind}.bin")
          for kind in ("sentencepiece", "tokenizers")}


def popen(workdir, data, *extra, params=PARAMS):
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--gin_file=configs/zero3.gin", f"--workdir={workdir}",
         f"--data={data}", *extra] + [f"--gin_param={p}" for p in params]
  return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)


def losses(workdir) -> dict:
  return {step: loss for step, loss, _ in records(workdir)}


@pytest.mark.e2e
def test_train_on_token_files_vocab_from_sidecar_and_a_killed_run_resumes_bitwise(token_files, tmp_path):
  data = token_files["sentencepiece"]
  whole = tmp_path / "whole"
  r = train(whole, *PARAMS[len(TINY):], extra=[f"--data={data}"])
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.load(open(whole / "summary.json"))
  assert summary["vocab_size"] == 400 and summary["data"].startswith("tokens from file")
  assert summary["final_loss"] < summary["first_loss"] - 0.5 and summary["final_eval_loss"] is not None
  assert "model_config.vocab_size = None" in open(whole / "config.gin").read()  # one setting: the data's

  killed = tmp_path / "killed"
  proc = popen(killed, data)
  deadline = time.time() + 300
  while not saved_steps(killed) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  stopped = max(saved_steps(killed))
  assert stopped < STEPS
  r = train(killed, *PARAMS[len(TINY):], extra=[f"--data={data}"])
  assert r.returncode == 0 and f"restored step {stopped} from" in r.stdout, r.stderr[-3000:]
  assert losses(killed) == losses(whole)  # every step's loss, bitwise: the same batches from (seed, step)

  r = train(tmp_path / "bpe", "train.steps=3", extra=[f"--data={token_files['tokenizers']}"])
  assert r.returncode == 0, r.stderr[-3000:]
  r = train(tmp_path / "small", "train.steps=3", "model_config.vocab_size=256", extra=[f"--data={data}"])
  assert r.returncode == 2 and "model_config.vocab_size=256 is smaller than the data's vocabulary of 400" in \
      error_line(r)


@pytest.mark.multiprocess
def test_two_processes_of_four_devices_train_as_one_of_eight(token_files, tmp_path):
  data, params = token_files["tokenizers"], PARAMS[:-3] + ["train.steps=6", "train.eval_every=0"]
  r = train(tmp_path / "one", *params[len(TINY):], extra=[f"--data={data}"])
  assert r.returncode == 0, r.stderr[-3000:]
  port = free_port()
  procs = [popen(tmp_path / "two", data, f"--coordinator=localhost:{port}", "--num_processes=2",
                 f"--process_id={i}", "--devices=4", params=params) for i in range(2)]
  outs = outputs_of(procs, timeout=400)
  assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
  one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
  assert sorted(one) == sorted(two) == list(range(1, 7))
  np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=2e-5)


@pytest.mark.e2e
def test_a_resume_on_other_data_is_refused_unless_allowed(tmp_path):
  from zerojax.train.token_file import Sidecar, write_sidecar
  paths = []
  for name, seed in (("a", 0), ("b", 1)):
    ids = np.random.default_rng(seed).integers(0, 300, 40_000).astype(np.uint16)
    ids.tofile(tmp_path / f"{name}.bin")
    write_sidecar(str(tmp_path / f"{name}.bin"), Sidecar(dtype="uint16", tokens=ids.size, vocab_size=300))
    paths.append(str(tmp_path / f"{name}.bin"))
  work = tmp_path / "run"
  r = train(work, "train.steps=2", extra=[f"--data={paths[0]}"])
  assert r.returncode == 0, r.stderr[-3000:]
  r = train(work, "train.steps=4", extra=[f"--data={paths[1]}", "--allow_changed=train.steps"])
  line = error_line(r)
  assert r.returncode == 2 and "data.fingerprint" in line and "data.source" in line, line
  r = train(work, "train.steps=4", extra=[f"--data={paths[1]}", "--allow_changed=train.steps",
                                          "--allow_changed=data.source,data.fingerprint"])
  assert r.returncode == 0 and "continuing with changed settings" in r.stdout, r.stderr[-3000:]
