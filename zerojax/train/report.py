"""What a run leaves in its workdir: `metrics.jsonl`, TensorBoard events, `loss.png`, `summary.json`.

Only process 0 writes. After a resume `metrics.jsonl` is cut back to the restored step, so that every
step appears once, and the TensorBoard writer purges the events past it.
"""
from __future__ import annotations

import json
import logging
import math
import os

from zerojax.mesh import AXES

TENSORBOARD = "tensorboard"  # the events' folder in the workdir: `tensorboard --logdir WORKDIR/tensorboard`


def describe_plan(plan) -> str:
  """A name of the plan that tells its sharding and each ZeRO++ technique apart.

  E.g. "zero3", "mics", "zero3+qwZ(int8)", "zero3+hpZ(gpu)", "zero3+qwZ(int8)+hpZ(gpu)+qgZ(int4)";
  a sharding that is no named stage reads "shard(params=gpu,grads=node.gpu,opt=node.gpu)".
  """
  def whole(axes):  # a factored axis ("gpu.member") counts as its axis
    return frozenset(a.split(".")[0] for a in axes)
  every, gpu, none = frozenset(AXES), frozenset({"gpu"}), frozenset()
  stages = {(none, none, none): "dp", (none, none, every): "zero1", (none, every, every): "zero2",
            (every, every, every): "zero3", (gpu, gpu, gpu): "mics"}
  if not hasattr(plan, "settings"):  # auto(): the planner names the plan it picks
    return getattr(plan, "name", "auto")
  f = plan.settings()
  degrees = (f["param_axes"], f["grad_axes"], f["opt_axes"])
  if any(isinstance(d, int) for d in degrees):  # groups named by size (MiCS, AMSP)
    p, g, o = (d if isinstance(d, int) else "+".join(d) or 1 for d in degrees)
    base = plan.name if plan.name.startswith("amsp") or "-" in plan.name else (
        f"{plan.name}(group={p})" if p == g == o else f"{plan.name}(s_p={p},s_g={g},s_os={o})")
    return "+".join([base] + _techniques(plan))
  shard = tuple(whole(d) for d in degrees)
  base = stages.get(shard) or "shard(" + ",".join(
      f"{k}={'.'.join(a) or '-'}" for k, a in zip(("params", "grads", "opt"), degrees)) + ")"
  return "+".join([base] + _techniques(plan))


def _techniques(plan) -> list[str]:
  parts, f = [], plan.settings()
  if f["weight_bits"]:
    parts.append(f"qwZ(int{f['weight_bits']}{'' if f['weight_block'] else ',per-shard'}"
                 f"{',rot' if plan.gather.rotate else ''})")
  if f["weight_format"]:
    parts.append(f"gather({f['weight_format']}{'' if f['weight_block'] else ',per-shard'})")
  if f["secondary_axes"]:
    sec = f["secondary_axes"]
    parts.append(f"hpZ({sec if isinstance(sec, int) else ','.join(sec)})")
  if f["grad_bits"]:
    bits = "/".join(f"int{b}" for b in dict.fromkeys(plan.reduction.hop_bits))
    extra = [n for k, n in (("rotate", "rot"), ("grad_error_feedback", "ef"), ("stochastic_rounding", "sr"))
             if getattr(plan.reduction, k)]
    parts.append(f"qgZ({','.join([bits] + ([] if f['grad_block'] else ['per-shard']) + extra)})")
  elif f["reduce_dtype"] != "float32":
    parts.append(f"grads({f['reduce_dtype']})")
  if f["remat"] is not None:
    parts.append(f"remat({f['remat']})")
  if f["prefetch"]:
    parts.append("prefetch")
  return parts


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
  """`metrics.jsonl` and TensorBoard events of one run (process 0 only).

  Args:
    workdir: the run's folder.
    start_step: the step the run starts from; rows and events of later steps are dropped.
  """

  def __init__(self, workdir: str, start_step: int):
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
    step = row["step"]
    for key, tag in (("loss", "train/loss"), ("eval_loss", "eval/loss"), ("grad_norm", "train/grad_norm"),
                     ("tokens_per_s", "perf/tokens_per_s"), ("step_time_s", "perf/step_time_s"),
                     ("skipped", "train/skipped_steps")):
      if key in row:
        self._tb.add_scalar(tag, row[key], step)

  def close(self) -> None:
    self._file.close()
    self._tb.close()


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
