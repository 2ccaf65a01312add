"""The collectives: each one function citing its paper section, for `jax.shard_map` bodies.

| module   | collective                                                       | paper              |
|----------|------------------------------------------------------------------|--------------------|
| `gather` | a unit's parameter all-gather, flat or block-quantized (qwZ)     | ZeRO §5.3, ZeRO++ §3.1 |
| `reduce` | a unit's gradient reduce-scatter, flat or qgZ                    | ZeRO §5.2, ZeRO++ §3.3 |
| `qgz`    | 2-hop quantized all-to-all reduction with slice reordering       | ZeRO++ §3.3, §4.1.2 |
| `formats`| wire formats: int8/int4 blocks, float8 blocks (one type each)    | ZeRO++ §3.1, FP8-LM §2.1 |
| `wire`   | raw 16-bit words and packed quantized buffers on the wire        | ZeRO++ §4.2        |
| `radius` | sparse replica all-reduce: top-k window, compact sum, residual   | Radius §4, Alg. 1  |

This layer imports only `zerojax.quant.quantization` (the kernels' front), `zerojax.mesh` and, for qgZ's stochastic
rounding noise, `pallas_kernels.hadamard`.
"""
from zerojax.comm import formats, radius
from zerojax.comm.formats import FORMATS, BlockFloat8, BlockInt, WireFormat
from zerojax.comm.gather import all_gather_unit
from zerojax.comm.qgz import qgz_reduce_scatter
from zerojax.comm.reduce import reduce_scatter_unit
from zerojax.comm.wire import all_gather_raw, pack_wire, unpack_wire

__all__ = ["formats", "FORMATS", "BlockFloat8", "BlockInt", "WireFormat", "radius", "all_gather_unit", "qgz_reduce_scatter", "reduce_scatter_unit", "all_gather_raw", "pack_wire",
           "unpack_wire"]
