"""How the commands that print one JSON line end: `cli.export` and `cli.evaluate`."""
from __future__ import annotations

import json
import sys
from typing import Callable


def run(prog: str, work: Callable, args) -> int:
  """Runs `work(args)` and prints its result as one JSON line (exit 0); a user's error (ValueError,
  OSError) prints `PROG: error: <its first line>` on stderr instead (exit 2)."""
  try:
    out = work(args)
  except (ValueError, OSError) as e:
    print(f"{prog}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
    return 2
  print(json.dumps(out), flush=True)
  return 0
