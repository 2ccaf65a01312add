"""The training loop behind `train.py`: gin-configured, multi-host aware, with progress and metrics."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import NamedTuple

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from zerojax.planner.space import label
from zerojax.executor import Executor
from zerojax.executor.memory import memory_report
from zerojax.mesh import make_mesh, process_nodes
from zerojax import planner
from zerojax.plan import Plan, zero3
from zerojax.planner import remat as remat_choice
from zerojax.train import checkpoint as checkpoint_lib, config as config_lib, data as data_lib
from zerojax.train import export as export_lib, node_parts, replica as replica_lib, report, user_model
from zerojax.train import model_spec as spec_lib, run_metrics, tokenizer as tokenizer_lib
from zerojax.train.profile import Profile
from zerojax.train.progress import Progress
from zerojax.train.model_spec import ModelSpec, llama_config, model_config, model_spec  # noqa: F401  (gin configurables)
from zerojax.train import gin_registry  # noqa: F401  (registers the plan constructors with gin)
from zerojax.train.gin_registry import RUN_SETTINGS  # `train.*` in gin, for every plan
from zerojax.train.optim import make_optimizer, make_schedule
from zerojax.train.signals import StopSignal


def default_num_nodes() -> int:
  """The nodes (hosts) the processes run on (`zerojax.mesh.process_nodes`); a single CPU process simulates
  2 nodes (when its devices split evenly)."""
  if jax.process_count() > 1:
    return len(set(process_nodes()))
  return 2 if jax.default_backend() == "cpu" and jax.device_count() % 2 == 0 else 1


def platform_compute_dtype(mesh) -> str:
  """The compute dtype where `train.compute_dtype` is unset: bf16 on GPUs (the tensor cores' dtype; the
  master weights stay fp32), fp32 on CPUs (where bf16 matmuls are slower than fp32)."""
  return "float32" if mesh.devices.flat[0].platform == "cpu" else "bfloat16"


class NonFiniteError(RuntimeError):
  pass




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
          init_from: str | None = None, spec: ModelSpec | None = None) -> Executor:
  """The executor `train` runs: the gin-configured GPT (or the user's `model`) and optimizer under `plan`
  on a fresh mesh.

  Args mirror `train`'s (`steps` sets the optimizer's schedule); also used by `zerojax.cli.account`;
  `devices` (default `jax.devices()`) are those of the mesh, e.g. compile-only GPUs (`zerojax.gpu_aot`);
  `spec` (default: from `architecture`, `init_from` and gin, `model_spec.model_spec`) is the model. With `plan = auto()` the AMSP planner picks the plan (`planner_rows` on the executor holds its table).
  """
  spec = spec or spec_lib.model_spec(architecture, init_from)
  if isinstance(plan, planner.Auto):
    return _auto(plan, num_nodes, steps=steps, accum_steps=accum_steps, pad_multiple=pad_multiple,
                 param_dtype=param_dtype, compute_dtype=compute_dtype, batch_size=batch_size, model=model,
                 spec=spec)
  mesh = make_mesh(num_nodes or default_num_nodes(), devices=devices)
  if compute_dtype is None and plan.settings()["compute_dtype"] is None:
    compute_dtype = platform_compute_dtype(mesh)
  plan = with_run_settings(plan, param_dtype, compute_dtype, pad_multiple)
  cfg = spec.config
  net = spec.build() if model is None else user_model.build(model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
  optimizer = make_optimizer(total_steps=steps)
  # remat "auto": the cheapest mode whose compiled step fits the device (none on CPUs: the rule)
  plan, choice = remat_choice.choose(net, optimizer, plan, mesh, (accum_steps, batch_size, cfg.seq_len + 1),
                                     accum_steps=accum_steps)
  ex = Executor(net, optimizer, plan, mesh, accum_steps=accum_steps)
  ex.remat_choice = choice
  return ex


def _auto(choice: planner.Auto, num_nodes, *, batch_size: int, **kw) -> Executor:
  """Builds ZeRO-3 to read the model's units, measures the plans' compute (`auto.compute`), then builds
  the chosen plan."""
  lead = jax.process_index() == 0
  ex = build(zero3(), num_nodes, **kw)
  batch = np.zeros((ex.accum_steps, batch_size, kw["spec"].seq_len + 1), np.int32)
  plan, rows = choice.plan_for(ex.mesh, planner.workload(ex), lambda p: build(p, num_nodes, **kw), batch,
                               log=(lambda m: print(m, flush=True)) if lead else (lambda m: None))
  chosen = build(plan, num_nodes, **kw)
  chosen.planner_rows = rows
  return chosen


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
  stop = StopSignal().install()
  try:
    return _train(stop=stop, **args)
  finally:
    stop.uninstall()


def _say(msg: str) -> None:
  if jax.process_index() == 0:
    print(f"zerojax: {msg}", flush=True)


def _finite(x):
  return x if x is not None and np.isfinite(x) else None


def _train(workdir, data, restore_from, allow_changed, *, stop, plan, steps, checkpoint_every,
           keep_checkpoints, batch_size, accum_steps, num_nodes, seed, eval_every, eval_batches, log_every,
           max_consecutive_skips, data_dtype, tokenizer, eval_data, pad_multiple, param_dtype, compute_dtype,
           export, progress, model, node_copy, replica_every, replica_every_s, architecture, init_from, profile_steps,
           start_over, heartbeat, wandb_project, wandb_entity) -> dict:
  allowed = config_lib.check_allowed(allow_changed)
  tok = tokenizer_lib.load(tokenizer) if tokenizer is not None else None
  spec = spec_lib.model_spec(architecture, init_from)
  dataset = data_lib.open_data(data, eval_path=eval_data, seq_len=spec.seq_len, data_dtype=data_dtype,
                               tokenizer=tok)  # reads no ids: cheap, and it says the vocabulary
  spec = spec.with_vocab(dataset.vocab_size)
  cfg, vocab = spec.config, spec.config.vocab_size
  data_lib.check_vocab(dataset, vocab)
  ex = build(plan, num_nodes, steps=steps, accum_steps=accum_steps, pad_multiple=pad_multiple,
             param_dtype=param_dtype, compute_dtype=compute_dtype, batch_size=batch_size, model=model, spec=spec)
  plan, mesh = ex.plan, ex.mesh
  ex.check_batch((accum_steps, batch_size, cfg.seq_len + 1))
  if ex.remat_choice.get("rows"):  # chosen by compiling (GPUs): say what and why
    _say(ex.remat_choice["why"])
  settings = config_lib.run_settings(spec.settings(), steps=steps, batch_size=batch_size, accum_steps=accum_steps,
                                     user_model=model, data=data_lib.identity(dataset))
  check = lambda meta, where: config_lib.check_resume(meta.get("settings"), settings, meta["step"], where, allowed)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=keep_checkpoints)
  log = loader = None
  writer, cadence = replica_lib.Writer(), replica_lib.Cadence(replica_every, replica_every_s)
  try:
    copies = _node_copies(ex, node_copy)
    found = replica_lib.agree(node_copy.directory, node_copy.joining, seed) if copies else None
    if found is not None and found[0] >= (ckpt.latest_step() or -1):
      resumed = _from_copies(ex, copies, found, check)
    else:
      resumed = checkpoint_lib.resume(ex, ckpt, restore_from, check=check, warn=_say, start_over=start_over)
    start_step = int(resumed.state.step) if resumed is not None else 0
    if resumed is not None and start_step >= steps:
      _say(f"the run already finished: the checkpoint in {resumed.directory} is at step {start_step}, "
           f"train.steps={steps}; {workdir} is left as it is (raise train.steps to train on)")
      return {**_read_summary(workdir), "status": "already finished", "step": start_step}
    if resumed is not None:  # the data position is the step; the data order is the checkpoint's seed
      seed, asked = resumed.meta.get("seed", seed), seed
      _say(f"restored step {start_step} from {resumed.directory}"
           + (f" (data seed {seed}; train.seed={asked} applies to new runs only)" if seed != asked else ""))
      if resumed.note:
        _say(resumed.note)
    if resumed is not None:
      state = resumed.state
    elif spec.init_from is not None:
      state = ex.init_from_params(spec_lib.initial_params(spec))  # each device is sent its own shards
      _say(f"initialised from {spec.init_from} ({spec.model_type}, {spec.describe()})")
    else:
      state = ex.init(jax.random.key(seed))
    step_fn, eval_fn = ex.step_fn(), ex.eval_fn()
    eval_sharding = NamedSharding(mesh, P(ex.batch_axes))
    held_out = data_lib.eval_arrays(dataset.eval, eval_sharding, num_batches=eval_batches, batch_size=batch_size,
                                    seq_len=cfg.seq_len, vocab_size=vocab)
    batches = data_lib.Batches(data_lib.Windows(dataset.train, cfg.seq_len, seed, vocab, "the training data"),
                               ex.batch_sharding, accum_steps=accum_steps, batch_size=batch_size)
    loader = data_lib.Prefetcher(batches.at, start_step, steps)
    loss_of = lambda out: out[0] if ex.model.has_aux else out
    evaluate = lambda st: float(np.mean([float(loss_of(eval_fn(st.params, b, st.mutable))) for b in held_out]))

    lead = jax.process_index() == 0
    first_loss = resumed.meta.get("first_loss") if resumed is not None else None
    if lead:
      os.makedirs(workdir, exist_ok=True)
      config_lib.write(os.path.join(workdir, "config.gin"), CONFIG_HEADER.format(workdir=workdir))
      spec_lib.write(workdir, spec, tokenizer)
      about = wandb_project and {**config_lib.gin_settings(), **settings, "plan": label(plan), "mesh": dict(mesh.shape)}
      log = report.RunLog(workdir, start_step, wandb_project, wandb_entity, config=about)
      if first_loss is None and resumed is not None:
        first_loss = log.first_loss()
    _say(f"plan={label(plan)} mesh={dict(mesh.shape)} data={dataset.source}")
    _say(f"model-state bytes per device {json.dumps(memory_report(ex)['expected'])}")
    tokens_per_step = batch_size * accum_steps * cfg.seq_len
    rates = run_metrics.Rates(tokens_per_step, None if model else run_metrics.flops_per_token(spec), mesh.size,
                              run_metrics.peak_flops(mesh.devices.flat[0].device_kind))
    lr_at = make_schedule(steps)
    bar = tqdm(total=steps, initial=start_step, disable=not (lead and progress), dynamic_ncols=True)
    in_a_row, times, waits, loss, eval_loss = 0, [], [], float("nan"), None
    stopped, step = stop.requested(), start_step
    nodes = int(mesh.shape["node"])
    event = node_copy.event if node_copy is not None else None
    pending, ready_at, eval_loss = None, None, None
    profiler = Profile(workdir, profile_steps, lead)

    def finish(d: run_metrics.Dispatched):
      """The host's work for a step whose metrics are read: the skip rule, the record, the progress bar."""
      nonlocal in_a_row, first_loss, loss, ready_at, event
      done, ready_at = run_metrics.read(d, ready_at)
      loss = done.loss
      if done.step > start_step + 1:  # the first step includes compilation
        times.append(done.seconds)
      in_a_row = 0 if done.finite else in_a_row + 1
      if in_a_row >= max_consecutive_skips:
        raise NonFiniteError(f"{in_a_row} steps in a row had non-finite loss or gradients (last at step "
                             f"{done.step}, loss={done.loss}); lower the learning rate or check the data")
      first_loss = done.loss if first_loss is None and done.finite else first_loss
      evaluated = eval_loss if done.step == step else None
      if lead and done.skipped is not None:
        rec = {"step": done.step, "time": time.time(), "nodes": nodes, "loss": done.loss,
               "learning_rate": float(lr_at(done.step - 1)), "grad_norm": done.grad_norm, "skipped": done.skipped,
               "step_time_s": done.seconds, "data_wait_s": done.data_wait, **rates.of(done.seconds),
               **run_metrics.device_memory()}
        if event is not None:  # the first step after a node was lost or rejoined
          rec["event"], event = report.membership(event, rec["time"], start_step), None
        log.write(rec if evaluated is None else {**rec, "eval_loss": evaluated})
      bar.set_postfix(loss=f"{done.loss:.3f}", tok_s=f"{tokens_per_step / done.seconds:,.0f}",
                      step_s=f"{done.seconds:.3f}")
      bar.update(1)
      profiler.after(done.step)
      if heartbeat is not None:
        heartbeat.completed(done.step, steps)

    while step < steps and not stopped:
      batch, data_wait = loader.get(step)
      waits.append(data_wait)
      profiler.before(step + 1)
      dispatched = time.perf_counter()
      state, metrics = step_fn(state, batch)
      step += 1
      if step == start_step + 1 and ex.prefetch_fallbacks():
        for u, why in ex.prefetch_fallbacks().items():  # said once: a default the model cannot use
          _say(f"unit {u!r}: {why}")
      stopped = stop.requested()
      evaluating = (eval_every and step % eval_every == 0) or step == steps
      saving = (checkpoint_every and step % checkpoint_every == 0) or step == steps or stopped
      copying = copies and (cadence.due(step) or step == steps or stopped)
      logged = step % log_every == 0 or evaluating
      # the skip count is one per replica with DiLoCo: every process joins its sum (read with the metrics)
      now = run_metrics.Dispatched(step, metrics, jnp.sum(state.skipped) if logged else None, dispatched, data_wait)
      if pending is not None:
        finish(pending)  # the previous step's metrics: the device computes this one meanwhile
      pending = now
      if not (evaluating or saving or copying):
        continue
      if copying:  # taken before the step is logged; the files are written on the writer's thread
        held = time.perf_counter()
        writer.save(ex, state, copies.directory, copies.node, seed=seed, first_loss=first_loss, settings=settings)
        cadence.copied(time.perf_counter() - held)
      eval_loss = evaluate(state) if evaluating else None
      finish(pending)  # logged with its eval loss
      pending = None
      if saving:
        ckpt.save(ex, state, seed=seed, first_loss=first_loss, settings=settings)
    if pending is not None:
      finish(pending)
    profiler.close()
    ckpt.wait()
    writer.wait()  # a failed write of a node copy stops the run here, or at the next save
    bar.close()
  finally:
    writer.wait(quiet=True)
    ckpt.close()
    if loader is not None:
      loader.close()
    if log is not None:
      log.close()
  stopped_by = signal.Signals(stopped).name if stopped else None
  if stopped_by:
    _say(f"stopped by {stopped_by} after step {step}; "
         + (f"saved a checkpoint of step {step}" if step > start_step else "nothing new to save")
         + "; run the same command to resume")
  if export:
    export_lib.export_params(ex, state, os.path.join(workdir, "params.npz"))
  median = float(np.median(times)) if times else None
  summary = {"plan": label(plan), "plan_name": plan.name, "mesh": dict(mesh.shape), "nodes": nodes,
             "status": f"stopped by {stopped_by}" if stopped_by else "finished", "stopped_by": stopped_by,
             "step": step, "steps": steps, "first_loss": _finite(first_loss), "final_loss": _finite(loss),
             "final_eval_loss": _finite(eval_loss), "skipped_steps": int(jnp.sum(state.skipped)),
             "median_step_time_s": median, "tokens_per_s": tokens_per_step / median if median else None,
             **({k: v for k, v in rates.of(median).items() if k != "tokens_per_s"} if median else {}),
             "data": dataset.source, "vocab_size": vocab, "architecture": spec.architecture,
             "init_from": spec.init_from,
             "data_wait_s": float(np.median(waits)) if waits else None, "memory_bytes_per_device": memory_report(ex)["expected"],
             "plan_fields": {"name": plan.name, **{k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                                                    for k, v in plan.settings().items()}}}
  if ex.planner_rows:
    summary["planner"] = ex.planner_rows
  summary["remat"] = ex.remat_choice
  if compute_dtype is None:  # what the platform chose (an explicit setting wins)
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
  replica_lib.write_run(node_copy.directory, plan=label(ex.plan), nodes=int(ex.mesh.shape["node"]),
                        survives=why is None, why=why, neighbour_parts=across is not None)
  if why is not None:
    _say(f"plan {label(ex.plan)} keeps no node copies ({why}): a lost node stops the run, which resumes from "
         "its last checkpoint")
    return None
  if across is not None:
    _say(f"plan {label(ex.plan)} shards the train state across nodes ({across}): each node's copy also keeps "
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


CONFIG_HEADER = """# The config this run used (gin's operative config: every parameter it read, defaults included).
# Run it again with: python train.py --gin_file={workdir}/config.gin --workdir={workdir}"""


def _read_summary(workdir: str) -> dict:
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}
