"""The in-process executor: one worker in this process, on the engine given or its own."""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

from .. import interrupts
from ..stats import RunResult, combine
from .base import Worker
from .schedule import WAIT

if TYPE_CHECKING:
    from ..job import Prepared
    from .schedule import Schedule


class Asking:
    """The pipeline's task queue over the run's schedule: parts held by another live run are waited
    for (a second between asks) until they are committed or their claims lapse."""

    def __init__(self, schedule: Schedule, worker=0):
        self.schedule, self.worker = schedule, worker

    def get_nowait(self):
        while True:
            task = self.schedule.take(self.worker)
            if task is None or interrupts.requested():
                raise queue.Empty
            if task is not WAIT:
                return task
            time.sleep(1.0)


def run_local(p: Prepared, schedule: Schedule, progress, engine=None, reference=None) -> RunResult:
    worker = Worker(p, engine, reference=reference, restarts=schedule.restarts)
    t0 = time.perf_counter()
    try:
        worker.run(Asking(schedule), progress)
        wall = time.perf_counter() - t0  # the engine's shutdown is not pipeline time
    finally:
        worker.close()
    return combine([worker.report()], wall)
