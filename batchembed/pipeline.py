"""The three stages of a run, joined by bounded queues:

    reader+tokenizer thread --q_in--> engine (the calling thread) --q_out--> writer thread

Queues are bounded, so memory stays flat whatever the corpus size, and the
engine thread does nothing but feed the engine: reading, tokenising, Matryoshka
reduction and Parquet writing all happen beside it.
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from . import storage
from .batcher import token_budget_batches
from .errors import RunError
from .matryoshka import reduce
from .plan import Task
from .reader import iter_batches, needed_columns
from .storage import is_transient
from .tokenizer import Tokenizer
from .writer import PartWriter, vector_array

if TYPE_CHECKING:
    from .runner import Prepared

log = logging.getLogger(__name__)


def now_utc() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


_END = object()  # no more work
_RESET = "reset"  # the task is being read again from its start: drop what was written of it
_FAILED = "failed"  # the task failed and on_error is skip: drop it, record why


class Pipeline:
    """The three stages of one run, joined by bounded queues.

    Items are (task, batch, tokenized[, vectors]); `batch` None closes the task,
    _RESET restarts it, _FAILED abandons it.
    """

    def __init__(self, p: Prepared, engine, tasks: queue.Queue, progress, stop: threading.Event | None = None):
        """`tasks` may be shared by several pipelines (one per engine), and so may `stop`."""
        self.p, self.engine, self.tasks, self.progress = p, engine, tasks, progress
        self.tokenizer = Tokenizer(p.model.path, p.max_length, p.spec.model.prefix)
        self.q_in: queue.Queue = queue.Queue(maxsize=4)
        self.q_out: queue.Queue = queue.Queue(maxsize=4)
        self.stop = stop or threading.Event()
        self.errors: list[BaseException] = []
        self.records: dict[int, dict] = {}
        self.failed: list[dict] = []
        self.engine_seconds = 0.0

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
        for attempt in range(1, policy.attempts + 1):
            sent = False
            try:
                for batch in iter_batches(self.p.in_fs, task.file, list(task.row_groups), cols,
                                          self.p.spec.engine.sort_window_rows):
                    texts = batch.column(spec.text_column).to_pylist()
                    if not self._put(self.q_in, (task, batch, self.tokenizer(texts))):
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
        return False

    def read_and_tokenise(self) -> None:
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
        while True:
            item = self._get(self.q_in)
            if item is _END:
                self._put(self.q_out, _END)
                return
            task, batch, tok = item
            if isinstance(batch, pa.RecordBatch):
                full = np.zeros((len(tok.ids), self.engine.dimension), dtype=np.float32)
                t0 = time.perf_counter()
                # One call per window, rows in token-budget batch order: vLLM's scheduler then
                # runs our batches as its steps back to back, without a Python round trip
                # between batches (measured in notes/performance.md).
                batches = token_budget_batches(tok.lengths, self.engine.token_budget, self.engine.max_batch_rows)
                if batches:
                    order = np.concatenate(batches)
                    full[order] = self.engine.embed([tok.ids[i] for i in order])
                self.engine_seconds += time.perf_counter() - t0
                item = (task, batch, tok, full)
            if not self._put(self.q_out, item):
                return

    def write(self) -> None:
        p = self.p
        keep = [c for c in dict.fromkeys([p.spec.input.id_column, *p.spec.input.carry_columns]) if c]
        writer: PartWriter | None = None
        counts: dict[str, int] = {}
        try:
            while True:
                item = self._get(self.q_out)
                if item is _END:
                    return
                task, batch, tok = item[:3]
                if isinstance(batch, str):  # _RESET or _FAILED
                    if writer is not None:
                        writer.discard()
                        self.progress(dict(rows=-counts["rows"], tokens=-counts["tokens"]))
                        writer = None
                    if batch == _FAILED:
                        self.failed.append({"file": task.file.url, "part": task.part_name, "error": tok})
                    continue
                if writer is None:
                    writer = PartWriter(task, p.output_schema, p.spec.output.compression)
                    counts = dict(rows=0, embedded=0, tokens=0, truncated=0, nulls=0, empty=0)
                if batch is None:
                    self._commit(writer, counts)
                    writer = None
                    continue
                arrays = [batch.column(c) for c in keep]
                for d, m in reduce(item[3], p.dimensions).items():
                    padded = np.zeros((batch.num_rows, d), dtype=np.float32)
                    padded[tok.valid] = m
                    arrays.append(vector_array(padded, tok.valid, p.spec.embedding.output_dtype))
                # by name, then cast by the writer: a carried column may be large_string in one file
                # and string in another
                writer.write(pa.Table.from_arrays(arrays, names=writer.schema.names))
                step = dict(rows=batch.num_rows, embedded=len(tok.ids), tokens=int(tok.lengths.sum()),
                            truncated=int(tok.truncated.sum()), nulls=int((~tok.valid).sum()), empty=tok.empty)
                for k, v in step.items():
                    counts[k] += v
                self.progress(step)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        finally:
            if writer is not None:
                writer.discard()

    def _commit(self, writer: PartWriter, counts: dict) -> None:
        task = writer.task
        if writer.rows != task.num_rows:
            raise RunError(f"{task.file.url}: read {writer.rows} rows, its footer says {task.num_rows}")
        record = {"part": task.part_name, **counts, "input": task.input_fingerprint,
                  "job": {**self.p.fingerprint.as_dict(), "digest": self.p.fingerprint.digest},
                  "committed_at": now_utc()}
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
            for t in threads:
                t.join()
        if self.errors:
            raise self.errors[0]
