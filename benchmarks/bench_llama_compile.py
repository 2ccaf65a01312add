"""The Llama family's shapes compiled for compile-only H100s: memory, fused attention, no score matrix.

  python benchmarks/bench_llama_compile.py [--out benchmarks/gpu/llama_compile.json]

For Llama-3-8B (`configs/models/llama3_8b.gin`, sequence 8192) on 1 x 8 and 2 x 8 H100s and Llama-2-7B
(`configs/models/llama2_7b.gin`, sequence 2048) on 2 x 8, one sequence per device, under each plan of `--plans`: `python -m zerojax.cli.compile --json --dump_hlo`, then in the
scheduled program the cuDNN fused-attention calls and every array with two dimensions of the sequence
length (a `[.., seq, seq]` score matrix: there should be none). Prints JSON; a failed compile is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import error_text, print_and_save  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (config, mesh, sequence length): a length no model dimension equals, so an array with two of them is a
# score matrix (Llama-3's context, 8192; Llama-2's 4096 is its d_model, so 2048 there)
CASES = (("llama3_8b", "1x8", 8192), ("llama3_8b", "2x8", 8192), ("llama2_7b", "2x8", 2048))


def square_buffers(hlo: str, seq: int) -> list[str]:
  """The distinct array shapes of `hlo` of rank 3 or more with two dimensions equal to `seq`: a score
  matrix `[batch, heads, seq, seq]` (or `[batch x heads, seq, seq]`). Rank 2 is left out: XLA bitcasts a
  flat optimizer shard of seq^2 elements to `[seq, seq]` (seen for Llama-3-8B at 8192), which is no score."""
  found = set()
  for dims in re.findall(r"\[([0-9,]+)\]", hlo):
    sizes = [int(d) for d in dims.split(",") if d]
    if len(sizes) >= 3 and sizes.count(seq) >= 2:
      found.add(dims)
  return sorted(found)


def compile_case(config: str, mesh: str, seq: int, plan: str | None) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    dump = os.path.join(tmp, "step.hlo")
    cmd = [sys.executable, "-m", "zerojax.cli.compile", f"--gin_file=configs/models/{config}.gin", "--target=h100",
           f"--mesh={mesh}", "--json", f"--dump_hlo={dump}", f"--gin_param=llama_config.seq_len={seq}",
           f"--batch_size={int(mesh.split('x')[0]) * int(mesh.split('x')[1])}"]  # one sequence per device
    if plan:
      cmd.append(f"--gin_param=train.plan=@{plan}()")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    if out.returncode:
      return {"error": out.stderr.strip().splitlines()[-1][:600] if out.stderr.strip() else f"exit {out.returncode}"}
    rep = json.loads(out.stdout)
    hlo = open(dump).read()
  seq = rep["config"]["seq_len"]
  return {"seq_len": seq, "batch_size": rep["config"]["batch_size"], "compile_s": rep["compile_s"],
          "remat": rep["remat"], "memory": rep["memory"], "memory_report": rep["memory_report"],
          "fused_attention_calls": {k: v for k, v in rep["kernels"].items() if "fmha" in k},
          "seq_by_seq_buffers": square_buffers(hlo, seq), "overlap": rep["overlap"]}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--plans", default="zero3,zeropp,mics", help="plans compiled for each case")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  rows = []
  for config, mesh, seq in CASES:
    for plan in args.plans.split(","):
      try:
        row = compile_case(config, mesh, seq, plan)
      except Exception as e:  # noqa: BLE001 - recorded, the benchmark goes on
        row = {"error": error_text(e)}
      rows.append({"config": config, "mesh": mesh, "plan": plan, **row})
      print(f"{config} {mesh} {plan}: " + json.dumps({k: row.get(k) for k in ("error", "compile_s", "remat")})[:400],
            file=sys.stderr, flush=True)

  def summary(result):
    return "\n".join(f"{r['config']} {r['mesh']} {r['plan']}: " + (
        r["error"] if "error" in r else f"peak {r['memory']['device_peak'] / 1e9:.1f} GB, remat {r['remat']['remat']}, "
        f"fused attention {sum(r['fused_attention_calls'].values())} calls, seq x seq buffers {len(r['seq_by_seq_buffers'])}")
        for r in result["rows"])
  print_and_save({"rows": rows, "target": "h100", "command": "python benchmarks/bench_llama_compile.py"}, summary,
                 args.out)


if __name__ == "__main__":
  main()
