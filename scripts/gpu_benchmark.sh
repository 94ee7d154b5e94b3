#!/usr/bin/env bash
# The GPU benchmark table on the lent H200 machine (vLLM 0.24 from the bundle of
# ../shared/gpu/README.md, installed into ~/site beforehand).
#   bash scripts/gpu_benchmark.sh OUT_DIR [VARIANTS] [CONFIGS]
#     VARIANTS: letters of scripts/benchmark.py (default: ad)
#     CONFIGS:  which of the cases below, e.g. "12" (default: all, 12345)
# Needs ~/models/minilm (the bf16 MiniLM of the bundle); makes random-weight bge-base and
# Qwen3-0.6B shapes with mkmodels.py (same speed as trained weights).
set -euo pipefail
OUT=${1:?usage: gpu_benchmark.sh OUT_DIR [VARIANTS] [CONFIGS]}
VARIANTS=${2:-ad}
CONFIGS=${3:-12345}
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
MK=${MKMODELS:-../shared/gpu/mkmodels.py}
[ -d ~/models/bge-base ] || python3 "$MK" ~/models/minilm ~/models
run() {  # case model max_length min_chars rows
  case "$CONFIGS" in *"$1"*) ;; *) return 0;; esac
  echo "== case $1: $2 max_length $3, $5 rows"
  python3 scripts/benchmark.py --model "$2" --max-length "$3" --min-chars "$4" --rows "$5" \
    --variants "$VARIANTS" --out "$OUT/work" 2>&1 | tail -9
}
run 1 ~/models/minilm 80 500 100000
run 2 ~/models/bge-base 80 500 100000
run 3 ~/models/bge-base 512 3000 20000
run 4 ~/models/qwen3-0.6b 80 500 60000
run 5 ~/models/qwen3-0.6b 512 3000 12000
cat "$OUT"/work/*/results.md > "$OUT/gpu-results.md"
