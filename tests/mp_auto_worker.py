"""One process of a 2-process x 4-device CPU cluster (gloo) whose plan is `auto()`, with local
measurements forced to disagree: each process reads its own profile (process 0: 1 MB/s between nodes,
process 1: 1 TB/s) and process 1's compute measurements are 3x process 0's. Writes what it would have
chosen alone, the plan it built, the planner's table it got, the loss of one step of that plan, and
the error it got when process 0 alone rejects its profile file; then auto with one trial whose first
candidate process 1 times 100x slower: the plan each process chose after the trials and the table.

Usage: python tests/mp_auto_worker.py PROCESS_ID PORT OUT_DIR
"""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin  # noqa: E402
import numpy as np  # noqa: E402

import zerojax  # noqa: E402
from zerojax import planner  # noqa: E402
from zerojax.planner import compute as compute_lib, links, trial  # noqa: E402
from zerojax.train import trainer  # noqa: E402


def main(pid, port, out):
  zerojax.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
  prof = links.link_profile(2, 4, b_gpu=200e9, b_node=1e6 if pid == 0 else 1e12, source=f"process {pid}'s view")
  path = os.path.join(out, f"profile{pid}.json")
  with open(path, "w") as f:
    json.dump(prof, f)
  measured, measure = [], compute_lib.measure

  def slowed(*a, **k):  # process 1 measures a 3x slower compute; both record what they measured
    s, t = measure(*a, **k)
    measured.append(s * (3 if pid == 1 else 1))
    return measured[-1], t
  compute_lib.measure = slowed
  gin.parse_config(["model_config.d_model = 32", "model_config.num_layers = 2", "model_config.seq_len = 16"])
  built = trainer.build(planner.auto(profile=path, trials=0), accum_steps=1, batch_size=8)
  ex = built.executor
  alone = planner.choose(planner.rank(2, 4, planner.workload(ex), prof, techniques=True))["plan"]
  state, step = ex.init(jax.random.key(0)), ex.step_fn()
  b = np.random.default_rng(0).integers(0, 256, (1, 8, 17)).astype(np.int32)
  state, m = step(state, jax.make_array_from_callback(b.shape, ex.batch_sharding, lambda idx: b[idx]))
  # a profile file process 0 rejects (another mesh shape) while process 1's is fine: both stop alike
  bad = os.path.join(out, f"bad{pid}.json")
  with open(bad, "w") as f:
    json.dump(links.link_profile(4, 2, b_gpu=200e9, b_node=1e9, source="4 x 2") if pid == 0 else prof, f)
  try:
    planner.auto(profile=bad).load(ex.mesh)
    error = None
  except planner.PlanError as e:
    error = str(e)
  first = list(measured)  # the first build's measurements (the second build measures its own)
  # trials whose local times disagree: process 1 times the first candidate 100x slower than it runs
  local, time_step = {}, trial.time_step

  def timed(executor, batch, steps=3):
    s = time_step(executor, batch, steps) * (100 if pid == 1 and not local else 1)
    local[executor.plan.name] = s
    return s
  trial.time_step = timed
  tried = trainer.build(planner.auto(profile=path, trials=1, trial_steps=1), accum_steps=1, batch_size=8)
  with open(os.path.join(out, f"auto{pid}.json"), "w") as f:
    json.dump({"alone": alone, "measured": first, "plan": ex.plan.name, "error": error, "rows": built.planner_rows,
               "loss": float(m.loss), "trial_local": local, "trial_plan": tried.executor.plan.name,
               "trial_rows": tried.planner_rows}, f)
  print(f"process {pid} ran {ex.plan.name}", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
