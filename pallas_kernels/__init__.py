"""Quantization kernels behind `zerojax.quant.quantization`: Pallas (`block_quant`) and Triton.

Both import on any machine. Their kernels are chosen by the platform a program is lowered for
(`per_platform`): `block_quant`'s run in the Pallas interpreter when lowered for the CPU and compile
through Triton when lowered for CUDA (also from a CPU host, for compile-only GPUs);
`triton_block_quant`'s need jax-triton and lower only for CUDA.

References:
  ZeRO++: Wang et al. 2023, §4.2 (CUDA kernels and their fusion).
"""
from pallas_kernels import block_quant
from pallas_kernels import triton_block_quant

__all__ = ["block_quant", "triton_block_quant"]
