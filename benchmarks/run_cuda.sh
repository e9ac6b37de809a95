#!/usr/bin/env bash
# The CUDA checks of funcamp in one prepared run (about 9 minutes on one H100/H200):
#   bash benchmarks/run_cuda.sh OUT_DIR
# 1. tests/test_cuda.py (float16 step vs GradScaler, one graph and no host sync, fp8 vs an exact
#    emulation, fp8 training vs bf16, checkpoints on the device);
# 2. benchmarks/bench_fp8_cuda.py on gpt2-124m: torch.amp bf16 + compile(model), funcamp's compiled bf16
#    step and fp8 tensorwise (tokens/s, MFU, first call);
# 3. benchmarks/bench_train_step.py on gpt2-124m in float16 (torch.amp eager and compiled against funcamp's
#    compiled step), then in bfloat16 if time is left (set T_BF16=0 to skip);
# 4. benchmarks/bench_memory.py on the state-dominated MLP: what a step adds over the state at rest,
#    compiled torch.optim against funcamp compiled with and without donate=True (T_MEM=0 to skip).
# Each part has its own time limit, so that a slow or failing part does not take the others with it.
set -u
OUT=${1:?usage: run_cuda.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/funcamp_inductor_cache}
T_TESTS=${T_TESTS:-90} T_FP8=${T_FP8:-220} T_FP16=${T_FP16:-230} T_BF16=${T_BF16:-200} T_MEM=${T_MEM:-150}
FP8_VARIANTS=${FP8_VARIANTS:-amp_bf16,funcamp_bf16,fp8_tensorwise}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, optree; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'optree', optree.__version__)"
  lscpu | grep 'Model name'
} 2>&1 | tee "$OUT/machine.txt"
timeout "$T_TESTS" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log"
common=(--device cuda --config gpt2-124m --variants amp_eager,amp_compile,funcamp_compile --no-probe
  --check-recompiles 0 --first-step none --warmup 3 --steps 10 --rounds 5)
timeout "$T_FP8" python3 benchmarks/bench_fp8_cuda.py --config gpt2-124m --variants "$FP8_VARIANTS" \
  --warmup 3 --steps 10 --rounds 3 --json "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.log"
timeout "$T_FP16" python3 benchmarks/bench_train_step.py "${common[@]}" --dtype float16 \
  --json "$OUT/bench_train_step_fp16.json" --markdown "$OUT/bench_train_step_fp16.md" 2>&1 | tee "$OUT/bench_fp16.log"
[ "$T_BF16" -gt 0 ] && timeout "$T_BF16" python3 benchmarks/bench_train_step.py "${common[@]}" --dtype bfloat16 \
  --json "$OUT/bench_train_step_bf16.json" --markdown "$OUT/bench_train_step_bf16.md" 2>&1 | tee "$OUT/bench_bf16.log"
[ "$T_MEM" -gt 0 ] && timeout "$T_MEM" python3 benchmarks/bench_memory.py --device cuda --models mlp \
  --variants torch_eager,torch_compiled_opt,funcamp_compiled,funcamp_compiled_donate --out "$OUT/bench_memory.json" \
  2>&1 | tee "$OUT/bench_memory.log"
date -u | tee -a "$OUT/machine.txt"
