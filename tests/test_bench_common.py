"""benchmarks/common.py's `interleaved`, the timing loop the in-process benchmarks share: the order of the
calls in each repetition, warm-up repetitions untimed, the median of a repetition's calls, the untimed hooks,
and a name that raises left out of the later repetitions."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def common(monkeypatch):
  spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  clock = iter(range(0, 10 ** 6))  # a clock that ticks once per reading: every call takes 1 s
  monkeypatch.setattr(mod.time, "perf_counter", lambda: next(clock), raising=True)
  return mod


def recorder(log, names):
  """fns that log (name, i) and return a name for it."""
  def make(name):
    def fn(i):
      log.append((name, i))
      return f"{name}{i}"
    return fn
  return {n: make(n) for n in names}


@pytest.mark.parametrize("order,expect", [
    ("alternate", ["a", "b", "c", "c", "b", "a", "a", "b", "c"]),
    ("rotate", ["a", "b", "c", "b", "c", "a", "c", "a", "b"]),
    ("fixed", ["a", "b", "c"] * 3),
])
def test_the_order_of_each_repetition(common, order, expect):
  log = []
  times = common.interleaved(recorder(log, "abc"), 3, order=order)
  assert [n for n, _ in log] == expect
  assert times == {n: [1, 1, 1] for n in "abc"}


def test_warmup_is_untimed_and_takes_the_first_order_and_steps_give_one_median(common):
  log, before, after = [], [], []
  times = common.interleaved(recorder(log, "ab"), 2, steps=3, warmup=1, before=before.append,
                             after=lambda n, i, out: after.append(out))
  assert log == [(n, i) for n in "ab" for i in range(3)] * 2 + [(n, i) for n in "ba" for i in range(3)]
  assert before == [0, 1, 2] and after == [f"{n}{i}" for n, i in log]
  assert times == {"a": [1, 1], "b": [1, 1]}


def test_a_name_that_raises_is_recorded_and_left_out(common):
  log, errors = [], {}
  fns = recorder(log, "ab")

  def broken(i):
    log.append(("b", i))
    if len([x for x in log if x[0] == "b"]) == 2:
      raise RuntimeError("no")
  fns["b"] = broken
  times = common.interleaved(fns, 3, on_error=lambda n, e: errors.setdefault(n, str(e)))
  assert errors == {"b": "no"} and times == {"a": [1, 1, 1], "b": [1]}
  assert [n for n, _ in log] == ["a", "b", "b", "a", "a"]
  with pytest.raises(ZeroDivisionError):  # without on_error the error is the caller's
    common.interleaved({"c": lambda i: 1 / 0}, 1)
  with pytest.raises(ValueError):
    common.interleaved(fns, 1, order="random")


def test_every_benchmark_script_has_an_entry_in_docs_benchmarks():
  """docs/benchmarks.md names every script of benchmarks/ and benchmarks/gpu/ in backquotes."""
  page = (ROOT / "docs" / "benchmarks.md").read_text()
  scripts = sorted(p.relative_to(ROOT).as_posix() for d in ("benchmarks", "benchmarks/gpu")
                   for ext in ("py", "sh") for p in (ROOT / d).glob(f"*.{ext}"))
  assert len(scripts) >= 30
  assert [s for s in scripts if f"`{s}`" not in page] == []
