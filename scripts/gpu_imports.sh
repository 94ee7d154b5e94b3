#!/usr/bin/env bash
# vLLM's import, alone and several at once: whether engine processes could each import vLLM
# (overlapping their reading and tokenising) instead of sharing one import in the forkserver.
#   bash scripts/gpu_imports.sh OUT_FILE [COUNTS (1,4,8,1)]
# Each line: how many interpreters ran `from vllm import LLM, PoolingParams` at once, and the
# slowest's wall seconds. Run it after another vLLM run on the machine, or first (a cold start).
set -uo pipefail
OUT=${1:?usage: gpu_imports.sh OUT_FILE [COUNTS]}
COUNTS=${2:-1,4,8,1}
PY=${PYTHON:-python3}
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
{
  echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo cpu), $(nproc) cores, $(date -u +%FT%TZ)"
  for n in ${COUNTS//,/ }; do
    t0=$(date +%s.%N)
    for _ in $(seq "$n"); do
      "$PY" -c "import time; t = time.perf_counter(); from vllm import LLM, PoolingParams; print(round(time.perf_counter() - t, 2))" \
        > "$OUT.$n.$_" 2> /dev/null &
    done
    wait
    echo "$n at once: wall $(python3 -c "import time; print(round(time.time() - $t0, 1))") s, each: $(cat "$OUT.$n".* | tr '\n' ' ')"
    rm -f "$OUT.$n".*
  done
} | tee "$OUT"
