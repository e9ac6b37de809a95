#!/usr/bin/env bash
# The CUDA checks and figures of funcamp in one prepared run (about 9 minutes on one H100/H200):
#   bash benchmarks/run_cuda.sh [OUT_DIR]           # default OUT_DIR: benchmarks/results/cuda-<date>
#   bash benchmarks/run_cuda.sh --dry-run OUT_DIR   # every part on the CPU, tiny model, 1 step (tests/test_benchmark.py)
# 1. tests/test_cuda.py: the float16 step against GradScaler, one graph and no host sync, donation, the step
#    replayed as one CUDA graph (funcamp.capture.cuda_graph) bitwise the uncaptured one, fp8 against an exact
#    emulation, fp8 training against bf16, checkpoints on the device;
# 2. benchmarks/bench_train_step.py on gpt2-124m in bfloat16 with a dynamic loss scale: torch.amp eager, torch.amp +
#    torch.compile(model), funcamp compiled (donate=True), funcamp compiled + CUDA graph: tokens/s, MFU, time to the
#    first step (its first call, compile included, in the timing process), and peak memory (fresh subprocesses);
# 3. the same in float16 (no memory subprocesses);
# 4. benchmarks/bench_fp8_cuda.py at the 1.3B width (gpt2-1.3b, FP8_LAYERS of its 24 blocks, default 6: every
#    matmul's shape, a quarter of the compile): bf16 against fp8 tensorwise, rowwise and delayed;
# 5. benchmarks/summarize_cuda.py: summary.json and summary.md (the docs/benchmarks.md section) from the parts.
# Each part has its own time limit (T_* seconds; 0 skips it), so that a slow or failing part does not take the
# others with it; the fp8 part writes its JSON after every variant.
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-benchmarks/results/cuda-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/funcamp_inductor_cache}
T_TESTS=${T_TESTS:-150} T_BF16=${T_BF16:-180} T_FP16=${T_FP16:-100} T_FP8=${T_FP8:-120}
if [ "$DRY" = 1 ]; then  # the same commands on the CPU: the harness works, nothing is measured
  DEV=cpu CONFIG=tiny FP8_CONFIG=tiny FP8_LAYERS=${FP8_LAYERS:-2} BACKEND=eager FP8_BACKEND=eager
  BS=2 FP8_BS=2 WARMUP=1 STEPS=1 ROUNDS=1
  V_BF16=${V_BF16:-amp_eager,funcamp_graph} V_FP16=${V_FP16:-amp_eager} FP8_VARIANTS=${FP8_VARIANTS:-fp8_tensorwise}
  PROBE=(--no-probe) TESTS=(--collect-only -q) NO_MFU=(--peak-size 0)  # a CPU's MFU is not the target's
else
  DEV=cuda CONFIG=gpt2-124m FP8_CONFIG=gpt2-1.3b FP8_LAYERS=${FP8_LAYERS:-6} BACKEND=inductor FP8_BACKEND=inductor
  BS=16 FP8_BS=8 WARMUP=3 STEPS=10 ROUNDS=3
  V_BF16=${V_BF16:-amp_eager,amp_compile,funcamp_donate,funcamp_graph}
  V_FP16=${V_FP16:-amp_eager,amp_compile,funcamp_graph}
  FP8_VARIANTS=${FP8_VARIANTS:-funcamp_bf16,fp8_tensorwise,fp8_rowwise,fp8_delayed}
  PROBE=(--probe-variants amp_eager,funcamp_donate,funcamp_graph --probe-workers 3 --probe-steps 3)
  TESTS=(-q) NO_MFU=()
fi
{
  date -u
  if [ "$DRY" = 0 ]; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; fi
  python3 -c "import torch, optree; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'optree', optree.__version__)"
  lscpu | grep 'Model name'
} 2>&1 | tee "$OUT/machine.txt"
run() {  # run NAME LIMIT_S CMD...: skipped when LIMIT_S is 0; its output in OUT/NAME.log, its status in OUT/status.txt
  local name=$1 limit=$2
  shift 2
  if [ "$limit" -le 0 ]; then echo "$name skipped" | tee -a "$OUT/status.txt"; return; fi
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "$name exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/status.txt"
}
run test_cuda "$T_TESTS" python3 -m pytest -p no:cacheprovider "${TESTS[@]}" tests/test_cuda.py
common=(--device "$DEV" --config "$CONFIG" --batch-size "$BS" --backend "$BACKEND" --loss-scale dynamic
  --check-recompiles 0 --first-step none --warmup "$WARMUP" --steps "$STEPS" --rounds "$ROUNDS" "${NO_MFU[@]}")
run bench_bf16 "$T_BF16" python3 benchmarks/bench_train_step.py "${common[@]}" --dtype bfloat16 --variants "$V_BF16" \
  "${PROBE[@]}" --json "$OUT/bench_train_step_bf16.json" --markdown "$OUT/bench_train_step_bf16.md"
run bench_fp16 "$T_FP16" python3 benchmarks/bench_train_step.py "${common[@]}" --dtype float16 --variants "$V_FP16" \
  --no-probe --json "$OUT/bench_train_step_fp16.json" --markdown "$OUT/bench_train_step_fp16.md"
run bench_fp8 "$T_FP8" python3 benchmarks/bench_fp8_cuda.py --device "$DEV" --config "$FP8_CONFIG" \
  --n-layer "$FP8_LAYERS" --batch-size "$FP8_BS" --backend "$FP8_BACKEND" --variants "$FP8_VARIANTS" \
  --warmup "$WARMUP" --steps "$STEPS" --rounds "$ROUNDS" --json "$OUT/bench_fp8.json"
python3 benchmarks/summarize_cuda.py "$OUT" 2>&1 | tee "$OUT/summarize.log"
date -u | tee -a "$OUT/machine.txt"
