"""The engine stage: vectors for each window's unique texts, from a cache of recent ones or
from the engine, which keeps `engine.windows_in_flight` windows queued (default 2) so it
starts on the next window while this thread collects the last one's vectors, instead of
draining and waiting for Python at every window's end.

The cache (text hash -> vector, `engine.dedup_cache_mb`) lives as long as the stage: a
worker keeps one stage for every task it runs, so a text seen in an earlier part is not
embedded again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..embed.batcher import embed_isolating, plan_rows
from ..embed.tokenizer import TokenIds
from ..embed.vectors import merge_windows
from ..errors import EngineFailure, RequestFailure
from .base import END, Window, get, put

if TYPE_CHECKING:
    from ..job import Prepared

log = logging.getLogger(__name__)

# Bytes a cached vector costs beyond its values: the ndarray's header, the OrderedDict's node
# and the int key (measured with tracemalloc on Python 3.11).
CACHE_ENTRY_OVERHEAD = 256


def _waiting(item) -> bool:
    """An item is a window whose vectors are still on the engine (control items never wait)."""
    w = item[2]
    return isinstance(item[1], pa.RecordBatch) and w.pending is not None and not w.pending.done


class EmbedStage:
    def __init__(self, p: Prepared, engine_source: Callable[[], object],
                 replace_engine: Callable[[object, EngineFailure], object] | None = None):
        """`engine_source()` gives the engine: as the first run starts, or, where a previous
        output may give the vectors, on the first window that needs one (a run that only reuses
        vectors never loads it). `replace_engine(engine, failure)` gives a new
        one for an engine that died or hung (or raises); without it the failure ends the run."""
        self.p, self.engine_source, self.replace_engine = p, engine_source, replace_engine
        self.engine = None
        # what one cached vector costs: its float32 values and CACHE_ENTRY_OVERHEAD
        self.width = p.model.dimension if "dense" in p.outputs else 0  # of a dense vector, 0: none written
        self.cache_rows = p.spec.engine.dedup_cache_mb * 2**20 // (4 * p.model.dimension + CACHE_ENTRY_OVERHEAD)
        # sparse and multi-vector rows are of any size: texts seen in earlier windows are embedded
        # again (a window's identical texts still once)
        self.cache: OrderedDict[int, np.ndarray] | None = \
            OrderedDict() if self.cache_rows and not p.extra_outputs else None
        self.engine_seconds = 0.0
        self.input_wait_seconds = 0.0  # waiting for a tokenised window
        self.output_wait_seconds = 0.0  # ... and for room in the writer's queue
        self.calls: list[tuple[float, float, int]] = []  # (start, end, tokens): busy spans, one per window
        self._on_engine: deque[Window] = deque()  # windows with vectors still to come, oldest first
        self._busy_since = 0.0
        self._coming: dict[int, tuple[Window, int]] = {}  # text hash -> (window on the engine, unique index)
        # set while an engine is being built (the first, or a replacement): the reader then reads
        # no further ahead (read.py), since tokenising takes the cores the build needs
        self.building = threading.Event()

    def _engine(self):
        if self.engine is None:
            self.engine = self._build(self.engine_source)
        return self.engine

    def _build(self, source, *args):
        self.building.set()
        try:
            return source(*args)
        finally:
            self.building.clear()

    def _start_window(self, w: Window) -> None:
        """Vectors for the window's unique texts from the cache of recent ones (or from a window
        still on the engine that has the same text); the rest are queued on the engine, in
        token-budget batch order, and come back in `_finish_window`."""
        w.full = np.empty((len(w.uniq), self.width), dtype=np.float32)
        w.extra = {r: [None] * len(w.uniq) for r in self.p.extra_outputs}
        cache, coming = self.cache, self._coming
        todo, w.borrowed = [], []
        for i, h in enumerate(w.uniq.tolist()):
            v = cache.get(h) if cache is not None else None
            if v is not None:
                cache.move_to_end(h)
                w.full[i] = v
            elif cache is not None and h in coming:
                w.borrowed.append((i, *coming[h]))
            else:
                todo.append(i)
                if cache is not None:
                    coming[h] = (w, i)
        w.todo = np.asarray(todo, dtype=np.int64)
        w.embedded = len(todo)
        if not todo:
            return
        engine = self._engine()
        w.plan = plan_rows(w.tok, w.todo, engine.token_budget, engine.max_batch_rows)
        w.tokens = int(w.tok.lengths[w.todo].sum())
        if not self._on_engine:
            self._busy_since = time.perf_counter()
        try:
            w.pending = engine.submit(w.plan.seqs)
        except EngineFailure as e:
            self._replace(e)
            w.pending = self.engine.submit(w.plan.seqs)
        except RequestFailure as e:
            self._on_engine.append(w)
            self._isolate(e)
            self._collect()
            return
        self._on_engine.append(w)

    def _replace(self, failure: EngineFailure) -> None:
        """A new engine for one that died or hung; every window whose vectors had not all come back
        goes to it whole (vectors that came back from the old one are dropped with it). Nothing
        was written of those windows, so nothing is written twice."""
        if self.replace_engine is None:
            raise failure
        self.engine = self._build(self.replace_engine, self.engine, failure)
        self._busy_since = time.perf_counter()
        for w in self._on_engine:
            w.pending = self.engine.submit(w.plan.seqs)

    def _step(self) -> None:
        """One engine step; then close the busy span of each window it finished."""
        try:
            self.engine.step()
        except EngineFailure as e:
            self._replace(e)
            return
        except RequestFailure as e:
            self._isolate(e)
        self._collect()

    def _collect(self) -> None:
        """Close the busy span of each window whose vectors have all come back, oldest first."""
        while self._on_engine and self._on_engine[0].pending.done:
            w = self._on_engine.popleft()
            t = time.perf_counter()
            # (start, end, tokens): back to back while the engine has work, so they add up to its
            # busy time; a window's tokens are counted in the span that ends with it
            self.calls.append((self._busy_since, t, w.tokens))
            self.engine_seconds += t - self._busy_since
            self._busy_since = t

    def _isolate(self, failure: RequestFailure) -> None:
        """The engine failed a step or a request of the windows on it (they were all aborted): each
        window is embedded again in halves, and halves of halves, until every sequence that fails
        alone is found; the rest get their vectors. A window with no such sequence costs one call."""
        log.warning("engine: %s; finding the rows that fail by bisection", failure)
        for w in self._on_engine:
            w.pending, bad = embed_isolating(self.engine, w.plan.seqs)
            for k, reason in bad.items():  # a chunked row fails with any of its chunks
                w.failed[int(w.todo[w.plan.row_of(k)])] = reason
            if bad:
                log.warning("engine: %d sequence(s) of a window fail alone; their rows get null vectors and go "
                            "to the output's error file", len(bad))

    def _finish_window(self, w: Window) -> None:
        """The window's vectors, once the engine has them all. Windows finish in order, so a
        window borrowed from has finished before the one borrowing."""
        if w.pending is not None:
            w.full[w.todo] = w.plan.vectors(w.pending.matrix())
            for r, values in w.pending.extras().items():  # submission order, as the matrix's rows
                row = w.extra[r]
                for i, value in zip(w.todo.tolist(), w.plan.values(values, partial(merge_windows, r))):
                    row[i] = value
        for i, src, j in w.borrowed:
            w.full[i] = src.full[j]
            if j in src.failed:
                w.failed[i] = src.failed[j]
        cache, coming = self.cache, self._coming
        if cache is not None:
            for i in w.todo.tolist():
                h = int(w.uniq[i])
                if i not in w.failed:  # a failed text is tried again when it comes back
                    cache[h] = w.full[i].copy()
                if coming.get(h, (None,))[0] is w:
                    del coming[h]
            while len(cache) > self.cache_rows:
                cache.popitem(last=False)
        w.pending = w.plan = w.todo = None
        w.borrowed = []
        # the writer needs the rows' token counts, not their ids: up to five windows wait for it
        w.tok.ids, w.tok.chunks = TokenIds([]), None

    def run(self, q_in: queue.Queue, q_out: queue.Queue, stop, has_work: Callable[[], bool] = lambda: True) -> None:
        """Items go out in the order they came in; up to `windows_in_flight` windows wait on the
        engine meanwhile. The thread blocks on its input only when the engine has no work.
        `has_work()`: whether the run has any task (it may wait for the reader's first ask)."""
        depth = self.p.spec.engine.windows_in_flight
        held: deque = deque()  # items taken, in order, not yet handed to the writer
        ended = False
        if self.engine is None and self.p.previous is None and has_work():
            # Without a previous output to reuse from, a run's rows need the engine: it starts now,
            # while the reader reads and tokenises the first windows, not after.
            self._engine()
        while True:
            while held and not _waiting(held[0]):
                item = held.popleft()
                if isinstance(item[1], pa.RecordBatch):
                    self._finish_window(item[2])
                t = time.perf_counter()
                if not put(q_out, item, stop):
                    return
                self.output_wait_seconds += time.perf_counter() - t
            if ended and not held:
                put(q_out, END, stop)
                return
            while not ended and len(self._on_engine) < depth:
                if self._on_engine:
                    try:
                        item = q_in.get_nowait()
                    except queue.Empty:
                        break
                else:
                    t = time.perf_counter()
                    item = get(q_in, stop)
                    if self.calls and item is not END:  # waits before the first window overlap the engine's start
                        self.input_wait_seconds += time.perf_counter() - t
                if item is END:
                    ended = True
                    break
                if isinstance(item[1], pa.RecordBatch):
                    self._start_window(item[2])
                held.append(item)
                if not self._on_engine:
                    break  # nothing for the engine: hand this on before waiting for more
            if self._on_engine:
                if stop.is_set():
                    return
                self._step()

    def reset(self) -> None:
        """After a run, failed or not: nothing of it stays queued on the engine."""
        if self.engine is not None:
            self.engine.abort()
        self._on_engine.clear()
        self._coming.clear()
