"""auto's trials: the fastest predicted plans and the named ones are run on the mesh and the fastest
measured is chosen, whatever the cost model predicted (AMSP §V; `zerojax.planner.trial`)."""
import json

import gin
import jax
import numpy as np
import pytest

from zerojax import planner
from zerojax.planner import links, trial
from zerojax.train import trainer

TINY = ["model_config.d_model = 32", "model_config.num_layers = 2", "model_config.seq_len = 16"]


def test_candidates_are_the_fastest_that_fit_then_the_named_plans():
  pts = [planner.Point(1, 1, 1), planner.Point(2, 2, 2), planner.Point(8, 8, 8)]
  fitting = [(p.name(8), p) for p in pts]
  base = [(p.name(8), p) for p in trial.baselines(2, 4)]
  got = trial.candidates(fitting, 2, base)
  assert [n for n, _ in got] == ["dp", "mics-2", "zero3", "zeropp", "mics-4"]
  assert [n for n, _ in trial.candidates(fitting, 3, base)] == ["dp", "mics-2", "zero3", "zeropp", "mics-4"]
  assert trial.candidates(fitting, 0, []) == []
  assert [p.name(8) for p in trial.baselines(2, 4)] == ["zero3", "zeropp", "mics-4"]


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_bad_trial_counts_are_one_line_errors(bad):
  with pytest.raises(ValueError, match=r"auto.trials = .*use a count >= 0"):
    planner.auto(trials=bad)
  with pytest.raises(ValueError, match=r"auto.trial_steps = 0: use a count >= 1"):
    planner.auto(trial_steps=0)


def test_time_step_runs_the_compiled_step():
  gin.clear_config()
  gin.parse_config(TINY)
  try:
    ex = trainer.build(trial.baselines(2, 4)[0].plan(2, 4), 2, accum_steps=1, batch_size=8).executor
  finally:
    gin.clear_config()
  s = trial.time_step(ex, np.zeros((1, 8, 17), np.int32), steps=2)
  assert 0 < s < 60


def test_auto_takes_the_fastest_measured_plan_not_the_fastest_predicted(tmp_path, monkeypatch, capsys):
  """A profile whose cross-node links are 1000x slower makes an in-node plan the predicted best; the
  trials (timed here by a stand-in that makes ZeRO-3 the fastest) decide."""
  path = tmp_path / "profile.json"
  path.write_text(json.dumps(links.link_profile(2, 4, b_gpu=100e9, b_node=0.1e9, source="test")))
  timed = []

  def fake(executor, batch, steps=3):
    timed.append(executor.plan.name)
    return 0.1 if executor.plan.name == "zero3" else 0.2 + 0.01 * len(timed)
  monkeypatch.setattr(trial, "time_step", fake)
  gin.clear_config()
  gin.parse_config(TINY)
  try:
    built = trainer.build(planner.auto(profile=str(path), trials=2, trial_steps=1), 2, accum_steps=1, batch_size=8)
  finally:
    gin.clear_config()
  ex, rows = built.executor, built.planner_rows
  tried = [r for r in rows if "trial_s" in r]
  assert ex.plan.name == "zero3" and rows[0]["plan"] != "zero3"  # not the predicted best
  assert len(timed) == len(tried) == 2 + 3 - sum(r["plan"] in ("zero3", "zeropp", "mics-4") for r in rows[:2])
  fitting = [r["plan"] for r in rows if r["fits"]]
  assert [r["plan"] for r in tried if r["plan"] in fitting[:2]] == fitting[:2]  # the 2 fastest predicted
  assert {"zero3", "zeropp", "mics-4"} <= {r["plan"] for r in tried}          # and the named plans
  log = capsys.readouterr().out
  assert f"auto chose zero3: fastest of the {len(tried)} plans measured on this cluster (0.100 s" in log
  assert "trial s" in log and "zerojax: auto: trial [1/" in log


def test_no_trials_chooses_the_prediction(tmp_path, monkeypatch):
  path = tmp_path / "profile.json"
  path.write_text(json.dumps(links.link_profile(2, 4, b_gpu=100e9, b_node=0.1e9, source="test")))
  monkeypatch.setattr(trial, "time_step", lambda *a, **k: pytest.fail("trials=0 ran a trial"))
  gin.clear_config()
  gin.parse_config(TINY)
  try:
    built = trainer.build(planner.auto(profile=str(path), trials=0), 2, accum_steps=1, batch_size=8)
  finally:
    gin.clear_config()
  ex, rows = built.executor, built.planner_rows
  assert ex.plan.name == rows[0]["plan"] and not any("trial_s" in r for r in rows)
  assert jax.device_count() == 8


@pytest.mark.slow
def test_the_trials_leave_nothing_alive(tmp_path):
  """After auto's choice nothing of its trials stays alive: no executor (so no compiled program or train
  state they hold) and no device buffer beyond what was alive before and the chosen executor's own."""
  import gc
  import weakref
  path = tmp_path / "profile.json"
  path.write_text(json.dumps(links.link_profile(2, 4, b_gpu=100e9, b_node=0.1e9, source="test")))
  made = []
  gin.clear_config()
  gin.parse_config(TINY)
  gc.collect()
  before = {id(a) for a in jax.live_arrays()}
  original_measure = trial.compute.measure

  def tracked(executor, batch, reps=3):
    made.append(weakref.ref(executor))
    return original_measure(executor, batch, reps)
  trial.compute.measure = tracked
  try:
    built = trainer.build(planner.auto(profile=str(path), trials=1, trial_steps=1), 2, accum_steps=1, batch_size=8)
    ex = built.executor
  finally:
    trial.compute.measure = original_measure
    gin.clear_config()
  gc.collect()
  assert len(made) >= 4  # the compute measurement and the trials (the best prediction and the named plans)
  alive = [r() for r in made if r() is not None and r() is not ex]
  assert alive == [], [e.plan.name for e in alive]
  leaked = [a for a in jax.live_arrays() if id(a) not in before]
  assert leaked == [], [(a.shape, a.dtype) for a in leaked[:5]]
  assert ex.plan.name in {r["plan"] for r in built.planner_rows}
