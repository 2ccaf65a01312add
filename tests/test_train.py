"""train.py end to end: gin configs, metrics files, one-line errors, device counts, non-finite handling."""
import json
import os
import subprocess
import sys

import gin
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model_config.d_model=32", "model_config.num_layers=2", "model_config.seq_len=32",
        "train.batch_size=8", "train.eval_every=5", "train.eval_batches=1", "train.progress=False",
        "train.max_data_bytes=2000000"]


def command(workdir, *params, gin_file="configs/zero3.gin", extra=(), tiny=True) -> list[str]:
  """`python .../train.py --workdir=... [--gin_file=...] --gin_param=...` with the TINY model."""
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}", *extra]
  cmd += [f"--gin_file={gin_file}"] if gin_file else []
  return cmd + [f"--gin_param={p}" for p in (TINY if tiny else []) + list(params)]


def clean_env() -> dict:
  return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def train(workdir, *params, gin_file="configs/zero3.gin", extra=(), tiny=True, cwd=ROOT, env=None, prefix=()):
  """Runs train.py as a user does and waits for it (`prefix`: a command that runs it, e.g. with a limit)."""
  cmd = [*prefix, *command(workdir, *params, gin_file=gin_file, extra=extra, tiny=tiny)]
  return subprocess.run(cmd, cwd=cwd, env=clean_env() if env is None else env, capture_output=True, text=True,
                        timeout=600)


def steps_of(workdir) -> list[int]:
  """The steps of metrics.jsonl, in order."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f]


def saved_steps(workdir) -> list[int]:
  """The finished checkpoints' steps."""
  folder = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(folder) if d.isdigit()) if os.path.isdir(folder) else []


def error_line(r) -> str:
  """The one line a failed run printed to stderr (asserts there is exactly one and no traceback)."""
  lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith(("W0000", "I0000", "WARNING: All"))]
  assert len(lines) == 1 and lines[0].startswith("zerojax: error: ") and "Traceback" not in r.stderr, r.stderr[-3000:]
  return lines[0]


def run_main(argv, capsys, monkeypatch):
  """`train.py ARGV` in this process (`zerojax.cli.train.main`): (exit code, stdout, stderr). For what needs
  no fresh process: one-line errors, --help. Leaves gin and the process's hooks as they were."""
  from zerojax.cli.train import main
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # main() quiets it for the process
  gin.clear_config()
  try:
    code = main(argv)
  except SystemExit as e:  # argparse: --help, usage errors
    code = e.code
  finally:
    gin.clear_config()
  out, err = capsys.readouterr()
  return code, out, err


def error_line_of(err: str) -> str:
  """The one line a failed in-process run printed to stderr."""
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("zerojax: error: ") and "Traceback" not in err, err[-3000:]
  return lines[0]


@pytest.mark.parametrize("gin_file", [pytest.param("configs/mics.gin", marks=pytest.mark.e2e), "configs/zeropp.gin"])
def test_train_writes_metrics_and_loss_falls(tmp_path, gin_file):
  """The fast suite's smoke test of train.py as a user runs it (a subprocess); MiCS in the full suite."""
  r = train(tmp_path, "train.steps=10", "make_optimizer.learning_rate=1e-2", "make_optimizer.warmup_steps=2",
            gin_file=gin_file)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [row["step"] for row in rows] == list(range(1, 11))
  assert {"loss", "step_time_s", "tokens_per_s"} <= set(rows[0]) and "eval_loss" in rows[4]
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["mesh"] == {"node": 2, "gpu": 4} and summary["skipped_steps"] == 0
  assert summary["final_loss"] < summary["first_loss"] - 0.5
  assert summary["status"] == "finished" and summary["plan_name"] == gin_file[8:-4]


@pytest.mark.parametrize("params,extra,expect", [
    (["train.stepz=3"], [], "--gin_param 'train.stepz=3': Configurable 'train' doesn't have a parameter named "
                            "'stepz'. (did you mean train.steps?)"),
    (["train.steps=abc"], [], "cannot read the value abc (a string needs quotes"),
    (["zeropp.weight_bits=7", "train.steps=1"], [], "plan 'zeropp': weight_bits=7; use one of (None, 4, 8)"),
    (["train.batch_size=12"], [], "global batch size 12 is not divisible by the 8 devices"),
    (["train.steps=1"], ["--data=/no/such/corpus"], "--data path '/no/such/corpus' does not exist; pass a text file"),
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
               "make_optimizer.learning_rate = 0.003", "zeropp.weight_bits = 8", "PLAN.param_dtype = 'bfloat16'"]:
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
