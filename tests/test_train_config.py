"""The pieces behind train.py, in process: gin files and includes, the settings a resume keeps. (Every
config's plan label: tests/test_plan_label.py.)"""
import os

import gin
import pytest

from zerojax.train import config, trainer  # noqa: F401  (trainer registers the configurables)
from zerojax.train.state_spec import CheckpointError


@pytest.fixture
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def test_includes_resolve_against_the_including_file(tmp_path, clean_gin, monkeypatch):
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "top.gin").write_text("include 'sub/part.gin'\ntrain.steps = 7\n")
  (tmp_path / "a" / "sub").mkdir()
  (tmp_path / "a" / "sub" / "part.gin").write_text("include 'configs/zero3.gin'\ntrain.batch_size = 16\n")
  monkeypatch.chdir(tmp_path)  # neither the repository nor the configs' folder
  paths = config.parse(["a/top.gin"], ["train.seed = 3"])
  assert paths == [str(tmp_path / "a" / "top.gin")]
  assert [gin.query_parameter(f"train.{k}") for k in ("steps", "batch_size", "seed")] == [7, 16, 3]
  assert gin.query_parameter("model_config.d_model") == 128  # from configs/base.gin, through zero3.gin


@pytest.mark.parametrize("text,expect", [
    ("include 'nowhere.gin'\n", "include in {top}:1 'nowhere.gin' does not exist (looked in {dir}"),
    ("train.steps = 3\ntrain.stepz = 3\n", "config {top}:2: Configurable 'train' doesn't have a parameter named "
                                           "'stepz'. (did you mean train.steps?)"),
    ("include 'top.gin'\n", "config {top} includes itself"),
])
def test_config_file_errors_name_the_file_and_line(tmp_path, clean_gin, text, expect):
  top = tmp_path / "top.gin"
  top.write_text(text)
  with pytest.raises(config.ConfigError) as e:
    config.parse([str(top)], [])
  assert expect.format(top=top, dir=tmp_path) in str(e.value)


SAVED = {"model_config.d_model": 32, "train.steps": 20, "train.batch_size": 8, "make_optimizer.name": "adamw",
         "make_optimizer.learning_rate": 0.003}


@pytest.mark.parametrize("now,step,allowed,expect", [
    ({}, 10, (), None),
    ({"train.steps": 30}, 10, (), "SettingsChanged: .*train.steps 20 -> 30 \\(saved -> now\\) \\(changes the "
                                  "learning-rate schedule\\); .*--allow_changed=train.steps"),
    ({"train.steps": 30}, 10, ("train.steps",), "note: continuing with changed settings train.steps 20 -> 30"),
    ({"train.steps": 30}, 20, (), "note: the run finished at step 20; continuing to train.steps=30"),
    ({"train.steps": 10}, 20, (), None),  # finished, and fewer steps: nothing runs, nothing to refuse
    ({"train.steps": 30, "make_optimizer.learning_rate": 0.01}, 20, (),
     "SettingsChanged: .*make_optimizer.learning_rate 0.003 -> 0.01"),
    ({"train.batch_size": 16, "model_config.d_model": 64}, 10, ("train.batch_size",),
     "CheckpointError: .*another model or optimizer \\(model_config.d_model 32 -> 64"),
    ({"make_optimizer.name": "lion"}, 10, (), "CheckpointError: .*make_optimizer.name 'adamw' -> 'lion'"),
])
def test_check_resume(now, step, allowed, expect):
  import re
  try:
    got = config.check_resume(SAVED, {**SAVED, **now}, step, "CKPT", set(allowed))
    got = None if got is None else f"note: {got}"
  except CheckpointError as e:
    got = f"{type(e).__name__}: {e}"
  assert (got is None) if expect is None else re.search(expect, got or ""), got
  assert config.check_resume(None, SAVED, 10, "CKPT") == "checkpoint CKPT records no settings; they are not compared"


def test_allow_changed_names_are_checked():
  assert config.check_allowed(["train.steps,train.batch_size", "make_optimizer.learning_rate"]) == {
      "train.steps", "train.batch_size", "make_optimizer.learning_rate"}
  with pytest.raises(config.ConfigError, match="--allow_changed=train.stepz names no setting; use one of"):
    config.check_allowed(["train.stepz"])
  with pytest.raises(config.ConfigError, match="the model and the optimizer's kind never change"):
    config.check_allowed(["make_optimizer.name"])


def test_train_py_keeps_compiled_programs_unless_told_otherwise(monkeypatch, tmp_path):
  """train.py turns JAX's persistent compilation cache on where it runs on an accelerator (a restart loads
  what it compiled before), not on CPUs (reading an XLA:CPU program back can crash); a path turns it on
  anywhere, '' off, and JAX_COMPILATION_CACHE_DIR, where set, wins."""
  import jax
  from zerojax.cli import train as cli
  assert cli.parser().parse_args(["--workdir", "w"]).compilation_cache is None
  before = jax.config.jax_compilation_cache_dir
  try:
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    cli.set_compilation_cache(None, accelerator=False)
    assert jax.config.jax_compilation_cache_dir is None
    cli.set_compilation_cache(None, accelerator=True)
    assert jax.config.jax_compilation_cache_dir == os.path.expanduser(cli.DEFAULT_CACHE)
    cli.set_compilation_cache(str(tmp_path / "cache"), accelerator=False)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
    jax.config.update("jax_compilation_cache_dir", None)
    cli.set_compilation_cache("", accelerator=True)
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    cli.set_compilation_cache(str(tmp_path / "cache"), accelerator=True)
    assert jax.config.jax_compilation_cache_dir is None  # jax reads the environment's itself
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.parametrize("settings,expect", [
    ({"steps": -5}, "train.steps=-5 must be at least 1"),
    ({"steps": 0}, "train.steps=0 must be at least 1"),
    ({"batch_size": 0}, "train.batch_size=0 must be at least 1"),
    ({"checkpoint_every": -1},
     "train.checkpoint_every=-1 must be at least 0 (0: only at the end and on SIGINT/SIGTERM)"),
    ({"eval_every": -2}, "train.eval_every=-2 must be at least 0 (0: only at the end)"),
    ({"log_every": 0}, "train.log_every=0 must be at least 1"),
    ({"accum_steps": 0, "replica_every": 0},
     "train.accum_steps=0 must be at least 1; train.replica_every=0 must be at least 1"),
    ({"keep_checkpoints": 0}, "train.keep_checkpoints=0 must be at least 1"),
    ({"replica_every_s": 0}, "train.replica_every_s=0 must be a number of seconds above 0"),
    ({"steps": 2.5}, "train.steps=2.5 must be a whole number"),
    ({"eval_batches": True}, "train.eval_batches=True must be a whole number"),
    ({"steps": None}, "train.steps=None must be a whole number"),
])
def test_run_settings_out_of_range_are_one_line(settings, expect):
  with pytest.raises(config.ConfigError) as e:
    config.check_run_settings(**{"steps": 10, "batch_size": 8, **settings})
  assert str(e.value).startswith(expect) and "\n" not in str(e.value)


def test_run_settings_in_range_pass():
  config.check_run_settings(steps=1, batch_size=1, accum_steps=1, checkpoint_every=0, keep_checkpoints=None,
                            eval_every=0, eval_batches=1, log_every=1, max_consecutive_skips=1, replica_every=1,
                            num_nodes=None, pad_multiple=None, seed=-3, workdir="/w", plan=object())  # others ignored


def test_train_py_refuses_a_negative_step_count_in_one_line(capsys, monkeypatch, tmp_path):
  """train.steps=-5 used to exit 0 as "finished"; trainer.train checks its counts first."""
  from tests.train_helpers import command, error_line_of, run_main
  code, _, err = run_main(command(tmp_path / "run", "train.steps=-5")[2:], capsys, monkeypatch)
  assert code == 2 and "train.steps=-5 must be at least 1" in error_line_of(err)
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
