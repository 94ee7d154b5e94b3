#!/usr/bin/env bash
# engine.data_parallel on ONE GPU: K engine replicas in one batchembed process, fed from
# one task queue (the performance issue's GPU targets). Run on the lent H200 machine with
# vLLM 0.24 installed into ~/site (../shared/gpu/README.md) and ~/models/minilm present.
#   bash scripts/gpu_replicas.sh OUT_DIR CASE...
#     CASE = model:max_length:min_chars:rows:K[:KEY=VALUE+KEY=VALUE...], e.g. bge-base:80:500:200000:4
#            or qwen3-0.6b:512:3000:150000:2:engine.enforce_eager=false+output.rows_per_part=5000
# Each case is one `batchembed run` (variant d of scripts/benchmark.py) with
# --set engine.data_parallel=K and the case's other --set pairs; prints its whole-process and
# all-engines-running tok/s, and keeps the run's log (OUT/NAME.d.log: vLLM's own start-up
# timings too when VLLM_LOGGING_LEVEL=INFO is exported) and manifest beside its JSON.
set -euo pipefail
OUT=${1:?usage: gpu_replicas.sh OUT_DIR CASE...}
shift
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
MK=${MKMODELS:-../shared/gpu/mkmodels.py}
[ -d ~/models/bge-base ] || python3 "$MK" ~/models/minilm ~/models > "$OUT.mkmodels.log" 2>&1
mkdir -p "$OUT"
for c in "$@"; do
  IFS=: read -r model len chars rows k extra <<< "$c"
  # a short checksum names the extra settings (they are in the JSON's "settings"): file names stay plain
  name=$model-$len-rows$rows-dp$k${extra:+-x$(cksum <<< "$extra" | cut -d' ' -f1)}
  sets=(--d-set engine.data_parallel="$k")
  IFS=+ read -ra pairs <<< "${extra:-}"
  for kv in "${pairs[@]}"; do sets+=(--d-set "$kv"); done
  echo "== $model @ $len tokens, $rows rows, data_parallel=$k ${extra:-}"
  timeout "${CASE_TIMEOUT:-400}" python3 scripts/benchmark.py --model ~/models/"$model" --max-length "$len" \
    --min-chars "$chars" --rows "$rows" --variants d "${sets[@]}" \
    --out "$OUT/$name" 2>&1 | tail -4 || echo "case failed or timed out: $c"
  python3 - "$OUT/$name" <<'PY' || true
import json, sys, pathlib
for f in pathlib.Path(sys.argv[1]).glob("*/results.json"):
    d = json.loads(f.read_text())["results"]["d"]
    print(f"   all engines running: {d.get('tok_s_all_engines') or 0:,.0f} tok/s; engines {d['engines']}, "
          f"start {d['engine_start_s']:.0f} s, whole {d['tok_s_whole']:,.0f} tok/s")
PY
  for f in "$OUT/$name"/*/results.json; do cp "$f" "$OUT/$name.json"; done 2>/dev/null || true
  for f in "$OUT/$name"/*/d.log; do cp "$f" "$OUT/$name.d.log"; done 2>/dev/null || true
  for f in "$OUT/$name"/*/d-out/manifest.json; do cp "$f" "$OUT/$name.manifest.json"; done 2>/dev/null || true
done
