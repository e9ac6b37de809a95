#!/usr/bin/env bash
# A/B of the main job's time to its first step, cold, this checkout against another, in interleaved rounds.
#
#   git worktree add /tmp/base <commit>
#   ../shared/tools/quiet -- benchmarks/ab_main_job.sh /tmp/base 3 [examples/train_gpt.py arguments ...]
#
# Each run is a whole process (`examples/train_gpt.py --steps 1 --no-compile-cache`) with every cache fresh
# (FUNCAMP_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR and --cache-dir empty directories), the checkout's funcamp first on
# PYTHONPATH. Prints one line per run: the round, which checkout, the wall seconds and the storage part of the
# header. Pin --policy for an A/B: --policy auto times the candidate dtypes afresh in every cold run.
set -euo pipefail
base=$(cd "$1" && pwd); rounds=$2; shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
for r in $(seq 1 "$rounds"); do
  for which in this base; do
    if [ "$which" = this ]; then root=$here; else root=$base; fi
    d=$(mktemp -d)
    t0=$(date +%s.%N)
    (cd "$root" && PYTHONPATH=$root FUNCAMP_CACHE_DIR=$d/f TORCHINDUCTOR_CACHE_DIR=$d/i \
      python3 examples/train_gpt.py --steps 1 --cache-dir "$d/c" --no-compile-cache "$@" >"$d/log" 2>&1)
    t1=$(date +%s.%N)
    printf 'round %s %s %.1f s  %s\n' "$r" "$which" "$(echo "$t1 - $t0" | bc)" \
      "$(grep -m1 -o 'storage flat: [^|]*' "$d/log" || echo 'storage: per leaf')"
    rm -rf "$d"
  done
done
