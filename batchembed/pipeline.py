"""The three stages of a run, joined by bounded queues:

    reader+tokenizer thread --q_in--> engine (the calling thread) --q_out--> writer thread

Queues are bounded, so memory stays flat whatever the corpus size, and the
engine thread does nothing but feed the engine: reading, tokenising, Matryoshka
reduction and Parquet writing all happen beside it. The engine thread keeps
`engine.windows_in_flight` windows queued on the engine (default 2), so the
engine starts on the next window while the thread collects the last one's
vectors, instead of draining and waiting for Python at every window's end.
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from . import calibration, fidelity, storage
from .batcher import RowPlan, plan_rows
from .errors import RunError
from .incremental import TaskIndex, id_keys, text_hashes
from .matryoshka import reduce
from .plan import Task
from .reader import iter_batches, needed_columns, select_rows
from .storage import is_transient
from .tokenizer import Tokenized, make_tokenizer
from .writer import SCALAR, PartWriter, vector_array

if TYPE_CHECKING:
    from .engine import Pending
    from .runner import Prepared

log = logging.getLogger(__name__)

# Bytes a cached vector costs beyond its values: the ndarray's header, the OrderedDict's node
# and the int key (tracemalloc, Python 3.11: 1,789 bytes an entry for 384 float32 values).
CACHE_ENTRY_OVERHEAD = 256


def now_utc() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def record_base(p: Prepared) -> dict:
    """What every commit record carries: the job's identity, and when."""
    return {"job": {**p.fingerprint.as_dict(), "digest": p.fingerprint.digest}, "committed_at": now_utc()}


HISTOGRAM_BINS = 32  # token lengths of the embedded rows, per part and in the manifest


def histogram_bin_width(max_length: int) -> int:
    return max(1, -(-max_length // HISTOGRAM_BINS))


# counted per part (commit records) and per run (Stats)
COUNTS = ("rows", "embedded", "reused", "deduplicated", "matched", "tokens", "truncated", "chunked", "nulls",
          "empty", "filtered")
TOTALS = tuple(k for k in COUNTS if k != "matched")  # added up over parts (matched only feeds `deleted`)


@dataclass
class Window:
    """One window of a task's rows on its way through the pipeline."""

    hashes: np.ndarray  # uint64 text hash per row
    valid: np.ndarray  # bool per row: text not null
    reuse: np.ndarray  # rows whose vectors come from the previous output
    reused: dict[int, np.ndarray]  # dimension -> (len(reuse), d) vectors
    need: np.ndarray  # rows to embed (valid, not reused)
    inverse: np.ndarray  # per need row: its unique text
    uniq: np.ndarray  # text hashes of the unique texts
    tok: Tokenized  # of the unique texts
    matched: int  # rows whose id was found in the previous output
    empty: int
    filtered: int = 0  # rows input.where dropped before this window
    chunked: int = 0  # rows embedded as several windows (long_text: chunk)
    full: np.ndarray | None = None  # (len(uniq), model dimension), set by the engine thread
    embedded: int = 0  # unique texts the engine embedded (the rest came from the cache)
    tokens: int = 0
    # while on the engine: which unique texts it embeds, how, and their vectors as they come
    todo: np.ndarray | None = None
    plan: RowPlan | None = None
    pending: "Pending | None" = None
    borrowed: list = field(default_factory=list)  # (unique index, earlier Window, its unique index)


_END = object()  # no more work
_RESET = "reset"  # the task is being read again from its start: drop what was written of it
_FAILED = "failed"  # the task failed and on_error is skip: drop it, record why


def name_os_thread() -> None:
    """Give the calling thread its Python name in the OS too (Linux; 15 characters), so `top -H`
    and /proc show which of batchembed's threads uses the CPU. Best effort: elsewhere, nothing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, threading.current_thread().name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _waiting(item) -> bool:
    """An item is a window whose vectors are still on the engine (control items never wait)."""
    w = item[2]
    return isinstance(item[1], pa.RecordBatch) and w.pending is not None and not w.pending.done


class Pipeline:
    """The three stages of one run, joined by bounded queues.

    Items are (task, batch, Window); `batch` None closes the task, _RESET restarts it,
    _FAILED abandons it (the third item is then the error).
    """

    def __init__(self, p: Prepared, engine_factory, tasks: queue.Queue, progress,
                 stop: threading.Event | None = None):
        """`engine_factory()` gives the engine, called on the first window that needs one (a run
        that only reuses vectors never loads it). `tasks` may be shared by several pipelines
        (one per engine), and so may `stop`."""
        self.p, self.engine_factory, self.tasks, self.progress = p, engine_factory, tasks, progress
        self.engine = None
        # what one cached vector costs: its float32 values and CACHE_ENTRY_OVERHEAD
        self.cache_rows = p.spec.engine.dedup_cache_mb * 2**20 // (4 * p.model.dimension + CACHE_ENTRY_OVERHEAD)
        self.cache: OrderedDict[int, np.ndarray] | None = OrderedDict() if self.cache_rows else None
        self.tokenizer = make_tokenizer(p)
        self.q_in: queue.Queue = queue.Queue(maxsize=4)
        self.q_out: queue.Queue = queue.Queue(maxsize=4)
        self.stop = stop or threading.Event()
        self.errors: list[BaseException] = []
        self.records: dict[int, dict] = {}
        self.failed: list[dict] = []
        self.engine_seconds = 0.0
        self.input_wait_seconds = 0.0  # the engine thread waiting for a tokenised window
        self.output_wait_seconds = 0.0  # ... and for room in the writer's queue
        self.calls: list[tuple[float, float, int]] = []  # (start, end, tokens): busy spans, one per window
        self._on_engine: deque[Window] = deque()  # windows with vectors still to come, oldest first
        self._busy_since = 0.0
        self._coming: dict[int, tuple[Window, int]] = {}  # text hash -> (window on the engine, unique index)
        # int8 / uint8: the output's calibration, made before any pipeline starts
        self.calibration = calibration.require(p) if p.spec.embedding.output_dtype in SCALAR else None

    def _put(self, q: queue.Queue, item) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=0.2)
            except queue.Empty:
                continue
        return _END

    def _fail(self, e: BaseException) -> None:
        self.errors.append(e)
        self.stop.set()

    def _read_task(self, task: Task) -> bool:
        """Read and tokenise one task, retrying it whole on transient storage errors."""
        spec = self.p.spec.input
        cols = needed_columns(spec)
        policy = storage.policy
        prev = self.p.previous if self.p.previous is not None and self.p.previous.usable else None
        for attempt in range(1, policy.attempts + 1):
            sent = False
            index = None
            try:
                index = TaskIndex(prev, task) if prev is not None else None
                for batch in iter_batches(self.p.in_fs, task.file, list(task.row_groups), cols,
                                          self.p.spec.engine.sort_window_rows):
                    batch, texts, dropped = select_rows(spec, batch)
                    window = self._plan(batch, texts, index)
                    window.filtered = dropped
                    if not self._put(self.q_in, (task, batch, window)):
                        return False
                    sent = True
                return self._put(self.q_in, (task, None, None))
            except RunError as e:
                if self.p.spec.on_error != "skip":
                    raise
                log.error("skipping %s: %s", task.file.url, e)
                return self._put(self.q_in, (task, _FAILED, str(e)))
            except Exception as e:  # noqa: BLE001 - transient ones are retried, the rest fail the run
                if not is_transient(e):
                    raise
                if attempt == policy.attempts:
                    raise RunError(f"storage error reading {task.file.url} after {attempt} attempts: "
                                   f"{type(e).__name__}: {e}") from e
                wait = policy.delay(attempt)
                log.warning("storage error reading %s (%s); task restarts in %.1f s", task.file.url, e, wait)
                if sent and not self._put(self.q_in, (task, _RESET, None)):
                    return False
                time.sleep(wait)
            finally:
                if index is not None:
                    index.close()
        return False

    def _plan(self, batch: pa.RecordBatch, texts: list[str | None], index: TaskIndex | None) -> Window:
        """Which rows of a window reuse a previous vector, and the unique texts left to embed."""
        valid = np.fromiter((t is not None for t in texts), dtype=bool, count=len(texts))
        hashes = text_hashes(texts)
        reuse = np.zeros(len(texts), dtype=bool)
        reused: dict[int, np.ndarray] = {}
        matched = 0
        if index is not None:
            keys, key_valid = id_keys(batch.column(self.p.spec.input.id_column))
            reuse, pos, matched = index.match(keys, key_valid, hashes, valid)
            reused = index.vectors(pos[reuse], self.p.dimensions)
        need = np.flatnonzero(valid & ~reuse)
        uniq, first, inverse = np.unique(hashes[need], return_index=True, return_inverse=True)
        tok = self.tokenizer([texts[i] for i in need[first]])
        inverse = inverse.reshape(-1)
        chunked = 0
        if tok.chunks:
            long_uniq = np.zeros(len(uniq), dtype=bool)
            long_uniq[list(tok.chunks)] = True
            chunked = int(long_uniq[inverse].sum())
        return Window(hashes=hashes, valid=valid, reuse=np.flatnonzero(reuse), reused=reused, need=need,
                      inverse=inverse, uniq=uniq, tok=tok, matched=matched,
                      empty=sum(1 for t in texts if t == ""), chunked=chunked)

    def _engine(self):
        if self.engine is None:
            engine = self.engine_factory()
            # before this engine's first vector: does it agree with sentence-transformers?
            # (the factories check their engines as part of start-up; this catches a given one)
            fidelity.ensure(self.p, engine)
            self.engine = engine
        return self.engine

    def _start_window(self, w: Window) -> None:
        """Vectors for the window's unique texts from the cache of recent ones (or from a window
        still on the engine that has the same text); the rest are queued on the engine, in
        token-budget batch order, and come back in `_finish_window`."""
        w.full = np.empty((len(w.uniq), self.p.model.dimension), dtype=np.float32)
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
        w.pending = engine.submit(w.plan.seqs)
        self._on_engine.append(w)

    def _step(self) -> None:
        """One engine step; then close the busy span of each window it finished."""
        self.engine.step()
        while self._on_engine and self._on_engine[0].pending.done:
            w = self._on_engine.popleft()
            t = time.perf_counter()
            # (start, end, tokens): back to back while the engine has work, so they add up to its
            # busy time; a window's tokens are counted in the span that ends with it
            self.calls.append((self._busy_since, t, w.tokens))
            self.engine_seconds += t - self._busy_since
            self._busy_since = t

    def _finish_window(self, w: Window) -> None:
        """The window's vectors, once the engine has them all. Windows finish in order, so a
        window borrowed from has finished before the one borrowing."""
        if w.pending is not None:
            w.full[w.todo] = w.plan.vectors(w.pending.matrix())
        for i, src, j in w.borrowed:
            w.full[i] = src.full[j]
        cache, coming = self.cache, self._coming
        if cache is not None:
            for i in w.todo.tolist():
                h = int(w.uniq[i])
                cache[h] = w.full[i].copy()
                if coming.get(h, (None,))[0] is w:
                    del coming[h]
            while len(cache) > self.cache_rows:
                cache.popitem(last=False)
        w.pending = w.plan = w.todo = None
        w.borrowed = []

    def read_and_tokenise(self) -> None:
        name_os_thread()
        try:
            while True:
                try:
                    task = self.tasks.get_nowait()
                except queue.Empty:
                    break
                if not self._read_task(task):
                    return
            self._put(self.q_in, _END)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self._fail(e)

    def run_engine(self) -> None:
        """Items go out in the order they came in; up to `windows_in_flight` windows wait on the
        engine meanwhile. The thread blocks on its input only when the engine has no work."""
        depth = self.p.spec.engine.windows_in_flight
        held: deque = deque()  # items taken, in order, not yet handed to the writer
        ended = False
        while True:
            while held and not _waiting(held[0]):
                item = held.popleft()
                if isinstance(item[1], pa.RecordBatch):
                    self._finish_window(item[2])
                t = time.perf_counter()
                if not self._put(self.q_out, item):
                    return
                self.output_wait_seconds += time.perf_counter() - t
            if ended and not held:
                self._put(self.q_out, _END)
                return
            while not ended and len(self._on_engine) < depth:
                if self._on_engine:
                    try:
                        item = self.q_in.get_nowait()
                    except queue.Empty:
                        break
                else:
                    t = time.perf_counter()
                    item = self._get(self.q_in)
                    if self.calls and item is not _END:  # waits before the first window overlap the engine's start
                        self.input_wait_seconds += time.perf_counter() - t
                if item is _END:
                    ended = True
                    break
                if isinstance(item[1], pa.RecordBatch):
                    self._start_window(item[2])
                held.append(item)
                if not self._on_engine:
                    break  # nothing for the engine: hand this on before waiting for more
            if self._on_engine:
                if self.stop.is_set():
                    return
                self._step()

    def write(self) -> None:
        name_os_thread()
        p = self.p
        keep = [c for c in dict.fromkeys([p.spec.input.id_column, *p.spec.input.carry_columns]) if c]
        width = histogram_bin_width(p.max_length)
        writer: PartWriter | None = None
        counts: dict[str, int] = {}
        try:
            while True:
                item = self._get(self.q_out)
                if item is _END:
                    return
                task, batch, w = item
                if isinstance(batch, str):  # _RESET or _FAILED
                    if writer is not None:
                        writer.discard()
                        self.progress(dict(rows=-counts["rows"], tokens=-counts["tokens"]))
                        writer = None
                    if batch == _FAILED:
                        self.failed.append({"file": task.file.url, "part": task.part_name, "error": w})
                    continue
                if writer is None:
                    writer = PartWriter(task, p.output_schema, p.spec.output.compression)
                    counts = dict.fromkeys(COUNTS, 0)
                    hist = np.zeros(HISTOGRAM_BINS, dtype=np.int64)
                if batch is None:
                    self._commit(writer, counts, hist)
                    writer = None
                    continue
                arrays = [batch.column(c) for c in keep]
                arrays.append(pa.array(w.hashes, type=pa.uint64(), mask=~w.valid))
                embedded = reduce(w.full[w.inverse], p.dimensions)
                for d in p.dimensions:
                    matrix = np.zeros((batch.num_rows, d), dtype=np.float32)
                    matrix[w.need] = embedded[d]
                    if len(w.reuse):
                        matrix[w.reuse] = w.reused[d]
                    arrays.append(vector_array(matrix, w.valid, p.spec.embedding.output_dtype,
                                               self.calibration.ranges[d] if self.calibration else None))
                # by name, then cast by the writer: a carried column may be large_string in one file
                # and string in another
                writer.write(pa.Table.from_arrays(arrays, names=writer.schema.names))
                step = dict(rows=batch.num_rows, embedded=w.embedded, reused=len(w.reuse),
                            deduplicated=len(w.need) - w.embedded, matched=w.matched, tokens=w.tokens,
                            truncated=int(w.tok.truncated[w.inverse].sum()), nulls=int((~w.valid).sum()),
                            chunked=w.chunked,
                            empty=w.empty, filtered=w.filtered)
                for k, v in step.items():
                    counts[k] += v
                if len(w.inverse):
                    hist += np.bincount(np.minimum(w.tok.lengths[w.inverse] // width, HISTOGRAM_BINS - 1),
                                        minlength=HISTOGRAM_BINS)
                self.progress(step)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        finally:
            if writer is not None:
                writer.discard()

    def _commit(self, writer: PartWriter, counts: dict, hist: np.ndarray) -> None:
        task = writer.task
        if writer.rows + counts["filtered"] != task.num_rows:
            raise RunError(f"{task.file.url}: read {writer.rows + counts['filtered']} rows, its footer says "
                           f"{task.num_rows}")
        record = {"part": task.part_name, **counts, "length_histogram": hist.tolist(),
                  "input": task.input_fingerprint, **record_base(self.p)}
        if self.calibration is not None:
            record["calibration"] = self.calibration.digest
        writer.commit(self.p.out_fs, self.p.out_root, record)
        self.records[task.index] = record

    def run(self) -> None:
        threads = [threading.Thread(target=self.read_and_tokenise, name="batchembed-read", daemon=True),
                   threading.Thread(target=self.write, name="batchembed-write", daemon=True)]
        for t in threads:
            t.start()
        try:
            self.run_engine()
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        finally:
            engine_done = time.perf_counter()
            if self.engine is not None:
                self.engine.abort()  # after a failure: nothing of this run stays queued on a reused engine
            self._on_engine.clear()
            self._coming.clear()
            for t in threads:
                t.join()
        if self.calls:
            # Where an engine's time went: busy (sequences queued on it), or idle because this
            # thread waited for the reader/tokeniser or did its own work (the writer's waits can
            # fall in either).
            span = engine_done - self.calls[0][0]
            log.info("engine thread, from its first window to its end (%.1f s): engine busy %.1f s over %d "
                     "windows, idle %.1f s (of which %.1f s waiting for tokenised windows); %.1f s waiting "
                     "for the writer", span, self.engine_seconds, len(self.calls),
                     max(0.0, span - self.engine_seconds), self.input_wait_seconds, self.output_wait_seconds)
        if self.errors:
            raise self.errors[0]
