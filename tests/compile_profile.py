"""Where a pytest run's time goes to XLA: each test's compiles (count and seconds, by program name), read
from jax's public monitoring events. A pytest plugin and its report:

  python -m pytest -q -p tests.compile_profile      # each process writes $ZEROJAX_COMPILE_PROFILE/<pid>.json
  python -m tests.compile_profile [--top 25]        # the tests that compile longest, and the totals

`ZEROJAX_COMPILE_PROFILE` defaults to `$TMPDIR/zerojax-compile-profile`; clear it between runs. Programs named
after one jnp operation (`jit_add`, `jit_reshape`, ...) are eager calls: outside `jax.jit` every operation
compiles a program of its own for each shape, so a reference written eagerly can compile hundreds
(docs/testing.md, "Keeping the fast suite fast").
"""
from __future__ import annotations

import argparse
import atexit
import collections
import glob
import json
import os
import tempfile

EVENT = "/jax/core/compile/backend_compile_duration"
_by_test: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
_current = {"test": "(outside a test)"}


def directory() -> str:
  return os.environ.get("ZEROJAX_COMPILE_PROFILE", os.path.join(tempfile.gettempdir(), "zerojax-compile-profile"))


def _listener(event, duration, **kw):
  if event == EVENT:
    row = _by_test[_current["test"]][str(kw.get("fun_name", "?"))]
    row[0] += 1
    row[1] += duration


def pytest_configure(config):
  import jax
  jax.monitoring.register_event_duration_secs_listener(_listener)
  atexit.register(_write)


def pytest_runtest_setup(item):
  _current["test"] = item.nodeid


def _write():
  if not _by_test:
    return
  os.makedirs(directory(), exist_ok=True)
  with open(os.path.join(directory(), f"{os.getpid()}.json"), "w") as f:
    json.dump({t: dict(p) for t, p in _by_test.items()}, f)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--dir", default=directory())
  ap.add_argument("--top", type=int, default=25)
  args = ap.parse_args(argv)
  tests: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
  for path in glob.glob(os.path.join(args.dir, "*.json")):
    with open(path) as f:
      for test, programs in json.load(f).items():
        for name, (n, s) in programs.items():
          tests[test][name][0] += n
          tests[test][name][1] += s
  if not tests:
    raise SystemExit(f"compile_profile: no profile in {args.dir}; record one with "
                     "`python -m pytest -q -p tests.compile_profile` (ZEROJAX_COMPILE_PROFILE names the folder)")
  total = lambda progs: sum(s for _, s in progs.values())
  count = lambda progs: sum(n for n, _ in progs.values())
  print(f"{sum(count(p) for p in tests.values())} compiles, {sum(total(p) for p in tests.values()):.1f} s, "
        f"in {len(tests)} tests ({args.dir})")
  for test, progs in sorted(tests.items(), key=lambda kv: -total(kv[1]))[:args.top]:
    top = sorted(progs.items(), key=lambda kv: -kv[1][1])[:3]
    print(f"{total(progs):7.1f} s {count(progs):5d}  {test}  " + ", ".join(f"{k} x{n} {s:.1f}s" for k, (n, s) in top))


if __name__ == "__main__":
  main()
