"""train.py end to end: gin configs, metrics files, one-line errors, device counts, non-finite handling."""
import json
import os

import pytest

from tests.train_helpers import command, error_line, error_line_of, run_main, train


@pytest.mark.parametrize("gin_file", [pytest.param("configs/mics.gin", marks=pytest.mark.e2e), "configs/zeropp.gin"])
def test_train_writes_metrics_and_loss_falls(tmp_path, gin_file):
  """The fast suite's smoke test of train.py as a user runs it (a subprocess); MiCS in the full suite.
  The shipped config leaves the compute dtype to the platform (fp32 on CPUs) and summary.json says so;
  MiCS's run sets it (`train.compute_dtype='float32'`): an explicit setting wins, and no platform default
  is reported."""
  explicit = gin_file == "configs/mics.gin"
  r = train(tmp_path, "train.steps=10", "make_optimizer.learning_rate=1e-2", "make_optimizer.warmup_steps=2",
            *(["train.compute_dtype='float32'"] if explicit else []), gin_file=gin_file)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [row["step"] for row in rows] == list(range(1, 11))
  assert {"loss", "step_time_s", "tokens_per_s"} <= set(rows[0]) and "eval_loss" in rows[4]
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["mesh"] == {"node": 2, "gpu": 4} and summary["skipped_steps"] == 0
  assert summary["final_loss"] < summary["first_loss"] - 0.5
  assert summary["status"] == "finished" and summary["plan_name"] == gin_file[8:-4]
  assert summary["plan_fields"]["compute_dtype"] == "float32"
  assert summary.get("platform_defaults") == (None if explicit else {"compute_dtype": "float32", "platform": "cpu"})


@pytest.mark.parametrize("params,extra,expect", [
    (["train.stepz=3"], [], "--gin_param 'train.stepz=3': Configurable 'train' doesn't have a parameter named "
                            "'stepz'. (did you mean train.steps?)"),
    (["train.steps=abc"], [], "cannot read the value abc (a string needs quotes"),
    (["zeropp.weight_bits=7", "train.steps=1"], [], "plan 'zeropp': weight_bits=7; use one of (None, 4, 8)"),
    (["train.batch_size=12"], [], "global batch size 12 is not divisible by the 8 devices"),
    (["train.steps=1"], ["--data=/no/such/corpus"], "--data path '/no/such/corpus' does not exist; pass a token file (.bin, .npy), a folder of them, or text"),
    ([], ["--gin_file=configs/zero4.gin"], "--gin_file 'configs/zero4.gin' does not exist (looked in"),
    ([], ["--allow_changed=model_config.d_model"], "--allow_changed=model_config.d_model: the model"),
])
def test_config_and_data_errors_are_one_line(tmp_path, capsys, monkeypatch, params, extra, expect):
  gin_file = None if any(e.startswith("--gin_file") for e in extra) else "configs/zeropp.gin"
  argv = command(tmp_path, *params, gin_file=gin_file, extra=extra)[2:]
  code, _, err = run_main(argv, capsys, monkeypatch)
  assert code == 2 and expect in error_line_of(err)


def test_no_config_and_verbose(tmp_path, capsys, monkeypatch):
  code, _, err = run_main(command(tmp_path, gin_file=None)[2:], capsys, monkeypatch)
  assert code == 2 and "no --gin_file given; pass a config, e.g. --gin_file=configs/zero3.gin" in error_line_of(err)
  code, _, err = run_main(command(tmp_path, "train.stepz=3", extra=["--verbose"])[2:], capsys, monkeypatch)
  assert code == 2 and "Traceback" in err and "zerojax: error: --gin_param 'train.stepz=3'" in err


def test_help_lists_the_gin_parameters(tmp_path, capsys, monkeypatch):
  code, out, _ = run_main(["--help"], capsys, monkeypatch)
  assert code == 0
  for line in ["train.steps = 200", "train.plan = REQUIRED", "model_config.d_model = 128",
               "make_optimizer.learning_rate = 0.003", "zeropp.weight_bits = 8", "PLAN.reduce_dtype = 'float32'",
               "train.param_dtype = None"]:
    assert line in out, line


@pytest.mark.parametrize("env,extra,devices", [
    ({"JAX_NUM_CPU_DEVICES": "4"}, [], "4 CPU devices per process (JAX_NUM_CPU_DEVICES)"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, [], "2 CPU devices per process (XLA_FLAGS)"),
    ({"JAX_NUM_CPU_DEVICES": "4"}, ["--devices=2"], "2 CPU devices per process (--devices)"),
    ({}, [], "8 CPU devices per process (the default"),
])
@pytest.mark.e2e  # a fresh process is the point: the device count is fixed when JAX starts
def test_device_count_comes_from_the_flag_else_the_environment_else_8(tmp_path, env, extra, devices):
  """Stops at the batch check (a batch of 5 fits no mesh here), after the devices are set up."""
  base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  r = train(tmp_path, "train.batch_size=5", extra=extra, env={**base, **env})
  assert devices in r.stdout, r.stdout + r.stderr[-2000:]
  n = int(devices.split()[0])
  assert r.returncode == 2 and f"not divisible by the {n} devices" in error_line(r)


@pytest.mark.e2e
def test_non_finite_steps_are_skipped_then_stop(tmp_path):
  r = train(tmp_path, "train.steps=20", "make_optimizer.learning_rate=1e30", "make_optimizer.clip_norm=None",
            "make_optimizer.warmup_steps=1", "train.max_consecutive_skips=3")
  assert r.returncode == 1 and "3 steps in a row had non-finite loss" in error_line(r)
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert rows[-1]["skipped"] >= 2
