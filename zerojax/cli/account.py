"""Accounts for the communication of `train.py`'s step: `python -m zerojax.cli.account --gin_file=...`.

Compiles the train step of a gin config for abstract inputs (nothing runs) and prints ZeRO++ Table 1:
per plan, the bytes of the forward gather, backward gather and gradient reduction, inside the node and
across nodes. `--json` prints every collective (op, dtype, shapes, replica groups, mesh axes, role,
executions per step, bytes). `--hlo FILE --mesh 2x4` accounts for a dumped HLO text instead. The plan is
named by `plan` (its name) and `label` (`Plan.label`: its sharding and techniques).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys

import jax

from zerojax import mesh as mesh_lib
from zerojax.analysis import (collectives_from_hlo, render_collectives, render_table, step_collectives,
                              step_hlo, step_report, summarize)


def gin_train_args(gin_files: list[str], gin_params: list[str]) -> dict:
  """Parses the gin config as `train.py` does; returns `train`'s arguments (defaults and bindings)."""
  import gin

  from zerojax.train import config as config_lib, trainer

  try:
    config_lib.parse(gin_files, gin_params)
  except config_lib.ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  args = {k: v.default for k, v in inspect.signature(trainer.train).parameters.items()
          if v.default is not inspect.Parameter.empty}
  args.update(gin.get_bindings(trainer.train))
  if args.get("plan", gin.REQUIRED) is gin.REQUIRED:
    raise SystemExit("error: the gin config sets no plan; bind train.plan (e.g. include configs/zero3.gin)")
  return args


def build_executor(args: dict, nodes: int, devices=None):
  """`train`'s executor for its arguments `args` on `nodes` nodes of `devices` (default `jax.devices()`), with
  how it was chosen (`zerojax.train.loop.Built`); returns that with `args` and the model's config
  (`GPTConfig` or `LlamaConfig`)."""
  from zerojax.train import trainer

  shared = [k for k in inspect.signature(trainer.build).parameters
            if k not in ("plan", "num_nodes", "devices") and k in args]
  built = trainer.build(args["plan"], nodes, devices=devices, **{k: args[k] for k in shared})
  return built, args, trainer.model_spec(args.get("architecture", "gpt"), args.get("init_from")).config


def gin_executor(gin_files: list[str], gin_params: list[str], nodes: int):
  """Parses the gin config as `train.py` does and builds its executor; returns `build_executor`'s."""
  return build_executor(gin_train_args(gin_files, gin_params), nodes)


def main(argv=None) -> None:
  """Prints the accounting of a gin config's train step (`--gin_file`) or of an HLO dump (`--hlo`)."""
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--gin_file", action="append", help="gin config of train.py (repeatable)")
  source.add_argument("--hlo", help="optimized HLO text file ('-' for stdin)")
  parser.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. train.accum_steps=2")
  parser.add_argument("--mesh", default=None, help="NODESxGPUS, e.g. 2x4 (axes 'node', 'gpu'); default 2x4 "
                      "for --gin_file")
  parser.add_argument("--model_bytes", type=float, default=None, help="model size M in bytes (--hlo)")
  parser.add_argument("--json", action="store_true", help="print JSON with every collective instead of the table")
  parser.add_argument("--dump_hlo", default=None, help="also write the compiled step's HLO here (--gin_file)")
  parser.add_argument("--phase", default=None,
                      help="the step to account for: with Radius (replica_sync=@radius()) dense, select or sparse "
                      "(default sparse); with DiLoCo (outer_sync=@diloco()) dense (an inner step, the default) "
                      "or outer<f> (fragment f's sync)")
  args = parser.parse_args(argv)
  if args.hlo and args.mesh is None:
    parser.error("--hlo needs --mesh NODESxGPUS, e.g. --mesh 2x4")
  try:
    nodes, gpus = (int(v) for v in (args.mesh or "2x4").lower().split("x"))
  except ValueError:
    parser.error(f"--mesh {args.mesh!r} is not NODESxGPUS; use e.g. 2x4")
  if args.hlo:
    mesh = jax.sharding.AbstractMesh((nodes, gpus), ("node", "gpu"))
    text = sys.stdin.read() if args.hlo == "-" else open(args.hlo).read()
    found = collectives_from_hlo(text, mesh)
    out = summarize(found, model_bytes=args.model_bytes)
    out["collectives"] = [dataclasses.asdict(c) for c in found]
    if not args.json:
      print(render_collectives(found))
      return
  else:
    mesh_lib.request_cpu_devices(nodes * gpus)
    if jax.device_count() < nodes * gpus:
      raise SystemExit(f"error: a {nodes}x{gpus} mesh needs {nodes * gpus} devices, but jax has "
                       f"{jax.device_count()}; use --mesh with at most that many")
    built, train_args, cfg = gin_executor(args.gin_file, args.gin_param, nodes)
    ex = built.executor
    if ex.mesh.size != nodes * gpus:
      raise SystemExit(f"error: the mesh is {dict(ex.mesh.shape)}, not {nodes}x{gpus}; run with exactly "
                       f"{nodes * gpus} devices")
    phases = ("dense",) + tuple(p for c in ex.stateful.values() for p in c.phases)
    if args.phase and args.phase not in phases:
      raise SystemExit(f"error: --phase {args.phase}: this plan's steps are {phases}")
    phase = args.phase or ("sparse" if ex.plan.sync.replica_sync is not None else "dense")
    text = step_hlo(ex, (ex.accum_steps, train_args["batch_size"], cfg.seq_len + 1), phase=phase)
    if args.dump_hlo:
      with open(args.dump_hlo, "w") as f:
        f.write(text)
    name, tag = ex.plan.name, ex.plan.label()
    out = {"config": {"gin_files": args.gin_file, "gin_params": args.gin_param, "plan": name, "label": tag,
                      "phase": phase,
                      "mesh": {k: int(v) for k, v in ex.mesh.shape.items()}, "param_dtype": ex.plan.gather.param_dtype,
                      "reduce_dtype": ex.plan.reduction.reduce_dtype, "remat": ex.components.remat,
                      "gradient_reduction": ("qgz" if ex.plan.reduction.quantized else "all_to_all"
                                             if ex.plan.reduction.gradient_all_to_all else "reduce_scatter"),
                      "wire_formats": _wire_formats(ex.plan),
                      "accum_steps": ex.accum_steps,
                      "batch_size": train_args["batch_size"], "seq_len": cfg.seq_len}}
    out.update(step_report(ex, step_collectives(ex, hlo_text=text)))
    if ex.plan.sync.outer_sync is not None:
      out["outer_sync"] = _outer_sync(ex, (ex.accum_steps, train_args["batch_size"], cfg.seq_len + 1))
    if not args.json:  # the table's head names the plan and its label
      shown = name if name == tag else f"{name} = {tag}"
      print(render_table({**out, "config": {**out["config"], "plan": shown}}))
      if "outer_sync" in out:
        o = out["outer_sync"]["cross_node_bytes_per_device"]
        print(f"DiLoCo across nodes, bytes per device: inner step {o['inner_step']:,.0f}; outer syncs "
              f"{', '.join(f'{b:,.0f}' for b in o['outer_steps'])}; per step on average {o['per_step_mean']:,.0f}")
      return
  json.dump(out, sys.stdout, indent=2)
  sys.stdout.write("\n")


def _outer_sync(ex, batch_shape) -> dict:
  """DiLoCo (`outer_sync`): cross-node bytes per device of an inner step and of each fragment's sync step,
  from their compiled programs, and their mean over a window of `every` steps."""
  d = ex.plan.sync.outer_sync
  cross = lambda phase: sum(c.count * c.cross_node_bytes_per_device
                            for c in step_collectives(ex, hlo_text=step_hlo(ex, batch_shape, phase=phase)))
  inner = cross("dense")
  outer = [cross(f"outer{f}") for f in range(d.fragments)]
  return {"every": d.every, "fragments": d.fragments, "bits": d.bits,
          "cross_node_bytes_per_device": {"inner_step": inner, "outer_steps": outer,
                                          "per_step_mean": (inner * (d.every - d.fragments) + sum(outer)) / d.every}}


def _wire_formats(plan) -> dict:
  """The plan's wire formats by name (`comm.formats`): the forward gather's and qgZ's per hop."""
  hops = plan.reduction.hop_formats
  return {"gather": plan.gather.wire_format.name if plan.gather.wire_format else None,
          "grad_hops": [f.name for f in hops] if hops else None}


if __name__ == "__main__":
  main()
