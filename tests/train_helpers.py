"""Shared helpers of the tests that run train.py as a subprocess (tests/test_train*.py, test_checkpoint,
test_radius) and of the checkpoint worker."""
import dataclasses
import json
import os
import re
import subprocess
import sys
import time

import gin

import zerojax
from zerojax.train.optim import make_optimizer
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model_config.d_model=32", "model_config.num_layers=2", "model_config.seq_len=32",
        "train.batch_size=8", "train.eval_every=5", "train.eval_batches=1", "train.progress=False"]


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


STEPS = 2


def make_executor(plan, mesh, model=None, optimizer="adamw"):
  opt = make_optimizer(name=optimizer, total_steps=10)
  return zerojax.Executor(model or helpers.tiny_gpt(), opt, dataclasses.replace(plan, pad_multiple=3), mesh)


TRAIN_STEPS = 20


GIN = ["model_config.d_model=32", "model_config.num_layers=2", "model_config.seq_len=32", "train.batch_size=8",
       f"train.steps={TRAIN_STEPS}", "train.checkpoint_every=4", "train.keep_checkpoints=2",
       "train.eval_every=0", "train.progress=False"]


def start_train(workdir, gin_file="configs/zero3.gin", gin=tuple(GIN)):
  args = [sys.executable, os.path.join(ROOT, "train.py"), f"--gin_file={gin_file}", f"--workdir={workdir}"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.Popen(args + [f"--gin_param={g}" for g in gin], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def records(workdir):
  """The (step, loss, grad_norm) of every line of metrics.jsonl, in order."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, f) if r]


def run_train(workdir, sig=None, when=None, **config):
  """Runs train.py in `workdir` (`config`: `start_train`'s gin file and params); sends `sig` once
  `when(last step logged)` holds.

  Returns:
    (return code, output, the records this run wrote, the step it restored or None).
  """
  proc = start_train(workdir, **config)
  deadline = time.time() + 240
  while sig is not None and proc.poll() is None and time.time() < deadline:
    recs = records(workdir)
    if recs and when(recs[-1][0]):
      proc.send_signal(sig)
      break
    time.sleep(0.005)
  out = proc.communicate(timeout=240)[0]
  restored = [int(s) for s in re.findall(r"restored step (\d+) from", out)]
  restored = restored[0] if restored else None
  return proc.returncode, out, [r for r in records(workdir) if r[0] > (restored or 0)], restored


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


def outputs_of(procs, timeout: float) -> list[str]:
  """The output of each of `procs` (started with stdout piped, stderr to stdout) once all have exited;
  every one is killed at the end, whatever happened."""
  try:
    return [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
