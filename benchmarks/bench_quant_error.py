"""Quantization error of model weights: block-wise against per-tensor scales, int8 and int4, and the
float8 gather's block-wise float8_e4m3fn (`weight_format`).

For every leaf of a params pytree, quantizes it with one scale per block of `--block` elements (the
ZeRO++ format) and with one scale for the whole leaf (per-tensor), dequantizes, and reports the
relative L2 error and the max absolute error, per leaf and over the whole pytree. Prints one JSON
object. Weights come from an `.npz` of arrays (`--params`), else from a model-like random init with
outlier weights (key "source" says which).

  python benchmarks/bench_quant_error.py [--params weights.npz] [--block 256]

References:
  ZeRO++: Wang et al. 2023, §3.1 (block-based quantization keeps the error of int8/int4 weights
  low where per-tensor scales do not; Figure 2: 3x lower error on BERT weights).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from zerojax.quant import quantization as Q  # noqa: E402


def _errors(x, bits, block, backend):
  """(sum of squared errors, max abs error) of one leaf quantized with `block`."""
  x32 = jnp.ravel(x).astype(jnp.float32)
  v, s = Q.quantize(x, bits, block, backend=backend)
  err = Q.dequantize(v, s, bits, block, size=x32.shape[0], backend=backend) - x32
  return float(jnp.sum(err * err)), float(jnp.max(jnp.abs(err)))


def _float8_errors(x, block):
  """(sum of squared errors, max abs error) of one leaf as float8_e4m3fn blocks (FP8-LM §2.1)."""
  x32 = jnp.ravel(x).astype(jnp.float32)
  padded = jnp.pad(x32, (0, -x32.shape[0] % block))
  codes, scales = Q.quantize_float8(padded, block)
  err = Q.dequantize_float8(codes, scales, block, jnp.float32)[: x32.shape[0]] - x32
  return float(jnp.sum(err * err)), float(jnp.max(jnp.abs(err)))


def quant_error_report(params, *, block: int = 256, bits=(8, 4), backend: str = "xla") -> dict:
  """Block-wise vs per-tensor quantization error over the leaves of `params`.

  Args:
    params: a pytree of float arrays.
    block: elements per block for the block-wise scales.
    bits: the code widths to evaluate.
    backend: quantization backend.

  Returns:
    {"parameters", "leaves", "block", "int8": {"blockwise": {...}, "per_tensor": {...}}, ...,
    "per_leaf": [...]} with relative L2 errors (||deq - x|| / ||x||) and max absolute errors.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  norm2 = 0.0
  totals = {(b, m): [0.0, 0.0] for b in bits for m in ("blockwise", "per_tensor")}
  f8 = [0.0, 0.0]
  per_leaf = []
  for path, x in leaves:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.size == 0:
      continue
    x2 = float(jnp.sum(jnp.square(x.astype(jnp.float32))))
    norm2 += x2
    row = dict(name=jax.tree_util.keystr(path), shape=list(x.shape))
    whole = x.size + x.size % 2  # one block for the whole leaf (even, for int4 pairs)
    for b in bits:
      for method, blk in (("blockwise", block), ("per_tensor", whole)):
        sq, mx = _errors(x, b, blk, backend)
        totals[b, method][0] += sq
        totals[b, method][1] = max(totals[b, method][1], mx)
        row[f"int{b}_{method}_rel_l2"] = float(np.sqrt(sq / x2)) if x2 else 0.0
    sq, mx = _float8_errors(x, block)
    f8[0] += sq
    f8[1] = max(f8[1], mx)
    row["float8_blockwise_rel_l2"] = float(np.sqrt(sq / x2)) if x2 else 0.0
    per_leaf.append(row)
  report = dict(parameters=int(sum(np.prod(r["shape"]) for r in per_leaf)),
                leaves=len(per_leaf), block=block)
  for b in bits:
    entry = {m: dict(rel_l2=float(np.sqrt(totals[b, m][0] / norm2)), max_abs=totals[b, m][1])
             for m in ("blockwise", "per_tensor")}
    entry["per_tensor_over_blockwise_rel_l2"] = (entry["per_tensor"]["rel_l2"] /
                                                 entry["blockwise"]["rel_l2"])
    report[f"int{b}"] = entry
  report["float8_e4m3fn"] = {"blockwise": dict(rel_l2=float(np.sqrt(f8[0] / norm2)), max_abs=f8[1])}
  report["per_leaf"] = per_leaf
  return report


def model_like_init(seed: int = 0, vocab: int = 8192, d_model: int = 256, layers: int = 4):
  """GPT-shaped random weights with the outliers trained transformers show.

  Scaled-normal matrices, LayerNorm scales near 1, zero biases; then a few "outlier feature"
  columns (x8) and rare large single weights (0.1% of entries, x20).
  """
  rng = np.random.default_rng(seed)

  def matrix(fan_in, fan_out, std):
    w = rng.normal(0.0, std, (fan_in, fan_out))
    w[:, rng.choice(fan_out, max(1, fan_out // 128), replace=False)] *= 8.0
    hit = rng.random(w.shape) < 1e-3
    w[hit] *= 20.0
    return w.astype(np.float32)

  d = d_model
  params = {"embed": matrix(vocab, d, 0.02), "final_norm": np.ones(d, np.float32)}
  for i in range(layers):
    params[f"layer_{i}"] = {
        "attn_norm": (1.0 + rng.normal(0, 0.05, d)).astype(np.float32),
        "qkv": matrix(d, 3 * d, d ** -0.5),
        "attn_out": matrix(d, d, 0.02 / np.sqrt(2 * layers)),
        "mlp_norm": (1.0 + rng.normal(0, 0.05, d)).astype(np.float32),
        "mlp_in": matrix(d, 4 * d, d ** -0.5),
        "mlp_in_bias": np.zeros(4 * d, np.float32),
        "mlp_out": matrix(4 * d, d, 0.02 / np.sqrt(2 * layers)),
    }
  return params


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--params", help="an .npz of weight arrays (e.g. from a short training run)")
  ap.add_argument("--block", type=int, default=256)
  ap.add_argument("--backend", default="xla")
  ap.add_argument("--per_leaf", action="store_true", help="include the per-leaf table")
  args = ap.parse_args()
  if args.params:
    with np.load(args.params) as f:
      params = {k: f[k] for k in f.files}
    source = f"npz:{args.params}"
  else:
    params = model_like_init()
    source = "random_init_with_outliers (GPT-shaped, 4 layers, d_model 256, vocab 8192)"
  report = quant_error_report(params, block=args.block, backend=args.backend)
  if not args.per_leaf:
    report.pop("per_leaf")
  print(json.dumps(dict(source=source, **report), indent=1))


if __name__ == "__main__":
  main()
