"""One run of `trainer.train`: its configuration (`RunConfig`, built once from gin), what it trains
(`Setup`), where it starts (`Start`), and its steps (`Loop`): each step is handed to the device before
the previous step's metrics are read; evaluations, checkpoints and node copies at their steps."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from zerojax import hardware
from zerojax.executor import Executor
from zerojax.executor.memory import memory_report
from zerojax.plan import Plan
from zerojax.train import config as config_lib, data as data_lib, model_spec as spec_lib, replica as replica_lib
from zerojax.train import report, run_metrics
from zerojax.train.model_spec import ModelSpec
from zerojax.train.optim import make_schedule
from zerojax.train.profile import Profile
from zerojax.train.progress import Progress
from zerojax.train.signals import StopSignal

CONFIG_HEADER = """# The config this run used (gin's operative config: every parameter it read, defaults included).
# Run it again with: python train.py --gin_file={workdir}/config.gin --workdir={workdir}"""


class NonFiniteError(RuntimeError):
  pass


def say(msg: str) -> None:
  """Prints one line of the run's log (process 0)."""
  if jax.process_index() == 0:
    print(f"zerojax: {msg}", flush=True)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """`trainer.train`'s arguments (its docstring says each), built once; the run's parts read them here."""
  workdir: str
  data: str | None
  restore_from: str | None
  allow_changed: Any
  node_copy: replica_lib.NodeCopy | None
  eval_data: str | None
  start_over: bool
  heartbeat: Progress | None
  plan: Plan
  steps: int
  checkpoint_every: int
  keep_checkpoints: int
  batch_size: int
  accum_steps: int
  num_nodes: int | None
  seed: int
  eval_every: int
  eval_batches: int
  log_every: int
  max_consecutive_skips: int
  data_dtype: str | None
  tokenizer: str | None
  pad_multiple: int
  param_dtype: str | None
  compute_dtype: str | None
  export: bool
  progress: bool
  model: str | None
  replica_every: int | None
  replica_every_s: float
  architecture: str
  init_from: str | None
  profile_steps: tuple[int, int] | None
  wandb_project: str | None
  wandb_entity: str | None


class Built(NamedTuple):
  """The executor a run trains with and what choosing it found: how remat "auto" was resolved
  (`zerojax.planner.remat.choose`'s report) and the planner's ranked table where `auto()` chose the plan."""
  executor: Executor
  remat: dict
  planner_rows: list | None = None


class Setup(NamedTuple):
  """What a run trains: the model (with the data's vocabulary), the data, the executor, the settings its
  checkpoints record, those allowed to differ from a checkpoint's (`--allow_changed`), and how the
  executor was chosen (`Built`)."""
  spec: ModelSpec
  dataset: data_lib.Dataset
  settings: dict
  allowed: set
  built: Built

  @property
  def ex(self) -> Executor:
    """The executor (`built.executor`)."""
    return self.built.executor


class Start(NamedTuple):
  """Where the loop starts: the train state, its step, the data seed, the first loss (a resume's)."""
  state: Any
  step: int
  seed: int
  first_loss: float | None
  resumed: bool


class Loop:
  """The steps from `start` to `train.steps`, and what the summary reads of them.

  Each step is handed to the device before the previous step's metrics are read (`_finish`); at an
  evaluation, a checkpoint or a node copy the step's own metrics are read at once (`_sync`). `copies`:
  this process's node copies (`trainer.Copies`: directory, node), or None.
  """

  def __init__(self, run: RunConfig, s: Setup, start: Start, copies, stop: StopSignal, ckpt,
               writer: replica_lib.Writer):
    self.config, self.s, self.copies, self.stop, self.ckpt, self.writer = run, s, copies, stop, ckpt, writer
    self.state, self.step, self.start_step, self.seed = start.state, start.step, start.step, start.seed
    self.first_loss, self.resumed = start.first_loss, start.resumed
    self.lead, self.loader, self.log = jax.process_index() == 0, None, None
    self.cadence = replica_lib.Cadence(run.replica_every, run.replica_every_s)
    self.tokens_per_step = run.batch_size * run.accum_steps * s.spec.config.seq_len
    self.rates = run_metrics.Rates(self.tokens_per_step, None if run.model else run_metrics.flops_per_token(s.spec),
                                   s.ex.mesh.size, hardware.peak_flops(s.ex.mesh.devices.flat[0].device_kind))
    self.lr_at, self.nodes = make_schedule(run.steps), int(s.ex.mesh.shape["node"])
    self.in_a_row, self.times, self.waits, self.loss, self.eval_loss = 0, [], [], float("nan"), None
    self.event = run.node_copy.event if run.node_copy is not None else None
    self.pending, self.ready_at, self.stopped = None, None, 0

  def open(self) -> None:
    """The step and evaluation functions, the held-out batches, the prefetcher, the workdir's config, model
    and log (process 0), the progress bar and the profiler."""
    run, ex, spec, dataset = self.config, self.s.ex, self.s.spec, self.s.dataset
    seq_len, vocab = spec.config.seq_len, spec.config.vocab_size
    self.step_fn, self.eval_fn = ex.step_fn(), ex.eval_fn()
    self.held_out = data_lib.eval_arrays(dataset.eval, NamedSharding(ex.mesh, P(ex.batch_axes)),
                                         num_batches=run.eval_batches, batch_size=run.batch_size, seq_len=seq_len,
                                         vocab_size=vocab)
    batches = data_lib.Batches(data_lib.Windows(dataset.train, seq_len, self.seed, vocab, "the training data"),
                               ex.batch_sharding, accum_steps=run.accum_steps, batch_size=run.batch_size)
    self.loader = data_lib.Prefetcher(batches.at, self.start_step, run.steps)
    if self.lead:
      os.makedirs(run.workdir, exist_ok=True)
      config_lib.write(os.path.join(run.workdir, "config.gin"), CONFIG_HEADER.format(workdir=run.workdir))
      spec_lib.write(run.workdir, spec, run.tokenizer)
      about = run.wandb_project and {**config_lib.gin_settings(), **self.s.settings, "plan": ex.plan.label(),
                                     "mesh": dict(ex.mesh.shape)}
      self.log = report.RunLog(run.workdir, self.start_step, run.wandb_project, run.wandb_entity, config=about)
      if self.first_loss is None and self.resumed:
        self.first_loss = self.log.first_loss()
    say(f"plan={ex.plan.label()} mesh={dict(ex.mesh.shape)} data={dataset.source}")
    say(f"model-state bytes per device {json.dumps(memory_report(ex)['expected'])}")
    self.bar = tqdm(total=run.steps, initial=self.start_step, disable=not (self.lead and run.progress),
                    dynamic_ncols=True)
    self.stopped = self.stop.requested()
    self.profiler = Profile(run.workdir, run.profile_steps, self.lead)

  def run(self) -> None:
    """Steps until `train.steps` or a stop signal; then waits for the checkpoint and node copy in flight."""
    run, ex = self.config, self.s.ex
    while self.step < run.steps and not self.stopped:
      batch, data_wait = self.loader.get(self.step)
      self.waits.append(data_wait)
      self.profiler.before(self.step + 1)
      dispatched = time.perf_counter()
      self.state, metrics = self.step_fn(self.state, batch)
      self.step = step = self.step + 1
      if step == self.start_step + 1 and ex.prefetch_fallbacks():
        for u, why in ex.prefetch_fallbacks().items():  # said once: a default the model cannot use
          say(f"unit {u!r}: {why}")
      self.stopped = self.stop.requested()
      evaluating = (run.eval_every and step % run.eval_every == 0) or step == run.steps
      saving = (run.checkpoint_every and step % run.checkpoint_every == 0) or step == run.steps or self.stopped
      copying = self.copies and (self.cadence.due(step) or step == run.steps or self.stopped)
      logged = step % run.log_every == 0 or evaluating
      # the skip count is one per replica with DiLoCo: every process joins its sum (read with the metrics)
      now = run_metrics.Dispatched(step, metrics, jnp.sum(self.state.skipped) if logged else None, dispatched,
                                   data_wait)
      if self.pending is not None:
        self._finish(self.pending)  # the previous step's metrics: the device computes this one meanwhile
      self.pending = now
      if evaluating or saving or copying:
        self._sync(evaluating, saving, copying)
    if self.pending is not None:
      self._finish(self.pending)
    self.profiler.close()
    self.ckpt.wait()
    self.writer.wait()  # a failed write of a node copy stops the run here, or at the next save
    self.bar.close()

  def _sync(self, evaluating, saving, copying) -> None:
    """A step whose metrics are read at once: its node copy, its evaluation, its record, its checkpoint."""
    ex, settings = self.s.ex, self.s.settings
    if copying:  # taken before the step is logged; the files are written on the writer's thread
      held = time.perf_counter()
      self.writer.save(ex, self.state, self.copies.directory, self.copies.node, seed=self.seed,
                       first_loss=self.first_loss, settings=settings)
      self.cadence.copied(time.perf_counter() - held)
    self.eval_loss = self._evaluate() if evaluating else None
    self._finish(self.pending)  # logged with its eval loss
    self.pending = None
    if saving:
      self.ckpt.save(ex, self.state, seed=self.seed, first_loss=self.first_loss, settings=settings)

  def _evaluate(self) -> float:
    """The mean loss of the held-out batches."""
    st, eval_fn = self.state, self.eval_fn
    loss_of = lambda out: out[0] if self.s.ex.model.has_aux else out
    return float(np.mean([float(loss_of(eval_fn(st.params, b, st.mutable))) for b in self.held_out]))

  def _finish(self, d: run_metrics.Dispatched) -> None:
    """The host's work for a step whose metrics are read: the skip rule, the record, the progress bar."""
    run = self.config
    done, self.ready_at = run_metrics.read(d, self.ready_at)
    self.loss = done.loss
    if done.step > self.start_step + 1:  # the first step includes compilation
      self.times.append(done.seconds)
    self.in_a_row = 0 if done.finite else self.in_a_row + 1
    if self.in_a_row >= run.max_consecutive_skips:
      raise NonFiniteError(f"{self.in_a_row} steps in a row had non-finite loss or gradients (last at step "
                           f"{done.step}, loss={done.loss}); lower the learning rate or check the data")
    self.first_loss = done.loss if self.first_loss is None and done.finite else self.first_loss
    if self.lead and done.skipped is not None:
      self._record(done, self.eval_loss if done.step == self.step else None)
    self.bar.set_postfix(loss=f"{done.loss:.3f}", tok_s=f"{self.tokens_per_step / done.seconds:,.0f}",
                         step_s=f"{done.seconds:.3f}")
    self.bar.update(1)
    self.profiler.after(done.step)
    if run.heartbeat is not None:
      run.heartbeat.completed(done.step, run.steps)

  def _record(self, done: run_metrics.Done, evaluated: float | None) -> None:
    """Process 0's row of metrics.jsonl for a logged step."""
    rec = {"step": done.step, "time": time.time(), "nodes": self.nodes, "loss": done.loss,
           "learning_rate": float(self.lr_at(done.step - 1)), "grad_norm": done.grad_norm, "skipped": done.skipped,
           "step_time_s": done.seconds, "data_wait_s": done.data_wait, **self.rates.of(done.seconds),
           **run_metrics.device_memory()}
    if self.event is not None:  # the first step after a node was lost or rejoined
      rec["event"], self.event = report.membership(self.event, rec["time"], self.start_step), None
    self.log.write(rec if evaluated is None else {**rec, "eval_loss": evaluated})

  def close(self) -> None:
    """Stops the prefetcher and closes the log (those `open` made)."""
    if self.loader is not None:
      self.loader.close()
    if self.log is not None:
      self.log.close()
