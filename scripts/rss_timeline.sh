#!/usr/bin/env bash
# Memory of a command and all its descendant processes, every half second, while it runs: shows
# whether a run's memory grows with its rows or levels off once its queues and caches are full.
#   bash scripts/rss_timeline.sh OUT.txt COMMAND [ARGS...]
#   e.g. bash scripts/rss_timeline.sh out/rss.txt .venv/bin/batchembed run job.yaml --no-progress
# Writes "seconds RSS_MB PSS_MB" lines to OUT.txt (the command's own output goes to OUT.txt.log)
# and prints the peaks. RSS counts a page shared by several processes (forked engine processes
# and the forkserver they come from) once in each; PSS splits it among them: the machine's share.
set -uo pipefail
OUT=${1:?usage: rss_timeline.sh OUT.txt COMMAND [ARGS...]}
shift
"$@" > "$OUT.log" 2>&1 &
pid=$!
t0=$(date +%s.%N)
: > "$OUT"
tree() { local p; echo "$1"; for p in $(pgrep -P "$1"); do tree "$p"; done; }
while kill -0 "$pid" 2>/dev/null; do
  rss=0 pss=0
  for p in $(tree "$pid"); do
    read -r r s < <(awk '/^Rss:/{r=$2} /^Pss:/{s=$2} END{print r+0, s+0}' "/proc/$p/smaps_rollup" 2>/dev/null)
    rss=$((rss + ${r:-0})) pss=$((pss + ${s:-0}))
  done
  echo "$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN{printf "%.1f", a - b}') $((rss / 1024)) $((pss / 1024))" >> "$OUT"
  sleep 0.5
done
wait "$pid"; rc=$?
sort -k2 -n "$OUT" | tail -1 | awk '{print "peak RSS " $2 " MB at " $1 " s"}'
sort -k3 -n "$OUT" | tail -1 | awk '{print "peak PSS " $3 " MB at " $1 " s"}'
exit $rc
