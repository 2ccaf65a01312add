"""The supervisor's watchdog and restart caps (`zerojax.train.supervisor`, `zerojax.train.watchdog`) on
stand-in processes that train in lockstep and beat with the real heartbeat (`zerojax.train.progress`): a
SIGSTOPped node is ended and the others train on, a hang with every heartbeat alive restarts every node,
a stopped node is the one lost when JAX's heartbeat ends the others first; restarts stop after
`max_restarts` with one line, back off when a start trains nothing, and stop below `min_nodes`; and end
to end, a SIGSTOPped train.py is ended and the two others train on."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from zerojax.train import progress, report, supervisor, watchdog

# Each process takes a step when every process of its start has written the one before (a collective),
# reports it through the real heartbeat (beating every 0.05 s), and the first logs it in metrics.jsonl.
# Modes: "train" (STEPS steps, then exit 0), "hang" (from step 5 no process steps, the first start only),
# "die" (the start's last process SIGKILLs itself at once), "give_up" (a process stalled for 2 s aborts,
# as JAX's distributed runtime ends the peers of a process whose heartbeat stopped: SIGABRT).
STAND_IN = r"""
import importlib.util, json, os, signal, sys, time
work, node, gen, mode, module = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
spec = importlib.util.spec_from_file_location("progress", module)
progress = importlib.util.module_from_spec(spec)
spec.loader.exec_module(progress)
args = dict(a.split("=", 1) for a in sys.argv[6:] if "=" in a)
pid, n = int(args["--process_id"]), int(args["--num_processes"])
d = args["--replica_dir"]
os.makedirs(d, exist_ok=True)
json.dump({"plan": "P", "survives": True, "why": None}, open(os.path.join(d, "run.json"), "w"))
if mode == "die" and pid == n - 1:
  time.sleep(0.3)
  os.kill(os.getpid(), signal.SIGKILL)
beat = progress.Progress(args["--progress_file"], every_s=0.05)
here = os.path.join(work, f"gen{gen}")
os.makedirs(here, exist_ok=True)
STEPS, step, event = 30, 0, args.get("--event")
while step < STEPS:
  with open(os.path.join(here, f"p{pid}.tmp"), "w") as f:
    f.write(str(step))
  os.replace(os.path.join(here, f"p{pid}.tmp"), os.path.join(here, f"p{pid}"))
  waited = time.monotonic()
  while not all(os.path.exists(os.path.join(here, f"p{i}")) and int(open(os.path.join(here, f"p{i}")).read()) >= step
                for i in range(n)) or (mode == "hang" and gen == 0 and step >= 5):
    if mode == "give_up" and step > 0 and time.monotonic() - waited > 2:
      os.abort()
    time.sleep(0.01)
  step += 1
  beat.completed(step, STEPS)
  if pid == 0:
    with open(os.path.join(work, "metrics.jsonl"), "a") as f:
      f.write(json.dumps({"step": step, "time": time.time(), "nodes": n, "event": json.loads(event) if event and step == 1 else None}) + "\n")
  time.sleep(0.03)
"""


def make(tmp_path, nodes, mode, **kw):
  script = tmp_path / "node.py"
  script.write_text(STAND_IN)
  starts, lines = [], []

  def launch(s):
    starts.append((time.monotonic(), s))
    return subprocess.Popen([sys.executable, str(script), str(tmp_path), str(s.node), str(s.generation), mode,
                             progress.__file__, *s.args], start_new_session=True)

  kw = {"watchdog_floor_s": 0.5, "watchdog_first_s": 30, "finish_s": 0.1, "restart_backoff_s": 0.2, **kw}
  sup = supervisor.Supervisor(nodes, launch, str(tmp_path), lambda n: str(tmp_path / f"node{n}"), log=lines.append,
                              **kw)
  return sup, starts, lines


def run(sup, timeout=60):
  sup.start(list(range(sup.nodes)))
  end = time.monotonic() + timeout
  try:
    while sup.poll() is None:
      assert time.monotonic() < end, f"not over after {timeout} s"
      time.sleep(0.02)
  finally:
    sup.stop_all()
  return sup.status


@pytest.fixture
def quick(monkeypatch):
  """A heartbeat unchanged for 1 s counts as stopped (the stand-ins beat every 0.05 s)."""
  monkeypatch.setattr(watchdog, "STALE_S", 1.0)


def test_a_stopped_node_is_ended_and_the_others_train_on(tmp_path, quick):
  sup, starts, lines = make(tmp_path, 3, "train", hang_at={2: 3})
  assert run(sup) == 0, lines
  assert [(s.generation, s.node) for _, s in starts] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
  assert lines[0].startswith("zerojax: supervisor: stopping node 2 (SIGSTOP) at step")
  assert lines[1].startswith("zerojax: supervisor: node 2 completed no step for") and "its heartbeat stopped" in lines[1]
  assert lines[2].startswith("zerojax: supervisor: node 2 lost after step") and "restarting 2 nodes [0, 1]" in lines[2]
  lost, = sup.events
  assert lost["kind"] == "node_lost" and lost["node"] == [2] and 0.5 < lost["detected"] - lost["failed"] < 10
  # restarts wait less for each other in jax.distributed.initialize than the first start
  assert not any("--initialization_timeout" in a for _, s in starts[:3] for a in s.args)
  assert all("--initialization_timeout=60" in s.args for _, s in starts[3:])


def test_a_hang_with_every_heartbeat_alive_restarts_every_node(tmp_path, quick):
  sup, starts, lines = make(tmp_path, 3, "hang")
  assert run(sup) == 0, lines
  assert [(s.generation, s.node) for _, s in starts] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
  assert len(lines) == 1 and lines[0].startswith("zerojax: supervisor: no step completed for")
  assert "while every node's heartbeat goes on" in lines[0] and lines[0].endswith("restarting nodes [0, 1, 2]")
  assert sup.events[0]["kind"] == "hang" and sup.events[0]["last_step"] == 5
  assert report.read_metrics(str(tmp_path / "metrics.jsonl"))[-1]["step"] == 30


def test_when_the_others_exit_first_the_stopped_node_is_the_one_lost(tmp_path, quick):
  """As JAX's distributed runtime ends the peers of a SIGSTOPped process (SIGABRT) before the watchdog
  (off here) acts: the stopped node is lost, not the ones that exited."""
  sup, starts, lines = make(tmp_path, 3, "give_up", hang_at={1: 3}, watchdog_k=0)
  assert run(sup) == 0, lines
  assert [s.node for _, s in starts[3:]] == [0, 2]
  assert sup.events[0]["node"] == [1] and "node 1 lost after step" in lines[-1]


def test_restarts_stop_after_max_restarts_with_one_line_and_back_off(tmp_path):
  sup, starts, lines = make(tmp_path, 4, "die", max_restarts=2)
  assert run(sup) == 1
  assert [len([s for _, s in starts if s.generation == g]) for g in range(3)] == [4, 3, 2] and len(starts) == 9
  assert lines[:2] == ["zerojax: supervisor: node 3 lost after step None; restarting 3 nodes [0, 1, 2] from their "
                       "own copies in 0.2 s",
                       "zerojax: supervisor: node 2 lost after step None; restarting 2 nodes [0, 1] from their own "
                       "copies in 0.4 s"]
  assert len(lines) == 3 and lines[2] == (
      "zerojax: supervisor: node 1 lost after step None; the run was restarted 2 times already (--max_restarts=2), "
      "so it stops; start it again to resume from the nodes' own copies, or raise --max_restarts")
  first = [min(t for t, s in starts if s.generation == g) for g in range(3)]
  assert first[2] - first[1] > 0.4 + 0.3  # the dying process lives 0.3 s; the second backoff is doubled


def test_the_run_stops_below_min_nodes_with_one_line(tmp_path):
  sup, starts, lines = make(tmp_path, 3, "die", min_nodes=3)
  assert run(sup) == 1 and len(starts) == 3
  assert lines == ["zerojax: supervisor: node 2 lost after step None; 2 of 3 nodes left, fewer than --min_nodes=3, "
                   "so the run stops; start the nodes again to resume from their own copies"]


def test_the_watchdogs_limits():
  dog = watchdog.Watchdog(lambda n: "", k=10, floor_s=120, first_s=1800)
  assert dog.limit({})[0] == 1800 and dog.limit({"step": 7, "steps": 7})[0] == 1800  # compiling; the final save
  assert dog.limit({"step": 3, "steps": 7})[0] == 120
  assert dog.limit({"step": 3, "steps": 7, "median_step_s": 30.0}) == (300, "10 x the median step 30 s, at least 120 s")


def test_train_py_passes_its_initialization_timeout_to_jax(monkeypatch):
  import jax
  from zerojax.cli import train as cli
  got = {}
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: got.update(kw))
  monkeypatch.setattr(jax.config, "update", lambda *a: None)
  base = ["--workdir=w", "--coordinator=localhost:1", "--num_processes=2", "--process_id=0"]
  cli.initialize_distributed(cli.parser().parse_args(base))
  assert got["initialization_timeout"] == 300
  cli.initialize_distributed(cli.parser().parse_args(base + ["--initialization_timeout=60"]))
  assert got["initialization_timeout"] == 60


# -- end to end: three train.py processes under the supervisor, one SIGSTOPped ------------------------

@pytest.mark.e2e
@pytest.mark.multiprocess
def test_a_stopped_trainer_is_ended_and_the_others_train_on(tmp_path):
  """3 nodes x 2 CPU devices, MiCS: node 2 is SIGSTOPped when step 3 is logged; the watchdog (floor 2 s)
  sees that its heartbeat stopped while nodes 0 and 1 wait for it in a collective, ends it, and the two
  train on from their own copies to the last step."""
  from tests.helpers import free_port
  from tests.train_helpers import ROOT, TINY, clean_env
  steps = 30
  params = [p for p in TINY if not p.startswith("train.batch_size")] + [
      "train.batch_size=24", f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0",
      "train.replica_every=1"]
  cmd = [sys.executable, "-m", "zerojax.cli.supervise", "--nodes=3", "--devices=2", f"--workdir={tmp_path}",
         f"--port={free_port()}", "--hang=2@3", "--watchdog_floor=2", "--", "--gin_file=configs/mics.gin",
         *[f"--gin_param={p}" for p in params]]
  r = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
  logs = "".join((tmp_path / "logs" / f"node{i}.log").read_text()[-2000:] for i in range(3))
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + logs
  assert "node 2 completed no step for" in r.stdout and "its heartbeat stopped" in r.stdout, r.stdout
  rows = report.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert [x["step"] for x in rows] == list(range(1, steps + 1)) and rows[-1]["nodes"] == 2
  lost, = [x["event"] for x in rows if x.get("event")]
  assert lost["kind"] == "node_lost" and lost["node"] == [2] and lost["nodes"] == 2
  assert 2 <= lost["detect_s"] < 25, lost  # the watchdog's, not JAX's heartbeat (30 s)
  assert json.loads((tmp_path / "summary.json").read_text())["status"] == "finished"
