"""What a run leaves in its workdir: `metrics.jsonl`, TensorBoard events, `loss.png`, `summary.json`, and
with `train.wandb_project` a W&B run.

Only process 0 writes. After a resume `metrics.jsonl` is cut back to the restored step, so that every
step appears once, and the TensorBoard writer purges the events past it; the W&B run is the same one
(its id is kept in the workdir, `WANDB_ID`), continued. The plan is named by its one label,
`zerojax.plan.Plan.label`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import uuid

from zerojax.train import config as config_lib

TENSORBOARD = "tensorboard"  # the events' folder in the workdir: `tensorboard --logdir WORKDIR/tensorboard`
WANDB_ID = "wandb_run_id"  # the W&B run's id, in the workdir: a resume logs to the same run

# A record's scalars and their names in TensorBoard and W&B.
SCALARS = (("loss", "train/loss"), ("eval_loss", "eval/loss"), ("grad_norm", "train/grad_norm"),
           ("learning_rate", "train/learning_rate"), ("tokens_per_s", "perf/tokens_per_s"),
           ("step_time_s", "perf/step_time_s"), ("data_wait_s", "perf/data_wait_s"),
           ("model_tflops_per_device", "perf/model_tflops_per_device"), ("mfu", "perf/mfu"),
           ("device_bytes_in_use", "memory/device_bytes_in_use"), ("device_peak_bytes", "memory/device_peak_bytes"),
           ("skipped", "train/skipped_steps"), ("nodes", "cluster/nodes"))


def scalars(row: dict) -> dict:
  """The TensorBoard and W&B scalars of one record: `{"train/loss": ..., ...}` (a membership change's
  times under `cluster/<kind>/`)."""
  out = {tag: row[key] for key, tag in SCALARS if key in row}
  for key, value in (row.get("event") or {}).items():
    if key.endswith(("_s", "steps_lost")) and value is not None:
      out[f"cluster/{row['event']['kind']}/{key}"] = value
  return out


def read_metrics(path: str) -> list[dict]:
  """The rows of a `metrics.jsonl`; a line cut short by a kill is dropped."""
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


class RunLog:
  """`metrics.jsonl`, TensorBoard events and the W&B run of one run (process 0 only).

  Args:
    workdir: the run's folder.
    start_step: the step the run starts from; rows and events of later steps are dropped.
    wandb_project: also log every record to this W&B project (None: no W&B), to the run `start_wandb` opens.
    wandb_entity: the W&B entity (user or team; None: the logged-in user's default).
    config: the W&B run's config (the gin settings, the plan).
  """

  def __init__(self, workdir: str, start_step: int, wandb_project: str | None = None,
               wandb_entity: str | None = None, config: dict | None = None):
    self._wandb = start_wandb(workdir, wandb_project, wandb_entity, config) if wandb_project is not None else None
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.rows = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in self.rows)
    os.replace(tmp, self.path)
    self._file = open(self.path, "a")
    from tensorboardX import SummaryWriter
    logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)  # a skipped step's NaN loss is logged as is
    self._tb = SummaryWriter(os.path.join(workdir, TENSORBOARD), purge_step=start_step + 1 if start_step else None)

  def first_loss(self) -> float | None:
    """The loss of the earliest step logged (before a resume, too)."""
    return next((r["loss"] for r in self.rows if math.isfinite(r.get("loss", math.nan))), None)

  def write(self, row: dict) -> None:
    """Appends one step's row and its scalars."""
    self.rows.append(row)
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    step, values = row["step"], scalars(row)
    for tag, value in values.items():
      self._tb.add_scalar(tag, value, step)
    if self._wandb is not None and step >= self._wandb.step:  # W&B keeps a step's first record (see start_wandb)
      self._wandb.log(values, step=step)

  def close(self) -> None:
    self._file.close()
    self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()


def start_wandb(workdir: str, project: str, entity: str | None, config: dict | None):
  """The W&B run of `workdir` (`wandb.init`), named after the workdir's folder, its files in the workdir's
  `wandb/` unless `WANDB_DIR` is set.

  The first start writes the run's id to `workdir/WANDB_ID`; a resume continues that run
  (`resume="allow"`). W&B's steps only increase: where a run logged steps past the checkpoint it resumes
  from, W&B keeps those steps' first records (metrics.jsonl and TensorBoard hold the steps trained again).
  `WANDB_MODE=offline` writes the run to disk only (`wandb sync` uploads it).

  Raises:
    ConfigError: wandb is missing, or W&B could not start the run (e.g. not logged in).
  """
  wandb = config_lib.wandb_module(project)
  path = os.path.join(workdir, WANDB_ID)
  run_id = open(path).read().strip() if os.path.exists(path) else ""
  if not run_id:
    run_id = uuid.uuid4().hex[:12]
    with open(path + ".tmp", "w") as f:
      f.write(run_id + "\n")
    os.replace(path + ".tmp", path)
  where = {} if os.environ.get("WANDB_DIR") else {"dir": workdir}
  try:
    return wandb.init(project=project, entity=entity, id=run_id, resume="allow", config=config,
                      name=os.path.basename(os.path.abspath(workdir)), **where)
  except Exception as e:  # noqa: BLE001  (W&B's errors: not logged in, no network, a bad entity)
    text = " ".join(str(e).split()) or type(e).__name__
    raise config_lib.ConfigError(f"W&B could not start run {run_id} of project {project!r}: {text}; run `wandb "
                                 "login`, or set WANDB_MODE=offline to keep the run on disk (`wandb sync` "
                                 "uploads it later)") from e


def membership(event: dict, now: float, start_step: int) -> dict:
  """The record of a membership change (`zerojax.train.supervisor`) at the first step after it: `event`
  with the seconds from the failure to its detection (`detect_s`), from the detection to this step
  (`resume_s`), and the steps logged before it that the run trains again (`steps_lost`)."""
  out = dict(event)
  failed, detected = event.get("failed"), event.get("detected")
  out["detect_s"] = detected - failed if failed is not None and detected is not None else None
  out["resume_s"] = now - detected if detected is not None else None
  out["resumed_from"] = start_step
  last = event.get("last_step")
  out["steps_lost"] = max(0, last - start_step) if last is not None else None
  return out


def membership_summary(rows: list[dict]) -> dict:
  """summary.json's count of the run's lost and rejoined nodes, with each change's record."""
  events = [r["event"] for r in rows if r.get("event")]
  return {"nodes_lost": sum(e["kind"] == "node_lost" for e in events),
          "nodes_rejoined": sum(e["kind"] == "node_rejoined" for e in events), "events": events}


def plot_loss(rows: list[dict], path: str, title: str) -> None:
  """Draws the training loss (and the held-out loss where measured) over the steps into a PNG."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
  ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, label="train loss")
  evals = [r for r in rows if "eval_loss" in r]
  if evals:
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", ms=3, label="held-out loss")
  ax.set(xlabel="step", ylabel="loss (nats/byte)", title=title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def write_json(path: str, obj: dict) -> None:
  """Writes `obj` as JSON, atomically (a kill never leaves half a file)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)
