"""CPU seconds per thread of a running batchembed (or benchmark) and its vLLM processes.

    python3 scripts/thread_cpu.py [--match batchembed] [--seconds 15] [--wait 0]

Start it beside a run, once the engine is up (e.g. `--wait 30` after launching), to see
where the cores go in steady state: vLLM's worker (the compute threads), its engine-core
process, and this tool's own threads (main = engine thread, batchembed-read, batchembed-writ).
Reads /proc (Linux only) every half second over --seconds; prints the CPU seconds each
(process, thread name) used in that span, largest first. Processes matched: command line
containing --match, or a vLLM process name (VLLM::*).
"""

from __future__ import annotations

import argparse
import collections
import os
import time

TICK = os.sysconf("SC_CLK_TCK")


def snapshot(match: str) -> dict[tuple[int, str, int, str], float]:
    """(pid, process name, tid, thread name) -> CPU seconds so far."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if match not in cmd and not comm.startswith("VLLM"):
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                out[(int(pid), comm, int(tid), name)] = (int(fields[11]) + int(fields[12])) / TICK  # utime+stime
        except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
            continue  # gone meanwhile
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--match", default="batchembed", help="substring of the command line")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--wait", type=float, default=0.0, help="seconds to wait before sampling")
    args = ap.parse_args()
    me = os.getpid()
    time.sleep(args.wait)
    first: dict = {}
    last: dict = {}
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        for key, value in snapshot(args.match).items():
            if key[0] != me:
                first.setdefault(key, value)
                last[key] = value
        time.sleep(0.5)
    span = time.monotonic() - t0
    used: collections.Counter = collections.Counter()
    for key, value in last.items():
        used[(key[0], key[1], key[3])] += value - first[key]
    print(f"CPU seconds over {span:.1f} s (cores: {os.cpu_count()}):")
    for (pid, comm, name), sec in used.most_common():
        if sec >= 0.05:
            print(f"{sec:7.2f} s  {sec / span:6.1%} of a core  pid {pid} {comm} / {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
