"""What the benchmarks share: timing in interleaved repetitions, the spread of repeated figures, an error as
a report records it, the repository's git state, a section of benchmarks/RESULTS.md written again, and a
result printed and saved. (The
bytes of a compiled program are `zerojax.gpu_aot.memory`.)"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spread(values) -> dict:
  """Median, min and max of repeated figures (timings, ratios)."""
  return {"median": statistics.median(values), "min": min(values), "max": max(values)}


ORDERS = ("alternate", "rotate", "fixed")


def interleaved(fns: dict, reps: int, steps: int = 1, warmup: int = 0, order: str = "alternate",
                before=None, after=None, on_error=None) -> dict[str, list[float]]:
  """Seconds of each of `fns` per repetition, timed in interleaved repetitions, so that a slow phase of a
  shared machine falls on every one of them alike.

  A repetition runs every name in turn: `steps` calls fn(0) .. fn(steps - 1), each timed alone with
  `time.perf_counter` (fn returns when its work is done: it blocks on its result, `jax.block_until_ready`
  or a read of it); the name's figure for the repetition is the median of those calls (with steps=1 the
  call's own time). The order of the names: "alternate", as given on even repetitions and reversed on odd
  ones; "rotate", starting one name further each repetition; "fixed", always as given. `warmup` untimed
  repetitions come first, in the order of the first timed one. Untimed hooks: `before(r)` runs before
  repetition r (warm-up repetitions counted, from 0), `after(name, i, out)` after each call with what the
  call returned. A fn that raises calls `on_error(name, error)` and is left out of the later repetitions,
  its figures so far kept; without `on_error` the error propagates.

  Returns {name: [figure per timed repetition]}; `spread` of a list is its median, min and max."""
  if order not in ORDERS:
    raise ValueError(f"order {order!r}; expected one of {ORDERS}")
  names, failed = list(fns), set()
  times = {name: [] for name in names}
  for r in range(-warmup, reps):
    if before is not None:
      before(r + warmup)
    k = max(r, 0)  # a warm-up repetition takes the first timed one's order
    if order == "rotate" and names:
      turn = names[k % len(names):] + names[:k % len(names)]
    elif order == "alternate" and k % 2:
      turn = names[::-1]
    else:
      turn = names
    for name in turn:
      if name in failed:
        continue
      fn, ts = fns[name], []
      try:
        for i in range(steps):
          t0 = time.perf_counter()
          out = fn(i)
          ts.append(time.perf_counter() - t0)
          if after is not None:
            after(name, i, out)
      except Exception as e:  # noqa: BLE001 - the caller's on_error records it
        if on_error is None:
          raise
        on_error(name, e)
        failed.add(name)
        continue
      if r >= 0:
        times[name].append(statistics.median(ts))
  return times


def git(*args, cwd: str = ROOT) -> str | None:
  """`git ARGS` in the repository (stdout stripped), or None where git or the repository is missing."""
  try:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None


def error_text(e: BaseException, limit: int = 600) -> str:
  """An exception as one entry of a report: its type and the first `limit` characters of its message."""
  return f"{type(e).__name__}: {str(e)[:limit]}"


def write_section(path: str, text: str, heading: str) -> None:
  """Appends `text` to the markdown file `path` (created if missing) after dropping its old section
  `heading`: that whole line up to the next `## ` heading."""
  old = open(path).read() if os.path.exists(path) else ""
  if heading + "\n" in old:  # the whole heading line: "(batch 8)" sections are not the default's
    start = old.index(heading + "\n")
    nxt = old.find("\n## ", start + len(heading))
    old = old[:start] + old[nxt + 1:] if nxt >= 0 else old[:start]
  with open(path, "w") as f:
    f.write(old.rstrip() + "\n\n" + text)


def print_and_save(result: dict, summary, out: str | None) -> None:
  """Prints `result` as JSON and `summary(result)` on stderr, and writes the JSON to `out` where one is named."""
  text = json.dumps(result, indent=1)
  print(text, flush=True)
  print(summary(result), file=sys.stderr, flush=True)
  if out:
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
