"""The matmul FLOPs a compiled program runs, read from its optimized HLO text.

XLA's `cost_analysis()` is empty for programs compiled for compile-only GPUs, so the count is read from
the text: every `dot` (inside fusions too), every cuBLAS call (`__cublas$gemm`, `__cublas$lt$matmul`) and
every cuDNN fused attention (`__cudnn$fmha...`), each times the executions of its computation (the known
trip counts of the loops around it, `Module.count`). A dot of result R contracting over C elements does
`2 |R| C` FLOPs. A fused attention forward does two such products (scores Q·Kᵀ and the values P·V:
`4 B T N H S`, no causal halving, as `run_metrics.flops_per_token` counts); its backward four (`8 B T N H
S`). Elementwise work is not counted: it is memory-bound, and no remat mode trades it for what the
pricing weighs (`zerojax.planner.remat`).

References:
  Chowdhery et al. 2022, "PaLM", appendix B (matmul FLOPs of a transformer, attention included).
"""
from __future__ import annotations

import json
import math
import re

from zerojax.analysis.hlo_text import Instr, Module, arrays, attr

_GEMM = re.compile(r"__cublas\$(lt\$matmul|gemm)")
_FMHA = re.compile(r"__cudnn\$fmha")


def matmul_flops(hlo_text: str) -> float:
  """FLOPs of every matmul and fused attention a run of the program executes (see the module docstring)."""
  mod = Module(hlo_text)
  total = 0.0
  for comp, instrs in mod.comps.items():
    per_run = sum(_flops(mod, comp, i) for i in instrs)
    if per_run:
      total += per_run * mod.count(comp)
  return total


def _shape(mod: Module, comp: str, instr: Instr, k: int) -> tuple[int, ...]:
  text = instr.inline_shapes[k] or mod.shape_of(comp, instr.operands[k]) or ""
  found = arrays(text)
  return found[0][1] if found else ()


def _contracted(shape: tuple[int, ...], dims: list[int]) -> int:
  return math.prod(shape[d] for d in dims if d < len(shape))


def _dims(text: str | None) -> list[int]:
  return [int(v) for v in re.findall(r"\d+", text or "")]


def _flops(mod: Module, comp: str, instr: Instr) -> float:
  if instr.opcode == "dot":
    lhs = _shape(mod, comp, instr, 0)
    return 2.0 * math.prod(arrays(instr.shape)[0][1]) * _contracted(lhs, _dims(attr(instr.attrs, "lhs_contracting_dims")))
  if instr.opcode != "custom-call":
    return 0.0
  target = attr(instr.attrs, "custom_call_target") or ""
  if _GEMM.search(target):
    dnums = _backend(instr).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    lhs = _shape(mod, comp, instr, 0)
    return 2.0 * math.prod(arrays(instr.shape)[0][1]) * _contracted(lhs, [int(d) for d in dnums.get("lhs_contracting_dimensions", [])])
  if _FMHA.search(target):
    return _attention(mod, comp, instr, backward="Backward" in target)
  return 0.0


def _attention(mod: Module, comp: str, instr: Instr, backward: bool) -> float:
  """`4 B T N H S` forward, twice that backward: Q (operand 0) holds B T N H, K (operand 1) holds S in the
  dimensions the scores product neither batches nor contracts (`bmm1_dot_dimension_numbers`; BTNH when the
  call carries none)."""
  q, k = _shape(mod, comp, instr, 0), _shape(mod, comp, instr, 1)
  if not q or not k:
    return 0.0
  dnums = _backend(instr).get("cudnn_fmha_backend_config", {}).get("bmm1_dot_dimension_numbers", {})
  fixed = {int(d) for key in ("rhs_contracting_dimensions", "rhs_batch_dimensions") for d in dnums.get(key, [])}
  keys = math.prod(n for d, n in enumerate(k) if d not in fixed) if fixed else k[1]
  return (8.0 if backward else 4.0) * math.prod(q) * keys


def _backend(instr: Instr) -> dict:
  m = re.search(r"backend_config=(\{.*\})", instr.attrs)
  if not m:
    return {}
  text, depth = m.group(1), 0
  for i, ch in enumerate(text):  # the JSON object alone: attributes may follow it
    depth += {"{": 1, "}": -1}.get(ch, 0)
    if depth == 0:
      try:
        return json.loads(text[:i + 1])
      except ValueError:
        return {}
  return {}
