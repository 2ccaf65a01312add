"""Reading compiled programs: which collectives a step runs, over which devices, and the bytes they move.

Nothing in the library imports this package; the accounting command (`zerojax.cli.account`), the
benchmarks and the tests do.

| module        | holds                                                                  |
|---------------|------------------------------------------------------------------------|
| `hlo_text`    | HLO syntax: instructions, shapes, replica groups, loops, backend rewrites |
| `quantized`   | the quantized arrays of a program (s8/u8/s4/u4/f8), cuDNN's and cuBLAS's workspaces aside |
| `collectives` | `Collective` and `collectives_from_hlo`                                |
| `wire_model`  | the ring byte model (per device, cross-node, node egress) and `summarize` |
| `roles`       | the role of each collective in a train step (forward gather, ...)      |
| `schedule`    | what a scheduled GPU program overlaps with each collective; gathered weights alive |
| `report`      | a compiled train step laid out as ZeRO++ Table 1, as JSON or a table   |
"""
from zerojax.analysis.collectives import Collective, collectives_from_hlo
from zerojax.analysis.hlo_text import OPS, parse_replica_groups
from zerojax.analysis.quantized import QUANTIZED_TYPES, QuantizedArray, quantized_arrays
from zerojax.analysis.report import (TABLE1_ROLES, model_parameters, render_collectives, render_table,
                                     step_collectives, step_hlo,
                                     step_report)
from zerojax.analysis.roles import ROLES, label_roles
from zerojax.analysis.wire_model import summarize

__all__ = ["Collective", "collectives_from_hlo", "OPS", "parse_replica_groups", "QUANTIZED_TYPES", "QuantizedArray",
           "quantized_arrays", "TABLE1_ROLES",
           "model_parameters", "render_collectives", "render_table", "step_collectives", "step_hlo", "step_report", "ROLES",
           "label_roles", "summarize"]
