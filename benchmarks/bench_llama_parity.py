"""The Llama family against transformers 5 (PyTorch, CPU, fp32): the figures docs/huggingface.md quotes.

  python benchmarks/bench_llama_parity.py [--out benchmarks/llama_parity.json]

For each tiny random config of `tests/llama_reference.py` (what `tests/test_llama.py` checks) (Llama with grouped-query attention, Llama 3 RoPE scaling,
Mistral, Qwen2, tied multi-query): the checkpoint `save_pretrained` writes, read by `read_hf_dir`; the largest
difference of the logits over the largest logit, and of every weight's gradient of the mean next-token loss
over that gradient's largest entry (the worst tensor). Prints JSON; a failed config is recorded.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import error_text, print_and_save  # noqa: E402


def measure(name: str, folder: str) -> dict:
  import jax
  import jax.numpy as jnp
  import torch
  from tests import llama_reference as T
  from zerojax.models import llama as L
  from zerojax.models import llama_hf as H
  model = T.torch_model(name)
  model.save_pretrained(folder)
  cfg, _, params = H.read_hf_dir(folder, T.SEQ)
  params = jax.tree.map(jnp.asarray, params)
  logits = T.rel(jax.jit(L.logits, static_argnums=0)(cfg, params, T.TOKENS[:, :-1]),
                 T.torch_logits(model, T.TOKENS[:, :-1]))
  named = dict(model.named_parameters())
  out = model(torch.tensor(T.TOKENS[:, :-1])).logits
  loss = torch.nn.functional.cross_entropy(out.reshape(-1, cfg.vocab_size), torch.tensor(T.TOKENS[:, 1:]).reshape(-1))
  grads = dict(zip(named, (g.numpy() for g in torch.autograd.grad(loss, list(named.values())))))
  want = H.params_from_hf(grads.__getitem__, grads, cfg)
  _, got = jax.jit(jax.value_and_grad(L.llama(cfg).loss))(params, T.TOKENS)
  return {"logits_rel": logits, "worst_gradient_rel": max(jax.tree.leaves(jax.tree.map(T.rel, got, want)))}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  from tests import llama_reference as T
  rows = {}
  for name in T.CONFIGS:
    with tempfile.TemporaryDirectory() as folder:
      try:
        rows[name] = measure(name, folder)
      except Exception as e:  # noqa: BLE001 - recorded, the benchmark goes on
        rows[name] = {"error": error_text(e)}
  print_and_save({"configs": rows, "reference": "transformers 5 (PyTorch, CPU, fp32)",
                  "command": "python benchmarks/bench_llama_parity.py"},
                 lambda r: "; ".join(f"{n}: {v.get('logits_rel', float('nan')):.1e} / "
                                     f"{v.get('worst_gradient_rel', float('nan')):.1e}" for n, v in r["configs"].items()),
                 args.out)


if __name__ == "__main__":
  main()
