"""A real 2-process x 4-device cluster over gloo trains every plan like single-device jax.grad."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import zerojax
from zerojax import plan as plans
from tests.helpers import free_port, run
from tests import helpers

WORKER = os.path.join(os.path.dirname(__file__), "mp_worker.py")



def run_cluster(tmp_path, names, timeout=900):
  port = free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, WORKER, str(i), str(port), str(tmp_path), *names], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]


@pytest.mark.multiprocess
def test_two_processes_match_reference(tmp_path):
  names = ["dp", "zero1", "zero2", "zero3", "mics", "zeropp"]
  run_cluster(tmp_path, names)
  model, opt = helpers.tiny_gpt(), helpers.optimizer("sgd")
  init = jax.jit(model.init)(jax.random.key(0))
  ref, _ = helpers.reference_train(model, opt, init, helpers.batches(3, 2))
  ref = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(ref)}
  for name in names[:-1]:
    got = np.load(tmp_path / f"{name}.npz")
    assert set(got.files) == set(ref)
    for k in ref:
      np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-5 * np.abs(ref[k]).max(), err_msg=f"{name} {k}")
  # ZeRO++ quantizes, so its reference is the same plan on one process with 8 devices.
  ex, state, _, _ = run(plans.zeropp(param_dtype="float32"), zerojax.make_mesh(2, 4), opt)
  single = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(ex.logical_params(state))}
  got = np.load(tmp_path / "zeropp.npz")
  for k in single:
    np.testing.assert_allclose(got[k], single[k], rtol=1e-5, atol=1e-6 * np.abs(single[k]).max(), err_msg=k)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_auto_is_one_decision_for_the_cluster(tmp_path):
  """`auto` on 2 processes whose own measurements disagree (their profiles, their compute): alone they
  would choose different plans; together both build and step process 0's choice from the same table
  (`planner.agree`), where deciding apart would compile different programs and hang."""
  import json
  port = free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  worker = os.path.join(os.path.dirname(__file__), "mp_auto_worker.py")
  procs = [subprocess.Popen([sys.executable, worker, str(i), str(port), str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  got = [json.loads((tmp_path / f"auto{i}.json").read_text()) for i in range(2)]
  assert got[0]["alone"] != got[1]["alone"]                  # the local measurements disagree
  assert got[0]["plan"] == got[1]["plan"] == got[0]["alone"]  # one plan: process 0's decision
  assert got[0]["rows"] == got[1]["rows"]                    # one table
  assert got[0]["loss"] == got[1]["loss"] and np.isfinite(got[0]["loss"])
  # the compute in the table is the slowest process's (process 1 measured 3x): DP's step, the only one
  # measured with auto.compute = 'uniform'
  assert len(got[0]["measured"]) == len(got[1]["measured"]) == 1
  slowest = max(got[0]["measured"][0], got[1]["measured"][0])
  assert all(r["compute_s"] == slowest for r in got[0]["rows"])
  # a profile that process 0 rejects stops both processes with its error (not process 1 profiling alone)
  assert got[0]["error"] == got[1]["error"] and "measured on 4 nodes x 2 gpus" in got[1]["error"]
  # trials: each is timed on every process and the slowest process's time decides, so both processes
  # choose the same plan even where process 1 alone measured its first candidate 100x slower
  assert got[0]["trial_plan"] == got[1]["trial_plan"] and got[0]["trial_rows"] == got[1]["trial_rows"]
  tried = {r["plan"]: r["trial_s"] for r in got[0]["trial_rows"] if "trial_s" in r}
  assert set(tried) == set(got[0]["trial_local"]) == set(got[1]["trial_local"]) and len(tried) >= 3
  assert all(tried[n] == max(got[0]["trial_local"][n], got[1]["trial_local"][n]) for n in tried)
  assert got[0]["trial_plan"] == min(tried, key=tried.get)
