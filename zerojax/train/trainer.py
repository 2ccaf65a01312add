"""The trainer behind `train.py`: gin-configured, multi-host aware, with progress and metrics; `train` sets
up the run, resumes it and writes its summary; its steps are `zerojax.train.loop`'s."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
from typing import NamedTuple

import gin
import jax
import jax.numpy as jnp
import numpy as np

from zerojax.executor import Executor
from zerojax.executor.memory import memory_report
from zerojax.mesh import make_mesh, process_nodes
from zerojax import planner
from zerojax.plan import Plan, zero3
from zerojax.planner import remat as remat_choice
from zerojax.train import checkpoint as checkpoint_lib, config as config_lib, data as data_lib
from zerojax.train import export as export_lib, node_parts, replica as replica_lib, report, user_model
from zerojax.train import model_spec as spec_lib, tokenizer as tokenizer_lib
from zerojax.train.loop import Built, Loop, RunConfig, Setup, Start, say as _say
from zerojax.train.progress import Progress
from zerojax.train.model_spec import ModelSpec, llama_config, model_config, model_spec  # noqa: F401  (gin configurables)
from zerojax.train import gin_registry  # noqa: F401  (registers the plan constructors with gin)
from zerojax.train.gin_registry import RUN_SETTINGS  # `train.*` in gin, for every plan
from zerojax.train.optim import make_optimizer
from zerojax.train.signals import StopSignal


def default_num_nodes() -> int:
  """The nodes (hosts) the processes run on (`zerojax.mesh.process_nodes`); a single CPU process simulates
  2 nodes (when its devices split evenly)."""
  if jax.process_count() > 1:
    return len(set(process_nodes()))
  return 2 if jax.default_backend() == "cpu" and jax.device_count() % 2 == 0 else 1


def platform_compute_dtype(mesh) -> str:
  """The compute dtype where `train.compute_dtype` is unset (as `configs/base.gin` leaves it): bf16 on GPUs
  (the tensor cores' dtype; the master weights stay fp32), fp32 on CPUs (where bf16 matmuls are slower
  than fp32). `mesh`: the run's mesh, or a platform's name ("cpu", "gpu")."""
  platform = mesh if isinstance(mesh, str) else mesh.devices.flat[0].platform
  return "float32" if platform == "cpu" else "bfloat16"


def platform_chooses_dtype(compute_dtype: str | None, plan) -> bool:
  """Whether the platform picks the compute dtype (`platform_compute_dtype`): neither `train.compute_dtype`
  nor a plan built in Python sets it (`auto()`'s candidates are built with the run's setting)."""
  return compute_dtype is None and (isinstance(plan, planner.Auto) or plan.settings()["compute_dtype"] is None)


def with_run_settings(plan: Plan, param_dtype: str | None = None, compute_dtype: str | None = None,
                      pad_multiple: int | None = None) -> Plan:
  """`plan` with the run's settings (`train.param_dtype`, `train.compute_dtype`, `train.pad_multiple`;
  None keeps the plan's).

  Each has one channel in gin, `train.*` (the plan constructors refuse these fields there:
  `zerojax.train.gin_registry`); a plan built in Python that sets another value itself is refused.
  """
  defaults, settings = Plan().settings(), plan.settings()
  for field, value in zip(RUN_SETTINGS, (param_dtype, compute_dtype, pad_multiple)):
    own = settings[field]
    if value is None or own == value:
      continue
    if own != defaults[field]:
      raise ValueError(f"plan {plan.name!r} sets {field}={own!r} but train.{field}={value!r}; set it in one "
                       f"place: train.{field} (or train.{field}=None to keep the plan's)")
    plan = dataclasses.replace(plan, **{field: value})
  return plan


def build(plan: Plan, num_nodes: int | None = None, *, steps: int = 200, accum_steps: int = 1,
          pad_multiple: int = 256, param_dtype: str | None = None, compute_dtype: str | None = None,
          batch_size: int = 32, model: str | None = None, devices=None, architecture: str = "gpt",
          init_from: str | None = None, spec: ModelSpec | None = None) -> Built:
  """The executor `train` runs: the gin-configured GPT (or the user's `model`) and optimizer under `plan`
  on a fresh mesh.

  Args mirror `train`'s (`steps` sets the optimizer's schedule); also used by `zerojax.cli.account`;
  `devices` (default `jax.devices()`) are those of the mesh, e.g. compile-only GPUs (`zerojax.gpu_aot`);
  `spec` (default: from `architecture`, `init_from` and gin, `model_spec.model_spec`) is the model. With
  `plan = auto()` the AMSP planner picks the plan. Returns the executor with how it was chosen (`Built`).
  """
  spec = spec or spec_lib.model_spec(architecture, init_from)
  if isinstance(plan, planner.Auto):
    return _auto(plan, num_nodes, steps=steps, accum_steps=accum_steps, pad_multiple=pad_multiple,
                 param_dtype=param_dtype, compute_dtype=compute_dtype, batch_size=batch_size, model=model,
                 spec=spec)
  mesh = make_mesh(num_nodes or default_num_nodes(), devices=devices)
  if platform_chooses_dtype(compute_dtype, plan):
    compute_dtype = platform_compute_dtype(mesh)
  plan = with_run_settings(plan, param_dtype, compute_dtype, pad_multiple)
  cfg = spec.config
  net = spec.build() if model is None else user_model.build(model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
  optimizer = make_optimizer(total_steps=steps)
  # remat "auto": the fastest mode whose compiled step fits the device (on CPUs: the rule)
  plan, choice = remat_choice.choose(net, optimizer, plan, mesh, (accum_steps, batch_size, cfg.seq_len + 1),
                                     accum_steps=accum_steps)
  return Built(Executor(net, optimizer, plan, mesh, accum_steps=accum_steps), choice)


def _auto(choice: planner.Auto, num_nodes, **kw) -> Built:
  """Builds ZeRO-3 to read the model's units, measures the plans' compute (`auto.compute`), then builds
  the chosen plan (every build with the run's settings `kw`, its batch size included)."""
  lead = jax.process_index() == 0
  ex = build(zero3(), num_nodes, **kw).executor
  batch = np.zeros((ex.accum_steps, kw["batch_size"], kw["spec"].seq_len + 1), np.int32)
  plan, rows = choice.plan_for(ex.mesh, planner.workload(ex), lambda p: build(p, num_nodes, **kw).executor, batch,
                               log=(lambda m: print(m, flush=True)) if lead else (lambda m: None))
  return build(plan, num_nodes, **kw)._replace(planner_rows=rows)


@gin.configurable(denylist=["workdir", "data", "eval_data", "restore_from", "allow_changed", "node_copy",
                            "start_over", "heartbeat"])
def train(workdir: str, data: str | None = None, restore_from: str | None = None, allow_changed=(),
          node_copy: replica_lib.NodeCopy | None = None, eval_data: str | None = None, start_over: bool = False,
          heartbeat: Progress | None = None, *,
          plan: Plan = gin.REQUIRED,
          steps: int = 200, checkpoint_every: int = 100, keep_checkpoints: int = 3,
          batch_size: int = 32, accum_steps: int = 1, num_nodes: int | None = None, seed: int = 0,
          eval_every: int = 50, eval_batches: int = 4, log_every: int = 1,
          max_consecutive_skips: int = 5, data_dtype: str | None = None, tokenizer: str | None = None,
          pad_multiple: int = 256,
          param_dtype: str | None = None, compute_dtype: str | None = None, export: bool = False,
          progress: bool = True, model: str | None = None, replica_every: int | None = None,
          replica_every_s: float = 120.0, architecture: str = "gpt", init_from: str | None = None,
          profile_steps: tuple[int, int] | None = None, wandb_project: str | None = None,
          wandb_entity: str | None = None) -> dict:
  """Trains the GPT model (or your own, `model`) on byte-level text under `plan`; writes metrics to `workdir`.

  SIGINT (Ctrl-C) and SIGTERM finish the current step, save a checkpoint and stop (a second signal
  ends the process at once); the summary then says `stopped_by`.

  Args:
    workdir: output folder: `metrics.jsonl` (one object per logged step), `summary.json`, `config.gin`
      (the config run), `loss.png`, `tensorboard/` and `checkpoints/`; a run resumes from the latest
      checkpoint there. A run whose checkpoint is at `steps` already is left as it is. Every record of
      metrics.jsonl carries its unix `time` and the run's `nodes`.
    data: a token file (`.bin`, `.npy`; `python -m zerojax.cli.tokenize` writes one), a folder of them, or
      text (a file or folder, read as bytes); default the running Python's standard library sources
      (`zerojax.train.data`, docs/data.md).
    restore_from: a workdir or checkpoint folder to start from when `workdir` has no checkpoint (any
      mesh, process count or plan; same model and optimizer). Never silently ignored.
    allow_changed: settings (gin names, e.g. "train.steps") that may differ from the checkpoint's on
      resume; others that differ stop the run (`zerojax.train.config.check_resume`).
    node_copy: this node's own copy of the train state (`train.py --replica_dir`, one process per node):
      written about every `replica_every_s` seconds; a start resumes from the latest step every holder has
      when it is newer than the checkpoint, on any number of nodes (`zerojax.train.replica`).
    heartbeat: the supervisor's progress file (`train.py --progress_file`), told of each completed step.
    plan: the sharding plan (`@zero3()`, `@mics()`, ... in gin).
    steps: optimizer steps (also the length of the learning-rate schedule).
    checkpoint_every: steps between checkpoints (0: only at the end and on SIGINT/SIGTERM).
    keep_checkpoints: how many of the latest checkpoints to keep.
    batch_size: global micro-batch size (sequences), divisible by the number of devices.
    accum_steps: micro-batches per optimizer step.
    num_nodes: nodes of the mesh (default `default_num_nodes()`).
    seed: seed of the initial parameters and of the data order (a resumed run keeps its checkpoint's).
    eval_every: steps between evaluations of the held-out loss (0: only at the end).
    eval_batches: held-out batches per evaluation.
    log_every: steps between rows of metrics.jsonl.
    max_consecutive_skips: stop after this many steps in a row with non-finite loss or gradients.
    data_dtype: the dtype of `.bin` token files without a sidecar: "uint16" (nanoGPT's) or "uint32".
    tokenizer: a SentencePiece `.model` or a Hugging Face `tokenizer.json`: the vocabulary of the model and
      of the token files (text is refused with the command that tokenizes it).
    pad_multiple: leaves are padded to a multiple of devices x lcm(this, the plan's quantization blocks),
      for every plan (`Sharding.pad_multiple`): one layout of the shards for every plan of the run.
    param_dtype: the run's parameter dtype on the wire and in compute, for every plan (`Gather.param_dtype`;
      None keeps the plan's). The one place to set it in gin: the plan constructors refuse it.
    compute_dtype: the run's compute dtype, for every plan (`Gather.compute_dtype`); None: the plan's, or
      where it sets none the platform's (`platform_compute_dtype`: bf16 on GPUs, fp32 on CPUs; summary.json's
      `platform_defaults` says which applied).
    export: write the final logical parameters to `workdir/params.npz`.
    progress: show a progress bar.
    model: a model of your own instead of the GPT: "path/to/file.py:function" or "package.module:function"
      (train.py's --model), called as `function(vocab_size=..., seq_len=...)` with model_config's values;
      it returns a `zerojax.Model` whose loss takes `[batch, seq_len + 1]` int32 byte tokens
      (`zerojax.train.user_model`).
    replica_every: steps between writes of the node's own copy (with `node_copy`); None: by time,
      `replica_every_s`.
    replica_every_s: about the seconds between writes of the node's own copy, turned into steps from the
      first steps' time (`replica.Cadence`); the device-to-host copy is what the step pays, the files are
      written on a thread.
    start_over: when every checkpoint in workdir was set aside as damaged, start over (from restore_from, or
      step 0) instead of stopping (train.py --start_over).
    eval_data: a separate held-out source (train.py's --eval_data); default the last 5% of `data`.
    architecture: "gpt" (`model_config`) or "llama" (`llama_config`; docs/models.md).
    profile_steps: (START, STOP): a `jax.profiler` trace of steps START..STOP in `workdir/profile`
      (TensorBoard's profile plugin, Perfetto); None: no trace.
    wandb_project: also log every record to this W&B project (`pip install 'zerojax[wandb]'`; the run is
      named after the workdir, its id kept there, so a resume continues it; `WANDB_MODE=offline` keeps it
      on disk, in `workdir/wandb`); None: no W&B.
    wandb_entity: the W&B user or team of the run (None: W&B's default).
    init_from: a Hugging Face checkpoint folder (config.json and *.safetensors of a Llama, Mistral or Qwen2)
      whose weights a new run starts from; its config.json gives the model (a resume starts from the
      checkpoint instead).

  Returns:
    The summary dict also written to `summary.json`.
  """
  args = dict(locals())
  config_lib.check_run_settings(**args)
  run = RunConfig(**args)
  stop = StopSignal().install()
  try:
    return _train(run, stop)
  finally:
    stop.uninstall()


def _finite(x):
  return x if x is not None and np.isfinite(x) else None


def _train(run: RunConfig, stop: StopSignal) -> dict:
  """One run: its setup, the state it starts from, the loop, the summary."""
  s = _setup(run)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(run.workdir, "checkpoints"), max_to_keep=run.keep_checkpoints)
  writer, loop = replica_lib.Writer(), None
  try:
    copies, resumed = _resume(run, s, ckpt)
    if resumed is not None and int(resumed.state.step) >= run.steps:
      step = int(resumed.state.step)
      _say(f"the run already finished: the checkpoint in {resumed.directory} is at step {step}, "
           f"train.steps={run.steps}; {run.workdir} is left as it is (raise train.steps to train on)")
      return {**_read_summary(run.workdir), "status": "already finished", "step": step}
    loop = Loop(run, s, _start(run, s, resumed), copies, stop, ckpt, writer)
    loop.open()
    loop.run()
  finally:
    writer.wait(quiet=True)
    ckpt.close()
    if loop is not None:
      loop.close()
  return _summary(run, s, loop)


def _setup(run: RunConfig) -> Setup:
  """The run's model spec, data and executor (`build`), checked against each other."""
  allowed = config_lib.check_allowed(run.allow_changed)
  tok = tokenizer_lib.load(run.tokenizer) if run.tokenizer is not None else None
  spec = spec_lib.model_spec(run.architecture, run.init_from)
  dataset = data_lib.open_data(run.data, eval_path=run.eval_data, seq_len=spec.seq_len, data_dtype=run.data_dtype,
                               tokenizer=tok)  # reads no ids: cheap, and it says the vocabulary
  spec = spec.with_vocab(dataset.vocab_size)
  data_lib.check_vocab(dataset, spec.config.vocab_size)
  built = build(run.plan, run.num_nodes, steps=run.steps, accum_steps=run.accum_steps,
                pad_multiple=run.pad_multiple, param_dtype=run.param_dtype, compute_dtype=run.compute_dtype,
                batch_size=run.batch_size, model=run.model, spec=spec)
  ex = built.executor
  ex.check_batch((run.accum_steps, run.batch_size, spec.config.seq_len + 1))
  if built.remat.get("rows"):  # chosen by compiling (GPUs): say what and why
    _say(built.remat["why"])
  settings = config_lib.run_settings(spec.settings(), steps=run.steps, batch_size=run.batch_size,
                                     accum_steps=run.accum_steps, user_model=run.model,
                                     data=data_lib.identity(dataset))
  return Setup(spec, dataset, settings, allowed, built)


def _resume(run: RunConfig, s: Setup, ckpt) -> tuple[Copies | None, checkpoint_lib.Resumed | None]:
  """This process's node copies (`_node_copies`), and what the run resumes from: the nodes' copies where
  they are at least as new as the latest checkpoint, else a checkpoint (`checkpoint.resume`); None: none."""
  check = lambda meta, where: config_lib.check_resume(meta.get("settings"), s.settings, meta["step"], where,
                                                      s.allowed)
  copies = _node_copies(s.ex, run.node_copy)
  found = replica_lib.agree(run.node_copy.directory, run.node_copy.joining, run.seed) if copies else None
  if found is not None and found[0] >= (ckpt.latest_step() or -1):
    return copies, _from_copies(s.ex, copies, found, check)
  return copies, checkpoint_lib.resume(s.ex, ckpt, run.restore_from, check=check, warn=_say,
                                       start_over=run.start_over)


def _start(run: RunConfig, s: Setup, resumed: checkpoint_lib.Resumed | None) -> Start:
  """The resumed state (with its checkpoint's data seed), else `train.init_from`'s weights, else new
  parameters from `train.seed`."""
  if resumed is None:
    if s.spec.init_from is not None:
      state = s.ex.init_from_params(spec_lib.initial_params(s.spec))  # each device is sent its own shards
      _say(f"initialised from {s.spec.init_from} ({s.spec.model_type}, {s.spec.describe()})")
    else:
      state = s.ex.init(jax.random.key(run.seed))
    return Start(state, 0, run.seed, None, False)
  # the data position is the step; the data order is the checkpoint's seed
  step, seed = int(resumed.state.step), resumed.meta.get("seed", run.seed)
  _say(f"restored step {step} from {resumed.directory}"
       + (f" (data seed {seed}; train.seed={run.seed} applies to new runs only)" if seed != run.seed else ""))
  if resumed.note:
    _say(resumed.note)
  return Start(resumed.state, step, seed, resumed.meta.get("first_loss"), True)


def _summary(run: RunConfig, s: Setup, loop: Loop) -> dict:
  """The run's summary, also in `summary.json` (with `loss.png`, by process 0); a stop by signal is said
  first, and `train.export` writes the parameters."""
  ex, plan, mesh, workdir, lead, log = s.ex, s.ex.plan, s.ex.mesh, run.workdir, loop.lead, loop.log
  step, times, waits, rates = loop.step, loop.times, loop.waits, loop.rates
  stopped_by = signal.Signals(loop.stopped).name if loop.stopped else None
  if stopped_by:
    _say(f"stopped by {stopped_by} after step {step}; "
         + (f"saved a checkpoint of step {step}" if step > loop.start_step else "nothing new to save")
         + "; run the same command to resume")
  if run.export:
    export_lib.export_params(ex, loop.state, os.path.join(workdir, "params.npz"))
  median = float(np.median(times)) if times else None
  summary = {"plan": plan.label(), "plan_name": plan.name, "mesh": dict(mesh.shape), "nodes": loop.nodes,
             "status": f"stopped by {stopped_by}" if stopped_by else "finished", "stopped_by": stopped_by,
             "step": step, "steps": run.steps, "first_loss": _finite(loop.first_loss),
             "final_loss": _finite(loop.loss), "final_eval_loss": _finite(loop.eval_loss),
             "skipped_steps": int(jnp.sum(loop.state.skipped)),
             "median_step_time_s": median, "tokens_per_s": loop.tokens_per_step / median if median else None,
             **({k: v for k, v in rates.of(median).items() if k != "tokens_per_s"} if median else {}),
             "data": s.dataset.source, "vocab_size": s.spec.config.vocab_size, "architecture": s.spec.architecture,
             "init_from": s.spec.init_from,
             "data_wait_s": float(np.median(waits)) if waits else None, "memory_bytes_per_device": memory_report(ex)["expected"],
             "plan_fields": {"name": plan.name, **{k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                                                    for k, v in plan.settings().items()}}}
  if s.built.planner_rows:
    summary["planner"] = s.built.planner_rows
  summary["remat"] = s.built.remat
  if platform_chooses_dtype(run.compute_dtype, run.plan):
    summary["platform_defaults"] = {"compute_dtype": ex.plan.settings()["compute_dtype"],
                                    "platform": mesh.devices.flat[0].platform}
  if ex.prefetch_fallbacks():
    summary["prefetch_fallbacks"] = ex.prefetch_fallbacks()
  if lead:
    summary["membership"] = report.membership_summary(log.rows)
    report.write_json(os.path.join(workdir, "summary.json"), summary)
    if log.rows:
      report.plot_loss(log.rows, os.path.join(workdir, "loss.png"), f"{summary['plan']}, {dict(mesh.shape)}")
  return summary


class Copies(NamedTuple):
  directory: str  # this node's folder
  node: int       # this process's node on the mesh
  event: dict | None = None  # the membership change this start follows (`NodeCopy.event`)


def _node_copies(ex: Executor, node_copy) -> Copies | None:
  """Where this process writes its node's copy, or None: no `node_copy`, or not one process per node
  (said in one line: the run keeps its checkpoints only). A plan that shards the state across nodes keeps
  a neighbour's part in each node's copy too (`zerojax.train.replica`)."""
  if node_copy is None:
    return None
  node = jax.process_index()
  own = {d.process_index for d in ex.mesh.devices[min(node, ex.mesh.devices.shape[0] - 1)].flat}
  why = None if own == {node} and ex.mesh.devices.shape[0] == jax.process_count() else (
      "node copies need one process per node")
  across = node_parts.sharded_across_nodes(ex)
  replica_lib.write_run(node_copy.directory, plan=ex.plan.label(), nodes=int(ex.mesh.shape["node"]),
                        survives=why is None, why=why, neighbour_parts=across is not None)
  if why is not None:
    _say(f"plan {ex.plan.label()} keeps no node copies ({why}): a lost node stops the run, which resumes from "
         "its last checkpoint")
    return None
  if across is not None:
    _say(f"plan {ex.plan.label()} shards the train state across nodes ({across}): each node's copy also keeps "
         "the next node's part")
  return Copies(node_copy.directory, node, node_copy.event)


def _from_copies(ex: Executor, copies: Copies, found, check) -> checkpoint_lib.Resumed:
  """The state of the latest step every holder has, from the nodes' own copies (`replica.restore`)."""
  step, held, seed = found
  mine = held[copies.node]
  meta = replica_lib.read_meta(copies.directory, step) if mine else {}
  note = check(meta, os.path.join(copies.directory, str(step))) if "settings" in meta else None
  state = replica_lib.restore(ex, step, held, {copies.node: copies.directory} if mine else {})
  holders, new = [i for i, h in enumerate(held) if h], [i for i, h in enumerate(held) if not h]
  where = (f"the nodes' own copies (held by nodes {holders}"
           + (f"; nodes {new} take theirs from node {holders[0]})" if new else ")"))
  last = (copies.event or {}).get("last_step")
  if last is not None and last > step:  # the steps since the last copy: at most one cadence
    note = "; ".join(filter(None, [note, f"steps {step + 1}..{last} are trained again (the copies are of step {step})"]))
  return checkpoint_lib.Resumed(state, {**meta, "seed": seed}, where, note)


def _read_summary(workdir: str) -> dict:
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}
