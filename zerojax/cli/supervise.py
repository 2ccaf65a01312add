"""Run train.py as N nodes under the supervisor (`zerojax.train.supervisor`): a node whose process dies is
dropped and the survivors train on from their own copies; it rejoins when it is back.

  python -m zerojax.cli.supervise --nodes 3 --devices 2 --workdir=DIR [--kill 2@20 --restart_after 20] \\
      -- --gin_file=configs/mics.gin --gin_param=train.steps=60

Each node is one train.py process with its own folder DIR/replicas/node<i> (`--replica_root`); the
arguments after `--` go to every train.py. `--launcher` starts them (`zerojax.train.launchers`): `local`
(default) on this machine with `--devices` CPU devices each (the emulated cluster); `slurm` as one `srun`
step per node on the hosts of the allocation the supervisor runs in (`--hosts`, `--srun_args`;
examples/slurm/supervised.sbatch); `k8s` as one pod per node (`--k8s_image` or `--k8s_pod_template`,
`--k8s_name`, `--k8s_namespace`; examples/k8s/supervisor.yaml). `--kill NODE@STEP` kills that node's
process once step STEP is logged, `--hang NODE@STEP` SIGSTOPs it (the watchdog ends it; local only);
`--restart_after SECONDS` starts a lost node again that long after its loss, as a cluster manager would.

A watchdog takes a node that completed no step for max(--watchdog_k x the median step time,
--watchdog_floor) seconds (--watchdog_first until a start's first step) for hung: one whose heartbeat
stopped is ended and lost, and when every heartbeat goes on, every node is started again. Restarts are
capped (--max_restarts), a start that trained no step is retried after --restart_backoff seconds,
doubled each time in a row, and the run stops below --min_nodes nodes.

Exits with the run's status (0: finished; 1: stopped, with one line saying why and where it resumes; 2:
every node's train.py stopped with a usage error, whose line it prints). Ctrl-C, SIGTERM or SIGHUP: the
nodes finish their step and save a checkpoint (SIGKILL after --stop_grace seconds, or at once on a
second signal); exits 130 / 143 / 129.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from zerojax.train import launchers, supervisor as supervisor_lib


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--nodes", type=int, default=2, help="nodes (one train.py process each)")
  ap.add_argument("--launcher", choices=("local", "slurm", "k8s"), default="local",
                  help="what starts each node's process: local processes (the emulated cluster), an srun step per "
                       "node inside a Slurm allocation, a Kubernetes pod per node")
  ap.add_argument("--devices", type=int, default=None,
                  help="CPU devices per node (local: default 2; slurm, k8s: default the accelerator's)")
  ap.add_argument("--command", default=None, help="the command that starts a node's trainer, split as a shell "
                  "line (default: this Python and this checkout's train.py; k8s: the template's command, else "
                  "'python train.py')")
  ap.add_argument("--hosts", default=None, help="slurm: the hosts, comma-separated, node i on the i-th and the "
                  "rest spares (default: the allocation's, SLURM_JOB_NODELIST)")
  ap.add_argument("--srun_args", default="", help="slurm: options added to every srun step's, e.g. "
                  "'--gpus-per-node=8'")
  ap.add_argument("--k8s_image", default=None, help="k8s: the trainer's image")
  ap.add_argument("--k8s_pod_template", default=None, metavar="JSON",
                  help="k8s: a Pod manifest (JSON) whose first container runs the trainer (resources, volumes)")
  ap.add_argument("--k8s_name", default="zerojax", help="k8s: the pods' prefix and label, and the headless "
                  "Service that resolves them")
  ap.add_argument("--k8s_namespace", default=None, help="k8s: the namespace (default kubectl's)")
  ap.add_argument("--workdir", required=True, help="train.py's --workdir (shared by the nodes)")
  ap.add_argument("--replica_root", default=None, help="the nodes' own folders are REPLICA_ROOT/node<i> "
                  "(default WORKDIR/replicas)")
  ap.add_argument("--port", type=int, default=12400, help="coordinator port (one more for each restart)")
  ap.add_argument("--kill", action="append", default=[], metavar="NODE@STEP",
                  help="SIGKILL node NODE's process once step STEP is logged (repeatable; slurm: its srun ends the "
                       "step, k8s: its pod is deleted at once)")
  ap.add_argument("--hang", action="append", default=[], metavar="NODE@STEP",
                  help="SIGSTOP node NODE's process once step STEP is logged (repeatable; the watchdog's test)")
  ap.add_argument("--restart_after", type=float, default=None, metavar="SECONDS",
                  help="start a lost node again this long after its loss (default: never)")
  ap.add_argument("--watchdog_k", type=float, default=10,
                  help="a node that completed no step for K x the median step time (at least --watchdog_floor) "
                       "is hung; 0 turns the watchdog off")
  ap.add_argument("--watchdog_floor", type=float, default=120, metavar="SECONDS",
                  help="the least time a node may go without completing a step")
  ap.add_argument("--watchdog_first", type=float, default=1800, metavar="SECONDS",
                  help="the time a start may take to its first step (starting, restoring, compiling), and the "
                       "final save after the last step")
  ap.add_argument("--max_restarts", type=int, default=10,
                  help="restarts after a lost node or a hang before the run stops (a rejoin is not counted)")
  ap.add_argument("--restart_backoff", type=float, default=1.0, metavar="SECONDS",
                  help="wait before restarting after a start that trained no step; doubled for each such "
                       f"restart in a row, at most {supervisor_lib.MAX_BACKOFF_S:g} s")
  ap.add_argument("--min_nodes", type=int, default=1, help="stop the run when fewer nodes are left")
  ap.add_argument("--initialization_timeout", type=int, default=60, metavar="SECONDS",
                  help="train.py --initialization_timeout of the restarts: how long their processes wait for "
                       "each other (the first start keeps train.py's 300)")
  ap.add_argument("--logs", default=None, help="folder for each process's output (default WORKDIR/logs)")
  ap.add_argument("--stop_grace", type=float, default=120, metavar="SECONDS",
                  help="on Ctrl-C, SIGTERM or SIGHUP (and before a rejoin), seconds the nodes get to save "
                       "before they are SIGKILLed")
  ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's arguments")
  return ap


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  rest = [a for a in args.train_args if a != "--"] if args.train_args[:1] == ["--"] else args.train_args
  if args.nodes < 1 or (args.devices is not None and args.devices < 1):
    print(f"supervise: need --nodes >= 1 and --devices >= 1 (got {args.nodes}, {args.devices})", file=sys.stderr)
    return 2
  try:
    kill_at = dict(supervisor_lib.parse_kill(k) for k in args.kill)
    hang_at = dict(supervisor_lib.parse_kill(k, "--hang") for k in args.hang)
  except ValueError as e:
    print(f"supervise: {e}", file=sys.stderr)
    return 2
  bad = [(flag, n) for flag, faults in (("--kill", kill_at), ("--hang", hang_at)) for n in faults
         if not 0 <= n < args.nodes]
  if bad:
    print(f"supervise: {bad[0][0]} names node {bad[0][1]}, but the nodes are 0..{args.nodes - 1}", file=sys.stderr)
    return 2
  bad = [f"--{k}={getattr(args, k):g} must be 0 or more" for k in ("watchdog_k", "watchdog_floor", "watchdog_first",
                                                                    "max_restarts", "restart_backoff")
         if getattr(args, k) < 0]
  if not 1 <= args.min_nodes <= args.nodes:
    bad.append(f"--min_nodes={args.min_nodes} must be 1..{args.nodes} (--nodes)")
  if args.initialization_timeout < 1:
    bad.append(f"--initialization_timeout={args.initialization_timeout} must be 1 or more")
  if hang_at and args.launcher != "local":
    bad.append(f"--hang SIGSTOPs a local process: it works with --launcher local only (got --launcher {args.launcher})")
  if bad:
    print(f"supervise: {'; '.join(bad)}", file=sys.stderr)
    return 2
  workdir = os.path.abspath(args.workdir)
  root = os.path.abspath(args.replica_root or os.path.join(workdir, "replicas"))
  logs = os.path.abspath(args.logs or os.path.join(workdir, "logs"))
  try:
    launch = launcher(args, workdir, logs, rest)
  except ValueError as e:
    print(f"supervise: {e}", file=sys.stderr)
    return 2
  os.makedirs(logs, exist_ok=True)
  sup = supervisor_lib.Supervisor(args.nodes, launch, workdir, lambda n: os.path.join(root, f"node{n}"),
                                  restart_after=args.restart_after, kill_at=kill_at,
                                  log=lambda m: print(m, flush=True), stop_grace_s=args.stop_grace,
                                  error_line=lambda n: error_line(os.path.join(logs, f"node{n}.log")),
                                  hang_at=hang_at, watchdog_k=args.watchdog_k, watchdog_floor_s=args.watchdog_floor,
                                  watchdog_first_s=args.watchdog_first, max_restarts=args.max_restarts,
                                  restart_backoff_s=args.restart_backoff, min_nodes=args.min_nodes,
                                  init_timeout_s=args.initialization_timeout)
  try:
    return sup.run()  # passes SIGINT, SIGTERM and SIGHUP on to the nodes
  except KeyboardInterrupt:  # before the supervisor took the signal over
    return 130


def launcher(args, workdir: str, logs: str, rest: list[str]):
  """The `--launcher` chosen, given its flags (`zerojax.train.launchers`); ValueError: one line."""
  command = shlex.split(args.command) if args.command else None
  if args.launcher == "local":
    return launchers.Local(workdir, logs, args.devices or 2, args.port, command or launchers.TRAIN, rest)
  if args.launcher == "slurm":
    hosts = [h for h in (args.hosts or "").split(",") if h]
    return launchers.Slurm(workdir, logs, hosts, args.nodes, args.port, args.devices, command or launchers.TRAIN, rest,
                           shlex.split(args.srun_args))
  return launchers.Kubernetes(workdir, logs, args.k8s_pod_template, args.k8s_image, args.k8s_name, args.k8s_namespace,
                              args.port, args.devices, command, rest, args.stop_grace)


def error_line(log: str) -> str | None:
  """The last `error:` line train.py printed in the latest generation of a node's log."""
  try:
    with open(log, errors="replace") as f:
      text = f.read()
  except OSError:
    return None
  last = text.rsplit("\n--- generation ", 1)[-1].splitlines()
  return next((l.strip() for l in reversed(last) if re.search(r"\berror: ", l)), None)


if __name__ == "__main__":
  sys.exit(main())
