"""Fingerprints of the optimized step programs of every shipped config: a re-design that must keep every
number compiles the same programs.

    python benchmarks/hlo_fingerprint.py --out before.json        # at the old commit
    python benchmarks/hlo_fingerprint.py --out after.json         # at the new one
    python benchmarks/hlo_fingerprint.py --compare before.json after.json
    python benchmarks/hlo_fingerprint.py --compare_dumps BEFORE_DIR AFTER_DIR
        # the compile-only H100 programs that `bench_gpu_compile.py --dump_hlo DIR` wrote at each commit

Each config is built as tests/test_golden.py builds it (`tests/golden_configs.py`: tiny model, 2 x 4 CPU
devices); every program it runs (one per phase) is compiled and its optimized HLO reduced to its
instructions and computations, without metadata and source locations, each name renamed in order of
first appearance, then hashed. Prints JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


NAME = re.compile(r"%?[A-Za-z_][\w\-]*(?:\.\d+)+")  # an instruction or computation name: `%fusion.3`, `param_0.2168`


def normalize(text: str) -> str:
  """The instructions and computations of an HLO text, without metadata and source locations, every
  name renamed in order of first appearance (so which instruction feeds which is kept, and constants'
  values are untouched)."""
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  text = re.sub(r", stack_frame_id=\d+", "", text)
  lines = [l for l in text.splitlines() if (" = " in l or l.rstrip().endswith("{") or l.strip() == "}")
           and not l.startswith("HloModule")]
  names: dict[str, str] = {}
  rename = lambda m: names.setdefault(m.group(0).lstrip("%"), f"n{len(names)}")
  return NAME.sub(rename, "\n".join(lines))


def fingerprints() -> dict:
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, ROOT)
  import gin
  import jax
  import numpy as np
  from tests import golden_configs
  out = {}
  for config in golden_configs.CONFIGS:
    ex, args = golden_configs.build(config)
    seq = gin.query_parameter("model_config.seq_len")
    batch = ex.shard_batch(np.zeros((args["accum_steps"], args["batch_size"], seq + 1), np.int32))
    state = ex.init(jax.random.key(0))
    phases = ["dense"] + list(next((c.phases for c in ex.stateful.values() if getattr(c, "phases", ())), ()))
    out[config] = {}
    for phase in phases:
      out[config][phase] = fingerprint(ex.step_fn().lower(state, batch, phase=phase).compile().as_text())
    gin.clear_config()
    print(config, {p: v["sha256"][:12] for p, v in out[config].items()}, file=sys.stderr, flush=True)
  return out


def fingerprint(text: str) -> dict:
  """A program's hash and instruction lines, after `normalize`."""
  text = normalize(text)
  return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "lines": len(text.splitlines())}


def compare(a: dict, b: dict) -> dict:
  programs = [(c, p) for c in sorted(set(a) | set(b)) for p in sorted(set(a.get(c, {})) | set(b.get(c, {})))]
  differ = [f"{c}/{p}" for c, p in programs if a.get(c, {}).get(p) != b.get(c, {}).get(p)]
  return {"programs": len(programs), "identical": len(programs) - len(differ), "differ": differ,
          "lines": sum(v["lines"] for c in a.values() for v in c.values())}


KERNEL_IR = re.compile(r'ir = "((?:[^"\\]|\\.)*)"')


def _unescape(s: str) -> bytes:
  """An HLO text's string escapes (`\\XX` hex bytes, `\\\\`, `\\"`, `\\n`, `\\t`) back to bytes."""
  out, i = bytearray(), 0
  while i < len(s):
    if s[i] != "\\":
      out += s[i].encode()
      i += 1
    elif s[i + 1] in '\\"nt':
      out.append({"n": 10, "t": 9}.get(s[i + 1], ord(s[i + 1])))
      i += 2
    else:
      out.append(int(s[i + 1:i + 3], 16))
      i += 3
  return bytes(out)


def _without_locations(asm: str) -> str:
  """MLIR assembly with every `loc(...)` (nested call sites included) cut to `loc(?)`, every source path to `?.py`."""
  out, i = [], 0
  while (j := asm.find("loc(", i)) >= 0:
    out.append(asm[i:j] + "loc(?)")
    depth, k, quoted = 0, j + 3, False
    while True:
      c = asm[k]
      if c == '"' and asm[k - 1] != "\\":
        quoted = not quoted
      elif not quoted and c in "()":
        depth += 1 if c == "(" else -1
        if depth == 0:
          break
      k += 1
    i = k + 1
  return re.sub(r'"[^"]*\.py"', '"?.py"', "".join(out) + asm[i:])  # and bare source paths


def without_kernel_locations(text: str) -> tuple[str, int]:
  """Each Triton kernel's serialized MLIR (a Pallas kernel compiled for GPUs) replaced by a hash of its
  operations without source locations: the bytecode carries the file paths and line numbers of the code
  that traced it, which move with any edit or checkout path while the kernel stays the same. Returns the
  text and how many kernels did not read back without Triton's dialects (those keep only their name,
  grid and launch settings)."""
  from jaxlib.mlir import ir
  unread = []

  def kernel(m):
    try:
      with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        asm = ir.Module.parse(_unescape(m.group(1))).operation.get_asm(enable_debug_info=False)
    except ir.MLIRError:  # some kernels' bytecode does not read back without Triton's dialects
      unread.append(m)
      return 'ir = "unread"'
    return 'ir = "sha256:' + hashlib.sha256(_without_locations(asm).encode()).hexdigest() + '"'
  return KERNEL_IR.sub(kernel, text), len(unread)


def of_dumps(folder: str) -> tuple[dict, int]:
  """Fingerprints of the `<config>.hlo` programs in a folder (`bench_gpu_compile.py --dump_hlo`), each
  Triton kernel compared without its source locations, and how many kernels did not read back."""
  out, unread = {}, 0
  for name in sorted(os.listdir(folder)):
    if name.endswith(".hlo"):
      with open(os.path.join(folder, name)) as f:
        text, n = without_kernel_locations(f.read())
      out[name[:-len(".hlo")]], unread = {"program": fingerprint(text)}, unread + n
  return out, unread


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", help="write the fingerprints here")
  ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprint files")
  ap.add_argument("--compare_dumps", nargs=2, metavar=("BEFORE_DIR", "AFTER_DIR"),
                  help="compare two folders of dumped programs (bench_gpu_compile.py --dump_hlo)")
  args = ap.parse_args()
  if args.compare_dumps:
    missing = [d for d in args.compare_dumps if not os.path.isdir(d)]
    if missing:
      raise SystemExit(f"hlo_fingerprint: no folder {missing[0]}; give the DIR of bench_gpu_compile.py --dump_hlo DIR")
    (a, unread_a), (b, unread_b) = (of_dumps(d) for d in args.compare_dumps)
    print(json.dumps({**compare(a, b), "kernels_compared_by_launch_settings_only": unread_a + unread_b}, indent=1))
    return
  if args.compare:
    a, b = (json.load(open(p)) for p in args.compare)
    print(json.dumps(compare(a, b), indent=1))
    return
  out = fingerprints()
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
