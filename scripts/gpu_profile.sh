#!/usr/bin/env bash
# Where a multi-engine GPU run spends its time, on the lent H200 machine: the bge-base shape at
# 80 tokens (the whole-job target case) with N engines, sampled while every engine runs.
# Needs vLLM 0.24 in ~/site and the bf16 MiniLM in ~/models/minilm (../shared/gpu/README.md);
# makes the bge-base shape with mkmodels.py (MKMODELS, default ../shared/gpu/mkmodels.py).
#   bash scripts/gpu_profile.sh OUT_DIR [ENGINES (6)] [ROWS (2000000)] [KEY=VALUE+KEY=VALUE...]
# Writes into OUT_DIR:
#   run.log, run.json    the run's log (--log-level debug: vLLM's own build phases with times)
#                        and its summary line
#   gpu.csv              GPU busy % and memory, once a second (nvidia-smi)
#   threads.txt          CPU seconds per process and thread over 20 s of the run (thread_cpu.py)
#   pyspy-*.txt          20 s of py-spy samples (collapsed stacks) of one engine process and of
#                        its vLLM engine core, where py-spy is given (PYSPY=path; it needs ptrace)
#   imports.txt          PYTHONPROFILEIMPORTTIME of every process, the slowest imports first
# and OUT_DIR.tgz with it all.
set -uo pipefail
OUT=${1:?usage: gpu_profile.sh OUT_DIR [ENGINES] [ROWS] [SETTINGS]}
ENGINES=${2:-6}
ROWS=${3:-2000000}
EXTRA=${4:-}
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
MK=${MKMODELS:-../shared/gpu/mkmodels.py}
mkdir -p "$OUT"
[ -d ~/models/bge-base ] || python3 "$MK" ~/models/minilm ~/models > "$OUT/mkmodels.log" 2>&1
W=$(mktemp -d)
# the benchmark's corpus: docstrings joined to at least 500 characters, truncated at 80 tokens
python3 scripts/make_demo_corpus.py "$W/corpus" --rows "$ROWS" --files 8 --min-chars 500 > "$OUT/corpus.log" 2>&1 \
  || { echo "corpus failed"; cat "$OUT/corpus.log"; exit 1; }
printf 'name: profile\ninput: {uri: %s, text_column: text, id_column: id}\nmodel: {name: %s, max_length: 80, dtype: bfloat16}\noutput: {uri: %s, rows_per_part: 100000}\nengine: {data_parallel: %s}\n' \
  "$W/corpus" ~/models/bge-base "$W/out" "$ENGINES" > "$W/job.yaml"
sets=()
IFS=+ read -ra pairs <<< "$EXTRA"
for kv in "${pairs[@]}"; do sets+=(--set "$kv"); done
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -lms 1000 > "$OUT/gpu.csv" 2>&1 &
SMI=$!
t0=$(date +%s.%N)
PYTHONPROFILEIMPORTTIME=1 python3 -m batchembed.cli --log-level debug run "$W/job.yaml" --no-progress "${sets[@]}" \
  > "$OUT/run.json" 2> "$OUT/run.log" &
RUN=$!
# once every engine has its first vectors (the log says so per engine), sample for 20 s
for _ in $(seq 300); do
  [ "$(grep -c 'up: import' "$OUT/run.log" 2>/dev/null)" -ge "$ENGINES" ] && break
  kill -0 $RUN 2>/dev/null || break; sleep 1
done
sleep 15
python3 scripts/thread_cpu.py --match batchembed --seconds 20 > "$OUT/threads.txt" 2>&1 &
if [ -n "${PYSPY:-}" ]; then
  eng=$(for p in $(pgrep -P "$(pgrep -f 'multiprocessing.forkserver' | head -1)" 2>/dev/null); do echo "$p"; done | head -1)
  core=""
  for c in $(pgrep -P "${eng:-0}" 2>/dev/null); do grep -qai enginecore "/proc/$c/comm" "/proc/$c/cmdline" && core=$c; done
  for pair in "engine:$eng" "core:$core"; do
    name=${pair%%:*}; pid=${pair#*:}
    [ -n "$pid" ] && timeout 40 "$PYSPY" record -p "$pid" -d 20 -r 50 -f raw -o "$OUT/pyspy-$name.txt" --nonblocking \
      > "$OUT/pyspy-$name.log" 2>&1 &
  done
fi
wait $RUN
echo "exit $? after $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee "$OUT/exit.txt"
sleep 1; kill $SMI 2>/dev/null
wait
# the slowest imports of every process (self time, microseconds), then the log without them
grep '^import time:' "$OUT/run.log" | awk -F'|' '{gsub(/import time: */,"",$1); print $1 "|" $2 "|" $3}' \
  | sort -t'|' -k1,1nr | head -80 > "$OUT/imports.txt"
grep -v '^import time:' "$OUT/run.log" > "$OUT/run.log.tmp" && mv "$OUT/run.log.tmp" "$OUT/run.log"
tail -3 "$OUT/run.log"; cat "$OUT/threads.txt" | head -30
rm -rf "$W"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
