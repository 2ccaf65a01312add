"""How the supervisor (`zerojax.train.supervisor`) starts each node's process of a generation: `Local` (a
process on this machine: the emulated cluster), `Slurm` (an `srun` step on the node's host, inside one
allocation) and `Kubernetes` (a pod per node). Each is a callable `Start -> handle`; a handle answers `poll`,
`wait`, `send_signal`, `kill` and `returncode` as a `subprocess.Popen` does, a process ended by signal N
reading -N (srun and Kubernetes report 128 + N). Every node's output goes to LOGS/node<i>.log, each start
headed by a `--- generation G` line.

Slurm: one step per node (`srun --nodes=1 --ntasks=1 --nodelist=HOST`), not one `srun` of N tasks per
generation. The supervisor watches, ends and replaces each node's process on its own: a lost node is the one
step that ended, and the others are stopped apart; one step of N tasks ends as a whole (or goes on with a
dead task) and does not say which node failed. The steps get no `--exclusive`: since Slurm 20.11 it implies
`--exact`, which would leave a step the CPUs of one task; each step has a host of its own. A node absent
from the next generation was lost: its host is left out from then on, and when the node comes back it runs on
a spare host of the allocation (one no node holds), or on its own host again when none is left. The
allocation needs `--no-kill` so that a failed host does not end it. srun passes a single SIGINT on to its
task with `--disable-status`, and ends its task with SIGKILL on SIGTERM: the handle sends SIGINT for a
stop (train.py saves on either; a task stopped so reads as stopped by SIGTERM) and SIGTERM for a kill (a
second kill SIGKILLs srun itself).

Kubernetes: a pod per node and generation, `<name>-g<G>-n<node>`, created with `kubectl create -f -` from a
template (the first container runs the trainer) with JAX_COORDINATOR_ADDRESS (process 0's pod through the
headless Service `<name>`: each pod's `hostname` is its name, its `subdomain` the Service), JAX_NUM_PROCESSES,
JAX_PROCESS_ID and ZEROJAX_NODE_ID. One `kubectl get pods -l zerojax/run=<name> -o json` every `poll_s`
answers every handle's `poll`; a stop is `kubectl delete pod --grace-period=<grace_s>` (Kubernetes sends
SIGTERM), a kill `--grace-period=0 --force`. A pod that ended has its log appended to the node's and is
deleted; a pod that vanished without being asked (evicted, its node lost) reads as SIGKILLed. A pod that
cannot be created reads as exit status 2, with kubectl's error in the node's log.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Sequence

from zerojax.train.supervisor import USAGE, Start

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = (sys.executable, os.path.join(REPO, "train.py"))  # this checkout's train.py (a shared file system)
POD = ("python", "train.py")  # a pod's command when its template names none (examples/k8s)
RUN = "zerojax/run"  # the label of a run's pods


def status(code: int | None) -> int | None:
  """An exit status as `Popen.returncode` gives it: 128 + N (what a shell, srun or a container runtime reports
  for a process ended by signal N) reads -N."""
  return 128 - code if code is not None and 128 < code < 128 + signal.NSIG else code


def cache_env(workdir: str) -> dict[str, str]:
  """A restart compiles the earlier generations' programs again: JAX's persistent cache, in the workdir."""
  return {"JAX_COMPILATION_CACHE_DIR": os.path.join(workdir, "jax-cache"),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def open_log(logs: str, s: Start):
  """Node `s.node`'s log, for appending, headed by this start's line (`cli.supervise.error_line` reads it)."""
  out = open(os.path.join(logs, f"node{s.node}.log"), "a")
  out.write(f"--- generation {s.generation}: process {s.process_id} of {s.num_processes}\n")
  out.flush()
  return out


class Local:
  """Each node a process on this machine with `devices` CPU devices (the emulated cluster), its coordinator
  localhost:PORT + the generation.

  Args:
    workdir, logs: the run's workdir; the folder of the nodes' logs.
    devices, port: CPU devices per process; the coordinator's first port.
    command: the trainer (default this checkout's train.py); `args`: the run's own flags.
  """

  def __init__(self, workdir: str, logs: str, devices: int = 2, port: int = 12400, command: Sequence[str] = TRAIN,
               args: Sequence[str] = ()):
    self.workdir, self.logs, self.devices, self.port = workdir, logs, devices, port
    self.command, self.args = tuple(command), tuple(args)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    self.env = {**cache_env(workdir), "JAX_PLATFORMS": "cpu", **env, "PYTHONUNBUFFERED": "1"}

  def __call__(self, s: Start) -> subprocess.Popen:
    cmd = [*self.command, f"--workdir={self.workdir}", f"--devices={self.devices}",
           f"--coordinator=localhost:{self.port + s.generation}", *s.args, *self.args]
    with open_log(self.logs, s) as out:
      return subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True)


def allocation_hosts() -> list[str]:
  """The hosts of the Slurm allocation this process runs in: SLURM_JOB_NODELIST, expanded by `scontrol show
  hostnames`."""
  nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
  if not nodelist:
    raise ValueError("--launcher slurm: SLURM_JOB_NODELIST is not set (this is not inside a Slurm allocation); run "
                     "the supervisor in an allocation's batch script (examples/slurm/supervised.sbatch) or give the "
                     "hosts with --hosts")
  if not shutil.which("scontrol"):
    raise ValueError(f"--launcher slurm: scontrol, which expands SLURM_JOB_NODELIST={nodelist!r}, is not on PATH; "
                     "give the hosts with --hosts")
  r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=120)
  hosts = r.stdout.split()
  if r.returncode or not hosts:
    why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}, no host"])[-1]
    raise ValueError(f"--launcher slurm: `scontrol show hostnames {nodelist}` failed ({why}); give the hosts with "
                     "--hosts")
  return hosts


class Step:
  """An srun step's handle (`Slurm`): Popen's answers, the signals mapped to what srun passes on."""

  def __init__(self, proc: subprocess.Popen):
    self.proc, self.pid, self.asked = proc, proc.pid, None

  def read(self, code: int | None) -> int | None:
    code = status(code)
    # train.py stops alike on SIGINT, which srun passes on for the SIGTERM asked
    return -signal.SIGTERM if code == -signal.SIGINT and self.asked == signal.SIGTERM else code

  @property
  def returncode(self) -> int | None:
    return self.read(self.proc.returncode)

  def poll(self) -> int | None:
    return self.read(self.proc.poll())

  def wait(self, timeout: float | None = None) -> int:
    return self.read(self.proc.wait(timeout))

  def send_signal(self, sig: int) -> None:
    """SIGKILL: SIGTERM to srun (it SIGKILLs its task), SIGKILL to srun the second time; SIGINT, SIGTERM and
    SIGHUP: SIGINT to srun, which passes it on (--disable-status)."""
    if self.proc.poll() is not None:
      return
    if sig == signal.SIGKILL:
      self.proc.send_signal(signal.SIGKILL if self.asked == signal.SIGKILL else signal.SIGTERM)
    elif sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      self.proc.send_signal(signal.SIGINT)
    else:
      raise ValueError(f"an srun step takes no {signal.Signals(sig).name} (--hang works with --launcher local only)")
    self.asked = signal.SIGTERM if sig == signal.SIGHUP else sig

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)

  def terminate(self) -> None:
    self.send_signal(signal.SIGTERM)


class Slurm:
  """Each node an `srun` step on a host of the allocation (module docstring), its coordinator the host of
  process 0's node, port PORT + the generation.

  Args:
    workdir, logs: the run's workdir (on a file system every host shares); the folder of the nodes' logs.
    hosts: the allocation's hosts (default: SLURM_JOB_NODELIST's); node i starts on the i-th, the rest are spares.
    nodes: the run's nodes, checked against the hosts.
    port, devices: the coordinator's first port; CPU devices per process (None: the accelerator's).
    command, args: the trainer (default this checkout's train.py, the same path on every host); the run's flags.
    srun_args: srun options added to every step's (e.g. --gpus-per-node=8).
  """

  def __init__(self, workdir: str, logs: str, hosts: Sequence[str] | None = None, nodes: int | None = None,
               port: int = 12400, devices: int | None = None, command: Sequence[str] = TRAIN,
               args: Sequence[str] = (), srun_args: Sequence[str] = ()):
    self.hosts = list(hosts) if hosts else allocation_hosts()
    if nodes is not None and len(self.hosts) < nodes:
      raise ValueError(f"--launcher slurm: {len(self.hosts)} hosts ({','.join(self.hosts)}) for --nodes {nodes}; "
                       f"allocate at least {nodes} nodes (sbatch --nodes) or lower --nodes")
    if not shutil.which("srun"):
      raise ValueError("--launcher slurm: srun is not on PATH; run the supervisor on a host of the allocation "
                       "(examples/slurm/supervised.sbatch)")
    self.workdir, self.logs, self.port, self.devices = workdir, logs, port, devices
    self.command, self.args, self.srun_args = tuple(command), tuple(args), tuple(srun_args)
    self.env = {**cache_env(workdir), **os.environ, "PYTHONUNBUFFERED": "1"}
    self.host: dict[int, str] = {}   # node -> the host it runs on
    self.left_out: set[str] = set()  # the hosts of lost nodes
    self.members: tuple[int, ...] = ()
    self.generation = -1

  def place(self, members: Sequence[int]) -> None:
    """A new generation: the nodes of the last one that are not members were lost (their hosts are left out);
    each member keeps its host, or takes the first spare host, or its own host back when none is left."""
    for n in set(self.members) - set(members):
      self.left_out.add(self.host[n])
    for n in members:
      if n in self.host and self.host[n] not in self.left_out:
        continue
      taken = set(self.host.values()) | self.left_out
      spare = [h for h in self.hosts if h not in taken]
      if spare:
        self.host[n] = spare[0]
      elif n in self.host:
        self.left_out.discard(self.host[n])
      else:
        raise ValueError(f"--launcher slurm: no host left for node {n} (hosts {','.join(self.hosts)})")
    self.members = tuple(members)

  def __call__(self, s: Start) -> Step:
    if s.generation != self.generation:
      self.generation = s.generation
      self.place(s.members or (s.node,))
    elif s.node not in self.members:  # a Start that names no members
      self.place((*self.members, s.node))
    host = self.host[s.node]
    coordinator = self.host.get(s.coordinator, host)
    cmd = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--disable-status",
           f"--job-name=zerojax.g{s.generation}.n{s.node}", *self.srun_args, *self.command, f"--workdir={self.workdir}",
           *([f"--devices={self.devices}"] if self.devices else []),
           f"--coordinator={coordinator}:{self.port + s.generation}", *s.args, *self.args]
    env = {**self.env, "ZEROJAX_NODE_ID": str(s.node)}  # a one-node step's SLURM_NODEID is 0 on every host
    with open_log(self.logs, s) as out:
      return Step(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True))


class Pod:
  """A pod's handle (`Kubernetes`): Popen's answers through kubectl."""

  pid = None

  def __init__(self, launcher: "Kubernetes", name: str, node: int):
    self.launcher, self.name, self.node = launcher, name, node
    self.created, self.returncode, self.asked = time.monotonic(), None, None

  def poll(self) -> int | None:
    if self.returncode is None:
      self.returncode = self.launcher.exit_status(self)
      if self.returncode is not None:
        self.launcher.finished(self)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    end = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      if end is not None and time.monotonic() >= end:
        raise subprocess.TimeoutExpired(f"pod {self.name}", timeout)
      time.sleep(min(0.2, self.launcher.poll_s))
    return self.returncode

  def send_signal(self, sig: int) -> None:
    """SIGKILL: the pod deleted at once (--grace-period=0 --force); SIGINT, SIGTERM, SIGHUP: deleted with the
    launcher's grace period (Kubernetes sends SIGTERM, SIGKILL after it)."""
    if self.returncode is not None:
      return
    if sig == signal.SIGKILL:
      grace = ["--grace-period=0", "--force"]
    elif sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      grace = [f"--grace-period={self.launcher.grace_s}"]
    else:
      raise ValueError(f"a pod takes no {signal.Signals(sig).name} (--hang works with --launcher local only)")
    self.launcher.kubectl("delete", "pod", self.name, *grace, "--wait=false", "--ignore-not-found")
    self.asked = sig

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)

  def terminate(self) -> None:
    self.send_signal(signal.SIGTERM)


class Kubernetes:
  """Each node a pod (module docstring): run by the supervisor with kubectl, inside the cluster (a pod with a
  ServiceAccount allowed to create, list, delete pods and read their logs: examples/k8s/supervisor.yaml) or
  outside it.

  Args:
    workdir, logs: the run's workdir (on a volume the pods and the supervisor share, at the same path); the
      folder of the nodes' logs.
    template: a pod manifest (a dict, or the path of a JSON file) whose first container runs the trainer: its
      image, resources, volumes and node selectors are kept; name, labels, hostname, subdomain, restartPolicy
      (Never) and the env above are set, the supervisor's flags appended to its args.
    image: the container's image (required when the template names none).
    name: the pods' prefix, their `zerojax/run` label and the headless Service that resolves them.
    namespace: kubectl's namespace (default kubectl's own: the supervisor pod's).
    port, devices: the coordinator's first port; CPU devices per process (None: the accelerator's).
    command, args: the trainer (default the template's command, else `python train.py`); the run's flags.
    grace_s: the seconds a stopped pod gets before Kubernetes SIGKILLs it.
    poll_s: the least time between two listings of the pods.
  """

  def __init__(self, workdir: str, logs: str, template: dict | str | None = None, image: str | None = None,
               name: str = "zerojax", namespace: str | None = None, port: int = 12400, devices: int | None = None,
               command: Sequence[str] | None = None, args: Sequence[str] = (), grace_s: float = 120,
               poll_s: float = 1.0):
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,48}[a-z0-9])?", name):
      raise ValueError(f"--k8s_name {name!r}: a pod's hostname is NAME-g<start>-n<node>, so NAME must be a DNS "
                       "label of at most 50 characters (lowercase letters, digits and '-', e.g. zerojax)")
    if not shutil.which("kubectl"):
      raise ValueError("--launcher k8s: kubectl is not on PATH; install it where the supervisor runs (its image, "
                       "examples/k8s/supervisor.yaml) or put it on PATH")
    if isinstance(template, str):
      try:
        with open(template) as f:
          template = json.load(f)
      except (OSError, ValueError) as e:
        raise ValueError(f"--k8s_pod_template {template}: cannot read it as a JSON pod manifest ({e}); give a Pod's "
                         "JSON (examples/k8s/supervisor.yaml holds one)") from None
    self.template = template or {"apiVersion": "v1", "kind": "Pod"}
    containers = self.template.get("spec", {}).get("containers") or [{}]
    if not (image or containers[0].get("image")):
      raise ValueError("--launcher k8s: the trainer's image is not set; give --k8s_image or a --k8s_pod_template "
                       "whose first container names its image")
    self.workdir, self.logs, self.image, self.name, self.namespace = workdir, logs, image, name, namespace
    self.port, self.devices, self.args = port, devices, tuple(args)
    self.command = tuple(command) if command else tuple(containers[0].get("command") or POD)
    self.grace_s, self.poll_s = max(1, math.ceil(grace_s)), poll_s
    self.pods: dict[str, dict] = {}  # name -> the pod, as last listed
    self.listed = self.tried = -math.inf  # when it was listed, when last tried (time.monotonic)
    self.cleaned = False

  def kubectl(self, verb: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    ns = [f"--namespace={self.namespace}"] if self.namespace else []
    try:
      return subprocess.run(["kubectl", verb, *ns, *args], input=stdin, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
      return subprocess.CompletedProcess(["kubectl", verb], 1, "", f"kubectl {verb} took over 120 s")

  def pod_name(self, generation: int, node: int) -> str:
    return f"{self.name}-g{generation}-n{node}"

  def manifest(self, s: Start) -> dict:
    pod = json.loads(json.dumps(self.template))  # a copy
    name = self.pod_name(s.generation, s.node)
    meta = pod.setdefault("metadata", {})
    meta["name"] = name
    meta.setdefault("labels", {}).update({RUN: self.name, "zerojax/generation": str(s.generation),
                                          "zerojax/node": str(s.node)})
    spec = pod.setdefault("spec", {})
    spec.update(restartPolicy="Never", hostname=name, subdomain=self.name)
    c = (spec.get("containers") or [{}])[0]
    spec["containers"] = [c, *spec.get("containers", [])[1:]]
    c.setdefault("name", "train")
    if self.image:
      c["image"] = self.image
    c["command"] = list(self.command)
    devices = [f"--devices={self.devices}"] if self.devices else []
    c["args"] = [*c.get("args", []), f"--workdir={self.workdir}", *devices, *s.args, *self.args]
    coordinator = f"{self.pod_name(s.generation, s.coordinator)}.{self.name}:{self.port + s.generation}"
    ours = {"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(s.num_processes),
            "JAX_PROCESS_ID": str(s.process_id), "ZEROJAX_NODE_ID": str(s.node), "PYTHONUNBUFFERED": "1"}
    env = [e for e in c.get("env", []) if e.get("name") not in ours]
    named = {e.get("name") for e in env}
    env += [{"name": k, "value": v} for k, v in cache_env(self.workdir).items() if k not in named]
    c["env"] = env + [{"name": k, "value": v} for k, v in ours.items()]
    return pod

  def __call__(self, s: Start) -> Pod:
    if not self.cleaned:  # pods an earlier supervisor of this run left
      self.kubectl("delete", "pods", "-l", f"{RUN}={self.name}", "--ignore-not-found", "--wait=true")
      self.cleaned = True
    r = self.kubectl("create", "-f", "-", stdin=json.dumps(self.manifest(s)))
    pod = Pod(self, self.pod_name(s.generation, s.node), s.node)  # created: a listing from now on shows it
    with open_log(self.logs, s) as out:
      if r.returncode:
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        out.write(f"zerojax: error: kubectl create of pod {pod.name} failed: {why}\n")
        pod.returncode = USAGE
    return pod

  def listing(self, since: float) -> dict[str, dict] | None:
    """The run's pods by name, listed after `since` (time.monotonic), or None while the listing fails."""
    now = time.monotonic()
    if now - self.tried >= self.poll_s or self.tried < since:
      self.tried = now
      r = self.kubectl("get", "pods", "-l", f"{RUN}={self.name}", "-o", "json")
      try:
        pods = {p["metadata"]["name"]: p for p in json.loads(r.stdout)["items"]} if not r.returncode else None
      except (ValueError, KeyError, TypeError):
        pods = None
      if pods is not None:
        self.pods, self.listed = pods, now
    return self.pods if self.listed >= since else None

  def exit_status(self, pod: Pod) -> int | None:
    """The pod's exit status, or None while it runs (or the listing fails)."""
    pods = self.listing(pod.created)
    if pods is None:
      return None
    p = pods.get(pod.name)
    if p is None:  # deleted: as asked (SIGTERM, or SIGKILL when forced), else from outside (evicted, node lost)
      return -signal.SIGTERM if pod.asked not in (None, signal.SIGKILL) else -signal.SIGKILL
    phase = p.get("status", {}).get("phase")
    if phase == "Succeeded":
      return 0
    if phase != "Failed":
      return None
    states = [c.get("state", {}).get("terminated") for c in p["status"].get("containerStatuses", [])]
    codes = [t["exitCode"] for t in states if t and "exitCode" in t]
    return status(codes[0]) if codes else -signal.SIGKILL

  def finished(self, pod: Pod) -> None:
    """A pod that ended: its log appended to the node's, and the pod deleted."""
    if pod.name not in (self.pods or {}):
      return
    r = self.kubectl("logs", pod.name)
    with open(os.path.join(self.logs, f"node{pod.node}.log"), "a") as out:
      out.write(r.stdout if not r.returncode else f"(kubectl logs {pod.name}: {r.stderr.strip()})\n")
    self.kubectl("delete", "pod", pod.name, "--wait=false", "--ignore-not-found")
