#!/usr/bin/env bash
# Self-healing and stopping, on the lent H200 machine: the CLI as a user runs it, with real faults.
# Needs vLLM 0.24 in ~/site and the bf16 MiniLM in ~/models/minilm, as in ../shared/gpu/README.md.
#   bash scripts/gpu_recovery.sh OUT_DIR
# 1. a plain run (defaults), timed: start-up phases in its log;
# 2. engine.data_parallel=2: once a part is committed, kill -9 one engine's engine-core process:
#    the run must replace it and finish, exit 0, every row once;
# 3. one engine, SIGSTOP of its engine core (a hung engine): the watchdog replaces it;
# 4. SIGKILL of the run's own process: its engine must not outlive it;
# 5. Ctrl-C to the whole process group: exit 130, one line, no traceback, nothing left running.
# Each writes OUT_DIR/<case>.log and .json; OUT_DIR.tgz holds them all.
set -uo pipefail
OUT=${1:?usage: gpu_recovery.sh OUT_DIR}
export PYTHONPATH=~/site:$PWD VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
mkdir -p "$OUT"
W=$(mktemp -d)
python3 scripts/make_demo_corpus.py "$W/corpus" --rows 120000 --files 8 --row-group-rows 2500 > /dev/null
job() {  # job NAME [KEY=VALUE ...]: a job file for the corpus, output under $W/NAME
  local name=$1; shift
  printf 'name: %s\ninput: {uri: %s, text_column: text, id_column: id}\nmodel: {name: %s}\noutput: {uri: %s, rows_per_part: 2500}\n' \
    "$name" "$W/corpus" ~/models/minilm "$W/$name" > "$W/$name.yaml"
}
run_bg() {  # run_bg NAME [--set ...]: batchembed run in a session of its own, output to files; sets PID
  setsid python3 -m batchembed.cli run "$W/$1.yaml" --no-progress "${@:2}" > "$OUT/$1.json" 2> "$OUT/$1.log" &
  PID=$!
}
wait_commit() { for _ in $(seq 1 1200); do ls "$W/$1/_commits/"*.json > /dev/null 2>&1 && return 0; sleep 0.1; done; return 1; }
# an engine core of the run: a process below it with none below itself, leaving out
# multiprocessing's resource tracker (the GPU bundle has no setproctitle, so processes are not
# named VLLM::EngineCore there; with data_parallel the engine processes sit between)
core_of() { ps -o pid=,ppid=,args= -g "$1" | awk -v p="$1" '$1 != p && !/resource_tracker/ {s[$1] = $2} END {
  for (q in s) if (s[q] in s) up[s[q]] = 1; for (q in s) if (!(q in up)) {print q; exit}}'; }

echo "== $(date +%T) plain run"
job plain; t0=$(date +%s)
python3 -m batchembed.cli run "$W/plain.yaml" --no-progress > "$OUT/plain.json" 2> "$OUT/plain.log"
echo "exit $? in about $(( $(date +%s) - t0 )) s"; tail -1 "$OUT/plain.json"; grep -E "import .* build" "$OUT/plain.log"

echo "== $(date +%T) two engines, one engine core killed"
job heal; run_bg heal --set engine.data_parallel=2 --set fidelity_check=off
wait_commit heal; core=$(core_of "$PID" | head -1); echo "killing engine core $core"; kill -9 "$core"
wait "$PID"; echo "exit $?"; grep -E "is gone|restarted in" "$OUT/heal.log"; tail -1 "$OUT/heal.json"
python3 -c "import pyarrow.parquet as pq, sys; ids = pq.read_table(sys.argv[1], columns=['id']).column('id').to_pylist(); print('rows', len(ids), 'distinct', len(set(ids)))" "$W/heal"

echo "== $(date +%T) one engine, its engine core stopped (SIGSTOP, a hung engine)"
job hung; run_bg hung --set fidelity_check=off --set engine.stall_timeout_s=10
wait_commit hung; core=$(core_of "$PID"); echo "stopping engine core $core"; kill -STOP "$core"
wait "$PID"; echo "exit $?"; grep -E "no vector came back|restarted in" "$OUT/hung.log"; tail -1 "$OUT/hung.json"
echo "the stopped process afterwards: $(ps -o stat= -p "$core" || echo gone)"

echo "== $(date +%T) the run killed outright (SIGKILL of its own process only)"
job dead; run_bg dead --set fidelity_check=off
wait_commit dead; core=$(core_of "$PID"); echo "engine core $core; killing the run $PID"; kill -9 "$PID"
wait "$PID"; sleep 3; echo "engine core afterwards: $(ps -o stat= -p "$core" || echo gone)"

echo "== $(date +%T) Ctrl-C to the process group"
job stop; run_bg stop --set fidelity_check=off
wait_commit stop; kill -INT -- -"$PID"; wait "$PID"; echo "exit $?"
tail -1 "$OUT/stop.log"; echo "tracebacks: $(grep -c Traceback "$OUT/stop.log")"; sleep 2
echo "left running: $(ps -o pid=,comm= -g "$PID" | grep -v defunct | wc -l)"
rm -rf "$W"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
