"""A node dies and the others train on (`zerojax.train.replica`, `zerojax.train.supervisor`): each node's
own copy restores onto one node fewer and back (N -> N-1 -> N) by the rule of merging and splitting
replicas; plans without a replica per node are named; a failure while writing keeps the earlier copies;
the supervisor's decisions on stand-in processes."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import zerojax
import zerojax.plan as plans
from tests import helpers
from zerojax.train import node_parts, replica, report, state_spec, supervisor

BATCH = 24  # divides 3 x 2 and 2 x 2 devices


def make(plan, nodes):
  return zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), dataclasses.replace(plan, pad_multiple=1),
                          zerojax.make_mesh(nodes, 2, devices=jax.devices()[:2 * nodes]), accum_steps=2)


def train(ex, state, first, last):
  step = ex.step_fn()
  for b in helpers.batches(last, 2, batch=BATCH)[first:last]:
    state, _ = step(state, jax.device_put(b, ex.batch_sharding))
  return state


def logical(ex, state) -> dict:
  spec = state_spec.state_spec_of(ex)
  values = jax.device_get(spec.unnest(state_spec.logical_state(ex, state)))
  return {state_spec.SEP.join(l.names): np.asarray(v) for l, v in zip(spec.leaves, values)}


def save_all(ex, state, root, nodes):
  """Every node's copy, as its process writes it (here one process holds every node)."""
  for n, name in enumerate(nodes):
    replica.save(ex, state, os.path.join(root, name), n, seed=0)


def rows_of(key: str) -> bool:
  return key.split("/")[0] in ("params", "opt_state", "skipped")


@pytest.mark.parametrize("plan", [plans.mics(param_dtype="float32"),
                                  plans.mics(outer_sync=plans.diloco(every=4), param_dtype="float32")],
                         ids=["mics", "diloco"])
def test_restore_onto_one_node_fewer_and_back_follows_the_rule(tmp_path, plan):
  """3 x 2 devices, 2 steps; node 1 dies: nodes 0 and 2 restore onto 2 x 2 (each keeps its own replica,
  node 1's is discarded; what every node shares is the same); 1 step on 2 nodes; node 1 rejoins: 3 x 2
  again, the survivors' rows as they were, the newcomer's DiLoCo replica the outer parameters with the
  first holder's inner optimizer state and no skipped step."""
  diloco = plan.sync.outer_sync is not None
  big = make(plan, 3)
  state = train(big, big.init_from_params(jax.jit(big.model.init)(jax.random.key(0))), 0, 2)
  before = logical(big, state)
  if diloco:  # between two syncs the replicas differ
    w = before["params/blocks/fc/kernel"]
    assert not np.array_equal(w[0], w[2])
  save_all(big, state, tmp_path, ["a", "b", "c"])
  small = make(plan, 2)
  two = replica.restore(small, 2, [True, True], {0: str(tmp_path / "a"), 1: str(tmp_path / "c")})
  got = logical(small, two)
  assert set(got) == set(before)
  for k, v in before.items():
    want = v[[0, 2]] if diloco and rows_of(k) else v
    assert np.array_equal(got[k], want), k
  two = train(small, two, 2, 3)
  after = logical(small, two)
  save_all(small, two, tmp_path, ["a", "c"])
  back = replica.restore(big, 3, [True, True, False], {0: str(tmp_path / "a"), 1: str(tmp_path / "c")})
  full = logical(big, back)
  assert int(jax.device_get(back.step)) == 3
  for k, v in after.items():
    if not (diloco and rows_of(k)):
      assert np.array_equal(full[k], v), k
      continue
    assert np.array_equal(full[k][:2], v), k
    if k.startswith("params/"):
      assert np.array_equal(full[k][2], after["outer/" + k]), k
    elif k == "skipped":
      assert full[k][2] == 0
    else:
      assert np.array_equal(full[k][2], v[0]), k
  if diloco:  # the newcomer's replica differs from the survivors' until the next sync
    assert not np.array_equal(full["params/blocks/fc/kernel"][2], full["params/blocks/fc/kernel"][0])
  train(big, back, 3, 4)  # the restored state trains on the full mesh


def test_a_diloco_checkpoint_restores_onto_one_node_fewer_and_back(tmp_path):
  """The orbax checkpoint follows the same rule: 3 replicas onto 2 nodes keep the first two, 2 onto 3
  add a replica from the outer parameters with the first replica's inner optimizer state."""
  from zerojax.train.checkpoint import Checkpointer
  plan = plans.mics(outer_sync=plans.diloco(every=4), param_dtype="float32")
  big, small = make(plan, 3), make(plan, 2)
  state = train(big, big.init_from_params(jax.jit(big.model.init)(jax.random.key(0))), 0, 2)
  with Checkpointer(str(tmp_path / "three")) as c:
    c.save(big, state)
  with Checkpointer(str(tmp_path / "three"), read_only=True) as c:
    two, _ = c.restore(small)
  before, got = logical(big, state), logical(small, two)
  for k, v in before.items():
    assert np.array_equal(got[k], v[:2] if rows_of(k) else v), k
  with Checkpointer(str(tmp_path / "two")) as c:
    c.save(small, two)
  with Checkpointer(str(tmp_path / "two"), read_only=True) as c:
    three, _ = c.restore(big)
  full = logical(big, three)
  for k, v in got.items():
    if not rows_of(k):
      assert np.array_equal(full[k], v), k
      continue
    assert np.array_equal(full[k][:2], v), k
    want = got["outer/" + k] if k.startswith("params/") else (0 if k == "skipped" else v[0])
    assert np.array_equal(full[k][2], want), k


@pytest.mark.slow
def test_mics_on_one_node_fewer_trains_the_same_step():
  """MiCS on 2 nodes after a loss takes the same step as on 3 (the same global batch, the same replica):
  equal up to float reassociation of the gradient's mean."""
  plan = plans.mics(param_dtype="float32")
  big, small = make(plan, 3), make(plan, 2)
  params = jax.jit(big.model.init)(jax.random.key(0))
  a = logical(big, train(big, big.init_from_params(params), 0, 2))
  b = logical(small, train(small, small.init_from_params(params), 0, 2))
  for k in a:
    assert np.allclose(a[k], b[k], rtol=2e-5, atol=2e-6), k


@pytest.mark.slow
def test_radius_residuals_stay_with_their_nodes(tmp_path):
  """MiCS + Radius: the survivors keep their own residual rows, a newcomer's is empty (nothing unsent)."""
  plan = plans.mics(replica_sync=plans.radius(density=0.5, period=2, dense_steps=1), param_dtype="float32")
  big = make(plan, 3)
  state = train(big, big.init_from_params(jax.jit(big.model.init)(jax.random.key(0))), 0, 3)
  before = logical(big, state)
  res = [k for k in before if k.startswith("radius/residual")]
  assert res and any(np.any(before[k][2]) for k in res)
  save_all(big, state, tmp_path, ["a", "b", "c"])
  small = make(plan, 2)
  got = logical(small, replica.restore(small, 3, [True, True], {0: str(tmp_path / "b"), 1: str(tmp_path / "c")}))
  for k in res:
    assert np.array_equal(got[k], before[k][[1, 2]]), k
  back = logical(big, replica.restore(big, 3, [False, True, True], {1: str(tmp_path / "b"), 2: str(tmp_path / "c")}))
  for k in res:
    assert np.array_equal(back[k][1:], before[k][1:]) and not np.any(back[k][0]), k
  assert all(np.array_equal(back[k], before[k]) for k in before if not k.startswith("radius/residual"))


@pytest.mark.parametrize("plan, lost", [
    (plans.zero3(param_dtype="float32"), 1),
    pytest.param(plans.zero3(param_dtype="float32"), 0, marks=pytest.mark.slow),
    pytest.param(plans.zeropp(), 2, marks=pytest.mark.slow)],
    ids=["zero3-node1", "zero3-node0", "zeropp-node2"])
def test_a_plan_sharded_across_nodes_survives_a_lost_node(tmp_path, plan, lost):
  """ZeRO-3 and ZeRO++ (and so hpZ and MiCS groups spanning nodes: the same rule), 3 x 2 devices: no node holds the whole state;
  each copy keeps the node's part and the next node's, not the whole state. Whichever node dies, the two
  others restore every leaf value by value onto 2 x 2, train a step there equal to the step on 3 x 2 (up to
  float reassociation; ZeRO++'s quantization blocks follow the mesh, so its step is not compared), and
  restore back onto 3 x 2 with the newcomer taking its part from them."""
  big = make(plan, 3)
  assert node_parts.sharded_across_nodes(big) is not None
  state = train(big, big.init_from_params(jax.jit(big.model.init)(jax.random.key(0))), 0, 2)
  before = logical(big, state)
  names = ["a", "b", "c"]
  save_all(big, state, tmp_path, names)
  across = {state_spec.SEP.join(l.names) for l in state_spec.state_spec_of(big).leaves if node_parts.across_nodes(big, l)}
  assert across
  for n, name in enumerate(names):
    meta = replica.read_meta(str(tmp_path / name), 2)
    assert meta["covers"] == [n, (n + 1) % 3]
    with np.load(tmp_path / name / "2" / replica.STATE) as f:
      kept = {k: sum(f[a].nbytes for a, part in meta["parts"].items() if part[0] == k) for k in before}
    for k, v in before.items():  # its own third and the next node's of a leaf sharded across nodes
      assert kept[k] * (3 if k in across else 1) == v.nbytes * (2 if k in across else 1), k
  alive = [n for n in range(3) if n != lost]
  small = make(plan, 2)
  two = replica.restore(small, 2, [True, True], {i: str(tmp_path / names[n]) for i, n in enumerate(alive)})
  got = logical(small, two)
  assert set(got) == set(before)
  for k, v in before.items():
    assert np.array_equal(got[k], v), k
  two = train(small, two, 2, 3)  # the step on 2 x 2 is the step on 3 x 2
  on_two, on_three = logical(small, two), logical(big, train(big, state, 2, 3))
  for k, v in on_three.items() if plan.name != "zeropp" else ():
    np.testing.assert_allclose(on_two[k], v, rtol=2e-5, atol=2e-6, err_msg=k)
  save_all(small, two, tmp_path, ["a", "c"])
  back = replica.restore(big, 3, [True, True, False], {0: str(tmp_path / "a"), 1: str(tmp_path / "c")})
  for k, v in on_two.items():
    assert np.array_equal(logical(big, back)[k], v), k


def test_two_neighbouring_nodes_lost_fall_back_to_the_checkpoint(tmp_path):
  """ZeRO-3 on 3 x 2: nodes 1 and 2 lost together; node 0 keeps its own part and node 1's, not node 2's:
  `agree` says so and returns None (the run takes its checkpoint), and `restore` refuses rather than
  filling node 2's part with zeros."""
  big = make(plans.zero3(param_dtype="float32"), 3)
  state = train(big, big.init_from_params(jax.jit(big.model.init)(jax.random.key(0))), 0, 1)
  save_all(big, state, tmp_path, ["a", "b", "c"])
  said = []
  assert replica.agree(str(tmp_path / "a"), False, 0, warn=said.append) is None
  assert len(said) == 1 and "node [2]" in said[0] and "checkpoint" in said[0]
  with pytest.raises(state_spec.CheckpointError, match="do not hold all of"):
    replica.restore(make(plans.zero3(param_dtype="float32"), 1), 1, [True], {0: str(tmp_path / "a")})


def test_a_failure_while_writing_keeps_the_earlier_copies(tmp_path, monkeypatch):
  """A write that dies half way (here: the disk fails inside np.savez) leaves a temporary folder that is
  never taken for a copy; the earlier copies restore; the next write removes the temporary."""
  plan = plans.mics(param_dtype="float32")
  ex = make(plan, 2)
  state = ex.init_from_params(jax.jit(ex.model.init)(jax.random.key(0)))
  folder = str(tmp_path / "a")
  state = train(ex, state, 0, 1)
  replica.save(ex, state, folder, 0, seed=0)
  saved = logical(ex, state)
  state = train(ex, state, 1, 2)

  def broken(path, **arrays):
    with open(path, "wb") as f:
      f.write(b"PK\x03\x04 half a zip")
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(np, "savez", broken)
  with pytest.raises(OSError):
    replica.save(ex, state, folder, 0, seed=0)
  monkeypatch.undo()
  assert replica.steps(folder) == [1] and any(d.startswith(".tmp-") for d in os.listdir(folder))
  got = logical(ex, replica.restore(ex, 1, [True, False], {0: folder}))
  assert all(np.array_equal(got[k], v) for k, v in saved.items())
  replica.save(ex, state, folder, 0, seed=0)
  assert replica.steps(folder) == [1, 2] and not any(d.startswith(".tmp-") for d in os.listdir(folder))


def test_agree_takes_the_latest_step_every_holder_has(tmp_path):
  for s in (3, 4, 5):
    os.makedirs(tmp_path / str(s))
    (tmp_path / str(s) / replica.META).write_text("{}")
    np.savez(tmp_path / str(s) / replica.STATE)
  os.makedirs(tmp_path / ".tmp-6-1")
  assert replica.agree(str(tmp_path), False, 7) == (5, [True], 7)
  assert replica.agree(str(tmp_path), True, 7) is None
  assert replica.agree(str(tmp_path / "none"), False, 7) is None


def test_membership_record():
  rec = report.membership({"kind": "node_lost", "failed": 100.0, "detected": 100.5, "last_step": 20}, 130.5, 19)
  assert (rec["detect_s"], rec["resume_s"], rec["steps_lost"], rec["resumed_from"]) == (0.5, 30.0, 1, 19)
  rows = [{"step": 1}, {"step": 20, "event": rec}, {"step": 41, "event": {"kind": "node_rejoined"}}]
  s = report.membership_summary(rows)
  assert (s["nodes_lost"], s["nodes_rejoined"], len(s["events"])) == (1, 1, 2)


# -- the supervisor, on stand-in processes ------------------------------------------------------------

STAND_IN = r"""
import json, os, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
work, node, survives = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
d = args["--replica_dir"]
os.makedirs(d, exist_ok=True)
json.dump({"plan": "P", "survives": survives, "why": None if survives else "node copies need one process per node"}, open(os.path.join(d, "run.json"), "w"))
if args["--process_id"] == "0":
  with open(os.path.join(work, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 1, "time": time.time(), "nodes": int(args["--num_processes"]), "event": json.loads(args.get("--event", "null"))}) + "\n")
for _ in range(40 if os.path.exists(os.path.join(work, "finish")) else 600):
  time.sleep(0.05)
"""


def poll_until(sup, done, *, may_end=False, timeout=60.0):
  """Polls the supervisor every 20 ms until `done()`; the run must not end before (unless `may_end`)."""
  end = time.monotonic() + timeout
  while not done():
    status = sup.poll()
    assert may_end or status is None, f"the run ended with status {status}"
    assert time.monotonic() < end, f"not done after {timeout} s"
    time.sleep(0.02)


def stand_in_supervisor(tmp_path, survives, **kw):
  script = tmp_path / "node.py"
  script.write_text(STAND_IN)
  starts = []

  def launch(s):
    starts.append(s)
    return subprocess.Popen([sys.executable, str(script), str(tmp_path), str(s.node), "1" if survives else "0",
                             *s.args], start_new_session=True)

  lines = []
  sup = supervisor.Supervisor(3, launch, str(tmp_path), lambda n: str(tmp_path / f"node{n}"), log=lines.append, **kw)
  return sup, starts, lines


def test_supervisor_restarts_the_survivors_and_the_node_that_comes_back(tmp_path):
  sup, starts, lines = stand_in_supervisor(tmp_path, True, restart_after=0.5)
  sup.start([0, 1, 2])
  try:
    poll_until(sup, sup.trained)
    sup.kill(1)
    poll_until(sup, lambda: sup.generation >= 1)
    assert [(s.node, s.process_id, s.num_processes) for s in starts[3:]] == [(0, 0, 2), (2, 1, 2)]
    assert "--event" in " ".join(starts[3].args) and all("--join" not in s.args for s in starts[3:])
    poll_until(sup, lambda: sup.generation >= 2)
    (tmp_path / "finish").write_text("")
    assert [(s.node, s.process_id, "--join" in s.args) for s in starts[5:]] == [(0, 0, False), (2, 1, False), (1, 2, True)]
    poll_until(sup, lambda: sup.status is not None, may_end=True)
  finally:
    sup.stop_all()
  assert sup.status == 0
  lost, back = sup.events
  assert lost["kind"] == "node_lost" and lost["node"] == [1] and (lost["nodes_before"], lost["nodes"]) == (3, 2)
  assert 0 <= lost["detected"] - lost["failed"] < 5
  assert back["kind"] == "node_rejoined" and back["node"] == [1] and back["nodes"] == 3


def test_supervisor_stops_a_run_without_node_copies_in_one_line(tmp_path):
  os.makedirs(tmp_path / "checkpoints" / "16")
  sup, starts, lines = stand_in_supervisor(tmp_path, False, restart_after=0.5)
  sup.start([0, 1, 2])
  try:
    poll_until(sup, sup.trained)
    sup.kill(2)
    poll_until(sup, lambda: sup.status is not None, may_end=True)
  finally:
    sup.stop_all()
  assert sup.status == 1 and len(starts) == 3
  assert len(lines) == 1 and lines[0].startswith("zerojax: node 2 lost after step 1; P keeps no node copies")
  assert "one process per node" in lines[0] and lines[0].endswith("start all 3 nodes again to resume from step 16, its last checkpoint")


# -- end to end: three train.py processes under the supervisor ---------------------------------------

@pytest.mark.e2e
@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["mics", "zero3"])
def test_a_node_dies_the_others_train_on_and_it_rejoins(tmp_path, config):
  """3 nodes x 2 CPU devices, MiCS (a replica per node) and ZeRO-3 (sharded across nodes): node 2 is
  SIGKILLed when step 3 is logged, the two others train on from their own copies (ZeRO-3: node 1's copy
  holds node 2's part), node 2 comes back and takes its state from them; every step is logged once and
  the run ends on 3 nodes, with the loss and the rejoin in metrics.jsonl and summary.json."""
  from tests.helpers import free_port
  from tests.train_helpers import ROOT, TINY, clean_env
  steps = 8
  params = [p for p in TINY if not p.startswith("train.batch_size")] + [
      "train.batch_size=24", f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0",
      "train.replica_every=1"]
  cmd = [sys.executable, "-m", "zerojax.cli.supervise", "--nodes=3", "--devices=2", f"--workdir={tmp_path}",
         f"--port={free_port()}", "--kill=2@3", "--restart_after=1", "--", f"--gin_file=configs/{config}.gin",
         *[f"--gin_param={p}" for p in params]]
  r = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
  logs = "".join((tmp_path / "logs" / f"node{i}.log").read_text()[-2000:] for i in range(3))
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + logs
  rows = report.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert [x["step"] for x in rows] == list(range(1, steps + 1))
  nodes = [x["nodes"] for x in rows]
  assert nodes[0] == 3 and 2 in nodes and nodes[-1] == 3, nodes
  assert all(isinstance(x["time"], float) for x in rows) and [x["time"] for x in rows] == sorted(x["time"] for x in rows)
  lost, back = [x["event"] for x in rows if x.get("event")]
  assert lost["kind"] == "node_lost" and lost["node"] == [2] and lost["nodes"] == 2
  assert 0 <= lost["detect_s"] < 5 and lost["resume_s"] > 0 and lost["steps_lost"] in (0, 1)
  assert back["kind"] == "node_rejoined" and back["nodes"] == 3 and back["steps_lost"] == 0
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["status"] == "finished" and summary["nodes"] == 3
  assert (summary["membership"]["nodes_lost"], summary["membership"]["nodes_rejoined"]) == (1, 1)
  assert "node 2 taking the copy from node 0" in r.stdout
