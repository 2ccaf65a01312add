"""Cluster emulator: N nodes x G CPU devices on one machine, nodes joined by shaped network links.

Each node is one `train.py` process in its own network namespace, with its own hostname (`unshare
--uts`) and `/etc/netns/<ns>/hosts` so gloo binds the node's link-local address (169.254.77.i). Every
namespace has one veth link to a bridge in the root namespace (a star through one switch); `tc` shapes
both directions of each link: htb for `--rate`, netem for `--delay` (both ends of a link, so a message
between two nodes, which crosses two links, is delayed by 2 x `--delay`; kernels without sch_netem
refuse a delay). Traffic between the devices of a node stays on the namespace's loopback, so a link
carries exactly the node's cross-node traffic.

The bytes on each link are read from `/sys/class/net/<veth>/statistics` when the lead process logs step
`--from_step` in `metrics.jsonl` and again when it logs `--to_step`: per-step bytes are the difference
over the steps in between (after compilation, before the final evaluation and checkpoint). They are
Ethernet frames, so they include TCP/IP headers, acknowledgements and the coordinator's heartbeats;
`*_payload_*` subtracts 66 header bytes per frame (veth counts a GSO super-frame once).

  python benchmarks/cluster.py --gin_file=configs/zeropp.gin --rate 100mbit [--delay 1ms] \\
      [--nodes 2 --devices 4] [--steps 12] [--gin_param=model_config.num_layers=2]

A node that dies: `--kill NODE@STEP` SIGKILLs that node's process when the lead logs STEP (`--hang`
SIGSTOPs it: the supervisor's watchdog ends it), `--restart_after SECONDS` starts it again that long
after. The supervisor restarts the survivors with one node fewer from their copies (WORKDIR/replicas/
node<i>, the emulated local disks), and the node rejoins; the JSON gains `membership` (each loss and
rejoin: time to detect, to resume, steps lost) and `largest_gap_s`; `--supervised`: no fault, copies on.

Prints one JSON object. Needs root, `ip`, `tc` and `unshare`; namespaces, links and processes are removed
on exit, also on failure, Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "zjx"
SUBNET = "169.254.77"
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_DELAY = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12, once per (GSO) frame


class ClusterError(RuntimeError):
  pass


class Interrupted(BaseException):
  """Raised by the SIGINT/SIGTERM handlers so that cleanup runs."""


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
  cmd = (("ip", "netns", "exec", ns) if ns else ()) + cmd
  r = subprocess.run(cmd, capture_output=True, text=True)
  if check and r.returncode:
    raise ClusterError(f"`{shlex.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")
  return r


def check_environment() -> str | None:
  """Why namespaces cannot be built here, or None when they can."""
  if os.geteuid() != 0:
    return "the cluster emulator needs root (network namespaces, veth links and tc); run it as root"
  missing = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
  if missing:
    return f"the cluster emulator needs {', '.join(missing)} (iproute2, util-linux)"
  return None


def parse_rate(rate: str | None) -> str | None:
  """`tc` rate (e.g. 100mbit, 1gbit) or None for an unshaped link ('none')."""
  if rate is None or rate.lower() in ("none", "0", ""):
    return None
  if not _RATE.match(rate.lower()):
    raise ValueError(f"--rate {rate!r} is not a tc rate such as 100mbit or 1gbit (or 'none')")
  return rate.lower()


def parse_delay(delay: str | None) -> str | None:
  """`tc` delay (e.g. 1ms) or None ('0', 'none')."""
  if delay is None or delay.lower() in ("none", "0", ""):
    return None
  if not _DELAY.match(delay.lower()):
    raise ValueError(f"--delay {delay!r} is not a tc time such as 1ms or 500us (or 0)")
  return delay.lower()


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_stale() -> list[str]:
  """Removes namespaces and links left by emulator runs whose process is gone (e.g. killed -9)."""
  removed = []
  names = _sh("ip", "netns", "list", check=False).stdout.split()
  links = re.findall(r"^\d+:\s+([^:@\s]+)", _sh("ip", "-o", "link", "show", check=False).stdout, re.M)
  for name in names + links:
    m = re.fullmatch(PREFIX + r"(\d+)(n|h|c|br)\d*", name)
    if m and not _alive(int(m.group(1))):
      if m.group(2) == "n":
        _sh("ip", "netns", "del", name, check=False)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
      else:
        _sh("ip", "link", "del", name, check=False)
      removed.append(name)
  return removed


class Network:
  """The namespaces, veth links and bridge of one emulated cluster; `close()` removes them all."""

  def __init__(self, nodes: int, rate: str | None, delay: str | None):
    tag = f"{PREFIX}{os.getpid()}"
    self.bridge = f"{tag}br"
    self.ns = [f"{tag}n{i}" for i in range(nodes)]
    self.host_veth = [f"{tag}h{i}" for i in range(nodes)]
    self.node_veth = [f"{tag}c{i}" for i in range(nodes)]
    self.address = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
    self.hostname = [f"{PREFIX}-node{i}" for i in range(nodes)]
    self.rate, self.delay = rate, delay
    self._made: list[tuple[str, str]] = []

  def open(self) -> "Network":
    if not os.path.isdir("/etc/netns"):
      self._made.append(("etc-root", "/etc/netns"))
    _sh("ip", "link", "add", "name", self.bridge, "type", "bridge")
    self._made.append(("link", self.bridge))
    _sh("ip", "link", "set", self.bridge, "up")
    hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.address, self.hostname))
    for i, ns in enumerate(self.ns):
      _sh("ip", "netns", "add", ns)
      self._made.append(("netns", ns))
      os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
      self._made.append(("etc", f"/etc/netns/{ns}"))
      with open(f"/etc/netns/{ns}/hosts", "w") as f:
        f.write(hosts)
      host, node = self.host_veth[i], self.node_veth[i]
      _sh("ip", "link", "add", host, "type", "veth", "peer", "name", node)
      self._made.append(("link", host))
      _sh("ip", "link", "set", node, "netns", ns)
      _sh("ip", "link", "set", host, "master", self.bridge, "up")
      _sh("ip", "link", "set", "lo", "up", ns=ns)
      _sh("ip", "addr", "add", f"{self.address[i]}/24", "dev", node, ns=ns)
      _sh("ip", "link", "set", node, "up", ns=ns)
      self._shape(host, None)   # bridge -> node
      self._shape(node, ns)     # node -> bridge
    return self

  def _shape(self, dev: str, ns: str | None) -> None:
    if self.rate is None and self.delay is None:
      return
    rate = self.rate or "100gbit"
    _sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", ns=ns)
    _sh("tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate,
        ns=ns)
    if self.delay:
      r = _sh("tc", "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "netem", "delay", self.delay,
              "limit", "100000", ns=ns, check=False)
      if r.returncode:
        err = (r.stderr or r.stdout).strip().rstrip(".")
        raise ClusterError(f"cannot add a {self.delay} delay ({err}); this kernel probably lacks the netem "
                           "qdisc (sch_netem); use --delay 0")

  def counters(self) -> list[dict[str, int]]:
    """Per node: bytes and packets the node sent and received on its link (read on the bridge side)."""
    out = []
    for host in self.host_veth:
      stats = {}
      for key in ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets"):
        with open(f"/sys/class/net/{host}/statistics/{key}") as f:
          stats[key] = int(f.read())
      # The bridge side receives what the node sends.
      out.append({"sent_bytes": stats["rx_bytes"], "received_bytes": stats["tx_bytes"],
                  "sent_packets": stats["rx_packets"], "received_packets": stats["tx_packets"]})
    return out

  def close(self) -> None:
    for kind, name in reversed(self._made):
      if kind == "link":
        _sh("ip", "link", "del", name, check=False)
      elif kind == "netns":
        _sh("ip", "netns", "del", name, check=False)
      elif kind == "etc-root":
        try:
          os.rmdir(name)  # only when empty: another run may be using it
        except OSError:
          pass
      else:
        shutil.rmtree(name, ignore_errors=True)
    self._made.clear()


def _train_command(net: Network, i: int, args, workdir: str, port: int, coordinator: int = 0,
                   processes: tuple[str, ...] | None = None) -> list[str]:
  """Node i's train.py; `processes`: the supervisor's flags (`Start.args`) instead of all nodes' run."""
  processes = processes or (f"--num_processes={len(net.ns)}", f"--process_id={i}")
  train = [sys.executable, os.path.join(REPO, "train.py"), f"--workdir={workdir}",
           f"--coordinator={net.address[coordinator]}:{port}", *processes, f"--devices={args.devices}"]
  train += [f"--gin_file={f}" for f in args.gin_file]
  params = [f"train.steps={args.steps}", "train.log_every=1", "train.eval_every=0", "train.progress=False",
            "train.checkpoint_every=0", *args.gin_param]
  train += [f"--gin_param={p}" for p in params]
  return _in_node(net, i, train)


def _in_node(net: Network, i: int, program: list[str]) -> list[str]:
  """`program` run in node i's namespace under its own hostname (gloo binds the node's address)."""
  script = f"hostname {shlex.quote(net.hostname[i])} && exec {shlex.join(program)}"
  return ["ip", "netns", "exec", net.ns[i], "unshare", "--uts", "sh", "-c", script]


def run_profile(args) -> dict:
  """Runs the collective profiler (`zerojax.planner.profile`) on the emulated cluster; returns its JSON."""
  why = check_environment()
  if why:
    raise ClusterError(why)
  remove_stale()
  out = os.path.abspath(args.profile)
  net, procs, logs = Network(args.nodes, parse_rate(args.rate), parse_delay(args.delay)), [], []
  workdir = tempfile.mkdtemp(prefix="zjx-profile-")
  try:
    net.open()
    env = _child_env()
    for i in range(args.nodes):
      prog = [sys.executable, "-m", "zerojax.planner.profile", f"--out={out}", f"--devices={args.devices}",
              f"--coordinator={net.address[0]}:{args.port}", f"--num_processes={args.nodes}", f"--process_id={i}"]
      logs.append(open(os.path.join(workdir, f"node{i}.log"), "w"))
      procs.append(subprocess.Popen(_in_node(net, i, prog), cwd=REPO, env=env, stdout=logs[-1],
                                    stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.time() + args.timeout
    while any(p.poll() is None for p in procs):
      bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
      if bad or time.time() > deadline:
        i = bad[0] if bad else 0
        raise ClusterError(f"profiler on node {i} failed or timed out:\n" + _tail(os.path.join(workdir, f"node{i}.log")))
      time.sleep(0.1)
    if any(p.returncode for p in procs):
      raise ClusterError("the profiler failed:\n" + _tail(os.path.join(workdir, "node0.log")))
  finally:
    _stop(procs)
    for log in logs:
      log.close()
    net.close()
    shutil.rmtree(workdir, ignore_errors=True)
  with open(out) as f:
    return json.load(f)


def _child_env() -> dict[str, str]:
  drop = {"XLA_FLAGS", "JAX_NUM_CPU_DEVICES"}
  env = {k: v for k, v in os.environ.items() if k not in drop and not k.lower().endswith("_proxy")}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return env


def _supervised(net: Network, args, workdir: str, env: dict, logs: list):
  """The supervisor of a run with `--kill` or `--hang`: each start in the node's namespace."""
  from zerojax.train import supervisor as supervisor_lib
  env = {**env, "JAX_COMPILATION_CACHE_DIR": env.get("JAX_COMPILATION_CACHE_DIR", os.path.join(workdir, "jax-cache")),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}

  def launch(s):
    cmd = _train_command(net, s.node, args, workdir, args.port + s.generation, s.coordinator, s.args)
    logs[s.node].write(f"--- generation {s.generation}: process {s.process_id} of {s.num_processes}\n")
    logs[s.node].flush()
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logs[s.node], stderr=subprocess.STDOUT,
                            start_new_session=True)

  return supervisor_lib.Supervisor(
      len(net.ns), launch, workdir, lambda n: os.path.join(workdir, "replicas", f"node{n}"),
      restart_after=args.restart_after, kill_at=dict([supervisor_lib.parse_kill(args.kill)] if args.kill else []),
      hang_at=dict([supervisor_lib.parse_kill(args.hang, "--hang")] if args.hang else []),
      watchdog_floor_s=args.watchdog_floor, log=lambda m: print(m, file=sys.stderr, flush=True))


def _read_metrics(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]  # the lines written whole


def _tail(path: str, n: int = 3000) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()[-n:]
  except OSError:
    return ""


def _stop(procs: list[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGTERM)
      except ProcessLookupError:
        pass
  deadline = time.time() + 10
  for p in procs:
    try:
      p.wait(timeout=max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()


def run(args) -> dict:
  """Runs one emulated cluster (see the module docstring) and returns its JSON-ready measurements."""
  why = check_environment()
  if why:
    raise ClusterError(why)
  rate, delay = parse_rate(args.rate), parse_delay(args.delay)
  from_step = args.from_step
  to_step = args.to_step or args.steps - 1
  if not 1 <= from_step < to_step <= args.steps:
    raise ValueError(f"need 1 <= --from_step ({from_step}) < --to_step ({to_step}) <= --steps ({args.steps}); "
                     "use at least 4 steps")
  remove_stale()
  keep = args.workdir is not None
  workdir = args.workdir or tempfile.mkdtemp(prefix="zjx-cluster-")
  os.makedirs(workdir, exist_ok=True)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(metrics_path) or os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise ClusterError(f"workdir {workdir} already holds a run; use an empty folder")
  net, procs, logs, sup = Network(args.nodes, rate, delay), [], [], None
  old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

  def interrupt(signum, _frame):
    raise Interrupted(f"signal {signum}")

  for s in old:
    signal.signal(s, interrupt)
  try:
    net.open()
    env = _child_env()
    for i in range(args.nodes):
      logs.append(open(os.path.join(workdir, f"node{i}.log"), "w"))
    if args.kill or args.hang or args.supervised:
      sup = _supervised(net, args, workdir, env, logs)
      sup.start(list(range(args.nodes)))
    else:
      for i in range(args.nodes):
        procs.append(subprocess.Popen(_train_command(net, i, args, workdir, args.port), cwd=REPO, env=env,
                                      stdout=logs[i], stderr=subprocess.STDOUT, start_new_session=True))
    start, marks, late, deadline = time.time(), {}, [], time.time() + args.timeout
    while True:
      if sup is not None:
        status = sup.poll()
        procs = list(sup.procs.values())
        if status not in (None, 0):
          raise ClusterError(f"the supervised run stopped (status {status}); node 0's log ends:\n"
                             + _tail(os.path.join(workdir, "node0.log")))
      codes = [p.poll() for p in procs]
      failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
      if failed and sup is None:
        i = failed[0]
        raise ClusterError(f"node {i} exited with code {codes[i]}:\n"
                           + _tail(os.path.join(workdir, f"node{i}.log")))
      logged = {r["step"] for r in _read_metrics(metrics_path)}
      for step in (from_step, to_step):
        if step not in marks and step in logged:
          marks[step] = (time.time(), net.counters())
          if max(logged) > step or any(c is not None for c in codes):
            late.append(step)
      if (sup.status == 0) if sup is not None else all(c == 0 for c in codes):
        break
      if time.time() > deadline:
        raise ClusterError(f"the run took longer than --timeout={args.timeout}s; node 0's log ends:\n"
                           + _tail(os.path.join(workdir, "node0.log")))
      time.sleep(0.01)
    wall = time.time() - start
    if len(marks) != 2:
      raise ClusterError(f"metrics.jsonl never logged steps {from_step} and {to_step}")
    rows = {r["step"]: r for r in _read_metrics(metrics_path)}
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  finally:
    for s in old:  # a second Ctrl-C must not interrupt the cleanup
      signal.signal(s, signal.SIG_IGN)
    _stop(list(sup.procs.values()) if sup is not None else procs)
    for log in logs:
      log.close()
    net.close()
    if not keep:
      shutil.rmtree(workdir, ignore_errors=True)
    for s, h in old.items():
      signal.signal(s, h)
  n = to_step - from_step
  (t0, c0), (t1, c1) = marks[from_step], marks[to_step]
  links = []
  for i, (a, b) in enumerate(zip(c0, c1)):
    link = {"node": i, **{k + "_per_step": (b[k] - a[k]) / n for k in a}}
    for way in ("sent", "received"):
      frames = link[f"{way}_packets_per_step"]
      link[f"{way}_payload_bytes_per_step"] = link[f"{way}_bytes_per_step"] - HEADER_BYTES * frames
    links.append(link)
  times = [rows[s]["step_time_s"] for s in range(from_step + 1, to_step + 1)]
  median = statistics.median(times)
  tokens_per_step = rows[to_step]["tokens_per_s"] * rows[to_step]["step_time_s"]
  out = {
      "gin_files": args.gin_file, "gin_params": args.gin_param, "plan": summary.get("plan_name", summary.get("plan")),
      "nodes": args.nodes, "devices_per_node": args.devices, "rate": rate or "none", "delay": delay or "0",
      "steps": args.steps, "window": {"from_step": from_step, "to_step": to_step, "steps": n, "seconds": t1 - t0},
      "median_step_time_s": median, "tokens_per_s": tokens_per_step / median,
      "run_median_step_time_s": summary.get("median_step_time_s"),
      "links": links,
      "cross_node_bytes_per_step_per_node": statistics.mean(l["sent_bytes_per_step"] for l in links),
      "cross_node_payload_bytes_per_step_per_node": statistics.mean(l["sent_payload_bytes_per_step"] for l in links),
      "final_loss": summary.get("final_loss"), "final_eval_loss": summary.get("final_eval_loss"), "wall_s": wall,
  }
  if sup is not None:
    out["kill"], out["hang"], out["restart_after"] = args.kill, args.hang, args.restart_after
    out["membership"], out["final_nodes"] = summary.get("membership"), summary.get("nodes")
    out["steps_logged"], stamps = sorted(rows), [rows[s]["time"] for s in sorted(rows) if "time" in rows[s]]
    out["largest_gap_s"] = max((b - a for a, b in zip(stamps, stamps[1:])), default=None)  # between logged steps
  if late:
    out["warning"] = (f"the counters for step(s) {late} were read after a later step had been logged; the "
                      "window holds extra traffic: use more steps or a larger model")
  if keep:
    out["workdir"] = workdir
  return out


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gin_file", action="append", default=[], help="gin config of train.py (repeatable)")
  ap.add_argument("--profile", default=None, help="instead of training, run the collective profiler "
                  "(zerojax.planner.profile) on the cluster and write its JSON here")
  ap.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
  ap.add_argument("--nodes", type=int, default=2, help="emulated nodes (one train.py process each)")
  ap.add_argument("--devices", type=int, default=4, help="CPU devices per node")
  ap.add_argument("--rate", default="none", help="link rate per direction, e.g. 100mbit, 1gbit, or none")
  ap.add_argument("--delay", default="0", help="delay per link direction, e.g. 1ms (needs netem), or 0")
  ap.add_argument("--steps", type=int, default=12, help="train.steps")
  ap.add_argument("--from_step", type=int, default=2, help="count bytes and time after this step is logged")
  ap.add_argument("--to_step", type=int, default=None, help="... until this step is logged (default steps-1)")
  ap.add_argument("--workdir", default=None, help="keep the run's files here (default: a removed temp dir)")
  ap.add_argument("--port", type=int, default=12355, help="coordinator port on node 0")
  ap.add_argument("--timeout", type=float, default=1800, help="seconds before the run is stopped")
  ap.add_argument("--kill", default=None, metavar="NODE@STEP",
                  help="SIGKILL node NODE's process when the lead logs STEP; the supervisor restarts the others")
  ap.add_argument("--restart_after", type=float, default=None, metavar="SECONDS",
                  help="with --kill: start the killed node again this long after its loss")
  ap.add_argument("--hang", default=None, metavar="NODE@STEP", help="like --kill, with SIGSTOP (the watchdog's test)")
  ap.add_argument("--watchdog_floor", type=float, default=120, help="the supervisor's (zerojax.cli.supervise's)")
  ap.add_argument("--supervised", action="store_true", help="run under the supervisor (node copies on) without a fault")
  return ap


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  if args.nodes < 2 or args.devices < 1:
    print(f"need --nodes >= 2 and --devices >= 1 (got {args.nodes}, {args.devices})", file=sys.stderr)
    return 2
  if args.restart_after is not None and not (args.kill or args.hang):
    print("--restart_after goes with --kill or --hang NODE@STEP", file=sys.stderr)
    return 2
  for flag, value in [(f, v) for f, v in (("--kill", args.kill), ("--hang", args.hang)) if v is not None]:
    from zerojax.train.supervisor import parse_kill
    try:
      node = parse_kill(value, flag)[0]
      if not 0 <= node < args.nodes:
        raise ValueError(f"{flag} names node {node}, but the nodes are 0..{args.nodes - 1}")
    except ValueError as e:
      print(f"cluster: {e}", file=sys.stderr)
      return 2
  if not args.profile and not args.gin_file:
    print("need --gin_file (a training run) or --profile (the collective profiler)", file=sys.stderr)
    return 2
  try:
    out = run_profile(args) if args.profile else run(args)
  except (ClusterError, ValueError) as e:
    print(f"cluster: {e}", file=sys.stderr)
    return 1
  except Interrupted as e:
    print(f"cluster: stopped by {e}; cleaned up", file=sys.stderr)
    return 130
  print(json.dumps(out, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
