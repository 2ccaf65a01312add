"""Wire formats: what a block-quantized buffer is on the wire, one type per format.

A `WireFormat` owns everything that depends on how a block of floats is encoded: quantize and
dequantize (and the two fused steps of qgZ's hops), how values and scales are packed into the one
uint8 buffer a collective moves, its bytes per element, its alignment and its names in labels. The gathers
(`comm.gather`), qgZ's hops (`comm.qgz`), the plan values (`Gather.wire_format`,
`Reduction.hop_formats`), the planner's cost model and the labels read these; none of them keys on
bits or on a format's name.

Formats (`FORMATS`, by the name a plan gives):
- "int8", "int4" (`BlockInt`): symmetric integer codes with one fp32 scale per block, the arithmetic of
  `pallas_kernels.block_format` in every kernel backend (ZeRO++ §3.1, §4.2; docs/quantization.md);
- "float8_e4m3fn" (`BlockFloat8`): float8 e4m3 codes with one fp32 scale per block, max |x| / 448
  (FP8-LM, Peng et al. 2023, §2.1): the gather's float8 weights and qgZ's float8 gradient hops.

A format implements `quantize`, `dequantize`, `value_dtype` and `value_len`; the base class derives
the hops' fused steps from them (`reorder_quantize`, `dequant_sum`, `dequant_sum_quantize`), which a
format with fused kernels overrides (`BlockInt`). Adding a format is one class here and its name in
`FORMATS` (docs/DESIGN.md, "Wire formats").

References:
  ZeRO++: Wang et al. 2023, §3.1 (qwZ), §3.3 (qgZ), §4.2 (fused kernels, one collective per hop).
  FP8-LM: Peng et al. 2023, §2.1 (float8 with per-tensor scaling).
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from zerojax.quant import quantization as q
from zerojax.comm.wire import pack_wire, unpack_wire


@dataclasses.dataclass(frozen=True)
class WireFormat(abc.ABC):
  """A block format on the wire: value codes and one fp32 scale per `block` elements (0: one scale for
  the whole buffer, resolved by `for_length`).

  Subclasses set `name`, `bits` (bits per value code) and implement `quantize`, `dequantize`,
  `value_dtype` and `value_len`.
  """
  block: int = 256
  name: ClassVar[str] = ""
  bits: ClassVar[int] = 0
  scale_bytes: ClassVar[int] = 4  # fp32 scales

  # -- what a format defines ------------------------------------------------------------------------
  @property
  @abc.abstractmethod
  def value_dtype(self):
    """The dtype of the stored value codes (what `unpack` returns)."""

  @abc.abstractmethod
  def value_len(self, elements: int) -> int:
    """Stored value entries for `elements` codes."""

  @abc.abstractmethod
  def quantize(self, x: jax.Array, *, rotate: bool = False, noise: jax.Array | None = None,
               backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Flat `x` (a multiple of `block`) -> (values [value_len(n)], scales [n / block])."""

  @abc.abstractmethod
  def dequantize(self, values: jax.Array, scales: jax.Array, *, dtype=jnp.float32, rotate: bool = False,
                 backend: str | None = None) -> jax.Array:
    """Inverse of `quantize` over any leading axes, flattened: `[elements of all of them]` in `dtype`."""

  # -- derived ---------------------------------------------------------------------------------------
  @property
  def short(self) -> str:
    """How a plan's label names it ("int8", "fp8"; `Plan.label`)."""
    return self.name

  @property
  def token(self) -> str:
    """How the planner's ids name it ("8" in "qgz8", "fp8" in "qgzfp8")."""
    return str(self.bits)

  @property
  def alignment(self) -> int:
    """Elements a device's chunk is a multiple of: blocks never cross an owner's chunk."""
    return self.block or 2

  def bytes_per_element(self) -> float:
    """Wire bytes per element (the cost model's): codes plus each block's share of its scale."""
    return self.bits / 8 + (self.scale_bytes / self.block if self.block else 0.0)

  def for_length(self, elements: int) -> WireFormat:
    """This format with a block of `elements` when `block` is 0 (one scale per buffer)."""
    return self if self.block else dataclasses.replace(self, block=elements)

  def pack(self, values: jax.Array, scales: jax.Array) -> jax.Array:
    """Values and scales as one uint8 buffer `[..., V + 4 * S]`: one collective moves both, no float on
    the wire (`comm.wire.pack_wire`)."""
    return pack_wire(values, scales)

  def unpack(self, buf: jax.Array, num_values: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of `pack`: `(values in value_dtype, fp32 scales)`."""
    return unpack_wire(buf, num_values, self.value_dtype)

  def reorder_quantize(self, x: jax.Array, nodes: int, gpus: int, *, stages: int = 1, rotate: bool = False,
                       noise: jax.Array | None = None, backend: str | None = None):
    """qgZ's tensor-slice reordering, then `quantize` (ZeRO++ §3.3.3): `x [N*G*c]` viewed `[N, G, S, c/S]`
    -> values `[S, G, N, value_len(c/S)]`, scales `[S, G, N, c/(S*block)]` (`quantization.reorder_quantize`)."""
    cs = x.shape[0] // (nodes * gpus * stages)
    order = lambda a: jnp.transpose(jnp.reshape(a, (nodes, gpus, stages, cs)), (2, 1, 0, 3)).reshape(-1)
    v, s = self.quantize(order(x), rotate=rotate, noise=None if noise is None else order(noise), backend=backend)
    return (v.reshape(stages, gpus, nodes, self.value_len(cs)), s.reshape(stages, gpus, nodes, cs // self.block))

  def dequant_sum(self, values: jax.Array, scales: jax.Array, *, dtype=jnp.float32, rotate: bool = False,
                  backend: str | None = None) -> jax.Array:
    """K slabs `[K, ..., V]` dequantized and summed in fp32, slab 0 first: `[..., elements]`."""
    lead, elements = values.shape[1:-1], values.shape[-1] // self.value_len(self.block) * self.block
    acc = None
    for k in range(values.shape[0]):
      d = self.dequantize(values[k], scales[k], rotate=rotate, backend=backend)
      acc = d if acc is None else acc + d
    return acc.reshape(*lead, elements).astype(dtype)

  def dequant_sum_quantize(self, values: jax.Array, scales: jax.Array, out: WireFormat, *,
                           noise: jax.Array | None = None, backend: str | None = None):
    """qgZ's intra-node step: K slabs summed in fp32 (`dequant_sum`) and quantized in `out`, whose
    block is this format's: `(values [..., out.value_len(elements)], scales [..., elements / block])`."""
    acc = self.dequant_sum(values, scales, backend=backend)
    v, s = out.quantize(acc.reshape(-1), noise=None if noise is None else noise.reshape(-1), backend=backend)
    lead, elements = acc.shape[:-1], acc.shape[-1]
    return v.reshape(*lead, out.value_len(elements)), s.reshape(*lead, elements // out.block)


@dataclasses.dataclass(frozen=True)
class BlockInt(WireFormat):
  """Symmetric int8 / int4 codes with one fp32 scale per block (ZeRO++ §3.1): `zerojax.quant.quantization`,
  whose kernels fuse qgZ's steps (§4.2). int4 codes are packed two per byte."""
  bits: int = 8

  def __post_init__(self):
    q.qmax_of(self.bits)

  @property
  def name(self) -> str:
    return f"int{self.bits}"

  @property
  def value_dtype(self):
    return jnp.int8 if self.bits == 8 else jnp.uint8

  def value_len(self, elements: int) -> int:
    return q.packed_len(elements, self.bits)

  def quantize(self, x, *, rotate=False, noise=None, backend=None):
    return q.quantize(x, self.bits, self.block, rotate=rotate, noise=noise, backend=backend)

  def dequantize(self, values, scales, *, dtype=jnp.float32, rotate=False, backend=None):
    return q.dequantize(values, scales, self.bits, self.block, dtype=dtype, rotate=rotate, backend=backend)

  def reorder_quantize(self, x, nodes, gpus, *, stages=1, rotate=False, noise=None, backend=None):
    return q.reorder_quantize(x, nodes, gpus, self.bits, self.block, stages=stages, rotate=rotate, noise=noise,
                              backend=backend)

  def dequant_sum(self, values, scales, *, dtype=jnp.float32, rotate=False, backend=None):
    return q.dequant_sum(values, scales, self.bits, self.block, dtype=dtype, rotate=rotate, backend=backend)

  def dequant_sum_quantize(self, values, scales, out, *, noise=None, backend=None):
    if not isinstance(out, BlockInt) or out.block != self.block:
      return super().dequant_sum_quantize(values, scales, out, noise=noise, backend=backend)
    return q.dequant_sum_quantize(values, scales, self.bits, self.block, out_bits=out.bits, noise=noise,
                                  backend=backend)


@dataclasses.dataclass(frozen=True)
class BlockFloat8(WireFormat):
  """float8 e4m3 codes with one fp32 scale per block, max |x| / 448 (FP8-LM §2.1): 8 bits like int8,
  with a relative error that does not grow for a block's small values. Rounds to nearest (no rotation,
  no stochastic rounding: the plan values refuse them)."""
  name: ClassVar[str] = "float8_e4m3fn"
  bits: ClassVar[int] = 8

  @property
  def value_dtype(self):
    return jnp.uint8

  def value_len(self, elements: int) -> int:
    return elements

  @property
  def short(self) -> str:
    return "fp8"

  @property
  def token(self) -> str:
    return "fp8"

  def quantize(self, x, *, rotate=False, noise=None, backend=None):
    if rotate or noise is not None:
      raise ValueError("the float8_e4m3fn format rounds to nearest without rotation; drop rotate and "
                       "stochastic_rounding, or use an integer format")
    return q.quantize_float8(x, self.block)

  def dequantize(self, values, scales, *, dtype=jnp.float32, rotate=False, backend=None):
    return q.dequantize_float8(values, scales, self.block, dtype).reshape(-1)


FORMATS: dict[str, Callable[[int], WireFormat]] = {
    "int8": lambda block: BlockInt(block, 8),
    "int4": lambda block: BlockInt(block, 4),
    "float8_e4m3fn": BlockFloat8,
}


def of(name: str, block: int) -> WireFormat:
  """The format a plan names, with its block."""
  if name not in FORMATS:
    raise ValueError(f"wire format {name!r}; use one of {sorted(FORMATS)}")
  return FORMATS[name](block)


def integer(bits: int | None, block: int) -> WireFormat | None:
  """qwZ's / qgZ's integer format of `bits` (None: none)."""
  return None if bits is None else of(f"int{bits}", block)


def hops(grad_bits: int | tuple[int, int] | None, grad_format: str | None,
         block: int) -> tuple[WireFormat, WireFormat] | None:
  """qgZ's wire format per hop, (intra-node, inter-node), from a plan's `grad_bits` (one for both hops,
  or a pair) or `grad_format`; None without qgZ."""
  if grad_format:
    return (of(grad_format, block),) * 2
  if grad_bits is None:
    return None
  bits = tuple(grad_bits) if isinstance(grad_bits, (tuple, list)) else (grad_bits,) * 2
  return tuple(integer(b, block) for b in bits)
