#!/usr/bin/env bash
# The GPU benchmark table on the lent H200 machine: every case of it from one script, on one
# machine. Needs vLLM 0.24 installed into ~/site and ~/models/minilm (the bf16 MiniLM of the
# bundle), both as in ../shared/gpu/README.md; makes random-weight bge-base and Qwen3-0.6B
# shapes with mkmodels.py (same speed as trained weights).
#   bash scripts/gpu_benchmark.sh OUT_DIR [GROUP | CASE]...
#     GROUP  table: MiniLM, bge-base and Qwen3-0.6B shapes @ 80 and 512 tokens, variants abcd
#            targets: the whole-job target cases (bge-base @ 80 with six engines on 2 M rows;
#                     Qwen3-0.6B @ 512 with two engines on 200 k rows, bf16 and fp8 (fp8 after a
#                     short fp8 case that fills the compile cache))
#            all (default): table and targets. Device calls last at most 10 minutes: name a few
#            cases per call (CASE strings, as below) and run the calls back to back.
#     CASE   model:max_length:min_chars:rows:variants[:KEY=VALUE+KEY=VALUE...]
#            e.g. qwen3-0.6b:512:3000:200000:d:engine.data_parallel=2+output.rows_per_part=5000
#            (variants are letters of scripts/benchmark.py; KEY=VALUE pairs go to batchembed run --set)
# Each case writes OUT_DIR/NAME.results.json (benchmark.py's), NAME.log and, for variant d, NAME.d.log
# and NAME.manifest.json; scripts/gpu_table.py OUT_DIR prints the whole table, OUT_DIR.tgz holds it all.
# Give each case time: a cold compile makes each vLLM variant's start-up 40-70 s (CASE_TIMEOUT, 400 s).
set -euo pipefail
OUT=${1:?usage: gpu_benchmark.sh OUT_DIR [GROUP | CASE]...}
shift
[ $# -gt 0 ] || set -- all
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
MK=${MKMODELS:-../shared/gpu/mkmodels.py}
mkdir -p "$OUT"
[ -d ~/site/vllm ] || { echo "no vLLM in ~/site: install the bundle first (../shared/gpu/README.md)" >&2; exit 2; }
[ -d ~/models/bge-base ] || python3 "$MK" ~/models/minilm ~/models > "$OUT/mkmodels.log" 2>&1

QWEN_DP2=qwen3-0.6b:512:3000:200000:d:engine.data_parallel=2+output.rows_per_part=5000
TABLE=(minilm:80:500:40000:abcd minilm:512:3000:12000:abcd bge-base:80:500:40000:abcd
       bge-base:512:3000:12000:abcd qwen3-0.6b:80:500:20000:abcd qwen3-0.6b:512:3000:6000:abcd)
QWEN_FP8=engine.data_parallel=2+output.rows_per_part=5000+engine.vllm_args.quantization=fp8+fidelity_min_cosine=0.5
# the 4,000-row fp8 case fills vLLM's compile cache, so the 200,000-row one is measured warm, as a
# nightly job's machine has it (notes/performance.md, ninth session: 0.46 M tok/s whole job)
TARGETS=(bge-base:80:500:2000000:d:engine.data_parallel=6+output.rows_per_part=100000 "$QWEN_DP2"
         "qwen3-0.6b:512:3000:4000:d:$QWEN_FP8" "qwen3-0.6b:512:3000:200000:d:$QWEN_FP8")
cases=()
for a in "$@"; do
  case "$a" in
    table) cases+=("${TABLE[@]}") ;;
    targets) cases+=("${TARGETS[@]}") ;;
    all) cases+=("${TABLE[@]}" "${TARGETS[@]}") ;;
    *:*) cases+=("$a") ;;
    *) echo "unknown group or case: $a" >&2; exit 2 ;;
  esac
done

for c in "${cases[@]}"; do
  IFS=: read -r model len chars rows variants extra <<< "$c"
  # a short checksum names the extra settings (they are in the JSON's "settings"): file names stay plain
  name=$model-$len-rows$rows-$variants${extra:+-x$(cksum <<< "$extra" | cut -d' ' -f1)}
  sets=()
  IFS=+ read -ra pairs <<< "${extra:-}"
  for kv in "${pairs[@]}"; do sets+=(--d-set "$kv"); done
  echo "== $(date +%T) $model @ $len tokens, $rows rows, variants $variants ${extra:-}"
  if [[ "${extra:-}" == *quantization=fp8* ]] && ! python3 -c "import compressed_tensors" 2>/dev/null; then
    # vLLM's fp8 path imports it; the bundle of ../shared/gpu lacks it: carry the wheels of
    # compressed-tensors==0.17.0 (vLLM 0.24's pin) and loguru, pip install them into ~/site
    echo "   skipped: no compressed_tensors module (vLLM 0.24 needs it for quantization=fp8)"; continue
  fi
  # output to a file, not a pipe: vLLM's engine processes can keep a pipe open after they exit
  timeout "${CASE_TIMEOUT:-400}" python3 scripts/benchmark.py --model ~/models/"$model" --max-length "$len" \
    --min-chars "$chars" --rows "$rows" --variants "$variants" "${sets[@]}" --out "$OUT/$name" \
    > "$OUT/$name.log" 2>&1 || echo "   case failed or timed out: $c (see $name.log)"
  grep -E "^  |^Ratios" "$OUT/$name.log" || true
  for f in "$OUT/$name"/*/{results.json,d.log,d-out/_fidelity.json}; do
    if [ -f "$f" ]; then cp "$f" "$OUT/$name.$(basename "$f")"; fi
  done
  for f in "$OUT/$name"/*/d-out/_manifest.json; do  # as NAME.manifest.json, where gpu_table.py looks
    if [ -f "$f" ]; then cp "$f" "$OUT/$name.manifest.json"; fi
  done
  rm -rf "$OUT/$name"/*/corpus "$OUT/$name"/*/d-out "$OUT/$name"/*/*.parquet  # keep only the figures
done
python3 scripts/gpu_table.py "$OUT" > "$OUT/gpu-table.md" && cat "$OUT/gpu-table.md"
# one archive of every figure and log: the device tool brings back at most 8 files
tar czf "$OUT.tgz" --exclude='*/corpus' --exclude='*.parquet' -C "$(dirname "$OUT")" "$(basename "$OUT")"
