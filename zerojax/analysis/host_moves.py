"""The bytes a scheduled program moves between device and host memory, per direction, and which moves of
the two directions are in flight at once.

In XLA's optimized text host memory is the layout's memory space 5 (`{1,0:S(5)}`). A move is an instruction
(not inside a kernel's fused body) whose result lies in one memory and whose array operands in the other:
`copy-start`/`copy-done`, an async `fusion-start`/`fusion-done` (a dynamic slice of a host array into device
memory, or a `dynamic-update-slice` of a device layer into a host array) or its synchronous form. Host->device
bytes are the device result's (a slice reads only what it returns), device->host bytes the device operands'.
A move inside a `while` counts once per iteration (its known trip count). A computation run on the host
(`compute_on("device_host")`, XLA:GPU's `HostExecute`) moves what it reads from or writes to device memory.

In a scheduled module, instructions appear in schedule order: an async move is in flight from its start to
its done, and two moves of opposite directions overlap when their spans intersect (a synchronous one spans
its own position). A computation on the host reads its operands and writes its results where they are:
device operands count as moved down, device results as moved up. `overlapping_pairs` counts such pairs: the two directions of the host link used at once
(ZeRO-Offload, Ren et al. 2021, §4.1; Megatron-Core's chunked offloader overlaps the copy of chunk N+1 to the
device with the copy of chunk N-1 back).
"""
from __future__ import annotations

import re

from zerojax.analysis.hlo_text import Module, arrays, nbytes

_HOST = re.compile(r"S\(5\)")
_SCALAR = re.compile(r"[a-z0-9]+\[\]")
_KERNEL_CALLERS = ("fusion", "fusion-start", "async-start", "custom-call", "custom-call-start", "call-start")


def _split(shape: str) -> list[tuple[str, bool]]:
  """The arrays of a shape string (a tuple or one array), each (its text, whether it is in host memory)."""
  found = re.findall(r"[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?", shape)
  return [(s, bool(_HOST.search(s))) for s in found]


def _bytes(text: str) -> float:
  return nbytes(arrays(text))


def _moves_of(mod: Module, comp: str) -> list[dict]:
  """The moves of one computation, in schedule order: {direction, bytes, start, end} (positions)."""
  instrs = mod.comps[comp]
  pos = {i.name: k for k, i in enumerate(instrs)}
  out = []
  for k, instr in enumerate(instrs):
    op = instr.opcode
    host_call = False
    if op in ("copy-done", "fusion-done", "custom-call-done"):
      start = mod.by_name[comp].get(instr.operands[0])
      if start is None:
        continue
      operands, first = start.operands, pos[start.name]
      host_call = op == "custom-call-done" and "HostExecute" in start.attrs
    elif op in ("copy", "fusion", "dynamic-update-slice", "dynamic-slice"):
      operands, first = instr.operands, k
    else:
      continue
    result = [a for a in _split(instr.shape) if not _SCALAR.match(a[0])]
    ins = [a for o in operands for a in _split(mod.shape_of(comp, o) or "") if not _SCALAR.match(a[0])]
    if host_call:  # a computation on the host: its device operands go down, its device results come up
      for direction, arrs in (("device_to_host", ins), ("host_to_device", result)):
        if any(not h for _, h in arrs):
          out.append({"direction": direction, "bytes": sum(_bytes(a) for a, h in arrs if not h), "start": first, "end": k})
      continue
    if not result or not ins:
      continue
    to_host = all(h for _, h in result)
    if to_host and any(not h for _, h in ins):
      out.append({"direction": "device_to_host", "bytes": sum(_bytes(a) for a, h in ins if not h),
                  "start": first, "end": k})
    elif not any(h for _, h in result) and any(h for _, h in ins):
      out.append({"direction": "host_to_device", "bytes": min(sum(_bytes(a) for a, _ in result),
                                                               sum(_bytes(a) for a, h in ins if h)),
                  "start": first, "end": k})
  return out


def host_moves(hlo_text: str) -> dict:
  """Per run of the program: `host_to_device` and `device_to_host` bytes, the moves of each direction, and
  `overlapping_pairs` (pairs of opposite moves whose spans intersect, counted per execution of their
  computation), `overlapped` (per direction, the bytes of the moves in flight beside at least one move of the
  other direction), `kernels_beside_moves` (kernels run while a move is in flight: the update beside the copies),
  with `per_computation` detail for the computations that move anything."""
  mod = Module(hlo_text)
  kernels = set()
  for instrs in mod.comps.values():
    for i in instrs:
      if i.opcode in _KERNEL_CALLERS:
        kernels.update(re.findall(r"%?([^\s{},%]+)", (re.search(r"calls=([^,]*(?:\{[^}]*\})?)", i.attrs) or
                                                    re.search(r"()", "")).group(1)))
  total = {"host_to_device": 0.0, "device_to_host": 0.0, "moves": {"host_to_device": 0, "device_to_host": 0},
           "overlapping_pairs": 0, "overlapped": {"host_to_device": 0.0, "device_to_host": 0.0},
           "kernels_beside_moves": 0,
           "per_computation": {}}
  for comp in mod.comps:
    if comp in kernels:
      continue
    moves = _moves_of(mod, comp)
    if not moves:
      continue
    n = mod.count(comp)
    up = [m for m in moves if m["direction"] == "host_to_device"]
    down = [m for m in moves if m["direction"] == "device_to_host"]
    meets = lambda a, b: a["start"] <= b["end"] and b["start"] <= a["end"]
    pairs = sum(1 for a in up for b in down if meets(a, b))
    beside = {"host_to_device": sum(a["bytes"] for a in up if any(meets(a, b) for b in down)),
              "device_to_host": sum(b["bytes"] for b in down if any(meets(a, b) for a in up))}
    for m in moves:
      total[m["direction"]] += n * m["bytes"]
      total["moves"][m["direction"]] += n
    total["overlapping_pairs"] += n * pairs
    for d, b in beside.items():
      total["overlapped"][d] += n * b
    spans = [(m["start"], m["end"]) for m in moves]
    launched = [k for k, i in enumerate(mod.comps[comp]) if i.opcode in ("fusion", "custom-call")
                and not any(m["start"] == k or m["end"] == k for m in moves)]
    beside_kernels = sum(1 for k in launched if any(a < k < b for a, b in spans))
    total["kernels_beside_moves"] += n * beside_kernels
    total["per_computation"][comp] = {"executions": n, "host_to_device": sum(m["bytes"] for m in up),
                                      "device_to_host": sum(m["bytes"] for m in down),
                                      "moves": [len(up), len(down)], "overlapping_pairs": pairs,
                                      "overlapped": beside, "kernels": len(launched),
                                      "kernels_beside_moves": beside_kernels}
  return total
