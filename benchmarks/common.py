"""What the benchmarks share: the spread of repeated figures, an error as a report records it, a section
of benchmarks/RESULTS.md written again, and a result printed and saved. (The bytes of a compiled program
are `zerojax.gpu_aot.memory`.)"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys


def spread(values) -> dict:
  """Median, min and max of repeated figures (timings, ratios)."""
  return {"median": statistics.median(values), "min": min(values), "max": max(values)}


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
