"""What travels on the wire: 16-bit floats as raw words, quantized values and scales in one byte buffer.

XLA's CPU backend widens 16-bit float collectives to fp32 (twice the bytes); a collective that only moves
data can carry the raw bit patterns instead. Quantized collectives pack values and fp32 scales into one
uint8 buffer, so one collective moves both and no float is on the wire.

References:
  ZeRO++: Wang et al. 2023, §3.1 (qwZ), §3.3 (qgZ), §4.2 (one collective per hop).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def all_gather_raw(x: jax.Array, axes, **kw) -> jax.Array:
  """`lax.all_gather` that moves 16-bit floats as raw 16-bit words.

  A gather only moves data, so bf16/fp16 travel as uint16 bit patterns: XLA's CPU backend would otherwise
  widen 16-bit float collectives to fp32 and send twice the bytes.
  """
  if x.dtype.itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    return lax.all_gather(x, axes, **kw)
  return lax.bitcast_convert_type(lax.all_gather(lax.bitcast_convert_type(x, jnp.uint16), axes, **kw), x.dtype)


def pack_wire(values: jax.Array, scales: jax.Array) -> jax.Array:
  """Quantized values and their fp32 scales as one uint8 buffer `[..., V + 4 * S]`.

  One collective then moves both (fewer, larger messages), and no floating-point data is on the wire:
  the scales travel as raw bytes (bitcast, never converted or reduced).
  """
  v = lax.bitcast_convert_type(values, jnp.uint8) if values.dtype == jnp.int8 else values
  s = lax.bitcast_convert_type(scales, jnp.uint8)  # [..., S, 4]
  return jnp.concatenate([v, s.reshape(*scales.shape[:-1], -1)], axis=-1)


def unpack_wire(buf: jax.Array, num_values: int, bits: int) -> tuple[jax.Array, jax.Array]:
  """Inverse of `pack_wire`: `(values, scales)` from `[..., V + 4 * S]` uint8."""
  v, s = buf[..., :num_values], buf[..., num_values:]
  if bits == 8:
    v = lax.bitcast_convert_type(v, jnp.int8)
  s = lax.bitcast_convert_type(s.reshape(*s.shape[:-1], -1, 4), jnp.float32)
  return v, s
