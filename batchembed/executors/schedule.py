"""The work of one run, as every executor hands it out: the parts left, largest first; a part to
whichever worker asks; the parts of a worker that is lost back to the list; one budget of engine
restarts for the whole run; and, through the output's claims (output/leases.py), parts that
another live run on the same output holds left to it, waited for at the end only while its claims
live. Engine processes (processes.py), Ray actors (ray.py) and this process (local.py) are only
transports for it."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..errors import RunError

if TYPE_CHECKING:
    from ..job import Prepared
    from ..output.leases import Leases
    from ..plan import Task

log = logging.getLogger(__name__)

# Schedule.take's answer when every part left is held by another live run: ask again shortly
WAIT = "wait"
# how often parts held elsewhere are looked at again
_RECHECK_S = 2.0


class Restarts:
    """engine.max_restarts as one budget for the run, whoever restarts: an engine replaced inside
    its worker (base.Worker), a worker process or Ray actor replaced by the scheduler. `counts`: one
    slot per restarter (a list, or a shared multiprocessing array across engine processes), so no
    two of them write the same slot."""

    def __init__(self, limit: int, counts=None):
        self.limit = limit
        self.counts = counts if counts is not None else [0]
        self._lock = threading.Lock()

    def take(self, slot: int = 0) -> int | None:
        """One restart from the budget: the run's count with it, or None when none is left."""
        with self._lock:
            used = sum(self.counts)
            if used >= self.limit:
                return None
            self.counts[slot] += 1
            return used + 1

    def used(self) -> int:
        return sum(self.counts)

    def spend(self, why: str, slot: int = 0) -> int:
        """One restart for a failure (`why`): the run's count with it, or the RunError that ends the
        run once none is left."""
        n = self.take(slot)
        if n is None:
            raise RunError(f"the engine failed {self.used() + 1} times in this run (engine.max_restarts: "
                           f"{self.limit}), last: {why}; committed parts are kept, a rerun resumes")
        return n


class Schedule:
    """The parts of a run left to embed, handed out by `take`."""

    def __init__(self, p: Prepared, pending: list[Task], leases: Leases | None = None,
                 restarts: Restarts | None = None, retried: dict[int, dict] | None = None):
        """`retried`: the commit records, by task index, of the parts planned again for their failed rows."""
        self.p, self.leases = p, leases
        self.retried = {t.part_id: retried[t.index] for t in pending if retried and t.index in retried}
        self.restarts = restarts or Restarts(p.spec.engine.max_restarts)
        self.by_id = {t.part_id: t for t in pending}
        # the largest parts first, the smallest last: the engines run out of work at nearly the same
        # moment, each finishing a small part (longest-processing-time-first); taken from the end
        self.todo = [t.part_id for t in sorted(pending, key=lambda t: (-t.num_rows, t.part_id))][::-1]
        self.taken: dict[object, list[str]] = {}
        self.elsewhere: set[str] = set()  # held by another live run
        self.done_elsewhere: set[str] = set()  # committed by another run while this one ran
        self._checked = 0.0

    def take(self, worker) -> Task | str | None:
        """The next part for `worker`, WAIT (parts are left, all held by other live runs: ask again
        in a second), or None (nothing left)."""
        while self.todo:
            part = self.todo.pop()
            if self.leases is not None:
                holder = self.leases.claim(part)
                if holder is not None:
                    log.info("part %s: claimed by run %s, which embeds it", part, holder)
                    self.elsewhere.add(part)
                    continue
                # ours now, but another run may have committed it since this one planned: one that
                # has ended (its claims lapsed), or one killed before it moved on from that part
                if self._done(part):
                    self.done_elsewhere.add(part)
                    continue
            self.taken.setdefault(worker, []).append(part)
            return self.by_id[part]
        if not self.elsewhere:
            return None
        if time.monotonic() - self._checked >= _RECHECK_S:
            self._checked = time.monotonic()
            self._look_elsewhere()
            if self.todo:
                return self.take(worker)
        return WAIT if self.elsewhere else None

    def _look_elsewhere(self) -> None:
        """Parts held elsewhere: committed by now, or back on the list once their run's claim lapsed."""
        for part in sorted(self.elsewhere):
            if self._done(part):
                self.elsewhere.discard(part)
                self.done_elsewhere.add(part)
            elif self.leases.holder(part) is None:
                self.elsewhere.discard(part)
                self.todo.append(part)

    def _done(self, part: str) -> bool:
        """Whether `part` is committed as no longer to embed: without failed rows, or with them by another
        commit than the one this run planned to retry (a part planned for its failed rows is tried again
        once, not by every run)."""
        r = self.committed(part)
        return r is not None and (not r.get("failed_rows") or r != self.retried.get(part))

    def committed(self, part: str) -> dict | None:
        """The commit record of `part` when it is committed for this input, else None."""
        t = self.by_id[part]
        r = self.p.out.read_commit(self.p.out.part_name(t))
        return r if r and r.get("input") == t.input_fingerprint else None

    def lose(self, worker) -> dict[str, dict]:
        """`worker` is gone: the parts it took and did not commit go back on the list (this run
        still holds their claims); returns the records of those it did commit, by part name."""
        records, lost = {}, []
        for part in self.taken.pop(worker, []):
            r = self.committed(part)
            if r is None:
                lost.append(part)
            else:
                records[r["part"]] = r
        self.todo += lost
        return records

    def finished(self, worker) -> None:
        """`worker` ended with every part it took committed."""
        self.taken.pop(worker, None)

    def close(self) -> None:
        if self.elsewhere or self.done_elsewhere:
            log.info("%d part(s) were embedded by another run on this output", len(self.done_elsewhere))
        if self.leases is not None:
            self.leases.close()
