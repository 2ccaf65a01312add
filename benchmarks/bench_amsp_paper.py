"""The planner on AMSP's own cluster and models, beside the paper's Table IV.

AMSP's cluster (128 nodes x 8 A800 80 GB, NVLink, 4 x HDR InfiniBand, no SHARP) is described by a
profile written from its published link figures (`zerojax/planner/profiles/amsp_a800_128x8.json`,
`zerojax.planner.links.amsp_a800`); LLaMA 7B/13B/30B are described by their shapes alone
(`Workload.transformer`: nothing is built). The paper's settings (§VI-A): sequence 4096, micro-batch 1,
global batch 4M tokens, so M = 1024 / GPUs micro-batches per step; bf16 parameters and gradients, fp32
master weights and Adam moments (12 bytes per parameter); activation recomputation for 30B only.

Activations per device (an estimate; AMSP delegates them to prior work): 34 s h L bytes without
recomputation (Korthikanti et al. 2022, Eq. 2, without the attention-score term FlashAttention-2 does
not store), 2 s h L + 34 s h with full recomputation, plus the fp32 logits and their gradient (8 s V).
Compute (the same for every plan, AMSP's model; only T_step's scale depends on it): the Megatron-LM
FLOPs of the step per device (§VI-A's MFU formula, recomputation adding one forward) at the A800's 312
TFLOP/s bf16 peak.

  python benchmarks/bench_amsp_paper.py [--gpus 1024] [--write-profile] [--results benchmarks/RESULTS.md]
  python benchmarks/bench_amsp_paper.py --compiled [--target a100] [--out benchmarks/gpu/amsp_table4.json]
      [--results benchmarks/RESULTS.md]

Prints JSON: per model the chosen plan, the paper's plan, the predicted seconds and memory of each, and
the five fastest plans that fit; with --results also writes the "AMSP planner on the paper's cluster"
section of RESULTS.md. Deterministic: no measurement is involved.

`--compiled` (needs `pip install -e '.[gpu-aot]'`) compiles, at 1024 GPUs (128 x 8 compile-only A100s,
the A800's compute capability and 80 GB), the train step of the planner's plan, its next two plans that
the formula lets fit, the paper's Table IV plan and MiCS, and of the plan the planner chooses when the
compiled peak decides "fits" (`zerojax.planner.compiled.check_rows`), and reports per plan the formula's
bytes per device beside the compiled peak and whether each fits 80 GB. The model is the GPT of
`zerojax.models.gpt` at LLaMA's shape: layers, d_model, heads (head width 128), vocabulary 32000,
sequence 4096, and a GELU MLP of width 4 d_model, whose two matrices hold 8 d^2 per layer where LLaMA's
three SwiGLU matrices hold 3 d d_ff (7B: 134.2 M vs 135.3 M, 13B: 209.7 M vs 212.3 M, 30B: 354.4 M vs
357.8 M; the GPT also has LayerNorm biases, matmul biases and a 4096 x d position table, so it has
0.2-0.8% fewer parameters in all). bf16 parameters, gradients (reduced in bf16, a ring reduce-scatter)
and compute, fp32 master weights and AdamW moments, one sequence per device, M = 1. Recomputation: full
for 30B (the paper's), "dots" for 7B and 13B: the weight matmuls' outputs are kept and the attention
scores recomputed in backward, as FlashAttention-2 does (this GPT's attention materialises the scores,
which with no recomputation at all would keep heads x 4096^2 fp32 per layer: 243 GB per device for 7B).

References:
  AMSP: Chen et al. 2023, §VI-A (cluster, workload), Table IV (chosen strategies).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import jax  # noqa: E402

from zerojax import gpu_aot, planner  # noqa: E402
from zerojax.planner import links  # noqa: E402
from zerojax.planner.space import Point  # noqa: E402

PROFILE = os.path.join(REPO, "zerojax", "planner", "profiles", "amsp_a800_128x8.json")
SEQ, VOCAB, PEAK, CAP_GB = 4096, 32000, 312e12, 80
# LLaMA shapes (Touvron et al. 2023, Table 2): layers, hidden, SwiGLU width, heads; recomputation (AMSP §VI-A)
MODELS = {"LLaMA-7B": (32, 4096, 11008, False), "LLaMA-13B": (40, 5120, 13824, False),
          "LLaMA-30B": (60, 6656, 17920, True)}
# AMSP Table IV (s_p, s_g, s_os) at R = 8 GPUs per node, N = 128 nodes; 30B's s_os^1 cell is lost in the
# text, 1 is the only value its plan "from 8 GPUs upward" allows.
PAPER = {"LLaMA-7B": (1, 1, 8), "LLaMA-13B": (4, 4, 8), "LLaMA-30B": (8, 8, 8)}
MICS = {"LLaMA-7B": (8, 8, 8), "LLaMA-13B": (8, 8, 8), "LLaMA-30B": (16, 16, 16)}


def workload(model: str, gpus: int) -> planner.Workload:
  layers, h, ff, remat = MODELS[model]
  accum = max(1024 // gpus, 1)
  act = (2 * SEQ * h * layers + 34 * SEQ * h) if remat else 34 * SEQ * h * layers
  act += 8 * SEQ * VOCAB
  flops = accum * (72 * layers * h * h * SEQ * (1 + SEQ / (6 * h) + VOCAB / (12 * h * layers)))
  flops *= (4 / 3) if remat else 1
  return planner.Workload.transformer(layers=layers, d_model=h, d_ff=ff, vocab=VOCAB, accum=accum,
                                      param_bytes=2, grad_bytes=2, opt_bytes_per_param=8,
                                      compute_s=flops / PEAK, activation_bytes=act)


def plan_name(row) -> str:
  return f"({row['s_p']},{row['s_g']},{row['s_os']})"


def brief(row: dict | None) -> dict | None:
  keep = ("plan", "s_p", "s_g", "s_os", "T_comm", "T_step", "bytes_per_device", "fits")
  return None if row is None else {k: row[k] for k in keep} | {"degrees": plan_name(row)}


def report(gpus: int = 1024, profile: dict | None = None) -> dict:
  nodes = gpus // 8
  prof = profile if profile is not None else (links.amsp_a800() if gpus == 1024 else links.link_profile(
      nodes, 8, b_gpu=200e9, b_node=100e9, source="AMSP §VI-A links"))
  cap = CAP_GB * 1e9
  out = {"gpus": gpus, "memory_cap_gb": CAP_GB, "seq": SEQ, "models": {}}
  for model in MODELS:
    work = workload(model, gpus)
    rows = planner.rank(nodes, 8, work, prof, memory_cap_bytes=cap)
    best = planner.choose(rows, cap)
    find = lambda t, rows=rows: brief(next((r for r in rows if (r["s_p"], r["s_g"], r["s_os"]) == t), None))
    out["models"][model] = {
        "params": work.numel, "accum": work.accum, "compute_s": work.compute_s, "activation_bytes": work.activation_bytes,
        "chosen": brief(best), "paper": find(PAPER[model]), "mics_paper": find(MICS[model]),
        "zero3": find((gpus, gpus, gpus)), "zero1": find((1, 1, gpus)),
        "top5_fit": [brief(r) for r in rows if r["fits"]][:5], "matches_paper": plan_name(best) == str(PAPER[model]).replace(" ", "")}
  return out


def markdown(reps: list[dict]) -> str:
  lines = ["## AMSP planner on the paper's cluster (Table IV)", "",
           ("`python benchmarks/bench_amsp_paper.py`: the profile written from the paper's link figures "
           "(`zerojax/planner/profiles/amsp_a800_128x8.json`: NVLink 200 GB/s one way per GPU, 4 x HDR 200 Gb/s "
           "per node, NCCL ring latencies; the same links for the 8-GPU node), LLaMA shapes only, sequence 4096, "
           f"micro-batch 1, M = 1024 / GPUs micro-batches per step, memory cap {reps[0]['memory_cap_gb']} GB, "
           "recomputation for 30B. (s_p, s_g, s_os) in devices; predicted T_comm and model states + activations "
           "per device."), "",
           ("| GPUs | model | planner's plan | T_comm s | GB/device | paper's AMSP plan (Table IV) | T_comm s | GB/device | "
            "ZeRO-1 T_comm s | ZeRO-3 T_comm s | MiCS (Table IV) T_comm s |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
  for rep in reps:
    lines += [_row(rep["gpus"], m, r) for m, r in rep["models"].items()]
  return "\n".join(lines) + "\n"


def _row(gpus: int, m: str, r: dict) -> str:
  c, p = r["chosen"], r["paper"]
  t = lambda x: "—" if x is None else f"{x['T_comm']:.3f}" + ("" if x["fits"] else " (over)")
  return (f"| {gpus} | {m} | {c['degrees']} | {c['T_comm']:.3f} | {c['bytes_per_device'] / 1e9:.1f} | {p['degrees']} | "
          f"{t(p)} | {p['bytes_per_device'] / 1e9:.1f} | {t(r['zero1'])} | {t(r['zero3'])} | {t(r['mics_paper'])} |")


HEAD = 128  # LLaMA's head width: 32, 40 and 52 heads
NEXT = 2    # the planner's next plans (that the formula lets fit) compiled beside its choice


def gpt_config(model: str):
  """The GPT of `zerojax.models.gpt` at `model`'s LLaMA shape (GELU MLP of width 4 d: see the docstring)."""
  from zerojax.models.gpt import GPTConfig
  layers, h, _, _ = MODELS[model]
  return GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=h, num_heads=h // HEAD, num_layers=layers, mlp_ratio=4)


def compiled_report(target: str = "a100") -> dict:
  """Per model: each plan's formula bytes per device beside its compiled peak (see the docstring)."""
  from zerojax.models.gpt import gpt
  from zerojax.planner import compiled

  gpus = 1024  # Table IV's 128 x 8
  nodes, cap = gpus // 8, CAP_GB * 1e9
  prof = planner.load_profile(PROFILE, nodes, 8)
  out = {"gpus": gpus, "target": target, "memory_cap_gb": CAP_GB, "seq": SEQ, "models": {}}
  for model in MODELS:
    work = workload(model, gpus)
    cfg = gpt_config(model)
    fields = dict(remat="full" if MODELS[model][3] else "dots", reduce_dtype="bfloat16", reduce_via="reduce_scatter")
    cache = {}

    def memory_of(pt: Point, cfg=cfg, fields=fields, cache=cache, accum=work.accum) -> dict:
      key = (pt.s_p, pt.s_g, pt.s_os)
      if key not in cache:
        cache[key] = compiled.memory(pt, gpt(cfg), SEQ, nodes, 8, target, accum=accum, **fields)
        print(f"{model} {plan_name(dict(zip(('s_p', 's_g', 's_os'), key)))}: peak {cache[key]['peak'] / 1e9:.2f} GB, "
              f"compiled in {cache[key]['compile_s']:.1f} s", file=sys.stderr, flush=True)
      return cache[key]

    rows = planner.rank(nodes, 8, work, prof, memory_cap_bytes=cap)
    best = planner.choose(rows, cap)
    fitting = [r for r in rows if r["fits"]]
    plans = {"planner": best, **{f"planner #{i + 2}": r for i, r in enumerate(fitting[1:1 + NEXT])}}
    find = lambda t: next(r for r in rows if (r["s_p"], r["s_g"], r["s_os"]) == t)
    plans.update({"paper (Table IV)": find(PAPER[model]), "MiCS (Table IV)": find(MICS[model])})
    # the choice when the compiled peak decides "fits": the fastest row whose compiled peak fits
    by_compiled = next(r for r in fitting if memory_of(planner.solve.point_of(r))["peak"] <= cap)
    if by_compiled["plan"] not in [r["plan"] for r in plans.values()]:
      plans["planner, compiled fits"] = by_compiled
    table = []
    for label, r in plans.items():
      mem = memory_of(planner.solve.point_of(r))
      table.append({"label": label, "degrees": plan_name(r), "plan": r["plan"], "T_comm": r["T_comm"],
                    "model_state_bytes": r["model_state_bytes"], "formula_bytes": r["bytes_per_device"],
                    "compiled": mem, "fits_formula": r["fits"], "fits_compiled": mem["peak"] <= cap})
    out["models"][model] = {"params": work.numel, "gpt": cfg.__dict__, "plan_fields": fields, "accum": work.accum,
                            "activation_bytes": work.activation_bytes, "chosen": plan_name(best),
                            "chosen_by_compiled": plan_name(by_compiled), "plans": table}
  return out


def compiled_markdown(rep: dict) -> str:
  lines = ["## AMSP planner on the paper's cluster: compiled memory (Table IV)", "",
           (f"`python benchmarks/bench_amsp_paper.py --compiled`: each plan's train step compiled for {rep['gpus']} "
            f"compile-only {rep['target'].upper()}s (128 x 8; the A800's sm_80, 80 GB), the GPT at LLaMA's shape "
            "(GELU MLP of width 4 d, 0.2-0.8% fewer parameters than LLaMA), sequence 4096, one sequence per device, "
            "M = 1, bf16 parameters/gradients/compute, fp32 master + AdamW; recomputation full for 30B, 'dots' "
            "(attention recomputed, as FlashAttention-2) for 7B/13B. Formula: model states (AMSP §IV-D) + the "
            "activation estimate; compiled: `memory_analysis()` peak per device. Fits: at most "
            f"{rep['memory_cap_gb']} GB (1e9 bytes). Nothing ran."), "",
           ("| model | plan | (s_p,s_g,s_os) | T_comm s | model states GB | formula GB | compiled peak GB | "
            "fits (formula / compiled) | compile s |"),
           "|---|---|---|---|---|---|---|---|---|"]
  yn = lambda b: "yes" if b else "no"
  for m, r in rep["models"].items():
    for p in r["plans"]:
      c = p["compiled"]
      lines.append(f"| {m} | {p['label']} | {p['degrees']} | {p['T_comm']:.3f} | {p['model_state_bytes'] / 1e9:.1f} | "
                   f"{p['formula_bytes'] / 1e9:.1f} | {c['peak'] / 1e9:.1f} | {yn(p['fits_formula'])} / "
                   f"{yn(p['fits_compiled'])} | {c['compile_s']:.0f} |")
  lines += ["", "The planner's choice with the compiled peak deciding 'fits' (`compiled.check_rows`): " + ", ".join(
      f"{m} {r['chosen_by_compiled']}" for m, r in rep["models"].items()) + ". Compile times: a shared 2-core CPU "
      "machine (noisy)."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gpus", default="1024,8", help="GPUs of the paper's cluster to plan for (8 per node), "
                  "comma-separated (the paper uses one plan at every scale)")
  ap.add_argument("--write-profile", action="store_true", help=f"(re)write {PROFILE} from the link figures")
  ap.add_argument("--results", default=None, help="RESULTS.md to write the section into")
  ap.add_argument("--compiled", action="store_true", help="compile each plan's step for 1024 compile-only GPUs "
                  "and report the compiled peak beside the formula (needs pip install -e '.[gpu-aot]')")
  ap.add_argument("--target", default="a100", choices=sorted(gpu_aot.TARGETS), help="GPU kind to compile for (--compiled)")
  ap.add_argument("--out", default=os.path.join(HERE, "gpu", "amsp_table4.json"), help="JSON written by --compiled")
  args = ap.parse_args(argv)
  if args.compiled:
    try:
      gpu_aot.compile_only_host()
    except gpu_aot.PluginMissing as e:
      raise SystemExit(f"error: --compiled: {e}") from None
    rep = compiled_report(args.target)
    rep.update(device=f"{args.target} (compile-only)", jax=jax.__version__)
    with open(args.out, "w") as f:
      json.dump(rep, f, indent=1)
    print(json.dumps(rep, indent=2))
    if args.results:
      sys.path.insert(0, HERE)
      from common import write_section
      write_section(args.results, compiled_markdown(rep),
                    "## AMSP planner on the paper's cluster: compiled memory (Table IV)")
    return 0
  if args.write_profile:
    with open(PROFILE, "w") as f:
      json.dump(links.amsp_a800(), f, indent=1)
  reps = [report(int(g), planner.load_profile(PROFILE, 128, 8) if int(g) == 1024 else None)
          for g in args.gpus.split(",") if g]
  print(json.dumps(reps, indent=2))
  if args.results:
    sys.path.insert(0, HERE)
    from common import write_section
    write_section(args.results, markdown(reps), "## AMSP planner on the paper's cluster (Table IV)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
