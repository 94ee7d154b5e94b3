"""Run the batchembed command with a thread that prints, every INTERVAL seconds, the process's
RSS, its count of Python objects and the types that grew most since the last print: to tell a
Python-level leak (objects that pile up) from native memory.

    .venv/bin/python scripts/objects_timeline.py [--interval 30] -- run JOB.yaml --no-progress

Lines start with "OBJECTS" on stderr, among the run's log. The probe runs in the process that
runs the command (with engine.data_parallel, not in the engine processes); counting walks every
object under the GIL, so the run is a little slower while it does. vLLM freezes what its
start-up made (gc.freeze), which the count leaves out from then on: later counts are of objects
made since, which is where a leak would show.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import threading
import time


def _rss_mb() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


def _probe(interval: float) -> None:
    t0, before = time.time(), None
    while True:
        time.sleep(interval)
        objects = gc.get_objects()
        count = len(objects)
        types = collections.Counter(type(o).__name__ for o in objects)
        del objects  # held into the next count, it would keep every object of this one alive
        grew = sorted(((types[k] - before.get(k, 0), k) for k in types), reverse=True)[:6] if before else []
        before = types
        print(f"OBJECTS t={time.time() - t0:.0f}s rss={_rss_mb()}MB objects={count} grew={grew}",
              file=sys.stderr, flush=True)


def main() -> None:
    args = sys.argv[1:]
    interval = 30.0
    if args[:1] == ["--interval"]:
        interval, args = float(args[1]), args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    # on a CPU machine the command starts itself again with TCMalloc (exec): this thread ends
    # there, and the new process starts its own
    threading.Thread(target=_probe, args=(interval,), name="objects-probe", daemon=True).start()
    sys.argv = ["batchembed", *args]
    from batchembed.cli import main as batchembed

    batchembed()


if __name__ == "__main__":
    main()
