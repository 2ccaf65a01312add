"""Compiles `train.py`'s step for GPUs without one: `python -m zerojax.cli.compile --gin_file=... --target=h100`.

Builds the gin config's executor on `--mesh` NODESxGPUS compile-only GPUs of `--target` (h100 or a100;
`zerojax.gpu_aot`, needs `pip install -e '.[gpu-aot]'`), compiles its train step for abstract inputs
with the options a GPU run uses (nothing runs), and prints per collective: op, dtype, role, async or not,
inside a layer loop or not, the matmuls and kernels scheduled between its start and done
(`zerojax.analysis.schedule`); the layer loops' overlap per role; the kernels compiled; the most gathered
weights alive at once; and the compiled per-device memory (arguments, outputs, temporaries, peak; and
in host memory, with `offload`) beside `zerojax.executor.memory.memory_report`'s model-state bytes; the remat mode
and why (`remat="auto"` picks the fastest mode whose compiled peak fits, `zerojax.planner.remat`); the XLA
options. `--json` prints it all as JSON, `--dump_hlo FILE` writes the scheduled GPU program.
"""
from __future__ import annotations

import argparse
import json
import sys

from zerojax import gpu_aot, mesh as mesh_lib
from zerojax.executor.aot import compile_step
from zerojax.gpu_aot import memory
from zerojax.cli import account
from zerojax.analysis import collectives_from_hlo
from zerojax.analysis.schedule import (gathered_alive, kernel_counts, merged_backward_gathers, overlap_summary,
                                       schedule_from_hlo)
from zerojax.executor.memory import memory_report

GB = 1e9


def gin_executor(gin_files: list[str], gin_params: list[str], target: str, nodes: int, gpus: int):
  """The executor `train.py` builds for the gin config, on `nodes` x `gpus` compile-only `target` GPUs;
  returns `account.build_executor`'s (the executor with how it was chosen, `train`'s arguments, the model's
  config)."""
  from zerojax import planner

  args = account.gin_train_args(gin_files, gin_params)
  if isinstance(args["plan"], planner.Auto):
    raise SystemExit("error: train.plan=@auto() picks its plan by measuring this machine's collectives; "
                     "compile the config of the plan it picks (e.g. configs/zero3.gin)")
  return account.build_executor(args, nodes, devices=gpu_aot.devices(target, nodes, gpus))


def report(ex, compiled, seconds: float, remat: dict) -> dict:
  """The JSON-ready report of a compiled step (see the module docstring); `remat`: how remat "auto" was
  resolved (`Built.remat`)."""
  text = compiled.as_text()
  found = collectives_from_hlo(text, ex.mesh)
  scheduled = schedule_from_hlo(text, ex.mesh, collectives=found)
  devices = ex.mesh.devices.flat
  return {
      "plan": ex.plan.name, "prefetch": ex.components.prefetch, "device_kind": next(iter(devices)).device_kind,
      "mesh": {k: int(v) for k, v in ex.mesh.shape.items()}, "compile_s": seconds,
      "compiler_options": ex.compiler_options(),
      "compiler_options_user": gpu_aot.options_report(ex.mesh)["user"],
      "remat": remat,
      "collectives": [s.to_json() for s in scheduled],
      "overlap": overlap_summary(scheduled),
      "gathered_alive": gathered_alive(text, scheduled),
      "backward_gathers_in_forward": merged_backward_gathers(scheduled, text),
      "kernels": kernel_counts(text),
      "memory": memory(compiled),
      "memory_report": memory_report(ex)["expected"],
  }


def render(rep: dict) -> str:
  """The report for people."""
  lines = [f"plan {rep['plan']} (prefetch={rep['prefetch']})  {rep['mesh']}  {rep['device_kind']}  "
           f"compiled in {rep['compile_s']:.1f} s  options {rep['compiler_options']}"
           + (f" (yours in XLA_FLAGS win: {rep['compiler_options_user']})" if rep["compiler_options_user"] else ""),
           rep["remat"]["why"], "",
           f"{'op':<15}{'dtype':<7}{'role':<24}{'async':<7}{'loop':<6}{'x':>4}{'matmuls':>9}{'kernels':>9}  result"]
  for c in rep["collectives"]:
    lines.append(f"{c['op']:<15}{c['dtype']:<7}{c['role']:<24}{str(c['async']):<7}{str(c['in_layer_loop']):<6}"
                 f"{c['count']:>4}{c['matmuls_between']:>9}{c['kernels_between']:>9}  {c['result_shapes']}")
  lines.append("")
  for role, e in rep["overlap"].items():
    lines.append(f"layer loops, {role}: {e['overlapped']}/{e['in_loop']} with a matmul between start and done")
  alive = rep["gathered_alive"]
  lines.append(f"gathered weights alive at once: {alive['bytes'] / 1e6:.3f} MB; " + "; ".join(
      f"{e['direction']} layer loop {e['bytes'] / 1e6:.3f} MB ({e['outside_bytes'] / 1e6:.3f} MB gathered outside "
      "it)" for e in alive["layer_loops"]))
  if rep["backward_gathers_in_forward"]:
    lines.append(f"backward gathers scheduled in the forward: {rep['backward_gathers_in_forward']}")
  lines.append("kernels: " + ", ".join(f"{k} {v}" for k, v in rep["kernels"].items()))
  m, model = rep["memory"], rep["memory_report"]
  lines.append(f"memory per device (GB): arguments {m['argument'] / GB:.3f}, outputs {m['output'] / GB:.3f} "
               f"(aliased {m['alias'] / GB:.3f}), temporaries {m['temp'] / GB:.3f}, peak {m['device_peak'] / GB:.3f}; "
               f"memory_report model states {model['device'] / GB:.3f}")
  if m["host"]["argument"] or model["host"]:  # offloaded state (`Sharding.offload`)
    lines.append(f"host memory per device (GB): arguments {m['host']['argument'] / GB:.3f}, temporaries "
                 f"{m['host']['temp'] / GB:.3f}; memory_report offloaded states {model['host'] / GB:.3f}")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gin_file", action="append", required=True, help="gin config of train.py (repeatable)")
  ap.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
  ap.add_argument("--target", default="h100", choices=sorted(gpu_aot.TARGETS), help="GPU to compile for")
  ap.add_argument("--mesh", default="2x4", help="NODESxGPUS (default 2x4)")
  ap.add_argument("--batch_size", type=int, default=None, help="global micro-batch (default train.batch_size, "
                  "or one sequence per device when that does not divide)")
  ap.add_argument("--dump_hlo", default=None, help="write the scheduled GPU program here")
  ap.add_argument("--json", action="store_true", help="print the report as JSON")
  args = ap.parse_args(argv)
  try:
    nodes, gpus = (int(v) for v in args.mesh.lower().split("x"))
  except ValueError:
    ap.error(f"--mesh {args.mesh!r} is not NODESxGPUS; use e.g. 2x4")
  mesh_lib.request_cpu_devices(nodes * gpus)  # a step with offloaded state traces on as many (`aot.compile_step`)
  try:
    gpu_aot.compile_only_host()
    built, train_args, cfg = gin_executor(args.gin_file, args.gin_param, args.target, nodes, gpus)
    ex = built.executor
  except (gpu_aot.PluginMissing, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  batch = args.batch_size or train_args["batch_size"]
  if batch % ex.world:
    batch = ex.world
  compiled, seconds = compile_step(ex, (ex.accum_steps, batch, cfg.seq_len + 1))
  if args.dump_hlo:
    with open(args.dump_hlo, "w") as f:
      f.write(compiled.as_text())
  rep = report(ex, compiled, seconds, built.remat)
  rep.update(config={"gin_files": args.gin_file, "gin_params": args.gin_param, "target": args.target,
                     "batch_size": batch, "accum_steps": ex.accum_steps, "seq_len": cfg.seq_len})
  if args.json:
    json.dump(rep, sys.stdout, indent=2)
    sys.stdout.write("\n")
  else:
    print(render(rep))
  return 0


if __name__ == "__main__":
  sys.exit(main())
