"""The three stages of a run, joined by bounded queues:

    read.py (thread) --q_in--> embed.py (the calling thread) --q_out--> write.py (thread)

Queues are bounded, so memory grows to a bound (about twelve windows: the docs' Memory
section) whatever the corpus size, and the engine thread does nothing but feed the engine:
reading, tokenising, Matryoshka reduction and writing all happen beside it. A Pipeline may
run several times (a Ray actor runs one part at a time): the engine stage, its cache and its
timings last as long as the Pipeline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import interrupts
from .base import name_os_thread
from .embed import EmbedStage
from .read import ReadStage
from .write import WriteStage

if TYPE_CHECKING:
    from ..job import Prepared

log = logging.getLogger(__name__)

__all__ = ["Pipeline", "name_os_thread"]


class Pipeline:
    def __init__(self, p: Prepared, engine_source: Callable[[], object], replace_engine=None):
        """`engine_source()` gives the engine, when the embedding stage first wants it (embed.py);
        `replace_engine(engine, failure)` one for an engine that died or hung (embed.py)."""
        self.p = p
        self.reader = ReadStage(p)
        self.embedder = EmbedStage(p, engine_source, replace_engine)
        self.writer = WriteStage(p)
        self.reader.building = self.embedder.building
        self.records: dict[str, dict] = {}  # part name -> commit record, over every run
        self.failed: list[dict] = []

    @property
    def engine(self):
        return self.embedder.engine

    def run(self, tasks, progress: Callable[[dict], None], stop: threading.Event | None = None) -> dict[str, dict]:
        """Run the tasks `tasks` gives (get_nowait until queue.Empty; it may be shared with other
        pipelines, and so may `stop`). Returns the records of the parts committed by this run;
        raises the first error of any stage."""
        stop = interrupts.Either(stop or threading.Event(), interrupts.STOP)
        tasks = _Watched(tasks, stop)
        errors: list[BaseException] = []
        q_in: queue.Queue = queue.Queue(maxsize=4)
        q_out: queue.Queue = queue.Queue(maxsize=4)
        records: dict[str, dict] = {}

        def guarded(fn, *args):
            def body():
                name_os_thread()
                try:
                    fn(*args)
                except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                    errors.append(e)
                    stop.set()
            return body

        threads = [threading.Thread(target=guarded(self.reader.run, tasks, q_in, stop), name="batchembed-read",
                                    daemon=True),
                   threading.Thread(target=guarded(self.writer.run, q_out, stop, progress, records, self.failed),
                                    name="batchembed-write", daemon=True)]
        for t in threads:
            t.start()
        calls_before = len(self.embedder.calls)
        try:
            self.embedder.run(q_in, q_out, stop, tasks.any_task)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            stop.set()
        finally:
            engine_done = time.perf_counter()
            self.embedder.reset()
            for t in threads:
                t.join()
        self.records.update(records)
        self._log_time(self.embedder.calls[calls_before:], engine_done)
        if errors:
            raise errors[0]
        return records

    def _log_time(self, calls, engine_done: float) -> None:
        """Where an engine's time went in a run: busy (sequences queued on it), or idle because this
        thread waited for the reader/tokeniser or did its own work (the writer's waits can fall in either)."""
        if not calls:
            return
        e = self.embedder
        span = engine_done - calls[0][0]
        busy = sum(t1 - t0 for t0, t1, _ in calls)
        log.info("engine thread, from its first window to its end (%.1f s): engine busy %.1f s over %d "
                 "windows, idle %.1f s (of which %.1f s waiting for tokenised windows, over the pipeline's "
                 "life); %.1f s waiting for the writer", span, busy, len(calls), max(0.0, span - busy),
                 e.input_wait_seconds, e.output_wait_seconds)


class _Watched:
    """A run's `tasks`, which can tell whether the reader's first ask gave it a task: the engine is
    started ahead of the first window only for a pipeline that has work (an engine process that
    finds every part taken builds no engine)."""

    def __init__(self, tasks, stop):
        self.tasks, self.stop = tasks, stop
        self.asked = threading.Event()
        self.got = False

    def get_nowait(self):
        try:
            task = self.tasks.get_nowait()
            self.got = True
            return task
        finally:
            self.asked.set()

    def any_task(self) -> bool:
        """Whether the reader got a task, once it has asked (False if the run stops first)."""
        while not self.asked.wait(0.05):
            if self.stop.is_set():
                return False
        return self.got
