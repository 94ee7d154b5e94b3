#!/usr/bin/env bash
# A whole-job GPU figure as a user gets it without hand-tuning: `batchembed tune` measures engine
# counts on a sample of the job's corpus and writes the best into a copy of the job, then
# `batchembed run` runs that job on the whole corpus, timed from process start to exit.
# Needs vLLM 0.24 in ~/site and ~/models/minilm (../shared/gpu/README.md); makes the random-weight
# bge-base and Qwen3-0.6B shapes with mkmodels.py (MKMODELS, default ../shared/gpu/mkmodels.py).
#   bash scripts/gpu_tuned.sh OUT_DIR MODEL MAX_LENGTH MIN_CHARS ROWS ENGINES SAMPLE_ROWS
#   e.g. bash scripts/gpu_tuned.sh out/t bge-base 80 500 2000000 4,6,8 200000
# The corpus is scripts/make_demo_corpus.py's (docstrings joined to MIN_CHARS, 8 files).
# tune writes engine.data_parallel and output.rows_per_part (about 30 parts per engine); the run uses
# the written job as it is. Writes OUT_DIR/{tune.txt, tuned.yaml, run.log, run.json, result-run.json,
# manifest-run.json (its throughput: tok/s in 60 slices of the run)}, and the same for run-b with AB=
# or AB_SET= (below) and each of VARIANTS=, and OUT_DIR.tgz. COMPARE=1 keeps the first run's output
# and compares each later run's vectors with it (scripts/compare_outputs.py: compare-NAME.{txt,json});
# VERIFY_SAMPLE=N runs `batchembed verify --sample N` on each run's output (sample-NAME.txt; needs a
# sentence-transformers model: the real MiniLM, not the random-weight shapes).
set -uo pipefail
OUT=${1:?usage: gpu_tuned.sh OUT_DIR MODEL MAX_LENGTH MIN_CHARS ROWS ENGINES SAMPLE_ROWS}
MODEL=$2 LEN=$3 CHARS=$4 ROWS=$5 ENGINES=$6 SAMPLE=$7
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
MK=${MKMODELS:-../shared/gpu/mkmodels.py}
MODELS=${MODELS:-~/models}
mkdir -p "$OUT"
# where the image or the bundle has no bytecode, compile it first (as pip would; not counted)
bash scripts/gpu_bytecode.sh | tee "$OUT/bytecode.txt"
[ -d "$MODELS/$MODEL" ] || python3 "$MK" "$MODELS/minilm" "$MODELS" > "$OUT/mkmodels.log" 2>&1
W=$(mktemp -d)
python3 scripts/make_demo_corpus.py "$W/corpus" --rows "$ROWS" --files 8 --min-chars "$CHARS" > "$OUT/corpus.log" 2>&1 \
  || { cat "$OUT/corpus.log"; exit 1; }
printf 'name: tuned\ninput: {uri: %s, text_column: text, id_column: id}\nmodel: {name: %s, max_length: %s, dtype: bfloat16}\noutput: {uri: %s}\n' \
  "$W/corpus" "$MODELS/$MODEL" "$LEN" "$W/out" > "$OUT/job.yaml"
t0=$(date +%s.%N)
python3 -m batchembed.cli tune "$OUT/job.yaml" --engines "$ENGINES" --rows "$SAMPLE" --write "$OUT/tuned.yaml" \
  > "$OUT/tune.txt" 2> "$OUT/tune.log"
echo "tune: exit $?, $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"; cat "$OUT/tune.txt"
[ -f "$OUT/tuned.yaml" ] || { tail -20 "$OUT/tune.log"; exit 1; }
read -r k parts < <(python3 -c "import yaml, sys; j = yaml.safe_load(open(sys.argv[1]))
print(j['engine']['data_parallel'], j.get('output', {}).get('rows_per_part', 'default'))" "$OUT/tuned.yaml")
run() {  # run NAME [ENV=VALUE ...] [-- --set KEY=VALUE ...]: the tuned job, timed from process start to exit
  local name=$1; shift
  local envs=() sets=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift && sets=("$@")
  rm -rf "$W/out"
  # once a second: the host's CPU counters (/proc/stat) and the GPU's busy %, for how many cores
  # and how much of the GPU the run kept busy
  (while :; do echo "$(date +%s.%N) $(head -1 /proc/stat)"; sleep 1; done) > "$OUT/$name-cpu.txt" &
  local cpu=$!
  nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader,nounits -lms 1000 > "$OUT/$name-gpu.csv" 2>&1 &
  local smi=$!
  t0=$(date +%s.%N)
  env "${envs[@]}" python3 -m batchembed.cli run "$OUT/tuned.yaml" --no-progress "${sets[@]}" > "$OUT/$name.json" \
    2> "$OUT/$name.log"
  rc=$?
  wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
  kill $cpu $smi 2>/dev/null; wait $cpu $smi 2>/dev/null
  python3 - "$OUT" "$name" "$wall" "$rc" "$k" "$parts" "${envs[*]} ${sets[*]}" <<'PY'
import json, os, pathlib, sys
out, name, wall, rc, k, parts = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
s = json.loads(out.joinpath(f"{name}.json").read_text().strip().splitlines()[-1]) if rc == 0 else {}
r = {"run": name, "env": sys.argv[7], "exit": rc, "engines": k, "rows_per_part": parts, "wall_s": wall,
     "tok_s_whole_process": round(s["tokens"] / wall) if s else None,
     **{key: s.get(key) for key in ("tokens", "seconds", "tokens_per_s", "steady_tokens_per_s",
                                     "engine_start_seconds", "tail_seconds", "window_seconds", "engine_idle_share")}}
# busy cores over the run's middle (its second and third quarters: all engines running)
rows = [line.split() for line in out.joinpath(f"{name}-cpu.txt").read_text().splitlines()]
rows = [(float(x[0]), [int(v) for v in x[2:]]) for x in rows if len(x) > 6]
if len(rows) > 8:
    (t0, a), (t1, b) = rows[len(rows) // 4], rows[3 * len(rows) // 4]
    d = [y - x for x, y in zip(a, b)]
    idle = d[3] + d[4]  # idle, iowait
    r["busy_cores_mid_run"] = round(os.cpu_count() * (sum(d) - idle) / max(sum(d), 1), 1)
gpu = [line.split(",")[-1].strip() for line in out.joinpath(f"{name}-gpu.csv").read_text().splitlines()]
gpu = [int(g) for g in gpu if g.isdigit()]
if len(gpu) > 8:
    mid = gpu[len(gpu) // 4: 3 * len(gpu) // 4]
    r["gpu_busy_pct_mid_run"] = round(sum(mid) / len(mid), 1)
out.joinpath(f"result-{name}.json").write_text(json.dumps(r, indent=1))
print(json.dumps(r))
PY
  cp "$W/out/_manifest.json" "$OUT/manifest-$name.json" 2>/dev/null  # its throughput: tok/s in 60 slices
  if [ -n "${VERIFY_SAMPLE:-}" ]; then  # VERIFY_SAMPLE=N: N random rows of the output against sentence-transformers
    python3 -m batchembed.cli verify "$OUT/tuned.yaml" "${sets[@]}" --sample "$VERIFY_SAMPLE" --seed 1 \
      > "$OUT/sample-$name.txt" 2>&1
    echo "verify --sample $VERIFY_SAMPLE: exit $?"; tail -2 "$OUT/sample-$name.txt"
  fi
  if [ -n "${COMPARE:-}" ]; then  # COMPARE=1: every later run's vectors against the first run's
    if [ "$rc" != 0 ]; then
      echo "compare: this run failed (exit $rc); the next finished run is the one compared with"
    elif [ -d "$W/out-first" ]; then
      python3 scripts/compare_outputs.py "$W/out-first" "$W/out" > "$OUT/compare-$name.json" 2> "$OUT/compare-$name.txt"
      echo "compare with the first run: exit $?"; cat "$OUT/compare-$name.txt"
    else
      mv "$W/out" "$W/out-first"
    fi
  fi
  grep -h "first engine to run out\|up: import\|imported once" "$OUT/$name.log" | sed 's/.*INFO //' | head -4
  # vLLM's own start-up lines, where VLLM_LOGGING_LEVEL=INFO: compiling or loading, CUDA graphs
  grep -h "bytecode transform\|torch.compile took\|oad the compiled\|Graph capturing finished\|init engine" \
    "$OUT/$name.log" | sed 's/.*\] //' | head -6
}
run run
# AB="ENV=VALUE ..." and/or AB_SET="KEY=VALUE" (one `--set`): the same job again on the same
# machine with that environment or job key (e.g. AB=BATCHEMBED_SERIAL_START=1), to compare a
# switch's effect where hosts differ. AB_ORDER=ABBA runs B twice and A again (run-b, run-b2,
# run-a2): where B compiles anew, its second run is the one with a warm cache.
if [ -n "${AB:-}${AB_SET:-}" ]; then
  b=(${AB:-}); [ -n "${AB_SET:-}" ] && b+=(-- --set "$AB_SET")
  run run-b "${b[@]}"
  [ "${AB_ORDER:-AB}" = ABBA ] && { run run-b2 "${b[@]}"; run run-a2; }
fi
# VARIANTS: more runs of the same job after those, one a line: NAME [ENV=VALUE ...] [-- --set KEY=VALUE ...]
# (values without spaces), e.g. VARIANTS=$'run-c -- --set engine.token_budget=131072'
mapfile -t variants <<< "${VARIANTS:-}"
for line in "${variants[@]}"; do
  [ -n "$line" ] && run $line
done
rm -rf "$W"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
