#!/usr/bin/env bash
# Every GPU row of the README from one run of one script on one machine, in the order a fresh
# machine meets them, and all the results in one archive. Needs vLLM 0.24 in ~/site and the bf16
# MiniLM in ~/models/minilm (../shared/gpu/README.md); mkmodels.py makes the other shapes (MKMODELS).
#   bash scripts/gpu_all.sh OUT_DIR
# In order (each its own script, which says what it measures):
#   1. startup  QWEN=0 scripts/gpu_startup.sh: MiniLM's start on the fresh machine, cold, six engines
#   2. qwen     scripts/gpu_tuned.sh qwen3-0.6b 512 3000 200000 1,2 20000: `tune` chooses the engines
#               on 20,000 rows, then the 200 k-row job runs as tune wrote it (the 0.42 M target)
#   3. mixed    scripts/gpu_tuned.sh qwen3-0.6b 512 600 40000 1 2000: a decoder on texts of mixed lengths
#               (step 2's are all exactly 512 tokens, and never showed the stall that split rows caused)
#   4. bge      scripts/gpu_tuned.sh bge-base 80 500 2000000 6,8 200000 (the 1.4 M / 1.8 M targets)
#   5. end      scripts/gpu_end.sh: how runs of one and six engines end
#   6. build    scripts/gpu_build.sh qwen3-0.6b 512 1: a build with and without the GC switch
# and, named in STEPS only, imports: gpu_build.sh's timings of vLLM's import alone (REPEAT 0);
# async: vLLM's async scheduling, batchembed's default for decoders on a GPU (run), and off (run-b;
#   ASYNC_ORDER=ABBA adds run-b2, run-a2), each run's vectors compared with the first's (COMPARE=1): one
#   Qwen3 engine @ 512 on 40,000 rows of mixed lengths (docstrings joined to 600 characters; batchembed's
#   steps hold whole rows, chunked prefill off); async-minilm: the real MiniLM @ 256 as encoders run by
#   default (off, vLLM's choice) and on (its fidelity check on, and `verify --sample 256` of each run's
#   output against sentence-transformers); async-chunked: the Qwen3 job, then with vLLM's chunked prefill
#   on (run-c, one engine, no restart: vLLM 0.24 has known races where a row is split across steps, and
#   without async it stalled)
# qwen-async: step 2's job, then the same with async scheduling off, its vectors compared with the first's
# bge-async: step 4 (as the tool chooses it: async off for encoders), then the same job with async on
#   (run-b), its 2 M vectors compared with the first run's
# fp8: the Qwen3 job (FP8_ROWS rows, default 40,000, one engine), then with vLLM's dynamic fp8 weights
#   (run-b), its vectors compared with the first run's
# STEPS="startup qwen" runs only those, in that order; QWEN_TUNE="1 4000" tunes the Qwen job
# on fewer counts and rows (what `tune --engines 1,2` wrote on the H200 with async scheduling: 1 engine).
# BGE_TUNE="8 100000" does the same for the bge steps, and BGE_ROWS=1000000 sets their corpus.
# About 18 minutes on an H200 (mixed adds ~1.5), longer than one device call (10 minutes): start it in a session of
# its own and wait for OUT_DIR/DONE over several calls, e.g.
#   setsid bash scripts/gpu_all.sh ~/all > ~/all.log 2>&1 < /dev/null &
# OUT_DIR/progress.txt has a line as each step starts and ends; OUT_DIR.tgz holds every step's
# results (the cProfile dump left out) when DONE appears. CODE names the commit where the copy has no .git.
set -uo pipefail
OUT=${1:?usage: gpu_all.sh OUT_DIR}
mkdir -p "$OUT"
export MKMODELS=${MKMODELS:-../shared/gpu/mkmodels.py}
step() {  # step NAME COMMAND...: COMMAND's output in OUT_DIR/NAME.txt, its start and end in progress.txt
  local name=$1; shift
  echo "$(date -u +%T) $name: $*" >> "$OUT/progress.txt"
  "$@" > "$OUT/$name.txt" 2>&1
  echo "$(date -u +%T) $name: exit $?" >> "$OUT/progress.txt"
}
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader), $(nproc) cores, $(date -u +%FT%TZ), code ${CODE:-$(git rev-parse --short HEAD 2>/dev/null)}" \
  > "$OUT/progress.txt"
[ -d ~/models/bge-base ] || step mkmodels python3 "$MKMODELS" ~/models/minilm ~/models
for name in ${STEPS:-startup qwen mixed bge end build}; do
  case $name in
    startup) step startup env QWEN=0 bash scripts/gpu_startup.sh "$OUT/startup" ;;
    qwen) step qwen bash scripts/gpu_tuned.sh "$OUT/qwen" qwen3-0.6b 512 3000 200000 ${QWEN_TUNE:-1,2 20000} ;;
    mixed) step mixed bash scripts/gpu_tuned.sh "$OUT/mixed" qwen3-0.6b 512 600 40000 1 2000 ;;
    bge) step bge bash scripts/gpu_tuned.sh "$OUT/bge" bge-base 80 500 ${BGE_ROWS:-2000000} ${BGE_TUNE:-6,8 200000} ;;
    end) step end bash scripts/gpu_end.sh "$OUT/end" ;;
    imports) step imports bash scripts/gpu_build.sh "$OUT/imports" qwen3-0.6b 512 0 ;;
    build) step build bash scripts/gpu_build.sh "$OUT/build" qwen3-0.6b 512 1 ;;
    async)
      step async-qwen env AB_SET=engine.vllm_args.async_scheduling=false AB_ORDER=${ASYNC_ORDER:-AB} COMPARE=1 \
        bash scripts/gpu_tuned.sh "$OUT/async-qwen" qwen3-0.6b 512 600 40000 1 2000 ;;
    async-minilm)
      step async-minilm env AB_SET=engine.vllm_args.async_scheduling=true AB_ORDER=${ASYNC_ORDER:-AB} COMPARE=1 \
        VERIFY_SAMPLE=256 bash scripts/gpu_tuned.sh "$OUT/async-minilm" minilm 256 1000 40000 1 2000 ;;
    async-chunked)
      step async-chunked env COMPARE=1 \
        VARIANTS="run-c -- --set engine.vllm_args.enable_chunked_prefill=true --set engine.max_restarts=0" \
        bash scripts/gpu_tuned.sh "$OUT/async-chunked" qwen3-0.6b 512 600 40000 1 2000 ;;
    bge-async)
      step bge-async env AB_SET=engine.vllm_args.async_scheduling=true COMPARE=1 \
        bash scripts/gpu_tuned.sh "$OUT/bge-async" bge-base 80 500 ${BGE_ROWS:-2000000} ${BGE_TUNE:-6,8 200000} ;;
    fp8)
      step fp8 env AB_SET=engine.vllm_args.quantization=fp8 COMPARE=1 \
        bash scripts/gpu_tuned.sh "$OUT/fp8" qwen3-0.6b 512 3000 ${FP8_ROWS:-40000} 1 2000 ;;
    qwen-async)
      step qwen-async env AB_SET=engine.vllm_args.async_scheduling=false COMPARE=1 \
        bash scripts/gpu_tuned.sh "$OUT/qwen-async" qwen3-0.6b 512 3000 200000 ${QWEN_TUNE:-1,2 20000} ;;
    *) echo "unknown step: $name" >> "$OUT/progress.txt" ;;
  esac
done
rm -f "$OUT"/*.tgz
tar czf "$OUT.tgz" --exclude build.prof -C "$(dirname "$OUT")" "$(basename "$OUT")"
touch "$OUT/DONE"
