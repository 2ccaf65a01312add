"""train.py end to end: gin configs, metrics files, clear errors, non-finite handling."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model_config.d_model=32", "model_config.num_layers=2", "model_config.seq_len=32",
        "train.batch_size=8", "train.eval_every=5", "train.eval_batches=1", "train.progress=False",
        "train.max_data_bytes=2000000"]


def train(tmp_path, *params, gin_file="configs/zero3.gin", extra=()):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  cmd = [sys.executable, "train.py", f"--gin_file={gin_file}", f"--workdir={tmp_path}", *extra]
  cmd += [f"--gin_param={p}" for p in TINY + list(params)]
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("gin_file", ["configs/mics.gin", "configs/zeropp.gin"])
def test_train_writes_metrics_and_loss_falls(tmp_path, gin_file):
  r = train(tmp_path, "train.steps=10", "make_optimizer.learning_rate=1e-2", "make_optimizer.warmup_steps=2",
            gin_file=gin_file)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [row["step"] for row in rows] == list(range(1, 11))
  assert {"loss", "step_time_s", "tokens_per_s"} <= set(rows[0]) and "eval_loss" in rows[4]
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["mesh"] == {"node": 2, "gpu": 4} and summary["skipped_steps"] == 0
  assert summary["final_loss"] < summary["first_loss"] - 0.5


def test_unknown_gin_parameter_fails(tmp_path):
  r = train(tmp_path, "train.stepz=3")
  assert r.returncode != 0 and "stepz" in r.stderr


def test_missing_data_path_is_a_clear_error(tmp_path):
  r = train(tmp_path, "train.steps=1", extra=["--data=/no/such/corpus"])
  assert r.returncode != 0 and "--data path '/no/such/corpus' does not exist" in r.stderr


def test_non_finite_steps_are_skipped_then_stop(tmp_path):
  r = train(tmp_path, "train.steps=20", "make_optimizer.learning_rate=1e30", "make_optimizer.clip_norm=None",
            "make_optimizer.warmup_steps=1", "train.max_consecutive_skips=3")
  assert r.returncode != 0 and "3 steps in a row had non-finite loss" in r.stderr
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert rows[-1]["skipped"] >= 2
