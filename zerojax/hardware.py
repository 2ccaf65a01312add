"""What each GPU kind offers, from the vendors' specification sheets (SXM parts, HGX/DGX nodes of 8):
its dense bf16 tensor-core peak, and the links of a node built around it.

`peak_flops` is what MFU divides by (`zerojax.train.run_metrics`) and what remat "auto" prices recompute
with (`zerojax.planner.remat`); `node_links` the bandwidths it prices a collective left without a matmul
beside it with: a device's NVLink one way, and a node's network one way (its eight NICs together).

References:
  Chowdhery et al. 2022, "PaLM", appendix B (MFU: model FLOP/s over the hardware's peak).
  AMSP: Chen et al. 2023, §IV-A (collectives priced by α-β over a node's links).
"""
from __future__ import annotations

# Dense bf16 tensor-core peak per device, TFLOP/s.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "GB200": 2500.0}
# (NVLink per device, one way; a node's network, one way), GB/s: NVLink 4 (H100, H200) 450, NVLink 3
# (A100) 300, NVLink 5 (B200) 900; 8 x 400 Gb/s InfiniBand NDR (8 x 200 Gb/s HDR for A100).
NODE_LINKS_GBS = {"H200": (450.0, 400.0), "H100": (450.0, 400.0), "A100": (300.0, 200.0), "B200": (900.0, 400.0),
                  "GB200": (900.0, 400.0)}


def _kind(table: dict, device_kind: str):
  upper = f" {device_kind.upper()}"
  return next((v for name, v in table.items() if name in upper.split() or f" {name}" in upper), None)


def peak_flops(device_kind: str) -> float | None:
  """The dense bf16 peak FLOP/s of a device kind (e.g. "NVIDIA H100 80GB HBM3"), None if not known."""
  tflops = _kind(PEAK_TFLOPS, device_kind)
  return None if tflops is None else tflops * 1e12


def node_links(device_kind: str) -> tuple[float, float] | None:
  """(a device's in-node bandwidth, its node's network bandwidth), one way, bytes/s; None if not known."""
  gbs = _kind(NODE_LINKS_GBS, device_kind)
  return None if gbs is None else (gbs[0] * 1e9, gbs[1] * 1e9)
