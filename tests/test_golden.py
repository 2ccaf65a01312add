"""Golden values of every shipped config: losses, gradient norms, the train state and the compiled
collectives after three steps, compared bitwise with values stored in tests/golden/.

Each config of configs/ is parsed as `train.py` parses it, with a tiny model and three steps of two
micro-batches (`OVERRIDES`), and the executor is built by the trainer's `build` from the arguments gin
gives `train` (`zerojax.cli.account.gin_executor`). Three steps reach every program a config runs: with Radius the warm-up is one step and
the window two, so the steps run the "dense", "select" and "sparse" programs.

Stored per config (tests/golden/<config>.json):
  * `steps`: per step the program run, the loss and the gradient norm (float32 as `float.hex`, and the
    value for a readable diff), and whether the step was finite;
  * `params`: per logical parameter leaf a sha256 of its float32 bytes, and its sum;
  * `state`: a sha256 of every other field of the train state (the optimizer state holds Adam's first
    and second moments, so it fixes each step's gradient bitwise);
  * `collectives`: per program the sorted list of its collectives (op, dtype, shapes, replica groups,
    executions per step), read from the optimized HLO by `zerojax.analysis`.

Re-record after a change that is meant to change numbers: `python -m tests.test_golden --record`
(optionally followed by config names), then review the diff of tests/golden/.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

if __name__ == "__main__":  # the same 8 CPU devices as the test session (tests/conftest.py)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gin  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.golden_configs import CONFIGS, GOLDEN, build  # noqa: E402

FAST = ()  # a regression guard of the full suite: every config is marked slow


def digest(tree) -> str:
  h = hashlib.sha256()
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    x = np.asarray(jax.device_get(x))
    h.update(f"{jax.tree_util.keystr(path)}:{x.dtype}:{x.shape};".encode())
    h.update(np.ascontiguousarray(x).tobytes())
  return h.hexdigest()


def f32(x) -> dict:
  v = float(np.float32(x))
  return {"hex": v.hex(), "value": v}


def fingerprint(hlo_text: str, mesh) -> list[str]:
  from zerojax.analysis.collectives import collectives_from_hlo
  return sorted(f"{c.op} {c.dtype} {list(map(list, c.operand_shapes))}->{list(map(list, c.result_shapes))} "
                f"groups={[list(g) for g in c.replica_groups]} x{c.count}"
                for c in collectives_from_hlo(hlo_text, mesh))


def run(config: str) -> dict:
  """Three steps of `config` from `train`'s initial state on fixed random tokens; the golden record."""
  ex, args = build(config)
  seq = gin.query_parameter("model_config.seq_len")
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 256, (args["accum_steps"], args["batch_size"], seq + 1)).astype(np.int32)
             for _ in range(args["steps"])]
  state = ex.init(jax.random.key(args["seed"]))
  programs, steps = {}, []
  for b in batches:
    phase, b = ex.phase(state), ex.shard_batch(b)
    if phase not in programs:  # compile once, run the compiled program and read its collectives
      programs[phase] = ex.step_fn().lower(state, b, phase=phase).compile()
    state, m = programs[phase](state, b)
    steps.append({"program": phase, "loss": f32(m.loss), "grad_norm": f32(m.grad_norm), "finite": bool(m.finite)})
  params = jax.tree_util.tree_leaves_with_path(ex.logical_params(state))
  rest = {f.name: getattr(state, f.name) for f in state.__dataclass_fields__.values() if f.name != "params"}
  return {
      "config": config, "plan": ex.plan.name, "steps": steps,
      "params": {jax.tree_util.keystr(p): {"sha256": digest(x), "sum": float(np.sum(np.asarray(x, np.float64)))}
                 for p, x in params},
      "state": {k: digest(v) for k, v in rest.items()},
      "collectives": {ph: fingerprint(c.as_text(), ex.mesh) for ph, c in sorted(programs.items())},
  }


def stored(config: str) -> dict:
  path = GOLDEN / f"{config}.json"
  if not path.exists():
    pytest.fail(f"no golden values for {config}: record them with `python -m tests.test_golden --record {config}`")
  return json.loads(path.read_text())


@pytest.mark.parametrize("config", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS])
def test_config_matches_its_golden_values_bitwise(config):
  try:
    got = run(config)
  finally:
    gin.clear_config()
  want = stored(config)
  assert got["plan"] == want["plan"]
  assert got["steps"] == want["steps"]
  assert got["collectives"] == want["collectives"]
  assert got["params"] == want["params"]
  assert got["state"] == want["state"]


def test_every_shipped_config_has_golden_values():
  assert sorted(p.stem for p in GOLDEN.glob("*.json") if p.stem in CONFIGS) == CONFIGS
  assert set(FAST) <= set(CONFIGS)


def main(argv: list[str]) -> None:
  if not argv or argv[0] != "--record":
    raise SystemExit("usage: python -m tests.test_golden --record [config ...]")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  for config in argv[1:] or CONFIGS:
    record = run(config)
    gin.clear_config()
    (GOLDEN / f"{config}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"recorded {config}: losses {[s['loss']['value'] for s in record['steps']]}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
