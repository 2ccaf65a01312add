#!/usr/bin/env bash
# The GPU kit in one short device session (docs/gpu.md, "One device session"): run from the repository root
# on a machine with one H100 (or H200), Python 3.12 and jax with its CUDA plugin, flax, optax, orbax and triton
# installed but no package index:
#
#   OUT=$OUT DEADLINE=540 bash benchmarks/gpu/device_kit.sh
#
# Wheels: the packages that machine lacks travel in the git-ignored folder .whl/, copied with the repository.
# Fill it here, once (pure-Python wheels, ~170 kB; their needs, absl-py, numpy, packaging, protobuf and
# triton >= 3.6, are on that machine):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl gin-config tensorboardX jax-triton==0.3.1
#
# (2026-11-27: gin_config-0.5.0, tensorboardx-2.6.5, jax_triton-0.3.1, all py3-none-any.) They are installed
# with `pip install --no-index --no-deps --target /tmp/site` and the project runs from PYTHONPATH=<repo>:/tmp/site.
#
# The parts, in this order (PARTS overrides it); each runs under timeout with limit min(cap, time left before
# DEADLINE - keep), and is skipped when that is under its need, so the whole ends inside DEADLINE seconds.
# Estimates come from the second H100 run (../shared/data/gpu-h100-2026-11-26: run_commands.sh's caps, the
# benchmarks' compile_s and ms_per_step) and from compiling the kernels for a compile-only H100:
#
#   part          estimate need  cap keep  what, and where the estimate comes from
#   (setup)          10 s                  wheels installed, versions and nvidia-smi -> kit.log
#   step            100 s   60  150    0   bench_gpu_step.py at its defaults (737M GPT, bf16, remat auto, cuDNN
#                                          attention, 8 steps x 3 reps): plain, dp, zero3, zeropp, mics -> step.json.
#                                          Compiles: plain 10.9 s, plans 4-4.5 s each, each once more for remat
#                                          auto's choice (~45 s); 5 x 3 x 8 steps at ~0.1 s (~15 s); start ~15 s.
#   offload_cost     80 s   40  120    0   bench_offload.py cost mode: dp, d_model 2048, 8 layers, seq 1,024, bf16,
#                                          1 x 1, offload none / opt_state (bulk, streamed) / opt_state+master
#                                          (bulk, streamed, streamed_serial, host), 5 steps x 3 reps
#                                          interleaved -> offload_cost.json.
#                                          6 compiled systems ~8 s each; 3 x 5 steps of ~1.1 s for all six.
#   kernels         220 s   60  240   95   bench_kernels.py --sizes 256M --tuning 1 --no_fusion, backends
#                                          $KBACKENDS (default pallas) -> kernels.json; the winners -> kernel_tuning.json.
#                                          Tuning compiles 18 keys' candidates (12 one-slab ops x 14 + 6 K-slab
#                                          x 28 = 336; compiled for a compile-only H100 on a 2-core host, int8
#                                          quantize took 0.43 s a candidate in pallas, 0.70 s rotated (triton
#                                          0.32 / 0.89 s): ~190 s) + 36 rows and the copy ceiling (~30 s). With
#                                          the winners carried (benchmarks/gpu/kernel_tuning.json) ~40 s.
#   tests            95 s   60  120    0   pytest -m gpu -n 0 (32 tests, 91.5 s in the second run) -> kit.log
#                                          (full output) and kit.json (counts, failures); kernels untuned.
#   step_remat      105 s   45  120    0   bench_gpu_step.py --plans zero3 --remat <modes that fit the time
#                                          left> --steps 4 --reps 2 (the full kit: 8 x 3): zero3 vs plain at
#                                          full, dots, none, offloaded -> step_remat.json. ~25 s + ~20 s a mode.
#   offload_fit     300 s  240  600    0   bench_offload.py --fit --max_probes 3, each try capped so the
#                                          search ends inside its limit -> offload_fit.json (4.09B took
#                                          2.2 s/step; each try ~60-120 s).
#
# The first four fit 540 s (~505 s); step_remat and offload_fit run with what is left (with the tuning
# winners carried, step_remat fits). The step parts run with XLA_PYTHON_CLIENT_MEM_FRACTION=0.92: under
# remat auto ("none" on an H100 at batch 8) five systems' states (5 x 8.85 GB), the parameters (2.95 GB)
# and "none"'s temporaries (20.9 GB) need ~68 GB, over the default 0.75 of 80 GB. Every other part runs with
# ZEROJAX_KERNEL_TUNING=0 (the defaults table): only the kernels part times launch configurations.
# Each benchmark records a failing system or a differing kernel in its JSON and goes on.
#
# Outputs under $OUT (at most 8 files, so that a harness that copies a few files back gets them all; the kit's
# own from an earlier run are removed first): kit.json (versions, per part its limit, seconds, exit status;
# the goals of issues 42, 44 and 46 and the test counts, from benchmarks/gpu/kit_summary.py, rewritten after
# every part), kit.log (every part's output), step.json, offload_cost.json, kernels.json, kernel_tuning.json,
# step_remat.json, offload_fit.json.
# A part's status: ok, timeout, skipped, or failed (non-zero exit: a benchmark exits 1 where a row holds an
# error, and its JSON is written all the same).
#
# DRY=1: on this CPU machine (JAX_PLATFORMS=cpu), every part at tiny sizes (a few minutes): the same command
# lines with size flags appended (argparse keeps the last). PLAN=1: print each part's command line, run nothing.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
ROOT=$PWD
DRY=${DRY:-0}
PLAN=${PLAN:-0}
DEADLINE=${DEADLINE:-540}
PY=${PYTHON:-python3}
PARTS=${PARTS:-step offload_cost kernels tests step_remat offload_fit}
KBACKENDS=${KBACKENDS:-pallas}
WHEELS=${WHEELS:-.whl}
START=$(date +%s)

#      name         estimate need cap keep
TABLE="step          100  60  150   0
       offload_cost   80  40  120   0
       kernels       220  60  240  95
       tests          95  60  120   0
       step_remat    105  45  120   0
       offload_fit   300 240  600   0"
field() { echo "$TABLE" | awk -v n="$1" -v i="$2" '$1 == n {print $i}'; }
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# The first items of a comma-separated list that fit `seconds` at `base` + `each` per item.
fitting() {
  local list=$1 seconds=$2 base=$3 each=$4 n
  n=$(( (seconds - base) / each )); [ $n -lt 1 ] && n=1
  echo "$list" | cut -d, -f1-$n
}

if [ "$DRY" = 1 ]; then  # tiny sizes on CPU: appended, so they override the GPU sizes before them
  export JAX_PLATFORMS=cpu
  OUT=${OUT:-/tmp/device_kit_dry}
  TINY_STEP="--d_model 32 --layers 1 --heads 2 --vocab 64 --seq 16 --batch 2 --steps 1 --reps 1 --devices 1"
  TINY_OFFLOAD="--d_model 32 --layers 1 --seq 16 --batch_per_device 2 --dtype float32 --steps 1 --reps 1"
  TINY_KERNELS="--sizes 2K --copy_size 1M --reps 1"
  TINY_FIT="--d_model 128 --seq 16 --steps 2 --host_bytes 1.3e8 --max_probes 1"
else
  unset JAX_PLATFORMS  # the GPU (the tests select it themselves: tests/platforms.py)
  OUT=${OUT:-/tmp/out}
  TINY_STEP="" TINY_OFFLOAD="" TINY_KERNELS="" TINY_FIT=""
fi
LOG=$OUT/kit.log

if [ "$PLAN" != 1 ]; then
  WORK=$(mktemp -d /tmp/device_kit.XXXXXX)
  mkdir -p "$OUT"
  rm -f "$OUT"/{kit.json,kit.log,step.json,offload_cost.json,kernels.json,kernel_tuning.json,step_remat.json,offload_fit.json}
  : > "$LOG"
  SITE=${SITE:-$([ "$DRY" = 1 ] && echo "$WORK/site" || echo /tmp/site)}
  if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl >> "$LOG" 2>&1 || echo "wheel install failed" | tee -a "$LOG"
    export PYTHONPATH=$ROOT:$SITE
  else
    echo "no wheels in $WHEELS: gin-config, tensorboardX and jax-triton must be installed" | tee -a "$LOG"
    export PYTHONPATH=$ROOT
  fi
  export ZEROJAX_TEST_CACHE=0 ZEROJAX_KERNEL_TUNING=0 ZEROJAX_KERNEL_TUNING_CACHE=$WORK/kernel_tuning.json
  [ -f benchmarks/gpu/kernel_tuning.json ] && cp benchmarks/gpu/kernel_tuning.json "$ZEROJAX_KERNEL_TUNING_CACHE"
  { command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import sys, jax, flax, optax, gin, tensorboardX; print('python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" 2>&1 | tail -1
    "$PY" -c "import triton, jax_triton; print('triton', triton.__version__, 'jax_triton', jax_triton.__version__)" 2>&1 | tail -1
  } > "$WORK/versions.txt"
  tee -a "$LOG" < "$WORK/versions.txt"
fi

summary() {
  "$PY" benchmarks/gpu/kit_summary.py --out "$OUT" --parts "$WORK/parts.tsv" --versions "$WORK/versions.txt" \
    --tests_log "$WORK/tests.log" --deadline "$DEADLINE" --elapsed $(( $(date +%s) - START )) --dry "$DRY" "$@"
}

part() {  # name command...: runs the command under the part's limit; its output -> $WORK/name.log and kit.log
  local name=$1 est need cap keep lim t0 rc status; shift
  est=$(field "$name" 2) need=$(field "$name" 3) cap=$(field "$name" 4) keep=$(field "$name" 5)
  if [ "$PLAN" = 1 ]; then printf '%s\t%s\n' "$name" "$*"; return 0; fi
  lim=$(( $(left) - keep )); [ "$lim" -gt "$cap" ] && lim=$cap
  if [ "$lim" -lt "$need" ]; then
    echo "== $name: skipped (${lim}s left for it, needs ${need}s)" | tee -a "$LOG"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$est" "$lim" 0 "" skipped >> "$WORK/parts.tsv"
    summary > /dev/null
    return 0
  fi
  echo "== $name (limit ${lim}s, estimate ${est}s): $*" | tee -a "$LOG"
  t0=$(date +%s)
  timeout -k 5 "$lim" "$@" > "$WORK/$name.log" 2>&1; rc=$?
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  cat "$WORK/$name.log" >> "$LOG"
  tail -n 25 "$WORK/$name.log" | cut -c1-300
  echo "== $name: $status (rc $rc) in $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$est" "$lim" $(( $(date +%s) - t0 )) "$rc" "$status" >> "$WORK/parts.tsv"
  summary > /dev/null
}

# 1. issue 42: each plan against plain at the defaults (>= 400 TF/s, every plan <= 1.02x plain)
want step && part step env XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 "$PY" benchmarks/bench_gpu_step.py \
  --plans dp,zero3,zeropp,mics --remat auto --attention auto --out "$OUT/step.json" $TINY_STEP
# 2. issue 44: offload's step-time cost per update (streamed <= 145 ms; bulk was 249 ms)
want offload_cost && part offload_cost "$PY" benchmarks/bench_offload.py --plans dp --nodes 1 --d_model 2048 \
  --layers 8 --seq 1024 --batch_per_device 4 --dtype bfloat16 --updates bulk,streamed,streamed_serial,host \
  --steps 5 --reps 3 --out "$OUT/offload_cost.json" $TINY_OFFLOAD
# 3. issue 46: GB/s at 256M elements with tuned launch configurations; the winners stay in the cache
want kernels && part kernels "$PY" benchmarks/bench_kernels.py --sizes 256M --backends "$KBACKENDS" --tuning 1 \
  --no_fusion --out "$OUT/kernels.json" $TINY_KERNELS
[ "$PLAN" != 1 ] && want kernels && [ -f "$ZEROJAX_KERNEL_TUNING_CACHE" ] && cp "$ZEROJAX_KERNEL_TUNING_CACHE" "$OUT/kernel_tuning.json"
# 4. the gpu-marked tests on the GPU (on CPU, DRY: they skip)
want tests && part tests "$PY" -m pytest -q -p no:cacheprovider -n 0 -m gpu -rA tests/
# 1, if time is left: zero3 against plain at each remat mode, as many modes as the time left holds
REMATS=$(fitting full,dots,none,offloaded $(( $(left) < $(field step_remat 4) ? $(left) : $(field step_remat 4) )) 25 20)
want step_remat && part step_remat env XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 "$PY" benchmarks/bench_gpu_step.py \
  --plans zero3 --sweep_plans zero3 --remat "$REMATS" --attention auto --steps 4 --reps 2 \
  --out "$OUT/step_remat.json" $TINY_STEP
# 5, if time is left: the largest GPT trained with offload; each of its 2 + 3 processes capped
FIT_LIMIT=$(( $(left) < $(field offload_fit 4) ? $(left) : $(field offload_fit 4) ))
want offload_fit && part offload_fit env XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 "$PY" benchmarks/bench_offload.py \
  --fit --max_probes 3 --probe_timeout $(( FIT_LIMIT > 60 ? (FIT_LIMIT - 10) / 5 : 10 )) \
  --out "$OUT/offload_fit.json" $TINY_FIT

if [ "$PLAN" != 1 ]; then
  echo "total $(( $(date +%s) - START ))s of ${DEADLINE}s" | tee -a "$LOG"
  summary --print
  rm -rf "$WORK"
fi
