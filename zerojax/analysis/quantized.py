"""Quantized data in a compiled program: every array of an 8- or 4-bit integer or float8 type, except the
workspaces of library calls.

A program that quantizes nothing holds no such array, with one exception that is not data: XLA gives each
cuDNN or cuBLAS call (fused attention, a gemm, a cuDNN fusion) its scratch memory as the last element of
the call's tuple result, a 1-D u8 (cuDNN) or s8 (cuBLAS) buffer; a bf16 step on a GPU has them wherever
it calls cuDNN's fused attention. `quantized_arrays` leaves out exactly those workspaces (and the
`get-tuple-element` that reads one) and reports everything else: a collective's operands or results (a
quantized wire), a convert's, a fusion's or a kernel's result, a parameter, a computation's signature.
tests/test_quantized_arrays.py checks both sides: library workspaces alone are not reported, and a real
int8 / uint8 collective compiled on CPU devices is.
"""
from __future__ import annotations

import dataclasses
import re

from zerojax.analysis.hlo_text import Instr, arrays, attr, computation_header, parse_instruction

QUANTIZED_TYPES = ("s8", "u8", "s4", "u4", "f8e4m3fn", "f8e5m2")
_QUANTIZED = re.compile(r"\b(" + "|".join(QUANTIZED_TYPES) + r")\[")
# cuDNN's and cuBLAS's calls: a custom call to one of their targets, or a cuDNN fusion
_LIBRARY = re.compile(r'custom_call_target="__(?:cudnn|cublas)\$|"kind":"__cudnn\$')


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """An 8- or 4-bit integer or float8 array in a program (`quantized_arrays`).

  Attributes:
    computation: the computation that defines it (for a computation's signature, that computation).
    name: the instruction (for a signature, the computation).
    opcode: e.g. "all-gather-start", "convert", "fusion", "custom-call", "parameter"; "signature".
    dtypes: the quantized element types it holds, e.g. ("s8",).
  """
  computation: str
  name: str
  opcode: str
  dtypes: tuple


def _workspace(instr: Instr) -> int | None:
  """The tuple index of a cuDNN or cuBLAS call's workspace (a 1-D u8/s8 buffer, its result's last
  element); None for any other instruction."""
  if not instr.shape.startswith("(") or not _LIBRARY.search(instr.attrs):
    return None
  elements = arrays(instr.shape)
  dtype, dims = elements[-1]
  return len(elements) - 1 if dtype in ("u8", "s8") and len(dims) == 1 else None


def _distinct(types) -> tuple:
  return tuple(dict.fromkeys(types))


def quantized_arrays(text: str) -> list[QuantizedArray]:
  """Every array of a quantized element type (`QUANTIZED_TYPES`: s8, u8, s4, u4, float8) in an HLO text,
  cuDNN's and cuBLAS's workspaces aside (the module docstring); each reported once, by the instruction (or
  computation signature) whose line writes the type. A line this module cannot read as an instruction
  counts with every quantized type on it."""
  out, workspaces, comp = [], {}, None
  for raw in text.splitlines():
    line = re.sub(r"/\*.*?\*/", "", raw).rstrip()
    header = computation_header(line)
    if header is not None:
      comp = header
      if _QUANTIZED.search(line):
        out.append(QuantizedArray(comp, comp, "signature", _distinct(_QUANTIZED.findall(line))))
      continue
    if not _QUANTIZED.search(line):
      continue
    instr = parse_instruction(line, comp or "")
    if instr is None:
      out.append(QuantizedArray(comp or "", line.strip()[:80], "?", _distinct(_QUANTIZED.findall(line))))
      continue
    own = [t for t, _ in arrays(instr.shape)]
    ws = _workspace(instr)
    if ws is not None:
      workspaces[(comp, instr.name)] = ws
      own = own[:ws]
    elif (instr.opcode == "get-tuple-element" and len(instr.operands) == 1 and len(own) == 1
          and workspaces.get((comp, instr.operands[0])) == int(attr(instr.attrs, "index") or -1)):
      own = []  # the workspace read from its call
    found = [t for t in own if t in QUANTIZED_TYPES]
    for operand, shape in zip(instr.operands, instr.inline_shapes):  # operands printed with their shapes
      types = [t for t, _ in arrays(shape or "")]
      found += [t for t in types[:workspaces.get((comp, operand), len(types))] if t in QUANTIZED_TYPES]
    found += _QUANTIZED.findall(instr.attrs)
    if found:
      out.append(QuantizedArray(comp or "", instr.name, instr.opcode, _distinct(found)))
  return out
