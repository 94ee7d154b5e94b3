#!/usr/bin/env bash
# Engine start-up on the lent H200 machine, as a user meets it. Run it FIRST on a fresh machine:
# the first case is the fresh-machine figure (nothing of torch, CUDA or vLLM in the page cache).
# Needs vLLM 0.24 in ~/site and the bf16 MiniLM in ~/models/minilm (../shared/gpu/README.md).
#   bash scripts/gpu_startup.sh OUT_DIR
# 1. fresh: MiniLM, 3,000 rows, one engine, defaults;
# 2. cold: the page cache dropped (where the machine lets root do it), the same job again: what a
#    fresh machine costs beyond its cold disk (first CUDA use on the machine, its caches);
# 3. six engines on the GPU (engine.data_parallel=6), page cache warm;
# 4. two engines of a Qwen3-0.6B shape at 512 tokens saved as a sentence-transformers model
#    (scripts/fidelity_cost.py makes it, and measures the fidelity reference's cost on this
#    CPU: OUT_DIR/fidelity-cost.txt), so the fidelity check runs with a reference that costs
#    seconds: the benchmark models of ../shared/gpu have no modules.json and skip it.
# 5. vLLM's import with and without bytecode, twice each (page cache warm).
# Each writes OUT_DIR/<case>.log and .json (the run's summary); OUT_DIR/startup.md the table.
# First, as `pip install` does, the bundle's Python files are compiled to bytecode (timed apart):
# ../shared/gpu unpacks wheels without it, and a first import would compile vLLM and its
# dependencies on the way, a cost no user who installed with pip pays.
set -uo pipefail
OUT=${1:?usage: gpu_startup.sh OUT_DIR}
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
# vLLM's own start-up lines (weights loaded in X s, engine initialised in Y s) go to each case's log
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
mkdir -p "$OUT"
W=$(mktemp -d)
python3 scripts/make_demo_corpus.py "$W/corpus" --rows 3000 --files 4 --row-group-rows 500 > /dev/null
printf 'name: startup\ninput: {uri: %s, text_column: text, id_column: id}\nmodel: {name: %s, max_length: 80}\noutput: {uri: %s, rows_per_part: 500}\n' \
  "$W/corpus" ~/models/minilm "$W/out" > "$W/job.yaml"
run() {  # run NAME [ENV=VALUE ...] [-- --set KEY=VALUE ...]
  local name=$1; shift
  local envs=() sets=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift && sets=("$@")
  local t0=$(date +%s.%N)
  env "${envs[@]}" python3 -m batchembed.cli run "$W/job.yaml" --no-progress --set output.uri="$W/$name" \
    "${sets[@]}" > "$OUT/$name.json" 2> "$OUT/$name.log"
  echo "$name: exit $?, wall $(python3 -c "import time; print(round(time.time() - $t0, 1))") s; $(grep -h "up: import\|imported once" "$OUT/$name.log" | sed 's/.*INFO //' | head -2 | tr '\n' ' ')"
}
drop() { sync; if echo 3 > /proc/sys/vm/drop_caches 2> /dev/null; then echo "(page cache dropped)"; return 0; fi
         echo "(this machine does not let the page cache be dropped: cold cases skipped)"; return 1; }
{
  echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader), $(nproc) cores, $(date -u +%F)"
  bash scripts/gpu_bytecode.sh
  run fresh
  if drop; then run cold; fi
  run six-engines -- --set engine.data_parallel=6
  if [ "${QWEN:-1}" = 1 ]; then  # QWEN=0 leaves case 4 out (device time)
    python3 scripts/fidelity_cost.py --shapes qwen3-0.6b --out "$W/fc" > "$OUT/fidelity-cost.txt" 2>&1
    tail -3 "$OUT/fidelity-cost.txt"
    run qwen-st-two-engines -- --set engine.data_parallel=2 --set model.name="$W/fc/models/qwen3-0.6b" \
      --set model.max_length=512
  fi
  # what the bytecode is worth: vLLM's import with it, and with an empty cache (PYTHONPYCACHEPREFIX),
  # the page cache warm, twice each
  mkdir -p "$W/nopyc"
  for i in 1 2; do
    for c in with without; do
      t0=$(date +%s.%N)
      if [ $c = with ]; then python3 -c "from vllm import LLM" 2> /dev/null
      else PYTHONPYCACHEPREFIX="$W/nopyc" PYTHONDONTWRITEBYTECODE=1 python3 -c "from vllm import LLM" 2> /dev/null; fi
      echo "import vLLM $c bytecode: $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
    done
  done
} | tee "$OUT/startup.txt"
python3 - "$OUT" <<'PY' > "$OUT/startup.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| case | engines | engine start s | whole run s |\n|---|---|---|---|")
for name in ("fresh", "cold", "six-engines", "qwen-st-two-engines"):
    f = out / f"{name}.json"
    if f.exists() and f.read_text().strip():
        s = json.loads(f.read_text().strip().splitlines()[-1])
        print(f"| {name} | {s['engines']} | {s['engine_start_seconds']:.1f} | {s['seconds']:.1f} |")
PY
cat "$OUT/startup.md"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
