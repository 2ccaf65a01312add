"""Launch-configuration tuning of the quantization kernels (`pallas_kernels.tuning`) with a fake timer:
every candidate runs once, the fastest is cached on disk and reused without timing again, a failing
candidate is skipped and recorded; off (or with no GPU here), the defaults of the device kind."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tuning
from pallas_kernels.tuning import Config


def _fake(times: dict, failing_build=(), failing_run=()):
  """(build, timer, log): `build(c)` compiles nothing and returns a thunk; `timer` returns times[c]."""
  log = {"built": [], "timed": []}

  def build(c):
    log["built"].append(c)
    if c in failing_build:
      raise RuntimeError(f"no kernel for {c.text}")

    def thunk():
      if c in failing_run:
        raise ValueError("out of resources: shared memory")
      return c
    thunk.config = c
    return thunk

  def timer(thunk):
    thunk()
    log["timed"].append(thunk.config)
    return times[thunk.config]

  return build, timer, log


SPACE = tuning.space(4)


def test_the_fastest_candidate_is_cached_and_reused(tmp_path):
  times = {c: 10.0 + i for i, c in enumerate(SPACE)}
  fastest = SPACE[5]
  times[fastest] = 1.0
  build, timer, log = _fake(times)
  path = tmp_path / "tuning.json"
  t = tuning.Tuner(path, timer)
  assert t.choose("k", SPACE, build) == fastest
  assert log["built"] == SPACE and log["timed"] == SPACE  # each candidate compiled and timed once
  entry = json.loads(path.read_text())["k"]
  assert entry["config"] == fastest.text and len(entry["ms"]) == len(SPACE) and entry["failed"] == {}
  assert entry["ms"][fastest.text] == 1.0
  assert t.choose("k", SPACE, build) == fastest  # reused: nothing built or timed again
  assert len(log["built"]) == len(SPACE) and len(log["timed"]) == len(SPACE)
  other = tuning.Tuner(path, timer)  # another process reads the file
  assert other.choose("k", SPACE, build) == fastest
  assert len(log["built"]) == len(SPACE)
  assert other.choose("k2", SPACE[:2], build) == SPACE[0]  # a new key is timed; the old one stays
  assert set(json.loads(path.read_text())) == {"k", "k2"}


def test_a_failing_candidate_is_skipped_and_recorded(tmp_path):
  times = {c: 10.0 + i for i, c in enumerate(SPACE)}
  times[SPACE[1]], times[SPACE[2]], times[SPACE[3]] = 0.5, 0.7, 2.0  # the two fastest fail
  build, timer, log = _fake(times, failing_build=(SPACE[1],), failing_run=(SPACE[2],))
  t = tuning.Tuner(tmp_path / "t.json", timer)
  assert t.choose("k", SPACE, build) == SPACE[3]
  entry = json.loads((tmp_path / "t.json").read_text())["k"]
  assert entry["failed"] == {SPACE[1].text: f"RuntimeError: no kernel for {SPACE[1].text}",
                             SPACE[2].text: "ValueError: out of resources: shared memory"}
  assert SPACE[1].text not in entry["ms"] and SPACE[2].text not in entry["ms"]
  assert len(entry["ms"]) == len(SPACE) - 2


def test_every_candidate_failing_falls_back_to_the_first_and_records_it(tmp_path):
  build, timer, _ = _fake({}, failing_build=tuple(SPACE))
  t = tuning.Tuner(tmp_path / "t.json", timer)
  assert t.choose("k", SPACE, build) == SPACE[0] == Config()
  entry = json.loads((tmp_path / "t.json").read_text())["k"]
  assert entry["timed"] is False and len(entry["failed"]) == len(SPACE)


def test_an_unreadable_cache_is_timed_again(tmp_path):
  path = tmp_path / "t.json"
  path.write_text("{not json")
  build, timer, log = _fake({c: 1.0 for c in SPACE[:2]})
  assert tuning.Tuner(path, timer).choose("k", SPACE[:2], build) == SPACE[0]
  assert len(log["timed"]) == 2 and "k" in json.loads(path.read_text())


def test_the_space():
  for slabs in (1, 4):
    space = tuning.space(slabs)
    assert space[0] == Config() and len(set(space)) == len(space)
    assert all(4 <= c.tile // (32 * c.num_warps) <= 64 for c in space)
    assert {c.num_stages for c in space} == ({1} if slabs == 1 else {1, 2})
  assert 8 <= len(tuning.space(1)) <= 16


@pytest.mark.parametrize("m,row,tile,want", [(1024, 256, 4096, 16), (12, 256, 4096, 4), (7, 256, 4096, 1),
                                             (1024, 1024, 4096, 4), (1024, 8192, 4096, 1)])
def test_rows_per_program(m, row, tile, want):
  assert Config(tile=tile).rows(m, row) == want


def test_the_setting(monkeypatch):
  monkeypatch.delenv(tuning.ENV, raising=False)
  assert tuning.enabled() is False  # default: on only where jax's default backend is a GPU
  monkeypatch.setenv(tuning.ENV, "1")
  assert tuning.enabled() is True
  monkeypatch.setenv(tuning.ENV, "0")
  assert tuning.enabled() is False
  monkeypatch.setenv(tuning.ENV, "yes")
  with pytest.raises(ValueError, match="ZEROJAX_KERNEL_TUNING='yes'; expected 1"):
    tuning.enabled()
  monkeypatch.setenv(tuning.CACHE_ENV, "/tmp/x/t.json")
  assert str(tuning.cache_path()) == "/tmp/x/t.json"


def test_off_or_without_a_gpu_the_defaults_of_the_device_kind(monkeypatch, tmp_path):
  monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "t.json"))
  make = lambda c: (_ for _ in ()).throw(AssertionError("timed"))  # noqa: E731 - must not run
  monkeypatch.setenv(tuning.ENV, "1")  # on, but no GPU here to time
  assert tuning.config("pallas", "quantize", elements=1 << 20, block=256, dtype=jnp.float32, make=make) == Config()
  monkeypatch.setattr(tuning, "gpu_here", lambda: True)
  monkeypatch.setattr(tuning, "device_kind", lambda: "Some GPU")
  monkeypatch.setitem(tuning.DEFAULTS, "Some GPU", Config(8192, 8, 1))
  monkeypatch.setenv(tuning.ENV, "0")
  assert tuning.config("pallas", "quantize", elements=1 << 20, block=256, dtype=jnp.float32, make=make) == \
      Config(8192, 8, 1)
  assert not (tmp_path / "t.json").exists()


def test_candidates_run_on_real_arrays_inside_a_trace(monkeypatch, tmp_path):
  """Where a kernel is traced (inside jax.jit), the candidates are compiled and run then, on device
  arrays of the op's shapes (not staged into the program being traced); the key names the device kind,
  backend, op, shape class and dtype."""
  monkeypatch.setenv(tuning.ENV, "1")
  monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "t.json"))
  monkeypatch.setattr(tuning, "gpu_here", lambda: True)
  ran = []

  def make(c):
    def kernel(x):
      ran.append(c)
      return x * c.tile
    return kernel

  @jax.jit
  def f(x):
    c = tuning.config("pallas", "quantize/int8", elements=x.size, block=64, dtype=x.dtype, make=make, avals=[x])
    return x * c.tile

  x = jnp.arange(4 * 64, dtype=jnp.float32).reshape(4, 64)
  y = f(x)
  entries = json.loads((tmp_path / "t.json").read_text())
  [(key, entry)] = entries.items()
  assert key == f"{jax.devices()[0].device_kind}|pallas|quantize/int8|block=64,slabs=1,elements~2^16|float32"
  assert entry["timed"] and set(entry["ms"]) == {c.text for c in tuning.space(1)}, entry
  assert len(ran) == len(tuning.space(1))  # each candidate traced once (compiled once, run 1 + REPS times)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * tuning.Config.parse(entry["config"]).tile)
  assert tuning.CHOSEN[-1] == (key, entry["config"], "tuned")
  f(jnp.ones((8, 64), jnp.float32))  # a new trace of the same shape class reads the cache
  assert tuning.CHOSEN[-1] == (key, entry["config"], "cached") and len(ran) == len(tuning.space(1))


def test_shape_classes():
  assert tuning.shape_class(1 << 16, 256) == "block=256,slabs=1,elements~2^16"
  assert tuning.shape_class(1 << 20, 256, 4) == "block=256,slabs=4,elements~2^20"
  assert tuning.shape_class(1 << 28, 256) == tuning.shape_class(1 << 24, 256) == "block=256,slabs=1,elements~2^24"


def test_the_kits_benchmark_reports_the_best_backend_equal_to_xla_and_its_configuration():
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_kernels.py"
  spec = importlib.util.spec_from_file_location("bench_kernels", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  row = lambda backend, gbps, mism, **kw: dict(op="quantize", bits=8, elements=1 << 28, backend=backend,  # noqa: E731
                                               gbps=gbps, mismatched_bytes_vs_xla=mism, **kw)
  cfg = {"H100|pallas|quantize/int8|block=256,slabs=1,elements~2^24|bfloat16": {"config": "tile=8192,warps=8,stages=1",
                                                                                 "source": "tuned"}}
  rows = [row("xla", 1000.0, None), row("pallas", 2700.0, [0, 0], launch_config=cfg),
          row("triton", 2900.0, [3, 0]),  # faster but not xla's bits: never the best
          dict(op="quantize", bits=8, elements=1 << 28, backend="mosaic", error="RuntimeError: refused")]
  [best] = bench.best_per_op(rows, 2345.0, 3009.0)
  assert best["backend"] == "pallas" and best["gbps"] == 2700.0
  assert best["ratio_to_reference_copy"] == pytest.approx(2700 / 3009, rel=1e-2)
  assert best["ratio_to_measured_copy"] == pytest.approx(2700 / 2345, rel=1e-2)
  assert best["launch_config"] == ["tile=8192,warps=8,stages=1"] and best["others"] == {"xla": 1000.0}
