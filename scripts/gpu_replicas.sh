#!/usr/bin/env bash
# engine.data_parallel on ONE GPU: K engine replicas in one batchembed process, fed from
# one task queue (the performance issue's GPU targets). Run on the lent H200 machine with
# vLLM 0.24 installed into ~/site (../shared/gpu/README.md) and ~/models/minilm present.
#   bash scripts/gpu_replicas.sh OUT_DIR CASE...
#     CASE = model:max_length:min_chars:rows:K, e.g. bge-base:80:500:200000:4
# Each case is one `batchembed run` (variant d of scripts/benchmark.py) with
# --set engine.data_parallel=K; prints its whole-process and all-engines-running tok/s.
set -euo pipefail
OUT=${1:?usage: gpu_replicas.sh OUT_DIR CASE...}
shift
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
MK=${MKMODELS:-../shared/gpu/mkmodels.py}
[ -d ~/models/bge-base ] || python3 "$MK" ~/models/minilm ~/models > "$OUT.mkmodels.log" 2>&1
mkdir -p "$OUT"
for c in "$@"; do
  IFS=: read -r model len chars rows k <<< "$c"
  echo "== $model @ $len tokens, $rows rows, data_parallel=$k"
  timeout "${CASE_TIMEOUT:-400}" python3 scripts/benchmark.py --model ~/models/"$model" --max-length "$len" \
    --min-chars "$chars" --rows "$rows" --variants d --d-set engine.data_parallel="$k" \
    --out "$OUT/$model-$len-dp$k" 2>&1 | tail -4 || echo "case failed or timed out: $c"
  python3 - "$OUT/$model-$len-dp$k" <<'PY' || true
import json, sys, pathlib
for f in pathlib.Path(sys.argv[1]).glob("*/results.json"):
    d = json.loads(f.read_text())["results"]["d"]
    print(f"   all engines running: {d.get('tok_s_all_engines') or 0:,.0f} tok/s; engines {d['engines']}, "
          f"start {d['engine_start_s']:.0f} s, whole {d['tok_s_whole']:,.0f} tok/s")
PY
  cp "$OUT/$model-$len-dp$k"/*/results.json "$OUT/$model-$len-dp$k.json" 2>/dev/null || true
done
