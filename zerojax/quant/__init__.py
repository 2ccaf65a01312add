"""The block quantizers' front and which kernel backend runs each op (docs/quantization.md)."""
