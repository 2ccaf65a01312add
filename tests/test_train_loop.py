"""The training loop keeps the device fed: a step's metrics are read only after the next step was handed to
the device (between the sync points: evaluation, checkpoint, the last step), every record carries the
learning rate, the data wait and the model FLOP rate, and `train.profile_steps` writes a trace."""
import glob
import json
import os

from tests.train_helpers import command, run_main
from zerojax.executor import Executor
from zerojax import hardware
from zerojax.train import run_metrics

STEPS = 8


def test_metrics_are_read_one_step_late_and_records_say_the_rates(tmp_path, capsys, monkeypatch):
  events = []
  step_fn, read = Executor.step_fn, run_metrics.read

  def traced_step_fn(self, *a, **k):
    fn = step_fn(self, *a, **k)

    def step(state, batch):
      out = fn(state, batch)
      events.append(("dispatch", sum(e[0] == "dispatch" for e in events) + 1))
      return out
    return step

  def traced_read(d, previous):
    events.append(("read", d.step))
    return read(d, previous)

  monkeypatch.setattr(Executor, "step_fn", traced_step_fn)
  monkeypatch.setattr(run_metrics, "read", traced_read)
  argv = command(tmp_path, f"train.steps={STEPS}", "train.eval_every=0", "train.checkpoint_every=0",
                 "train.profile_steps=(2, 3)")[2:]
  code, _, err = run_main(argv, capsys, monkeypatch)
  assert code == 0, err[-3000:]
  for s in range(1, STEPS):  # the last step is a sync point (evaluation, checkpoint)
    assert events.index(("dispatch", s + 1)) < events.index(("read", s)), events
  assert events[-3:] == [("dispatch", STEPS), ("read", STEPS - 1), ("read", STEPS)]
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  for r in rows:
    assert {"learning_rate", "data_wait_s", "tokens_per_s", "model_tflops_per_device", "grad_norm"} <= set(r)
    assert "mfu" not in r  # no peak for a CPU
  assert rows[0]["learning_rate"] == 0.0 and rows[1]["learning_rate"] > 0  # the warmup's first update
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["model_tflops_per_device"] > 0 and summary["final_eval_loss"] is not None
  assert glob.glob(os.path.join(tmp_path, "profile", "plugins", "profile", "*", "*.xplane.pb"))


def test_flops_and_peaks():
  from zerojax.train.model_spec import ModelSpec
  from zerojax.models.gpt import GPTConfig
  from zerojax.models.llama import LlamaConfig
  gpt = ModelSpec("gpt", GPTConfig(vocab_size=256, seq_len=128, d_model=128, num_heads=4, num_layers=4))
  n = 4 * 12 * 128 ** 2 + 2 * 256 * 128
  assert run_metrics.flops_per_token(gpt) == 6 * n + 12 * 4 * 128 * 128
  llama = ModelSpec("llama", LlamaConfig(vocab_size=128256, seq_len=8192, d_model=4096, num_layers=32, num_heads=32,
                                         num_kv_heads=8, d_ff=14336))
  n = 32 * (4096 * 128 * 48 + 4096 * 4096 + 3 * 4096 * 14336) + 2 * 128256 * 4096  # 8.03 B: Llama-3-8B
  assert abs(n - 8.03e9) < 0.01e9 and run_metrics.flops_per_token(llama) == 6 * n + 12 * 32 * 4096 * 8192
  assert hardware.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert hardware.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and hardware.peak_flops("cpu") is None
