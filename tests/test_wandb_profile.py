"""What a run writes besides metrics.jsonl and TensorBoard: with `train.wandb_project` a W&B run holding
the same series (`WANDB_MODE=offline`: on disk, read back here from its transaction log), and with
`train.profile_steps=(3, 5)` a trace that TensorBoard's profile plugin (the `xprof` package) converts
into its trace viewer's events, with steps 3 to 5 marked."""
import collections
import glob
import json
import math
import os
import re
import struct
import sys
import time
import zlib

import gin
import pytest

from tests.train_helpers import command, error_line_of, run_main
from zerojax.train import report

STEPS = 6
PROFILED = (3, 5)


def wandb_records(path: str):
  """The records of a W&B run's transaction log (`run-<id>.wandb`), as `wandb_internal_pb2.Record`s.

  The file is a 7-byte header (":W&B", a 2-byte magic, a version byte) and then a LevelDB log: 32 KiB
  blocks of chunks, each with a 7-byte header (the CRC-32 of its type and data, its length, its type:
  1 a whole record, 2/3/4 its first/middle/last part); a block's tail shorter than a header is padding."""
  from wandb.proto import wandb_internal_pb2
  header, block = 7, 32768
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", data[:7]
  pos, parts = header, b""
  while pos + header <= len(data):
    if block - pos % block < header:
      pos += block - pos % block
      continue
    crc, n, kind = struct.unpack("<IHB", data[pos:pos + header])
    chunk = data[pos + header:pos + header + n]
    if (kind == 0 and n == 0) or len(chunk) < n:  # zero fill, or a chunk being written: the end so far
      break
    assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"a damaged chunk at byte {pos} of {path}"
    pos += header + n
    parts = chunk if kind in (1, 2) else parts + chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      yield record


def _key(item) -> str:
  return "/".join(item.nested_key) or item.key


def wandb_run(folder: str, wait_s: float = 60) -> tuple[dict, dict[int, dict]]:
  """(the run record's id, name, project and config; {step: the values logged at it}) of an offline run.

  `run.finish()` returns before W&B's service has written the whole log (wandb 0.31: the file held its
  header alone for a moment): the log is read again until it ends with the run's exit record."""
  (path,) = glob.glob(os.path.join(folder, "run-*.wandb"))
  deadline = time.monotonic() + wait_s
  records = list(wandb_records(path))
  while not records or records[-1].WhichOneof("record_type") != "exit":
    assert time.monotonic() < deadline, f"{path} has no exit record after {wait_s} s"
    time.sleep(0.1)
    records = list(wandb_records(path))
  run, history = {}, {}
  for r in records:
    kind = r.WhichOneof("record_type")
    if kind == "run":
      run = {"id": r.run.run_id, "name": r.run.display_name, "project": r.run.project,
             "config": {_key(i): json.loads(i.value_json) for i in r.run.config.update}}
    elif kind == "history":
      values = {_key(i): json.loads(i.value_json) for i in r.history.item}
      history[r.history.step.num] = {k: v for k, v in values.items() if not k.startswith("_")}
  return run, history


def same(a, b) -> bool:
  return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """One train.py run (in this process) with W&B offline and a trace of steps 3 to 5."""
  pytest.importorskip("wandb")
  from zerojax.cli.train import main
  workdir = tmp_path_factory.mktemp("run")
  argv = command(workdir, f"train.steps={STEPS}", "train.checkpoint_every=0", "train.wandb_project='zerojax-test'",
                 f"train.profile_steps={PROFILED}")[2:]
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("WANDB_MODE", "offline")
    mp.delenv("WANDB_DIR", raising=False)
    mp.setattr(sys, "unraisablehook", sys.unraisablehook)  # main() quiets it for the process
    gin.clear_config()
    try:
      assert main(argv) == 0
    finally:
      gin.clear_config()
  return workdir


def test_the_offline_wandb_run_holds_the_series_of_metrics_jsonl(run_dir):
  rows = report.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  (folder,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))  # WANDB_DIR: the workdir
  run, history = wandb_run(folder)
  assert run["id"] == open(os.path.join(run_dir, report.WANDB_ID)).read().strip() and run["id"] in folder
  assert run["name"] == os.path.basename(run_dir) and run["project"] == "zerojax-test"
  assert run["config"]["train.steps"] == STEPS and run["config"]["train.plan"] == "@zero3()"
  assert run["config"]["plan"] == "zero3" and run["config"]["model_config.d_model"] == 32
  assert sorted(history) == [r["step"] for r in rows]
  for row in rows:  # every scalar of every record, the same value at the same step
    logged = history[row["step"]]
    assert logged.keys() == report.scalars(row).keys()
    for key, tag in report.SCALARS:
      if key in row:
        assert same(logged[tag], row[key]), (row["step"], key, logged[tag], row[key])
  series = {tag: [history[r["step"]][tag] for r in rows] for tag in ("train/loss", "train/learning_rate",
                                                                      "train/grad_norm")}
  assert series == {"train/loss": [r["loss"] for r in rows], "train/learning_rate": [r["learning_rate"] for r in rows],
                    "train/grad_norm": [r["grad_norm"] for r in rows]}
  assert [s for s, v in history.items() if "eval/loss" in v] == [r["step"] for r in rows if "eval_loss" in r]


# about 17 s converting the trace on 2 cores: the full suite's; the fast suite keeps test_train_loop's file check
@pytest.mark.slow
def test_the_trace_reads_in_tensorboards_profile_plugin(run_dir):
  pytest.importorskip("xprof")
  from xprof.convert import raw_to_tool_data
  (xspace,) = glob.glob(os.path.join(run_dir, "profile", "plugins", "profile", "*", "*.xplane.pb"))
  assert glob.glob(os.path.join(os.path.dirname(xspace), "perfetto_trace.json.gz"))
  assert "trace_viewer@" in raw_to_tool_data.xspace_to_tool_names([xspace])
  data, content_type = raw_to_tool_data.xspace_to_tool_data([xspace], "trace_viewer", {})
  assert content_type == "application/json"
  events = json.loads(data)["traceEvents"]
  steps = [e for e in events if e.get("args", {}).get("step_num") is not None]
  assert [(e["name"], int(e["args"]["step_num"])) for e in steps] == [
      (f"train {s}", s) for s in range(PROFILED[0], PROFILED[1] + 1)]
  assert all(e["dur"] > 0 for e in steps)
  overview, _ = raw_to_tool_data.xspace_to_tool_data([xspace], "overview_page", {})
  (table,) = [t for t in json.loads(overview) if [c["id"] for c in t.get("cols", [])][:1] == ["stepnum"]]
  assert [row["c"][0]["v"] for row in table["rows"]] == [f"train {s}" for s in range(PROFILED[0], PROFILED[1] + 1)]
  # the training step's program ran on each of the 8 devices ("[d] ...") in every traced step
  runs = collections.Counter(e["name"].split("]")[0] for e in events if e.get("ph") == "X"
                             and re.fullmatch(r"\[\d+\] .*Execute \(jit__train_step\)", e.get("name", "")))
  assert len(runs) == 8 and min(runs.values()) >= PROFILED[1] - PROFILED[0] + 1, runs


def test_a_resume_continues_the_same_wandb_run(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.delenv("WANDB_DIR", raising=False)
  row = lambda s: {"step": s, "loss": 1.0 / s, "learning_rate": 0.1, "grad_norm": float("nan")}
  log = report.RunLog(str(tmp_path), 0, "zerojax-test", config={"train.steps": 5})
  for s in range(1, 5):
    log.write(row(s))
  log.close()
  log = report.RunLog(str(tmp_path), 2, "zerojax-test", config={"train.steps": 5})  # restored at step 2
  for s in range(3, 6):
    log.write(row(s))
  log.close()
  assert [r["step"] for r in report.read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4, 5]
  first, second = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
  (run1, history1), (run2, history2) = wandb_run(first), wandb_run(second)
  assert run1["id"] == run2["id"] == (tmp_path / report.WANDB_ID).read_text().strip()
  assert sorted(history1) == [1, 2, 3, 4] and sorted(history2) == [3, 4, 5]
  assert history2[5]["train/loss"] == 0.2 and math.isnan(history2[5]["train/grad_norm"])


def test_a_missing_wandb_package_is_one_line_naming_the_fix(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  argv = command(tmp_path, "train.wandb_project='zerojax-test'")[2:]
  code, _, err = run_main(argv, capsys, monkeypatch)
  assert code == 2
  assert "pip install 'zerojax[wandb]'" in error_line_of(err)
  assert not os.path.exists(tmp_path / "metrics.jsonl")  # said before anything ran


def test_wandb_failing_to_start_is_one_error_naming_offline_mode(tmp_path, monkeypatch):
  wandb = pytest.importorskip("wandb")

  def init(**kw):
    raise wandb.errors.UsageError("api_key not configured (no-tty).\ncall wandb.login(key=[your_api_key])")
  monkeypatch.setattr(wandb, "init", init)
  with pytest.raises(ValueError) as e:
    report.RunLog(str(tmp_path), 0, "zerojax-test")
  assert "\n" not in str(e.value) and "api_key not configured" in str(e.value)
  assert "WANDB_MODE=offline" in str(e.value)
