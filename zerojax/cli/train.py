"""Train the GPT model with a zerojax plan.

  python train.py --gin_file=configs/zero3.gin --gin_param='train.steps=200' --workdir=DIR

Your own model instead of the GPT: --model=path/to/my_model.py:build, a function
`build(vocab_size, seq_len)` returning a zerojax.Model whose loss takes [batch, seq_len + 1] byte tokens.

Resumes from the latest checkpoint in DIR/checkpoints; --restore_from=OTHER starts from another run's.
One run per workdir: a second one started in DIR stops with one line naming the first's host and pid.
Ctrl-C or SIGTERM: finish the step, save a checkpoint, exit 130 / 143 (press Ctrl-C twice to exit at
once). Config, data and checkpoint errors print one line and exit 2 (--verbose: with the traceback).

Several hosts: start it with the cluster's launcher, one process per node or one per GPU (Slurm's srun,
mpirun, a Kubernetes JobSet: examples/slurm, examples/k8s), or on every host with --coordinator=HOST:PORT
--num_processes=N --process_id=I. The processes of one host form one node of the mesh.
"""
import argparse
import dataclasses
import inspect
import json
import logging
import os
import re
import signal
import sys
import traceback
import warnings

import gin

from zerojax.train.checkpoint import SaveError
from zerojax.train.config import REPO_ROOT, ConfigError  # noqa: F401  (REPO_ROOT: configs resolve against it)

DEFAULT_DEVICES = 8
DEFAULT_CACHE = os.path.join("~", ".cache", "zerojax", "jax")


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, exit 2
    self.exit(2, f"train.py: error: {message} (see train.py --help)\n")


def parser(with_parameters: bool = False) -> argparse.ArgumentParser:
  """The command line; `with_parameters` lists the gin parameters in the help (imports the trainer)."""
  ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=parameters_help() if with_parameters else None)
  ap.add_argument("--gin_file", action="append", default=[],
                  help="gin config file (repeatable); relative to the working directory or the repository")
  ap.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. train.steps=100")
  ap.add_argument("--workdir", required=True,
                  help="output folder (metrics.jsonl, summary.json, config.gin, loss.png, tensorboard/, "
                       "checkpoints/)")
  ap.add_argument("--model", default=None, metavar="FILE.py:FUNCTION",
                  help="train your own model: a function `FUNCTION(vocab_size, seq_len)` in FILE.py (or "
                       "package.module:FUNCTION) returning a zerojax.Model whose loss takes [batch, seq_len + 1] "
                       "int32 byte tokens (sets train.model; default: the built-in GPT)")
  ap.add_argument("--data", default=None,
                  help="a token file (.bin, .npy; python -m zerojax.cli.tokenize writes one with its sidecar), a "
                       "folder of them, or text (a file or folder, read as bytes); default: the Python stdlib's "
                       "sources (docs/data.md)")
  ap.add_argument("--eval_data", default=None,
                  help="held-out data of the same kind as --data (default: the last 5%% of --data)")
  ap.add_argument("--restore_from", default=None,
                  help="workdir or checkpoint folder to start from when --workdir has no checkpoint yet "
                       "(any mesh, process count or plan; same model and optimizer)")
  ap.add_argument("--start_over", action="store_true",
                  help="when every checkpoint in --workdir was set aside as damaged (<step>.damaged-<time>), "
                       "start over (from step 0, or from --restore_from) instead of stopping; the damaged "
                       "folders stay for inspection")
  ap.add_argument("--allow_changed", action="append", default=[], metavar="NAME[,NAME]",
                  help="settings that may differ from the checkpoint's on resume, e.g. train.steps or "
                       "train.batch_size (the model never may)")
  ap.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (multi-host)")
  ap.add_argument("--num_processes", type=int, default=None)
  ap.add_argument("--process_id", type=int, default=None)
  ap.add_argument("--heartbeat_timeout", type=int, default=30,
                  help="seconds after which a silent process counts as dead and the others stop (multi-host)")
  ap.add_argument("--initialization_timeout", type=int, default=300,
                  help="seconds the processes wait for each other to start (multi-host; jax.distributed."
                       "initialize); the supervisor passes a shorter one to its restarts")
  ap.add_argument("--replica_dir", default=None,
                  help="this node's own folder (local disk) for its copy of the train state, written about "
                       "every train.replica_every_s seconds (or train.replica_every steps); a start resumes from "
                       "the latest step every node holds, on any number of nodes (plans with a full replica per "
                       "node; docs/training.md, \"When a node dies\")")
  ap.add_argument("--join", action="store_true",
                  help="with --replica_dir: this node has no current copy (restarted or replaced) and takes "
                       "it from the others")
  ap.add_argument("--progress_file", default=None, metavar="FILE",
                  help="rewrite FILE every second with the last completed step (the heartbeat that python -m "
                       "zerojax.cli.supervise's watchdog reads; set by it)")
  ap.add_argument("--event", default=None, metavar="JSON",
                  help="the membership change this start follows, recorded in metrics.jsonl (set by "
                       "python -m zerojax.cli.supervise)")
  ap.add_argument("--devices", type=int, default=None,
                  help="CPU devices in this process (default: JAX_NUM_CPU_DEVICES or XLA_FLAGS' "
                       f"--xla_force_host_platform_device_count if set, else {DEFAULT_DEVICES} on a "
                       "machine without an accelerator)")
  ap.add_argument("--compilation_cache", default=None, metavar="DIR",
                  help="JAX's persistent compilation cache: a restarted or resumed run loads its compiled "
                       f"programs instead of compiling them again (default {DEFAULT_CACHE} on GPUs, off on "
                       "CPUs, where reading a program back can crash the process; '' turns it off; "
                       "JAX_COMPILATION_CACHE_DIR, where set, wins)")
  ap.add_argument("--verbose", action="store_true", help="print the traceback of errors")
  return ap


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser(with_parameters=bool({"-h", "--help"} & set(argv))).parse_args(argv)
  if not args.verbose:
    _quiet()
  try:
    return _run(args)
  except KeyboardInterrupt:  # before the training loop took over the signal
    print("zerojax: interrupted before training started; nothing was saved", file=sys.stderr, flush=True)
    return 130
  except Exception as e:  # noqa: BLE001
    code = _exit_code(e)
    if code is None:
      raise
    if args.verbose:
      traceback.print_exc()
    print(f"zerojax: error: {one_line(e)}" + ("" if args.verbose else " (--verbose shows the traceback)"),
          file=sys.stderr, flush=True)
    if isinstance(e, SaveError):  # orbax's threads of the failed save wait minutes for each other: end now
      sys.stdout.flush()
      os._exit(code)
    return code


def _exit_code(e: Exception) -> int | None:
  """2 for what the user can fix (config, data, checkpoint, disk), 1 for a diverged run, None otherwise."""
  if isinstance(e, (ValueError, TypeError, OSError)):  # ConfigError and CheckpointError are ValueErrors
    return 2
  from zerojax.train.loop import NonFiniteError
  return 1 if isinstance(e, NonFiniteError) else None


def one_line(e: Exception) -> str:
  """The error's message on one line, without gin's "In call to configurable" context."""
  lines = [l.strip() for l in str(e).splitlines() if l.strip()
           and not re.match(r"\s*In (call to configurable|file|bindings string)", l)]
  return "; ".join(lines) or type(e).__name__


def _quiet() -> None:
  """Keeps orbax's logged tracebacks (of failed background saves, re-raised here) off the terminal."""
  for name in ("absl", "asyncio"):
    logging.getLogger(name).setLevel(logging.CRITICAL)
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited")
  sys.unraisablehook = lambda unraisable: None


def _run(args) -> int:
  for flag in ("data", "eval_data", "restore_from"):
    path = getattr(args, flag)
    if path is not None and not os.path.exists(path):
      kind = "a token file (.bin, .npy), a folder of them, or text" if flag != "restore_from" else \
          "the workdir of a run that saved checkpoints, or its checkpoints/ folder"
      raise ConfigError(f"--{flag} path {path!r} does not exist; pass {kind}")
  if not args.gin_file and not any(p.replace(" ", "").startswith("train.plan=") for p in args.gin_param):
    raise ConfigError("no --gin_file given; pass a config, e.g. --gin_file=configs/zero3.gin (configs/ has "
                      "dp, zero1, zero2, zero3, mics, zeropp, qwz, hpz, qgz)")
  if (args.join or args.event) and not args.replica_dir:
    raise ConfigError("--join and --event go with --replica_dir (the node's own folder); add it or drop them")
  if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
    raise ConfigError(f"--workdir {args.workdir!r} is a file; pass a folder (created if missing)")
  from zerojax.train import progress as progress_lib
  progress = progress_lib.Progress(args.progress_file) if args.progress_file else None  # beats from here on
  try:
    return _run_training(args, progress)
  finally:
    if progress is not None:
      progress.close()


def _run_training(args, progress) -> int:
  devices = set_device_count(args.devices)
  set_compilation_cache(args.compilation_cache, _has_accelerator())
  import jax
  from zerojax.train import config as config_lib, trainer, workdir_lock
  from zerojax.train.signals import exit_code
  allowed = config_lib.check_allowed(args.allow_changed)  # before any slow start
  from zerojax.mesh import launched_processes
  if args.coordinator or launched_processes() > 1 or os.environ.get("JAX_COORDINATOR_ADDRESS"):
    initialize_distributed(args)
  bindings = list(args.gin_param)
  if args.model is not None:
    from zerojax.train import user_model
    spec = user_model.absolute(args.model)
    user_model.load(spec)  # before the configs: its own gin configurables can be bound there
    bindings.append(f"train.model = {spec!r}")
  config_lib.parse(args.gin_file, bindings)
  if jax.process_index() == 0 and devices:
    print(f"zerojax: {jax.local_device_count()} CPU devices per process ({devices})", flush=True)
  node_copy = None
  with workdir_lock.hold(args.workdir):  # one run per workdir, held by process 0 until the run ends
    if args.replica_dir:
      from zerojax.train import replica
      node_copy = replica.NodeCopy(os.path.abspath(args.replica_dir), args.join, _event(args.event))
      replica.claim(node_copy.directory, replica.run_id(args.workdir))  # another run's copies are not used
    summary = trainer.train(args.workdir, args.data, restore_from=args.restore_from, allow_changed=allowed,
                            node_copy=node_copy, eval_data=args.eval_data, start_over=args.start_over,
                            heartbeat=progress)
  if jax.process_index() == 0:
    print(json.dumps(summary))
  stopped = summary.get("stopped_by")
  return exit_code(signal.Signals[stopped]) if stopped else 0


def _event(text: str | None) -> dict | None:
  if text is None:
    return None
  try:
    event = json.loads(text)
  except ValueError as e:
    raise ConfigError(f"--event {text!r} is not JSON ({e}); pass an object such as '{{\"kind\": \"node_lost\"}}'")
  if not isinstance(event, dict) or "kind" not in event:
    raise ConfigError(f"--event {text!r} must be a JSON object with a \"kind\"")
  return event


def set_compilation_cache(path: str | None, accelerator: bool) -> None:
  """JAX's persistent compilation cache in `path` (as MaxText's `jax_cache_dir`), unless the environment
  names one (JAX_COMPILATION_CACHE_DIR) or `path` is ''. `None`: `DEFAULT_CACHE` where JAX will run on an
  `accelerator`, none on CPUs: XLA:CPU executables read back from the cache can crash the process (a
  segfault in `deserialize_executable`, seen in this project's test runs; jax-ml/jax#28908). Programs that
  took over a second to compile are kept: a supervisor's restart (docs/training.md, "When a node dies") and
  a resumed job skip the compile of a program they ran before."""
  if path is None:
    path = DEFAULT_CACHE if accelerator else ""
  if not path or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  import jax
  jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))


def set_device_count(devices: int | None) -> str | None:
  """Sets the CPU device count: `--devices`, else what the user's environment says, else 8 on a machine
  without an accelerator. Returns where the count came from (None: the accelerator's devices)."""
  import jax
  if devices:
    jax.config.update("jax_num_cpu_devices", devices)
    return "--devices"
  if os.environ.get("JAX_NUM_CPU_DEVICES"):
    return "JAX_NUM_CPU_DEVICES"
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return "XLA_FLAGS"
  if _has_accelerator():
    return None
  jax.config.update("jax_num_cpu_devices", DEFAULT_DEVICES)
  return "the default; set --devices to change it"


def initialize_distributed(args) -> None:
  """`jax.distributed.initialize` wherever a launcher started several processes (Slurm, Open MPI, MPI, or
  JAX's variables, which examples/k8s sets), one per node or one per GPU, with a heartbeat timeout: when
  one process dies, the others stop within about `--heartbeat_timeout` seconds; a process whose peers do
  not all start stops after `--initialization_timeout` seconds. A job that names several processes but
  comes up as one stops with one line."""
  import jax
  from zerojax import mesh as mesh_lib
  launched = mesh_lib.launched_processes()
  try:
    mesh_lib.initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                    visible_gpus=_visible_gpus(), heartbeat_timeout_seconds=args.heartbeat_timeout,
                                    shutdown_timeout_seconds=args.heartbeat_timeout,
                                    initialization_timeout=args.initialization_timeout)
  except ValueError as e:
    if launched > 1 and "coordinator" in str(e) and not args.coordinator:
      raise ConfigError(f"the launcher names {launched} processes but this one cannot find the others (no "
                        "coordinator: it was not started by srun or mpirun); start every process with the launcher "
                        "(not python directly in the batch script), or give --coordinator, --num_processes and "
                        "--process_id") from None
    raise ConfigError(str(e)) from None
  except RuntimeError as e:
    raise ConfigError(f"starting the {launched if launched > 1 else ''} processes failed ({one_line(e)[:300]}); "
                      "start every process with the launcher (srun, mpirun) or give --coordinator, "
                      "--num_processes and --process_id") from None
  if launched > 1 and jax.process_count() == 1:
    raise ConfigError(f"the launcher started {launched} processes but this one runs alone; start them with srun "
                      "or mpirun (not python directly in the batch script), or give --coordinator, --num_processes "
                      "and --process_id")


def _visible_gpus() -> int:
  """The NVIDIA GPUs this process sees (`CUDA_VISIBLE_DEVICES` where set), 0 without an accelerator."""
  import glob
  if not _has_accelerator():
    return 0
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
  return len(glob.glob("/dev/nvidia[0-9]*"))


def _has_accelerator() -> bool:
  """Whether JAX will find an accelerator, decided before JAX starts: JAX_PLATFORMS names one, or (when it
  is unset) a CUDA plugin is installed and the machine has an NVIDIA GPU. A plugin alone is not a GPU: the
  `gpu-aot` extra installs one to compile for GPUs on a CPU machine."""
  import glob
  import importlib.util
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms != "cpu"
  plugin = any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None for v in (12, 13))
  return plugin and bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*"))


# -- the gin parameters, for --help -------------------------------------------------------------------

def _docs(fn, section: str = "Args:") -> dict[str, str]:
  """`{name: first sentence}` of a Google-style docstring section."""
  out, name, lines = {}, None, (inspect.getdoc(fn) or "").splitlines()
  inside = False
  for line in lines:
    if line.strip() == section:
      inside = True
      continue
    if inside and line and not line.startswith(" "):
      break
    m = re.match(r"^  (\w+): (.*)$", line) if inside else None
    if m:
      name = m.group(1)
      out[name] = m.group(2)
    elif inside and name and line.startswith("    "):
      out[name] += " " + line.strip()
  first = lambda text: re.split(r"(?<=[\w)])\. (?=[A-Z])", text)[0].rstrip(".")
  return {k: first(v) if len(first(v)) <= 100 else first(v)[:97] + "..." for k, v in out.items()}


def parameters_help() -> str:
  """The gin parameters `train.py` reads, with their defaults (configs/base.gin overrides some)."""
  from zerojax import plan as plan_lib
  from zerojax.train import gin_registry, trainer
  from zerojax.train.optim import make_optimizer
  rows = []

  def add(prefix, fn, skip=(), docs=None):
    docs = docs if docs is not None else _docs(fn)
    for name, p in inspect.signature(fn).parameters.items():
      if name in skip or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
        continue
      default = "REQUIRED" if p.default is gin.REQUIRED or p.default is p.empty else repr(p.default)
      rows.append((f"{prefix}.{name} = {default}", docs.get(name, "")))

  add("train", trainer.train, skip=("workdir", "data", "eval_data", "restore_from", "allow_changed", "start_over",
                                    "heartbeat"))
  add("model_config", trainer.model_config)
  add("make_optimizer", make_optimizer, skip=("total_steps",))
  add("zeropp", plan_lib.zeropp, docs={"weight_bits": "qwZ: bits of the forward weight gather (None: off)",
                                       "secondary_axes": "hpZ: axes of the secondary shard (None: off)",
                                       "grad_bits": "qgZ: bits of the gradient reduction (None: off)"})
  shared = {"rotate": "Hadamard-rotate every quantization block, qwZ's and qgZ's (SDP4Bit §3.2); needs "
                      "weight_bits or grad_bits and power-of-two blocks",
            "kernel_backend": "quantization kernels, 'xla', 'pallas' or 'triton' (None: the default backend)"}
  skip = {"param_axes", "grad_axes", "opt_axes", *gin_registry.RUN_SETTINGS}  # axes: the constructors'
  for value in plan_lib.VALUES.values():  # every plan setting, documented by the value that owns it
    fields = {**_docs(value, "Attributes:"), **shared}
    for f in dataclasses.fields(value):
      if f.name not in skip and f"PLAN.{f.name} = {f.default!r}" not in (r[0] for r in rows):
        rows.append((f"PLAN.{f.name} = {f.default!r}", fields.get(f.name, "")))
  add("radius", plan_lib.radius, docs=_docs(plan_lib.Radius, "Attributes:"))   # mics.replica_sync = @radius()
  add("diloco", plan_lib.diloco, docs=_docs(plan_lib.Diloco, "Attributes:"))   # mics.outer_sync = @diloco()
  width = max(len(r[0]) for r in rows) + 2
  body = "\n".join(f"  {a.ljust(width)}{b}".rstrip() for a, b in rows)
  return ("gin parameters (--gin_param='NAME=VALUE'), with their defaults; configs/base.gin sets some of "
          f"them. PLAN is the plan's constructor: {', '.join(plan_lib.PLANS)} (e.g. zero3.reduce_dtype):\n{body}")


if __name__ == "__main__":
  sys.exit(main())
