"""Quantization kernels behind `zerojax.quantization`: Pallas (`block_quant`) and Triton.

`block_quant` imports on any machine (its kernels run in the Pallas interpreter on CPU);
`triton_block_quant` imports on any machine too, but its kernels need a CUDA GPU and jax-triton.

References:
  ZeRO++: Wang et al. 2023, §4.2 (CUDA kernels and their fusion).
"""
from pallas_kernels import block_quant
from pallas_kernels import triton_block_quant

__all__ = ["block_quant", "triton_block_quant"]
