"""Claims on parts, so that runs meeting on one output share its work instead of each doing all of it.

    _runs/<run>.json           a live run's heartbeat, {"run", "host", "pid", "expires"}, rewritten every
                               third of output.lease_s while the run lives and removed when it ends
    _claims/<part>.<n>.json    {"run": <run>}: the run embedding that part; n counts the takeovers

A run claims a part before it embeds it. A claim holds while its run's heartbeat is unexpired; a run
that ends removes its heartbeat, and one killed outright stops beating, so its claims lapse (within
output.lease_s, or at once for a run of the reader's machine whose process is gone) and another run
takes its parts over. One heartbeat per run, not one lease per part, keeps the writes to one per
interval however many parts a run holds.

Every claim is created exclusively (storage.create_new: a hard link on local disk, a conditional PUT,
If-None-Match, on S3), taking over included: the claim that counts is the highest generation n, and a
run takes over a lapsed one by creating n + 1, which only one run can do. A claim file is never
rewritten nor removed while the output is unfinished, so the generations have no gaps and reading
them from 0 upwards finds the highest; the finished output's sweep removes them all. A store that
ignores the condition can let two runs both embed a part: work done twice, never a wrong output, since
a part is published whole and identical by either run (layout.py). Expiry compares the writer's clock
with the reader's: hosts are expected to keep time (NTP) within a few seconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid

from ..procguard import identity, is_alive
from ..storage import create_new, is_local, read_json, remove, retry, write_json_atomic

log = logging.getLogger(__name__)

RUNS = "_runs"
CLAIMS = "_claims"


class Leases:
    """This run's heartbeat and claims in the output folder `out` (layout.OutputFolder)."""

    def __init__(self, out, ttl_s: float):
        self.out, self.ttl = out, float(ttl_s)
        self.run = uuid.uuid4().hex[:12]
        self.mine: set[str] = set()  # part names this run claimed
        self._seen: dict[str, tuple[float, bool]] = {}  # run -> (read at, alive)
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._renew, name="batchembed-leases", daemon=True)
        self._thread.start()

    # --- this run ----------------------------------------------------------------------------

    def _beat(self) -> None:
        me = identity(os.getpid())
        write_json_atomic(self.out.fs, self._run_path(self.run),
                          {"run": self.run, "host": socket.gethostname(), "processes": _process_space(),
                           "pid": os.getpid(), "started": me[1] if me else None,
                           "expires": time.time() + self.ttl})

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._beat()
            except Exception as e:  # noqa: BLE001 - a missed beat is retried; the claims lapse only after ttl
                log.warning("could not renew this run's claims in %s: %s", self.out.url, e)

    def close(self) -> None:
        """Stop beating and remove the heartbeat (the run is over, or stopping): its claims lapse at
        once for every reader, and stay as files, so the generations keep no gaps (see above)."""
        self._stop.set()
        self._thread.join(timeout=30)
        remove(self.out.fs, self._run_path(self.run))
        self.mine.clear()

    # --- claims ------------------------------------------------------------------------------

    def claim(self, name: str) -> str | None:
        """Claim part `name` (a part id) for this run: None when it is ours, else the live run that holds it."""
        if name in self.mine:
            return None
        n, held = self._top(name)
        if held is not None:
            holder = held.get("run")
            if holder == self.run:
                self.mine.add(name)
                return None
            if self.alive(holder):
                return holder
        if not self._create(self._claim_path(name, n + 1), {"run": self.run}):
            # another run created that generation first: it holds the part
            return (read_json(self.out.fs, self._claim_path(name, n + 1)) or {}).get("run") or "another run"
        if held is not None:
            log.info("part %s: the claim of run %s lapsed; this run takes it over", name, held.get("run"))
        self.mine.add(name)
        return None

    def holder(self, name: str) -> str | None:
        """The live run other than this one that holds part `name`, or None."""
        holder = (self._top(name)[1] or {}).get("run")
        return holder if holder and holder != self.run and self.alive(holder) else None

    def alive(self, run: str | None) -> bool:
        """Whether run `run`'s heartbeat is unexpired and, for a run of this host, its process is
        there: a run killed here is taken over at once, as a rerun after a crash does (read at
        most once a second per run)."""
        if not run:
            return False
        at, alive = self._seen.get(run, (0.0, False))
        if time.monotonic() - at > 1.0:
            alive = _beating(read_json(self.out.fs, self._run_path(run)))
            self._seen[run] = (time.monotonic(), alive)
        return alive

    def _top(self, name: str) -> tuple[int, dict | None]:
        """The highest generation of part `name`'s claim and its record: (-1, None) when unclaimed.
        Claims are rarely taken over, so this is one or two reads."""
        n, held = -1, None
        while (record := read_json(self.out.fs, self._claim_path(name, n + 1))) is not None:
            n, held = n + 1, record
        return n, held

    def _create(self, path: str, record: dict) -> bool:
        """Write `record` at `path` unless something is there: False when something was."""
        return create_new(self.out.fs, path, (json.dumps(record) + "\n").encode())

    def _claim_path(self, part_id: str, n: int) -> str:
        return self.out.path(f"{CLAIMS}/{part_id}.{n}.json")

    def _run_path(self, run: str) -> str:
        return self.out.path(f"{RUNS}/{run}.json")


def sweep(out) -> None:
    """Once every part is committed: the claims left by runs killed outright, and their lapsed
    heartbeats, go (a claim on a committed part holds nothing)."""
    for path in retry(lambda: out.fs.glob(out.path(f"{CLAIMS}/*.json")), out.url):
        remove(out.fs, path)
    for path in retry(lambda: out.fs.glob(out.path(f"{RUNS}/*.json")), out.url):
        if not _beating(read_json(out.fs, path)):
            remove(out.fs, path)
    if is_local(out.fs):  # object stores have no folders to leave behind
        for folder in (CLAIMS, RUNS):
            with contextlib.suppress(OSError):  # gone, or a live run's heartbeat is in it
                os.rmdir(out.path(folder))


def _beating(beat: dict | None) -> bool:
    """Whether a heartbeat is unexpired and, for a run of this host, its process is there."""
    if beat is None or float(beat.get("expires", 0)) <= time.time():
        return False
    if beat.get("processes") == _process_space() and beat.get("started"):
        return is_alive((int(beat["pid"]), beat["started"]))
    return True


def _process_space() -> str:
    """This host and its process-id namespace: where a heartbeat's pid can be looked up (two
    containers of one host may share a hostname, never a pid namespace)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}/{ns}"
