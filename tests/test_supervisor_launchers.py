"""The supervisor's launchers (`zerojax.train.launchers`) on stand-ins: `srun`, `scontrol` and `kubectl` scripts
on PATH that record what they are asked and run it on this machine, and a stand-in trainer (no JAX).

Slurm: one step per node on its host, the coordinator on process 0's host, a killed node's host left out
and a spare host taken when the node rejoins (its own host when there is none), srun's signals (SIGTERM
kills its task, a single SIGINT is passed on) carrying the supervisor's kill and stop. Kubernetes: a pod per
node with JAX's variables and its DNS name, deleted at once on a kill and with the grace period on a stop,
the log of a pod that ended kept; a pod that cannot be created stops the run with kubectl's line. The command
line: the default local launcher as before, `--launcher slurm` end to end, and one-line errors."""
from __future__ import annotations

import json
import os
import re
import shlex
import stat
import sys
import textwrap
import time
import types

import pytest

from zerojax.cli import supervise as cli
from zerojax.train import launchers, supervisor

# The trainer: node NODE (from its --replica_dir) notes its start, then steps in lockstep with the other
# processes of its start (a step when each has written the one before: a collective, which waits for a dead
# node), every 0.05 s, from the last logged step on; process 0 logs each. With --until=KIND only a start whose
# --event is of that kind takes the last of --steps (the others log the one before again). SIGINT or
# SIGTERM: noted, exit 128 + the signal (as train.py after saving).
TRAINER = r"""
import json, os, signal, sys, time
argv = sys.argv[1:]
flags = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
work, d = flags["--workdir"], flags["--replica_dir"]
node, pid, n = int(os.path.basename(d)[4:]), int(flags["--process_id"]), int(flags["--num_processes"])

def note(name, row):
  with open(os.path.join(work, name), "a") as f:
    f.write(json.dumps(row) + "\n")

def stop(signum, frame):
  note("signals.jsonl", {"node": node, "signal": signal.Signals(signum).name})
  sys.exit(128 + signum)

signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
env = {k: os.environ.get(k) for k in ("ZEROJAX_NODE_ID", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                                      "JAX_PROCESS_ID", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR",
                                      "PYTHONUNBUFFERED", "STANDIN_HOST", "XLA_FLAGS")}
coordinator = flags.get("--coordinator") or env["JAX_COORDINATOR_ADDRESS"]
note("started.jsonl", {"node": node, "pid": pid, "n": n, "argv": argv, "env": env, "coordinator": coordinator})
print(f"stand-in trainer: node {node}, process {pid} of {n}", flush=True)
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "run.json"), "w") as f:
  json.dump({"plan": "P", "survives": True, "why": None}, f)
here = os.path.join(work, "lockstep", coordinator.replace(":", "_"))
os.makedirs(here, exist_ok=True)

def at(i):
  try:
    with open(os.path.join(here, f"p{i}")) as f:
      return int(f.read())
  except (OSError, ValueError):
    return -1

try:
  with open(os.path.join(work, "metrics.jsonl")) as f:
    step = max(json.loads(line)["step"] for line in f)
except (OSError, ValueError):
  step = 0
steps, event = int(flags.get("--steps", 30)), json.loads(flags.get("--event", "{}"))
last = "--until" not in flags or event.get("kind") == flags["--until"]
while step < steps:
  with open(os.path.join(here, f"p{pid}.tmp"), "w") as f:
    f.write(str(step))
  os.replace(os.path.join(here, f"p{pid}.tmp"), os.path.join(here, f"p{pid}"))
  while any(at(i) < step for i in range(n)):
    time.sleep(0.01)
  time.sleep(0.05)
  step += last or step + 1 < steps
  if pid == 0:
    note("metrics.jsonl", {"step": step, "time": time.time(), "nodes": n})
"""

HEAD = """import json, os, re, signal, subprocess, sys, time
def note(row):
  with open(os.environ["STANDIN_LOG"], "a") as f:
    f.write(json.dumps({**row, "t": time.time()}) + "\\n")
"""

# srun inside an allocation: runs the command here as the step's one task on host --nodelist (STANDIN_HOST);
# SIGTERM: SIGKILL to the task ("forcing job termination"); SIGINT with --disable-status: passed on.
SRUN = HEAD + r"""
argv = sys.argv[1:]
i = next(k for k, a in enumerate(argv) if not a.startswith("-"))
opts, cmd = argv[:i], argv[i:]
host = next(a.split("=", 1)[1] for a in opts if a.startswith("--nodelist="))
note({"tool": "srun", "opts": opts, "cmd": cmd, "env_node": os.environ.get("ZEROJAX_NODE_ID")})
task = []

def on(signum, frame):
  note({"tool": "srun", "signal": signal.Signals(signum).name, "host": host})
  if task and signum == signal.SIGINT and "--disable-status" in opts:
    task[0].send_signal(signal.SIGINT)
  elif task and signum in (signal.SIGTERM, signal.SIGHUP):
    task[0].kill()

for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
  signal.signal(s, on)
task.append(subprocess.Popen(cmd, env={**os.environ, "STANDIN_HOST": host}))
code = task[0].wait()
sys.exit(128 - code if code < 0 else code)
"""

SCONTROL = HEAD + r"""
note({"tool": "scontrol", "argv": sys.argv[1:]})
m = re.fullmatch(r"(\w+)\[(\d+)-(\d+)\]", sys.argv[3])
print("\n".join(f"{m[1]}{i}" for i in range(int(m[2]), int(m[3]) + 1)))
"""

# kubectl against a cluster of this machine: a pod is a folder entry (STANDIN_PODS) whose container runs here
# (`_run`, started by `create`); deleting with --grace-period=0 SIGKILLs it and the pod is gone at once,
# otherwise SIGTERM and the pod is gone when its container ends; STANDIN_FORBID refuses every create.
KUBECTL = HEAD + r"""
state, argv = os.environ["STANDIN_PODS"], sys.argv[1:]
verb, opts, words = argv[0], [a for a in argv[1:] if a.startswith("-")], [a for a in argv[1:] if not a.startswith("-")]
path = lambda name, ext: os.path.join(state, f"{name}.{ext}")
if verb == "_run":
  name = words[0]
  with open(path(name, "json")) as f:
    c = json.load(f)["spec"]["containers"][0]
  env = {**os.environ, **{e["name"]: e["value"] for e in c["env"]}, "STANDIN_HOST": name}
  with open(path(name, "out"), "w") as out:
    p = subprocess.Popen(c["command"] + c["args"], env=env, stdout=out, stderr=subprocess.STDOUT)
    with open(path(name, "pid"), "w") as f:
      f.write(str(p.pid))
    code = p.wait()
  with open(path(name, "exit"), "w") as f:
    f.write(str(128 - code if code < 0 else code))
  sys.exit(0)
stdin = sys.stdin.read() if verb == "create" else None
note({"tool": "kubectl", "argv": argv, "manifest": json.loads(stdin) if stdin else None})
if verb == "create":
  if os.environ.get("STANDIN_FORBID"):
    print('Error from server (Forbidden): pods is forbidden: User "system:serviceaccount:default:default" cannot '
          'create resource "pods" in API group "" in the namespace "default"', file=sys.stderr)
    sys.exit(1)
  name = json.loads(stdin)["metadata"]["name"]
  with open(path(name, "json"), "w") as f:
    f.write(stdin)
  subprocess.Popen([sys.executable, __file__, "_run", name], start_new_session=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  print(f"pod/{name} created")
elif verb == "get":
  items = []
  for name in sorted(f[:-5] for f in os.listdir(state) if f.endswith(".json")):
    ended = os.path.exists(path(name, "exit"))
    if os.path.exists(path(name, "gone")) or (os.path.exists(path(name, "deleting")) and ended):
      continue
    with open(path(name, "json")) as f:
      pod = json.load(f)
    if ended:
      code = int(open(path(name, "exit")).read())
      pod["status"] = {"phase": "Failed" if code else "Succeeded",
                       "containerStatuses": [{"name": "train", "state": {"terminated": {"exitCode": code}}}]}
    else:
      pod["status"] = {"phase": "Running"}
    items.append(pod)
  print(json.dumps({"items": items}))
elif verb == "delete" and "-l" not in argv:
  name = words[1]
  if os.path.exists(path(name, "json")) and not os.path.exists(path(name, "gone")):
    force = "--grace-period=0" in opts
    if not os.path.exists(path(name, "exit")):
      while not os.path.exists(path(name, "pid")):
        time.sleep(0.01)
      try:
        os.kill(int(open(path(name, "pid")).read()), signal.SIGKILL if force else signal.SIGTERM)
      except (ProcessLookupError, ValueError):
        pass
    open(path(name, "gone" if force or os.path.exists(path(name, "exit")) else "deleting"), "w").close()
elif verb == "logs":
  print(open(path(words[0], "out")).read(), end="")
"""


@pytest.fixture
def standins(tmp_path, monkeypatch):
  """srun, scontrol and kubectl on PATH; `calls()` reads what they were asked; `trainer` is the trainer."""
  bin_dir, pods = tmp_path / "bin", tmp_path / "pods"
  bin_dir.mkdir()
  pods.mkdir()
  for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("kubectl", KUBECTL)):
    (bin_dir / name).write_text(f"#!{sys.executable} -S\n{text}")  # -S: a quicker start
    (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IXUSR)
  (tmp_path / "trainer.py").write_text(TRAINER)
  log = tmp_path / "calls.jsonl"
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.setenv("STANDIN_LOG", str(log))
  monkeypatch.setenv("STANDIN_PODS", str(pods))
  for var in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "STANDIN_FORBID"):
    monkeypatch.delenv(var, raising=False)
  (tmp_path / "work" / "logs").mkdir(parents=True)
  return types.SimpleNamespace(work=tmp_path / "work", logs=tmp_path / "work" / "logs",
                               trainer=(sys.executable, "-S", str(tmp_path / "trainer.py")),
                               calls=lambda tool: rows(log, lambda r: r["tool"] == tool))


def rows(path, keep=lambda r: True) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [r for r in map(json.loads, f) if keep(r)]


def run(st, launch, nodes=3, timeout=60, **kw):
  """Runs the supervisor over `launch` to its end: (status, supervisor, its lines)."""
  lines = []
  kw = {"finish_s": 0.1, "watchdog_k": 0, "restart_backoff_s": 0.1, "stop_grace_s": 10, **kw}
  sup = supervisor.Supervisor(nodes, launch, str(st.work), lambda n: str(st.work / "replicas" / f"node{n}"),
                              log=lines.append, error_line=lambda n: cli.error_line(str(st.logs / f"node{n}.log")),
                              **kw)
  sup.start(list(range(nodes)))
  end = time.monotonic() + timeout
  try:
    while sup.poll() is None:
      assert time.monotonic() < end, lines
      time.sleep(0.02)
  finally:
    sup.stop_all()
  return sup.status, sup, lines


def started(st) -> list[dict]:
  """The trainers' starts, each with its generation (from the coordinator's port, the first + the generation)."""
  out = rows(st.work / "started.jsonl")
  for r in out:
    r["gen"] = int(r["coordinator"].rsplit(":", 1)[1]) % 1000
  return out


UNTIL_REJOINED = ["--steps=10", "--until=node_rejoined"]  # the run ends only after the rejoin


@pytest.mark.parametrize("hosts,back_on", [(4, "n3"), (3, "n2")], ids=["spare", "no_spare"])
def test_slurm_runs_a_step_per_node_and_leaves_a_lost_nodes_host_out(standins, monkeypatch, hosts, back_on):
  st = standins
  monkeypatch.setenv("SLURM_JOB_NODELIST", f"n[0-{hosts - 1}]")
  launch = launchers.Slurm(str(st.work), str(st.logs), nodes=3, port=23000, command=st.trainer, args=UNTIL_REJOINED,
                           srun_args=["--gpus-per-node=8"])
  status, sup, lines = run(st, launch, kill_at={2: 5}, restart_after=0.3)
  assert status == 0, lines
  assert [e["kind"] for e in sup.events] == ["node_lost", "node_rejoined"]
  assert [r["argv"] for r in st.calls("scontrol")] == [["show", "hostnames", f"n[0-{hosts - 1}]"]]
  steps = [r for r in st.calls("srun") if "opts" in r]
  placed = {}
  for r in steps:
    g, n = map(int, re.fullmatch(r"--job-name=zerojax\.g(\d+)\.n(\d+)", r["opts"][4]).groups())
    placed.setdefault(g, {})[n] = r["opts"][2].split("=")[1]
    assert r["opts"][:2] + r["opts"][3:4] + r["opts"][5:] == ["--nodes=1", "--ntasks=1", "--disable-status",
                                                                "--gpus-per-node=8"]
    assert r["cmd"][:3] == list(st.trainer) and r["env_node"] == str(n)
  # node 2's host n2 is left out once it was lost; it rejoins on the spare host, or on n2 when there is none
  assert placed == {0: {0: "n0", 1: "n1", 2: "n2"}, 1: {0: "n0", 1: "n1"}, 2: {0: "n0", 1: "n1", 2: back_on}}
  starts = started(st)
  assert sorted((r["gen"], r["node"], r["pid"], r["n"]) for r in starts) == [
      (0, 0, 0, 3), (0, 1, 1, 3), (0, 2, 2, 3), (1, 0, 0, 2), (1, 1, 1, 2), (2, 0, 0, 3), (2, 1, 1, 3), (2, 2, 2, 3)]
  for r in starts:  # the coordinator on process 0's host; each on its own host, with its node's id
    assert r["coordinator"] == f"n0:{23000 + r['gen']}" and r["env"]["STANDIN_HOST"] == placed[r["gen"]][r["node"]]
    assert r["env"]["ZEROJAX_NODE_ID"] == str(r["node"]) and r["env"]["PYTHONUNBUFFERED"] == "1"
    assert ("--join" in r["argv"]) == (r["gen"] == 2 and r["node"] == 2)
  # the kill: SIGTERM to node 2's srun, which SIGKILLs its task
  # (then SIGTERM to the survivors', which wait for it); the rejoin's stop: SIGINT, passed on to the trainers
  signals = [(r["host"], r["signal"]) for r in st.calls("srun") if "signal" in r]
  assert signals[0] == ("n2", "SIGTERM") and sorted(signals[1:3]) == [("n0", "SIGTERM"), ("n1", "SIGTERM")]
  assert sorted(signals[3:]) == [("n0", "SIGINT"), ("n1", "SIGINT")]
  assert sorted((r["node"], r["signal"]) for r in rows(st.work / "signals.jsonl")) == [(0, "SIGINT"), (1, "SIGINT")]
  assert "stand-in trainer: node 2, process 2 of 3" in (st.logs / "node2.log").read_text()


def test_an_srun_step_reads_as_the_supervisor_expects():
  """srun's 128 + N reads -N; the SIGINT that carried a stop reads as the SIGTERM asked."""
  assert [launchers.status(c) for c in (None, 0, 1, 2, 130, 137, 143, 255)] == [None, 0, 1, 2, -2, -9, -15, 255]


def test_kubernetes_runs_a_pod_per_node_and_deletes_it_on_a_kill(standins):
  st = standins
  launch = launchers.Kubernetes(str(st.work), str(st.logs), image="registry.example/zerojax:1", namespace="train",
                                port=24000, command=st.trainer, args=UNTIL_REJOINED, grace_s=7, poll_s=0.1)
  status, sup, lines = run(st, launch, nodes=2, kill_at={1: 5}, restart_after=0.3)
  assert status == 0, lines
  assert [e["kind"] for e in sup.events] == ["node_lost", "node_rejoined"]
  calls = st.calls("kubectl")
  assert all(c["argv"][1] == "--namespace=train" for c in calls)
  assert calls[0]["argv"] == ["delete", "--namespace=train", "pods", "-l", "zerojax/run=zerojax", "--ignore-not-found",
                              "--wait=true"]  # what an earlier supervisor of the run left
  pods = [c["manifest"] for c in calls if c["argv"][0] == "create"]
  assert [p["metadata"]["name"] for p in pods] == [f"zerojax-g{g}-n{n}" for g, ns in ((0, "01"), (1, "0"), (2, "01"))
                                                   for n in ns]
  for p in pods:
    g, n = map(int, re.fullmatch(r"zerojax-g(\d)-n(\d)", p["metadata"]["name"]).groups())
    spec, c = p["spec"], p["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["JAX_COORDINATOR_ADDRESS"] == f"zerojax-g{g}-n0.zerojax:{24000 + g}"  # pod 0, through the Service
    ids = [env[k] for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "ZEROJAX_NODE_ID")]
    assert ids == [f"{2 - (g == 1)}", f"{n}", f"{n}"]
    assert (spec["hostname"], spec["subdomain"], spec["restartPolicy"]) == (p["metadata"]["name"], "zerojax", "Never")
    assert p["metadata"]["labels"] == {"zerojax/run": "zerojax", "zerojax/generation": str(g), "zerojax/node": str(n)}
    assert c["image"] == "registry.example/zerojax:1" and c["command"] == list(st.trainer)
    assert f"--replica_dir={st.work}/replicas/node{n}" in c["args"] and c["args"][-2:] == UNTIL_REJOINED
  deletes = [(c["argv"][3], tuple(c["argv"][4:])) for c in calls if c["argv"][0] == "delete" and c["argv"][2] == "pod"]
  kill, stop, ended = ("--grace-period=0", "--force"), ("--grace-period=7",), ()
  expect = [(f"zerojax-{p}", (*how, "--wait=false", "--ignore-not-found")) for p, how in (
      ("g0-n1", kill), ("g0-n0", kill),  # the kill, then node 0, which waits for node 1
      ("g1-n0", stop),                   # the rejoin: a stop with the grace period
      ("g2-n0", ended), ("g2-n1", ended))]  # pods that ended by themselves
  assert deletes[:3] == expect[:3] and sorted(deletes[3:]) == expect[3:]
  assert rows(st.work / "signals.jsonl") == [{"node": 0, "signal": "SIGTERM"}]
  # the log of a pod that ended is kept
  last = (st.logs / "node1.log").read_text().rsplit("--- generation 2", 1)[1]
  assert "stand-in trainer: node 1, process 1 of 2" in last
  starts = started(st)
  assert sorted((r["gen"], r["env"]["STANDIN_HOST"]) for r in starts) == [(g, f"zerojax-g{g}-n{n}") for g, ns in (
      (0, "01"), (1, "0"), (2, "01")) for n in ns]


def test_a_pod_that_cannot_be_created_stops_the_run_with_kubectls_line(standins, monkeypatch):
  st = standins
  monkeypatch.setenv("STANDIN_FORBID", "1")
  launch = launchers.Kubernetes(str(st.work), str(st.logs), image="img", command=st.trainer, poll_s=0.1)
  status, _, lines = run(st, launch, nodes=2)
  assert status == 2 and len(lines) == 1
  assert lines[0].endswith("on every node [0, 1]: zerojax: error: kubectl create of pod zerojax-g0-n0 failed: Error "
                           "from server (Forbidden): pods is forbidden: User \"system:serviceaccount:default:default\" "
                           "cannot create resource \"pods\" in API group \"\" in the namespace \"default\""), lines


def test_the_command_line_runs_slurm_steps_on_the_allocations_hosts(standins, monkeypatch, capsys):
  st = standins
  monkeypatch.setenv("SLURM_JOB_NODELIST", "n[0-2]")
  rc = cli.main(["--launcher=slurm", "--nodes=2", f"--workdir={st.work}", "--port=25000", "--watchdog_k=0",
                 f"--command={' '.join(st.trainer)}", "--srun_args=--gpus-per-node=8 --cpus-per-task=4", "--",
                 "--steps=10"])
  assert rc == 0, capsys.readouterr()
  steps = [r for r in st.calls("srun") if "opts" in r]
  assert sorted(r["opts"][2] for r in steps) == ["--nodelist=n0", "--nodelist=n1"]
  assert all(r["opts"][-2:] == ["--gpus-per-node=8", "--cpus-per-task=4"] for r in steps)
  starts = started(st)
  assert [r["coordinator"] for r in starts] == ["n0:25000"] * 2
  assert not any(a.startswith("--devices") for r in starts for a in r["argv"])  # the accelerator's devices


def test_the_command_line_runs_local_processes_by_default(standins, capsys):
  st = standins
  rc = cli.main(["--nodes=2", f"--workdir={st.work}", "--port=26000", "--watchdog_k=0",
                 f"--command={' '.join(st.trainer)}", "--", "--steps=10"])
  assert rc == 0, capsys.readouterr()
  assert not st.calls("srun") and not st.calls("kubectl")
  starts = started(st)
  platform = os.environ.get("JAX_PLATFORMS", "cpu")
  assert sorted((r["node"], r["coordinator"], r["env"]["JAX_PLATFORMS"], r["env"]["XLA_FLAGS"]) for r in starts) == [
      (0, "localhost:26000", platform, None), (1, "localhost:26000", platform, None)]
  assert all("--devices=2" in r["argv"] and r["argv"][-1] == "--steps=10" for r in starts)


@pytest.mark.parametrize("argv,path,expect", [
    (["--launcher=slurm"], None, "--launcher slurm: SLURM_JOB_NODELIST is not set (this is not inside a Slurm "
     "allocation); run the supervisor in an allocation's batch script (examples/slurm/supervised.sbatch) or give "
     "the hosts with --hosts"),
    (["--launcher=slurm", "--hosts=a,b", "--nodes=3"], None, "--launcher slurm: 2 hosts (a,b) for --nodes 3; "
     "allocate at least 3 nodes (sbatch --nodes) or lower --nodes"),
    (["--launcher=slurm", "--hosts=a,b"], "empty", "--launcher slurm: srun is not on PATH"),
    (["--launcher=k8s", "--k8s_image=img"], "empty", "--launcher k8s: kubectl is not on PATH"),
    (["--launcher=k8s"], None, "--launcher k8s: the trainer's image is not set; give --k8s_image or a "
     "--k8s_pod_template whose first container names its image"),
    (["--launcher=k8s", "--k8s_pod_template=nowhere.json"], None, "--k8s_pod_template nowhere.json: cannot read it"),
    (["--launcher=k8s", "--k8s_image=img", "--k8s_name=Run_1"], None, "--k8s_name 'Run_1': a pod's hostname is "
     "NAME-g<start>-n<node>, so NAME must be a DNS label"),
    (["--launcher=slurm", "--hosts=a,b", "--hang=1@3"], None, "--hang SIGSTOPs a local process: it works with "
     "--launcher local only (got --launcher slurm)"),
])
def test_the_command_line_says_in_one_line_what_a_launcher_lacks(standins, monkeypatch, capsys, argv, path, expect):
  if path:
    (standins.work / path).mkdir()
    monkeypatch.setenv("PATH", str(standins.work / path))
  assert cli.main([*argv, f"--workdir={standins.work}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"supervise: {expect}") and err.count("\n") == 1, err


def test_the_ready_files_run_the_supervisor_as_their_comments_say(standins):
  """examples/slurm/supervised.sbatch and examples/k8s/supervisor.yaml: their supervise command lines parse,
  the allocation holds a spare host and survives a failed one, and the pod template builds a node's pod."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sbatch = open(os.path.join(root, "examples/slurm/supervised.sbatch")).read()
  line = re.search(r"^\S*python -m zerojax\.cli\.supervise (.*?[^\\])$", sbatch, re.S | re.M)[1]
  args = cli.parser().parse_args(shlex.split(line.replace("\\\n", " ").replace("$WORKDIR", "runs/x")))
  assert (args.launcher, args.nodes, args.restart_after) == ("slurm", 3, 60)
  assert "#SBATCH --nodes=4\n" in sbatch and "#SBATCH --no-kill\n" in sbatch  # one spare host
  yaml = open(os.path.join(root, "examples/k8s/supervisor.yaml")).read()
  job = re.search(r"^        args:\n((?:        - .*\n)+)", yaml, re.M)[1]
  args = cli.parser().parse_args([a[len("        - "):] for a in job.splitlines()])
  assert (args.launcher, args.nodes, args.k8s_name) == ("k8s", 2, "zerojax")
  assert args.k8s_pod_template == "/etc/zerojax/pod.json" and "mountPath: /etc/zerojax}" in yaml
  assert f"name: {args.k8s_name}  " in yaml and f"zerojax/run: {args.k8s_name}\n" in yaml  # the headless Service
  template = json.loads(textwrap.dedent(re.search(r"  pod\.json: \|\n((?:    .*\n)+)", yaml)[1]))
  launch = launchers.Kubernetes(args.workdir, str(standins.logs), template=template, name=args.k8s_name)
  pod = launch.manifest(supervisor.Start(1, 1, 2, 0, 0, ("--process_id=1",), (0, 1)))
  c = pod["spec"]["containers"][0]
  assert c["command"] == ["python", "train.py"] and c["resources"] == {"limits": {"nvidia.com/gpu": 8}}
  assert c["args"] == [f"--workdir={args.workdir}", "--process_id=1"] and pod["spec"]["volumes"]
  assert {e["name"]: e["value"] for e in c["env"]}["JAX_COORDINATOR_ADDRESS"] == "zerojax-g0-n0.zerojax:12400"
