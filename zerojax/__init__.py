"""zerojax: ZeRO-3, ZeRO++, MiCS, AMSP and Radius as plans of one sharded data-parallel executor."""
from zerojax.executor import Executor, Model, StepMetrics
from zerojax.engine.layout import Layout, LeafLayout
from zerojax.mesh import initialize_distributed, make_mesh
from zerojax.models.linen import from_linen, linen_rngs
from zerojax.models.nnx import from_nnx
from zerojax.plan import PLANS, Diloco, Plan, Radius, amsp, diloco, dp, mics, radius, zero1, zero2, zero3, zeropp
from zerojax.engine.scan_layers import scan_layers
from zerojax.state.radius import RadiusState
from zerojax.state.train_state import TrainState
from zerojax.engine.unit import ShardedUnit, unit

__all__ = [
    "Executor", "Model", "RadiusState", "StepMetrics", "TrainState", "Layout", "LeafLayout",
    "initialize_distributed", "make_mesh", "PLANS", "Plan", "Radius", "Diloco", "amsp", "diloco", "dp", "mics", "radius", "zero1",
    "zero2", "zero3", "zeropp", "ShardedUnit", "unit", "scan_layers", "from_linen", "from_nnx", "linen_rngs",
]
