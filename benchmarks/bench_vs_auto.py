"""Step time of a zerojax plan against a MaxText-style GSPMD baseline, side by side in one process.

The baseline is what MaxText's FSDP does with `jax.jit`'s partitioner: every weight matrix (and its
optimizer state) is sharded on its embedding (d_model) dimension over all devices, the activations are
constrained to the batch axes (`with_sharding_constraint` after the embedding and after every block),
and the step is jitted with explicit in/out shardings; the partitioner inserts the all-gathers and
reduce-scatters. Vectors (biases, LayerNorm scales) are replicated, as MaxText's "norm" axis is. It
recomputes what the plan's units recompute (`Schedule.remat`): "full" checkpoints the embedding, each block
and the head with nothing saved, "dots" saves the matmuls without batch dimensions, "none" checkpoints
nothing. Both start from the same parameters and train on the same batches with the same optimizer.

Each repetition times `--steps` steps of one, then of the other (the order alternates between
repetitions); the ratio plan / baseline is taken per repetition and printed as the median with its min
and max over the repetitions, as are the step times. Nothing is read from earlier runs. Prints one
JSON object.

  python benchmarks/bench_vs_auto.py [--plan zero3] [--remat full] [--reps 5] [--steps 5] [--layers 4]
      [--d_model 128] [--seq_len 128] [--batch 32] [--accum 1] [--param_dtype float32]
"""
import argparse
import collections
import json
import os

if "XLA_FLAGS" not in os.environ:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax import analysis, gpu_aot
from zerojax.models.gpt import Block, GPTConfig, embed_tokens, head_loss, gpt
from zerojax.train.optim import make_optimizer
from common import interleaved, spread  # benchmarks/, this script's directory

DATA = ("node", "gpu")
# The embedding dimension of each weight matrix (MaxText's "embed" logical axis): wte [vocab, d],
# wpe [seq, d], qkv [L, d, 3d], proj [L, d, d] (its output), fc [L, d, 4d], out [L, 4d, d], w_out [d, vocab].
EMBED_DIM = {"wte": -1, "wpe": -1, "qkv": 1, "proj": 2, "fc": 1, "out": 2, "w_out": 0}
POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _names(path):
  return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def embed_spec(path, shape, d_model):
  """FSDP on the embedding dimension: `P` sharding it over all devices; vectors (biases, LayerNorm
  scales, per layer or not) replicated."""
  names = _names(path)
  name = names[-2] if names[-1] == "kernel" else names[-1]
  if name not in EMBED_DIM:
    return P()
  dim = EMBED_DIM[name] % len(shape)
  if shape[dim] != d_model:
    raise ValueError(f"{jax.tree_util.keystr(path)}: dimension {dim} of {shape} is not d_model={d_model}")
  return P(*[DATA if i == dim else None for i in range(len(shape))])


def gspmd_loss(cfg: GPTConfig, mesh, remat: str):
  """The GPT's loss with MaxText's activation constraints and the plan's remat."""
  block = Block(cfg)
  batch_sharded = NamedSharding(mesh, P(DATA, None, None))
  wrap = (lambda f: f) if remat == "none" else (lambda f: jax.checkpoint(f, policy=POLICIES[remat]))
  embed, head = wrap(embed_tokens), wrap(head_loss)
  block_fn = wrap(lambda p, x: block.apply({"params": p}, x))

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = lax.with_sharding_constraint(embed(params["embed"], inputs), batch_sharded)
    x, _ = lax.scan(lambda x, p: (lax.with_sharding_constraint(block_fn(p, x), batch_sharded), None), x,
                    params["blocks"])
    return head(params["head"], x, targets)
  return loss


def gspmd_step(cfg, params, opt, mesh, accum, remat):
  """(jitted step, sharded params, sharded optimizer state, batch sharding, the step's compiled memory)."""
  loss = gspmd_loss(cfg, mesh, remat)

  def step(params, opt_state, batch):
    def micro(acc, tokens):
      value, g = jax.value_and_grad(loss)(params, tokens)
      return jax.tree.map(jnp.add, acc, g), value
    g, losses = lax.scan(micro, jax.tree.map(jnp.zeros_like, params), batch)
    updates, opt_state = opt.update(jax.tree.map(lambda x: x / accum, g), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jnp.mean(losses)

  specs = jax.tree_util.tree_map_with_path(lambda p, x: embed_spec(p, x.shape, cfg.d_model), params)
  by_path = {tuple(_names(p)): s for p, s in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda s: isinstance(s, P))}

  def opt_spec(path, x):  # an optimizer-state leaf is sharded like the parameter whose path ends its own
    names = tuple(_names(path))
    for k in range(len(names)):
      if names[k:] in by_path and x.ndim:
        return by_path[names[k:]]
    return P()
  p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
  o_sh = jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, opt_spec(p, x)),
                                          jax.eval_shape(opt.init, params))
  b_sh = NamedSharding(mesh, P(None, DATA))
  params = jax.device_put(params, p_sh)
  opt_state = jax.jit(opt.init, out_shardings=o_sh)(params)
  jitted = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh), out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())),
                   donate_argnums=(0, 1))
  return jitted, params, opt_state, b_sh


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--plan", default="zero3", choices=sorted(zerojax.PLANS))
  ap.add_argument("--remat", default=None, choices=("full", "dots", "none"), help="default: the plan's")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--steps", type=int, default=5, help="timed steps per system and repetition")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--d_model", type=int, default=128)
  ap.add_argument("--seq_len", type=int, default=128)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--accum", type=int, default=1)
  ap.add_argument("--param_dtype", default="float32")
  args = ap.parse_args(argv)
  if args.reps < 3:
    ap.error(f"--reps {args.reps}: use at least 3 repetitions")
  cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, num_layers=args.layers)
  model, opt, mesh = gpt(cfg), make_optimizer(total_steps=1000), zerojax.make_mesh(2, 4)
  plan = zerojax.PLANS[args.plan](param_dtype=args.param_dtype, remat=args.remat, pad_multiple=256)
  remat = plan.remat_mode
  params = jax.jit(model.init)(jax.random.key(0))
  ex = zerojax.Executor(model, opt, plan, mesh, accum_steps=args.accum)
  state, zstep = ex.init_from_params(params), ex.step_fn()
  astep, aparams, aopt, b_sh = gspmd_step(cfg, params, opt, mesh, args.accum, remat)
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 256, (args.accum, args.batch, args.seq_len + 1)).astype(np.int32)
             for _ in range(args.steps)]
  zb = [jax.device_put(b, ex.batch_sharding) for b in batches]
  ab = [jax.device_put(b, b_sh) for b in batches]
  state, m = zstep(state, zb[0])  # compile, and the first step's loss from the same parameters
  aparams, aopt, aloss = astep(aparams, aopt, ab[0])
  first = {"zerojax": float(m.loss), "gspmd": float(aloss)}
  compiled = {"zerojax": ex.step_fn().lower(state, zb[0]).compile(), "gspmd": astep.lower(aparams, aopt, ab[0]).compile()}
  memory = {k: gpu_aot.memory(c)["temp"] for k, c in compiled.items()}
  collectives = {k: dict(collections.Counter(x.op for x in analysis.collectives_from_hlo(c.as_text(), mesh)
                                             for _ in range(x.count)))
                 for k, c in compiled.items()}

  def run_zerojax(i):
    nonlocal state, m
    state, m = zstep(state, zb[i])
    jax.block_until_ready(m)

  def run_gspmd(i):
    nonlocal aparams, aopt, aloss
    aparams, aopt, aloss = astep(aparams, aopt, ab[i])
    jax.block_until_ready(aloss)
  times = interleaved({"zerojax": run_zerojax, "gspmd": run_gspmd}, args.reps, steps=args.steps)
  ratios = [z / a for z, a in zip(times["zerojax"], times["gspmd"])]
  print(json.dumps({
      "benchmark": "zerojax_vs_gspmd_fsdp", "plan": plan.name, "remat": remat, "devices": mesh.size,
      "mesh": {k: int(v) for k, v in mesh.shape.items()}, "backend": jax.default_backend(), "jax": jax.__version__,
      "config": vars(args), "baseline": "params sharded on d_model over all devices, activations on the batch axes",
      "step_s": {k: spread(v) for k, v in times.items()}, "ratio_zerojax_over_gspmd": spread(ratios),
      "temp_bytes": {k: int(v) for k, v in memory.items()}, "collectives_per_step": collectives,
      "first_loss": first,
      "last_loss": {"zerojax": float(m.loss), "gspmd": float(aloss)}}, indent=1))


if __name__ == "__main__":
  main()
