#!/usr/bin/env bash
# Resident memory of a command and its child processes, every half second, while it runs: shows
# whether a run's memory grows with its rows or levels off once its queues and caches are full.
#   bash scripts/rss_timeline.sh OUT.txt COMMAND [ARGS...]
#   e.g. bash scripts/rss_timeline.sh out/rss.txt .venv/bin/batchembed run job.yaml --no-progress
# Writes "seconds MB" lines to OUT.txt (the command's own output goes to OUT.txt.log) and prints
# the peak.
set -uo pipefail
OUT=${1:?usage: rss_timeline.sh OUT.txt COMMAND [ARGS...]}
shift
"$@" > "$OUT.log" 2>&1 &
pid=$!
t0=$(date +%s.%N)
: > "$OUT"
while kill -0 "$pid" 2>/dev/null; do
  kb=0
  for p in $pid $(pgrep -P "$pid"); do
    r=$(awk '/VmRSS/{print $2}' "/proc/$p/status" 2>/dev/null)
    kb=$((kb + ${r:-0}))
  done
  echo "$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN{printf "%.1f", a - b}') $((kb / 1024))" >> "$OUT"
  sleep 0.5
done
wait "$pid"; rc=$?
sort -k2 -n "$OUT" | tail -1 | awk '{print "peak " $2 " MB at " $1 " s"}'
exit $rc
