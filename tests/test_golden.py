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
    executions per step), read from the optimized HLO by `zerojax.analysis`;
  * `env`: where the values were recorded (jax and jaxlib versions, the CPU's vector instruction sets);
    never compared, named when a comparison fails. Files recorded before it have none. `quantized`:
    whether the plan quantizes weights or gradients (which bound `REASSOCIATION` applies), not compared.

Two call orders: one call per layer (the CPU's default) and `PREFETCH` (the GPU's, or `prefetch=True`). The
prefetch order runs the same collectives on the same values in another order (the golden model's two
layers are the first and last layer, which `PREFETCH` peels out of its loops), and its numbers are not
bitwise those of the per-layer order (measured on 2 x 4 CPU devices: the same losses, gradient norms one
float32 ulp apart, 14 of 17 parameter leaves different in the last bits after three AdamW steps), so the
configs of `PREFETCH` store their prefetch values apart (tests/golden/prefetch/<config>.json), compared
bitwise, and the prefetch run's losses and gradient norms are also compared with the per-layer golden
values within float reassociation (`REASSOCIATION`).

Bitwise golden values hold for one environment: XLA's CPU code (its vectorized reductions) changes with the
jax/XLA version and with the CPU (the same jax on one machine gives other last bits under
`--xla_cpu_max_isa=SSE4_2` than with AVX2; values recorded on one 2-core machine differed in the last bits of
the first gradient norm on another, for every config). So the comparison is bitwise where the suite runs
in the environment the values were recorded in (`env`: jax, jaxlib, the CPU model and its vector
instruction sets, and LLVM's optimization level where `XLA_FLAGS` sets it, as the fast suite does), and elsewhere it says so and compares what does not depend on the CPU exactly (the
plan, the programs run, their collectives, finiteness) and the losses and gradient norms within
`MACHINES`. Re-record where the suite runs.

Re-record after a change that is meant to change numbers: `python -m tests.test_golden --record`
(optionally `--order one-call` or `--order prefetch`, default both, then config names), then review the
diff of tests/golden/.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys

if __name__ == "__main__":  # the same 8 CPU devices as the test session (tests/conftest.py)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gin  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.golden_configs import CONFIGS, GOLDEN, PREFETCH, build  # noqa: E402
from zerojax.state.train_state import STATEFUL  # noqa: E402

# The fast suite runs ZeRO-3 in the prefetch order, which also checks its losses against the per-layer
# golden values (`REASSOCIATION`); every other config and order is a regression guard of the full suite.
FAST = {"one-call": (), "prefetch": ()}  # bitwise only where the full suite compiles as recorded (tests/conftest.py)
ORDERS = {"one-call": False, "prefetch": True}
# The prefetch order's losses and gradient norms against the per-layer golden values: float32
# reassociation (a gradient norm sums ~10^4 squares in another order; measured: losses equal, gradient
# norms at most 1 ulp, 1.1e-7, apart) and, after AdamW steps, a near-zero gradient element whose last bits
# moved can get another normalized update (lr-sized), which moves the next losses far less than this.
# Quantized plans: a value moved by reassociation can land on another quantization step (as in
# tests/test_prefetch.py, 1e-3 for the per-layer gradient), so the bound there is that step's.
REASSOCIATION = {"exact": 1e-5, "quantized": 1e-3}
# Values recorded in another environment (another CPU's vector width sums in another order): the same
# float reassociation as above, over three steps (measured between an AVX2 and the recording machine:
# gradient norms 1-2 ulp apart at the first step).
MACHINES = REASSOCIATION


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


def environment() -> dict:
  """What the bitwise values depend on besides the code: jax, jaxlib, and the CPU's vector instruction sets."""
  import jaxlib
  try:
    with open("/proc/cpuinfo") as f:
      info = dict(l.split(":", 1) for l in f.read().split("\n\n")[0].splitlines() if ":" in l)
  except OSError:
    info = {}
  info = {k.strip(): v.strip() for k, v in info.items()}
  flags = set(info.get("flags", "").split())
  isa = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
         if f in flags]
  model = info.get("model name", "")
  env = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "machine": platform.machine(),
         "cpu": model or platform.processor(), "cpu_isa": isa}
  # LLVM's level changes the bits (the fast suite lowers it, tests/conftest.py); named only when set
  level = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optimization_level")]
  return {**env, "xla_backend_optimization_level": level[-1].split("=")[1]} if level else env


def run(config: str, prefetch: bool = False) -> dict:
  """Three steps of `config` from `train`'s initial state on fixed random tokens, in the per-layer call
  order or (`prefetch`) the prefetch order; the golden record."""
  ex, args = build(config, prefetch)
  assert ex.plan.schedule.prefetch == prefetch
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
    # DiLoCo's compiled step gives one value per replica (node): their float32 mean, all finite
    loss, norm = (np.mean(np.asarray(x), dtype=np.float32) for x in (m.loss, m.grad_norm))
    steps.append({"program": phase, "loss": f32(loss), "grad_norm": f32(norm), "finite": bool(np.all(m.finite))})
  assert not ex.prefetch_fallbacks()  # the GPT's units run the order asked for
  params = jax.tree_util.tree_leaves_with_path(ex.logical_params(state))
  rest = {f.name: getattr(state, f.name) for f in state.__dataclass_fields__.values()
          if f.name not in ("params", "stateful")}
  rest.update({kind.name: state.stateful.get(kind.name) for kind in STATEFUL})  # each component's, by its name
  return {
      "config": config, "plan": ex.plan.name, "steps": steps,
      "params": {jax.tree_util.keystr(p): {"sha256": digest(x), "sum": float(np.sum(np.asarray(x, np.float64)))}
                 for p, x in params},
      "state": {k: digest(v) for k, v in rest.items()},
      "collectives": {ph: fingerprint(c.as_text(), ex.mesh) for ph, c in sorted(programs.items())},
      "env": environment(),
      "quantized": bool(ex.plan.gather.quantized or ex.plan.reduction.grad_bits),  # for the bound, not compared
  }


def path(config: str, order: str):
  return GOLDEN / f"{config}.json" if order == "one-call" else GOLDEN / order / f"{config}.json"


def stored(config: str, order: str = "one-call") -> dict:
  if not path(config, order).exists():
    pytest.fail(f"no golden values for {config} in the {order} order: record them with "
                f"`python -m tests.test_golden --record --order {order} {config}`")
  return json.loads(path(config, order).read_text())


def run_order(config: str, order: str) -> dict:
  try:
    return run(config, ORDERS[order])
  finally:
    gin.clear_config()


def assert_bitwise(got: dict, want: dict, config: str, order: str) -> None:
  """Bitwise in the recording environment; elsewhere exact where the CPU cannot matter and the losses and
  gradient norms within `MACHINES` (module docstring)."""
  where = (f"{config} ({order} order): recorded in {want.get('env', 'an environment not stored')}, run in "
           f"{got['env']}")
  if got["env"] == want.get("env"):
    for key in ("plan", "steps", "collectives", "params", "state"):
      assert got[key] == want[key], f"{key} differ: {where}"
    return
  print(f"golden values of {where}: another environment, compared within {MACHINES} (module docstring)")
  for key in ("plan", "collectives"):
    assert got[key] == want[key], f"{key} differ: {where}"
  assert [(s["program"], s["finite"]) for s in got["steps"]] == [(s["program"], s["finite"]) for s in want["steps"]]
  bound = MACHINES["quantized" if got["quantized"] else "exact"]
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([s[key]["value"] for s in got["steps"]], [s[key]["value"] for s in want["steps"]],
                               rtol=bound, err_msg=f"{key}: {where}")


def cases(order: str, configs: list[str]) -> list:
  return [c if c in FAST[order] else pytest.param(c, marks=pytest.mark.slow) for c in configs]


@pytest.mark.parametrize("config", cases("one-call", CONFIGS))
def test_config_matches_its_golden_values_bitwise(config):
  assert_bitwise(run_order(config, "one-call"), stored(config), config, "one-call")


@pytest.mark.parametrize("config", cases("prefetch", PREFETCH))
def test_prefetch_order_matches_its_golden_values(config):
  """Bitwise against the prefetch order's own values; losses and gradient norms against the per-layer
  order's within float reassociation (`REASSOCIATION`)."""
  got = run_order(config, "prefetch")
  per_layer = stored(config)
  bound = REASSOCIATION["quantized" if got["quantized"] else "exact"]
  assert [s["program"] for s in got["steps"]] == [s["program"] for s in per_layer["steps"]]
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([s[key]["value"] for s in got["steps"]],
                               [s[key]["value"] for s in per_layer["steps"]], rtol=bound, err_msg=key)
  assert_bitwise(got, stored(config, "prefetch"), config, "prefetch")


def test_every_shipped_config_has_golden_values():
  """Every config's per-layer values; prefetch values only of `PREFETCH` configs (a missing one fails its
  own test, with the command that records it)."""
  assert sorted(p.stem for p in GOLDEN.glob("*.json") if p.stem in CONFIGS) == CONFIGS
  assert set(p.stem for p in (GOLDEN / "prefetch").glob("*.json")) <= set(PREFETCH)
  assert set(FAST["one-call"]) <= set(CONFIGS) and set(FAST["prefetch"]) <= set(PREFETCH)


def main(argv: list[str]) -> None:
  usage = "usage: python -m tests.test_golden --record [--order one-call|prefetch] [config ...]"
  if not argv or argv[0] != "--record":
    raise SystemExit(usage)
  argv = argv[1:]
  orders = list(ORDERS)
  if argv[:1] == ["--order"]:
    if len(argv) < 2 or argv[1] not in ORDERS:
      raise SystemExit(usage)
    orders, argv = [argv[1]], argv[2:]
  jax.config.update("jax_numpy_rank_promotion", "raise")
  for config in argv or CONFIGS:
    for order in orders:
      if order == "prefetch" and config not in PREFETCH:
        continue
      record = run_order(config, order)
      path(config, order).parent.mkdir(exist_ok=True)
      path(config, order).write_text(json.dumps(record, indent=1) + "\n")
      print(f"recorded {config} ({order}): losses {[s['loss']['value'] for s in record['steps']]}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
