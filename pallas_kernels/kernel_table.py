"""Which quantization kernel runs by default on a GPU: per op, the fastest backend of a measured table.

The table is GB/s (bytes read + written over the median time) of each op and backend at 256M elements,
bf16 input, block 256, measured on NVIDIA H100 80GB HBM3 with jax 0.11.2 (`benchmarks/bench_kernels.py`,
2026-11-25; the raw file is in the shared data of that run). Every backend computes the same bits
(`pallas_kernels.block_format`), so the choice changes speed, never values. Ops the run did not time
with rotation (`reorder_quantize`, `dequant_sum`) take the ranking of the op that does the same rotation
(`quantize_rotate`, `dequantize_rotate`). On the CPU the default stays "xla" (the Pallas kernels run
in the interpreter there). Re-measure with `bash benchmarks/gpu/run.sh` and replace `MEASURED`.
"""
from __future__ import annotations

SOURCE = {"device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "elements": 268435456, "block": 256,
          "input": "bfloat16", "date": "2026-11-25"}

MEASURED = {  # "op/bits": {backend: GB/s}
    "dequant_sum/4": {"xla": 2005, "pallas": 1768, "triton": 684},
    "dequant_sum/8": {"xla": 2473, "pallas": 2491, "triton": 2480},
    "dequant_sum_quantize/4": {"xla": 602, "pallas": 651, "triton": 741},
    "dequant_sum_quantize/8": {"xla": 1386, "pallas": 1873, "triton": 1925},
    "dequantize/4": {"xla": 2104, "pallas": 1249, "triton": 321},
    "dequantize/8": {"xla": 2262, "pallas": 2018, "triton": 2278},
    "dequantize_rotate/4": {"xla": 133, "pallas": 1485, "triton": 94},
    "dequantize_rotate/8": {"xla": 149, "pallas": 1606, "triton": 138},
    "quantize/4": {"xla": 1362, "pallas": 964, "triton": 1677},
    "quantize/8": {"xla": 1336, "pallas": 2014, "triton": 2008},
    "quantize_rotate/4": {"xla": 119, "pallas": 594, "triton": 209},
    "quantize_rotate/8": {"xla": 132, "pallas": 1282, "triton": 237},
    "reorder_quantize/4": {"xla": 1376, "pallas": 970, "triton": 1558},
    "reorder_quantize/8": {"xla": 1441, "pallas": 2304, "triton": 2372},
}

SAME_ROTATION = {"reorder_quantize_rotate": "quantize_rotate", "dequant_sum_rotate": "dequantize_rotate"}


def ranking(op: str, bits: int, rotate: bool = False) -> list[str]:
  """The backends of `op` fastest first on the measured GPU (["xla"] for an op the table lacks)."""
  key = op + ("_rotate" if rotate else "")
  key = SAME_ROTATION.get(key, key)
  row = MEASURED.get(f"{key}/{bits}")
  return sorted(row, key=row.get, reverse=True) if row else ["xla"]
