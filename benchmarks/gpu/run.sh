#!/usr/bin/env bash
# The run kit for a machine with NVIDIA GPUs, in one command: bash benchmarks/gpu/run.sh [OUT_DIR]
#   1. the GPU-marked tests (`gpu`: run on the GPU -> OUT_DIR/gpu_tests.txt; `gpu_compile`: the compile-only
#      schedule checks, on the CPU host);
#   2. bench_kernels.py for every backend the device runs (xla, pallas, triton) -> OUT_DIR/kernels.json
#      (device, jax, rows of op/backend/bits/elements/gbps/ratio_to_copy against the best 4-byte copy, and
#      per row the bytes that differ from xla: recorded, never a stop);
#   3. bench_gpu_step.py -> OUT_DIR/step.json (each plan's step against a plain jitted step, interleaved,
#      swept over remat and attention; MFU) and OUT_DIR/step_xla.json (XLA option sets);
#   4. bench_offload.py: the largest GPT the host holds with offload, trained on one GPU
#      -> OUT_DIR/offload_fit_run.json (offload_fit.json is the compile-only table), and offload's step-time cost -> OUT_DIR/offload_cost.json;
#   5. a profiled train step of configs/zeropp.gin -> OUT_DIR/profile/ (a jax.profiler trace for
#      TensorBoard/Perfetto: where the collectives run beside the kernels, what only a GPU can show).
# Install first: pip install -e '.[test,bench,gpu,gpu-aot]' with a CUDA jax (pip install 'jax[cuda12]').
# For one short device session (15 minutes, no package index) use benchmarks/gpu/device_kit.sh instead:
# docs/gpu.md, "One device session" (the parts with goals, capped by a global deadline; wheels carried).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-benchmarks/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
status=0

echo "== GPU tests"
# `-m gpu` selects the GPU platform (tests/platforms.py); the compile-only checks run on the CPU host.
env -u JAX_PLATFORMS "$PY" -m pytest -q -n 0 -m gpu -rA tests/ 2>&1 | tee "$OUT/gpu_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
env -u JAX_PLATFORMS "$PY" -m pytest -q -m gpu_compile tests/ || status=1

echo "== kernels"
# Every backend against xla: differing bytes are counted per row (mismatched_bytes_vs_xla), never a stop;
# ratio_to_copy divides by the best of several 1 GiB copies of 4-byte words (copy_ceiling).
# The first run on a machine times each Pallas/Triton kernel's launch configurations (pallas_kernels/tuning.py;
# several minutes at 256M elements) and caches the winners; KERNEL_TUNING=0 uses the defaults table instead.
env -u JAX_PLATFORMS "$PY" benchmarks/bench_kernels.py --tuning "${KERNEL_TUNING:-1}" --out "$OUT/kernels.json" || status=1

echo "== train step against a plain jitted step"
# dp, zero3, zeropp and mics on the mesh of the GPUs present against jax.jit(value_and_grad) + optax of the
# same 737M-parameter GPT (bf16), interleaved repetitions; the first block is the default (remat auto,
# cuDNN attention, zerojax's XLA options) with every plan, then zero3 and plain at remat none and full and
# with the einsum attention (the before); a system that fails gets its error in its row of step.json.
env -u JAX_PLATFORMS "$PY" benchmarks/bench_gpu_step.py --remat auto,none,full --attention auto,einsum \
  --sweep_plans zero3 --steps 5 --out "$OUT/step.json" || status=1
# MaxText's GPU XLA options against zerojax's, zero3 and plain (remat auto, cuDNN attention).
env -u JAX_PLATFORMS "$PY" benchmarks/bench_gpu_step.py --plans zero3 --xla base,maxtext --sweep_plans zero3 \
  --steps 5 --out "$OUT/step_xla.json" || status=1

echo "== host offload"
# The largest GPT whose offloaded states 85% of the host holds, searched down to one that trains (each try in
# a process of its own), then the same size without offload (its out-of-memory error recorded).
# jax allocates 0.75 of the GPU by default; the fit search gives it 0.92 (the 8B-parameter goal needs > 0.8).
env -u JAX_PLATFORMS XLA_PYTHON_CLIENT_MEM_FRACTION="${FIT_MEM_FRACTION:-0.92}" "$PY" benchmarks/bench_offload.py --fit --out "$OUT/offload_fit_run.json" || status=1
# The step-time cost of each offload setting on this GPU (a 1 x 1 mesh), interleaved.
env -u JAX_PLATFORMS "$PY" benchmarks/bench_offload.py --plans dp --nodes 1 --d_model 2048 --layers 8 --seq 1024 \
  --batch_per_device 4 --dtype bfloat16 --out "$OUT/offload_cost.json" || status=1

echo "== profiled train step"
env -u JAX_PLATFORMS "$PY" - "$OUT" <<'PYEOF' || status=1
import os, sys, time
import jax, numpy as np
from zerojax.train import config as config_lib, trainer
out = sys.argv[1]
config_lib.parse(["configs/zeropp.gin"], ["train.compute_dtype='bfloat16'"])
import gin
ex = trainer.build(gin.get_bindings(trainer.train)["plan"], jax.process_count())
cfg = trainer.model_config()
state = ex.init(jax.random.key(0))
batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 4 * ex.world, cfg.seq_len + 1)).astype(np.int32)
step = ex.step_fn()
for _ in range(3):  # compile and warm up
  state, m = step(state, batch)
jax.block_until_ready(m.loss)
jax.profiler.start_trace(f"{out}/profile")
t0 = time.perf_counter()
for _ in range(5):
  state, m = step(state, batch)
jax.block_until_ready(m.loss)
jax.profiler.stop_trace()
print(f"zeropp on {jax.devices()[0].device_kind} x {ex.world}: {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms/step, "
      f"loss {float(m.loss):.3f}; trace in {out}/profile")
PYEOF
exit $status
