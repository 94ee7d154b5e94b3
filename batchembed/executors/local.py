"""The in-process executor: one worker in this process, on the engine given or its own."""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

from ..stats import RunResult, combine
from .base import Worker

if TYPE_CHECKING:
    from ..job import Prepared
    from ..plan import Task


def run_local(p: Prepared, pending: list[Task], progress, engine=None, reference=None) -> RunResult:
    tasks: queue.Queue = queue.Queue()
    for t in pending:
        tasks.put(t)
    worker = Worker(p, engine, reference=reference)
    t0 = time.perf_counter()
    try:
        worker.run(tasks, progress)
        wall = time.perf_counter() - t0  # the engine's shutdown is not pipeline time
    finally:
        worker.close()
    return combine([worker.report()], wall)
