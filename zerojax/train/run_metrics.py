"""What a step's record says beyond the loss: the learning rate, model FLOP/s and MFU, device memory, and
the step's metrics read one step late so the host never makes the device wait.

Model FLOPs per token are counted for the built-in models as PaLM's appendix B and nanoGPT do:
`6 N + 12 L d T` (N the parameters in matrix multiplies, embeddings included, learned positions not; L
layers, d the attention width, T the sequence length: the forward and backward of every matmul, and of
the attention's scores and values without causal halving). A user's model (`--model`) has no count:
its records carry no FLOP/s. MFU is that rate over the device kind's dense bf16 peak
(`zerojax.hardware.peak_flops`); devices not in its table (CPUs) get none.

References:
  Chowdhery et al. 2022, "PaLM", appendix B (model FLOPs utilization).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import numpy as np


def flops_per_token(spec) -> float | None:
  """`6 N + 12 L d T` for a built-in model (`zerojax.train.model_spec.ModelSpec`), else None."""
  c = spec.config
  if spec.architecture == "gpt":
    d, L = c.d_model, c.num_layers
    n = L * (4 * d * d + 2 * c.mlp_ratio * d * d) + 2 * c.vocab_size * d
    width = d
  elif spec.architecture == "llama":
    d, L, hd = c.d_model, c.num_layers, c.head_size
    attn = d * hd * (c.num_heads + 2 * c.num_kv_heads) + c.num_heads * hd * d
    n = L * (attn + 3 * d * c.d_ff) + c.vocab_size * d * (1 if c.tie_embeddings else 2)
    width = c.num_heads * hd
  else:
    return None
  return 6.0 * n + 12.0 * L * width * c.seq_len


def device_memory() -> dict:
  """Bytes in use and at peak on this process's first device, where the backend reports them."""
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 - a backend without memory statistics
    stats = {}
  out = {"device_bytes_in_use": stats.get("bytes_in_use"), "device_peak_bytes": stats.get("peak_bytes_in_use")}
  return {k: v for k, v in out.items() if v is not None}


@dataclasses.dataclass
class Rates:
  """Turns a step's time into tokens/s, model TFLOP/s per device and MFU."""
  tokens_per_step: int
  flops_per_token: float | None
  devices: int
  peak: float | None

  def of(self, seconds: float) -> dict:
    out = {"tokens_per_s": self.tokens_per_step / seconds}
    if self.flops_per_token is not None:
      per_device = self.tokens_per_step * self.flops_per_token / seconds / self.devices
      out["model_tflops_per_device"] = per_device / 1e12
      if self.peak:
        out["mfu"] = per_device / self.peak
    return out


class Dispatched(NamedTuple):
  """A step handed to the device whose metrics are not yet read."""
  step: int            # the step count after it
  metrics: Any         # its StepMetrics (device arrays)
  skipped: Any         # the state's skip count after it (a device array), or None
  dispatched: float    # perf_counter when it was handed over
  data_wait: float


class Done(NamedTuple):
  """A step's metrics on the host."""
  step: int
  loss: float
  finite: bool
  grad_norm: float
  skipped: int | None
  seconds: float       # from when the device could start it to when its metrics were ready
  data_wait: float


def read(d: Dispatched, previous_done: float | None) -> tuple[Done, float]:
  """`d`'s metrics on the host (blocks until the step is done); also the time they were ready.

  Called after the next step was dispatched, so the device computes that one meanwhile.
  """
  loss, finite, grad_norm, skipped = jax.device_get((d.metrics.loss, d.metrics.finite, d.metrics.grad_norm,
                                                     d.skipped))
  now = time.perf_counter()
  start = d.dispatched if previous_done is None else max(d.dispatched, previous_done)
  return Done(d.step, float(loss), bool(finite), float(grad_norm), None if skipped is None else int(np.sum(skipped)),
              now - start, d.data_wait), now
