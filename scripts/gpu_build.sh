#!/usr/bin/env bash
# One engine's build on the GPU machine, as an engine process of a run builds it (its engine core a
# process of its own), with and without the start-up changes to the garbage collector (vLLM's
# import with it paused and the heap frozen after it: BATCHEMBED_GC_FREEZE) and without the packages
# no engine uses (BATCHEMBED_LEAN_IMPORT; each RESULT says whether the build imported them after
# all), alternating; vLLM's import alone with and without both; then
# one build with the engine core in the process, timed, and one under cProfile, for where the time goes.
# Needs vLLM 0.24 in ~/site and the model in ~/models (../shared/gpu/README.md; mkmodels.py for
# the bge-base and Qwen3-0.6B shapes).
#   bash scripts/gpu_build.sh OUT_DIR MODEL MAX_LENGTH [REPEAT (2); 0: vLLM's imports alone, no build]
#   e.g. bash scripts/gpu_build.sh out/b qwen3-0.6b 512
# The first build compiles where vLLM's cache is cold and is not counted. Writes OUT_DIR/ab.jsonl
# (one line a build: import_s, build_s, the switch), profile.txt (the top functions), build.prof,
# and each build's log.
set -uo pipefail
OUT=${1:?usage: gpu_build.sh OUT_DIR MODEL MAX_LENGTH [REPEAT]}
MODEL=$2 LEN=$3 REPEAT=${4:-2}
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
mkdir -p "$OUT"
# vLLM's lines with milliseconds (its default stamps whole seconds), for where a build's time goes
cat > "$OUT/vllm-logging.json" <<'JSON'
{"version": 1, "disable_existing_loggers": false,
 "formatters": {"ms": {"class": "vllm.logging_utils.NewLineFormatter", "datefmt": "%H:%M:%S",
                       "format": "%(levelname)s %(asctime)s.%(msecs)03d [%(fileinfo)s:%(lineno)d] %(message)s"}},
 "handlers": {"ms": {"class": "logging.StreamHandler", "formatter": "ms", "level": "INFO", "stream": "ext://sys.stdout"}},
 "loggers": {"vllm": {"handlers": ["ms"], "level": "INFO", "propagate": false}}}
JSON
export VLLM_LOGGING_CONFIG_PATH=$OUT/vllm-logging.json
bash scripts/gpu_bytecode.sh
# Python 3.12 starts with objects in the collector's permanent generation already (375 on the lent
# machines), which imports_frozen once read as "frozen already" and so never froze the import
echo "python3 $(python3 -c 'import gc, sys; print(sys.version.split()[0], "starts with", gc.get_freeze_count())') objects frozen" \
  | tee "$OUT/freeze.txt"
# what the paused import and the freeze cost here, against Python's own collector, and what the
# packages no engine uses cost (BATCHEMBED_LEAN_IMPORT), twice each
for i in 1 2; do
  for e in "BATCHEMBED_GC_FREEZE=1 BATCHEMBED_LEAN_IMPORT=1" "BATCHEMBED_GC_FREEZE=1 BATCHEMBED_LEAN_IMPORT=0" \
           "BATCHEMBED_GC_FREEZE=0 BATCHEMBED_LEAN_IMPORT=0"; do
    env $e python3 -c "import gc, sys, time
from batchembed.embed.vllm_import import imports_frozen, unused_packages_hidden
t = time.perf_counter()
with imports_frozen(), unused_packages_hidden():
    from vllm import LLM
t1 = time.perf_counter(); n = gc.collect()
print(f'$e: import {t1 - t:.2f} s, {gc.get_freeze_count()} frozen, scipy {\"scipy\" in sys.modules}; a full collection after it {time.perf_counter() - t1:.2f} s ({n} unreachable)')" \
      2>> "$OUT/freeze.log" | tee -a "$OUT/freeze.txt"
  done
done
[ "$REPEAT" = 0 ] && exit 0  # REPEAT 0: the imports alone
build() {  # build NAME [ARGS...]
  local name=$1; shift
  python3 scripts/build_profile.py --model ~/models/"$MODEL" --max-length "$LEN" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.log"
}
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader), $(nproc) cores, $(date -u +%FT%TZ)" | tee "$OUT/machine.txt"
build first --set engine.in_process=false
echo "first (compiles where the cache is cold): $(grep -h '^RESULT ' "$OUT/first.txt")"
: > "$OUT/ab.jsonl"
for i in $(seq "$REPEAT"); do  # both switches, on and off (GC_FREEZE, LEAN_IMPORT)
  for fl in 11 01 10 00; do
    f=${fl:0:1} l=${fl:1:1}
    BATCHEMBED_GC_FREEZE=$f BATCHEMBED_LEAN_IMPORT=$l build "freeze$f-lean$l-$i" --set engine.in_process=false
    grep -h '^RESULT ' "$OUT/freeze$f-lean$l-$i.txt" | sed "s/^RESULT {/{\"gc_freeze\": $f, \"lean_import\": $l, /" \
      | tee -a "$OUT/ab.jsonl"
  done
done
# the engine core in the engine's process (the CPU default), timed, for what the core's own process costs
build inproc --set engine.in_process=true
grep -h '^RESULT ' "$OUT/inproc.txt" | sed 's/^RESULT {/{"in_process": true, /' | tee -a "$OUT/ab.jsonl"
build profile --profile "$OUT/build.prof" --set engine.in_process=true
grep -h '^RESULT ' "$OUT/profile.txt"
grep -h "gc.collect\|freeze_gc_heap\|profile_run\|_dummy_pooler_run\|load_model\|compile_or_warm_up\|load_compiled\|init_device" \
  "$OUT/profile.txt" | head -24
