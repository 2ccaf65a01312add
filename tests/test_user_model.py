"""train.py on a model the user defines in their own file, outside the repository (`--model=FILE.py:build`):
the loop, checkpoints, logs and config as for the built-in GPT; a bad `--model` is one line naming the fix."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.doc_sections import code_blocks
from tests.train_helpers import ROOT, clean_env, error_line_of, run_main, saved_steps, steps_of
from zerojax.train import user_model
from zerojax.train.config import ConfigError

NOT_A_MODEL = """

def not_a_model(vocab_size, seq_len):
  return LM(vocab_size)
"""


@pytest.fixture
def user_dir(tmp_path):
  (tmp_path / "my_model.py").write_text(code_blocks("Your own model", "training.md")[0] + NOT_A_MODEL)
  return tmp_path


def run(cwd, *args):
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), *args, "--gin_file=configs/zero3.gin"]
  cmd += [f"--gin_param={p}" for p in ["model_config.seq_len=16", "train.batch_size=8", "train.steps=3",
                                       "train.checkpoint_every=2", "train.eval_every=3", "train.eval_batches=1",
                                       "train.progress=False"]]
  return subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.e2e
def test_train_py_trains_a_model_from_the_users_file(user_dir):
  """Run from the user's folder, as a user does: metrics, held-out loss, checkpoints, and a config.gin that
  names the file by its absolute path."""
  r = run(user_dir, "--workdir=run", "--model=my_model.py:build")
  assert r.returncode == 0, r.stderr[-3000:]
  work = user_dir / "run"
  assert steps_of(work) == [1, 2, 3] and saved_steps(work) == [2, 3]
  summary = json.load(open(work / "summary.json"))
  assert summary["status"] == "finished" and summary["final_eval_loss"] > 0
  # the user's model (about 30k parameters), not the GPT (about 800k)
  assert summary["memory_bytes_per_device"]["numel_padded"] < 100_000
  config = re.sub(r"\\\n\s*", "", (work / "config.gin").read_text())  # gin wraps long values
  assert f"train.model = '{user_dir / 'my_model.py'}:build'" in config


@pytest.mark.parametrize("spec,match", [
    ("my_model.py", "pass FILE.py:FUNCTION"),
    ("missing.py:build", "does not exist"),
    ("my_model.py:nope", "has no function 'nope'"),
    ("no_such_package.models:build", "no module 'no_such_package.models'"),
])
def test_bad_model_spec(user_dir, monkeypatch, spec, match):
  monkeypatch.chdir(user_dir)
  with pytest.raises(ConfigError, match=match) as e:
    user_model.load(spec)
  assert "\n" not in str(e.value)


def test_factory_that_returns_no_model(user_dir, monkeypatch):
  monkeypatch.chdir(user_dir)
  with pytest.raises(ConfigError, match="returned a LM; return a zerojax.Model") as e:
    user_model.build("my_model.py:not_a_model", vocab_size=256, seq_len=16)
  assert "\n" not in str(e.value)


def test_bad_model_on_the_command_line(user_dir, capsys, monkeypatch):
  """`train.py --model=...` naming no function: one line, exit 2, before any compilation."""
  monkeypatch.chdir(user_dir)
  code, _, err = run_main(["--workdir=run", "--model=my_model.py:nope", "--gin_file=configs/zero3.gin"], capsys,
                          monkeypatch)
  assert code == 2 and "has no function 'nope'" in error_line_of(err)
