#!/usr/bin/env bash
# How a GPU run ends: MiniLM, 3,000 rows, with one engine (the run's own process drives it) and with
# six engine processes. For each: the exit code, the wall time, each engine process's "engine closed
# in" line, what the run wrote after its summary, and the processes of the run still there right
# after it exits and a second later (none may outlive the run).
# Needs vLLM 0.24 in ~/site and the bf16 MiniLM in ~/models/minilm (../shared/gpu/README.md).
#   bash scripts/gpu_end.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: gpu_end.sh OUT_DIR}
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
mkdir -p "$OUT"
bash scripts/gpu_bytecode.sh | tee "$OUT/bytecode.txt"
W=$(mktemp -d)
python3 scripts/make_demo_corpus.py "$W/corpus" --rows 3000 --files 4 --row-group-rows 500 > /dev/null
printf 'name: end\ninput: {uri: %s, text_column: text, id_column: id}\nmodel: {name: %s, max_length: 80}\noutput: {uri: %s, rows_per_part: 250}\n' \
  "$W/corpus" ~/models/minilm "$W/out" > "$W/job.yaml"
left() { ps -eo pid,ppid,comm,args | grep -E "VLLM|forkserver|batchembed" | grep -v grep | cut -c1-120; }
{
  echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader), $(nproc) cores, $(date -u +%F)"
  for dp in 1 6; do
    t0=$(date +%s.%N)
    python3 -m batchembed.cli run "$W/job.yaml" --no-progress --set output.uri="$W/out-$dp" \
      --set engine.data_parallel=$dp > "$OUT/dp$dp.json" 2> "$OUT/dp$dp.log"
    rc=$?
    echo "engines $dp: exit $rc, wall $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
    echo "  left at exit: $(left | wc -l)"; left | sed 's/^/    /'
    sleep 1; echo "  left 1 s later: $(left | wc -l)"
    grep -h "closed in\|first engine to run out" "$OUT/dp$dp.log" | sed 's/.*INFO /  /'
    echo "  stderr's last lines:"; tail -3 "$OUT/dp$dp.log" | cut -c1-160 | sed 's/^/    /'
  done
} | tee "$OUT/end.txt"
rm -rf "$W"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
