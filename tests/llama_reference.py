"""The reference side of the Llama tests and of benchmarks/bench_llama_parity.py: tiny random Hugging Face
configs of the Llama family, their PyTorch models (transformers 5, CPU, fp32) and the relative difference."""
import functools

import numpy as np
import torch
import transformers

SEQ = 16
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
# Llama 3's scaling with wavelengths in all three bands (kept, interpolated, divided) for head_dim 8.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CONFIGS = {
    "llama_gqa": lambda: transformers.LlamaConfig(**COMMON),
    "llama3_rope": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=dict(LLAMA3)),
    "mistral": lambda: transformers.MistralConfig(**COMMON, head_dim=16),  # head_dim != hidden / heads
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),  # q, k, v biases
    "tied_mqa": lambda: transformers.LlamaConfig(**COMMON | {"num_key_value_heads": 1}, tie_word_embeddings=True),
}
TOKENS = np.random.default_rng(0).integers(0, COMMON["vocab_size"], (2, SEQ + 1))


@functools.cache
def torch_model(name):
  """A random fp32 model; every weight random (norms around one, biases nonzero) so each one matters."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).float().eval()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.05 * torch.randn_like(p))
  return model


def torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()




def rel(got, want) -> float:
  """max |got - want| / max |want|."""
  return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))
