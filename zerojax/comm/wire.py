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
  """One-byte value codes and their scales as one uint8 buffer `[..., V + itemsize * S]`.

  One collective then moves both (fewer, larger messages), and no floating-point data is on the wire:
  the scales travel as raw bytes (bitcast, never converted or reduced). What the codes and scales are
  is the wire format's (`comm.formats`).
  """
  v = values if values.dtype == jnp.uint8 else lax.bitcast_convert_type(values, jnp.uint8)
  s = lax.bitcast_convert_type(scales, jnp.uint8)  # [..., S, itemsize]
  return jnp.concatenate([v, s.reshape(*scales.shape[:-1], -1)], axis=-1)


def unpack_wire(buf: jax.Array, num_values: int, value_dtype=jnp.uint8,
                scale_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Inverse of `pack_wire`: `(values in value_dtype, scales in scale_dtype)` from the uint8 buffer."""
  v, s = buf[..., :num_values], buf[..., num_values:]
  if jnp.dtype(value_dtype) != jnp.uint8:
    v = lax.bitcast_convert_type(v, value_dtype)
  s = lax.bitcast_convert_type(s.reshape(*s.shape[:-1], -1, jnp.dtype(scale_dtype).itemsize), scale_dtype)
  return v, s
