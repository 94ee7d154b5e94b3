"""The reading stage: a task's rows read, matched against the previous output (reuse) and
tokenised, a window at a time; a task is read again from its start after a transient
storage error."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .. import storage
from ..errors import RunError
from ..inputs.rows import select_rows
from ..plan import Task
from ..reuse import TaskIndex, id_keys, text_hashes
from ..storage import is_transient
from .base import END, FAILED, RESET, Window, put

if TYPE_CHECKING:
    from ..job import Prepared

log = logging.getLogger(__name__)


# Windows the reader keeps ready while the engine is being built (BATCHEMBED_READ_AHEAD_WHILE_BUILDING
# changes it, to compare). Tokenising as far ahead as the queue allows takes the host's cores from
# the engines' builds, which are CPU-bound too and slowed by it; the rest is tokenised while the
# engines run.
READ_AHEAD_WHILE_BUILDING = int(os.environ.get("BATCHEMBED_READ_AHEAD_WHILE_BUILDING", "1"))


class ReadStage:
    def __init__(self, p: Prepared):
        self.p = p
        self.tokenizer = p.tokenizer()
        self.building: threading.Event | None = None  # set while the engine is being built (embed.py)

    def run(self, tasks, q_in: queue.Queue, stop) -> None:
        """Every task of `tasks` (get_nowait until queue.Empty) onto q_in as windows, then END."""
        while True:
            try:
                task = tasks.get_nowait()
            except queue.Empty:
                break
            if not self._read_task(task, q_in, stop):
                return
        put(q_in, END, stop)

    def _read_task(self, task: Task, q_in: queue.Queue, stop) -> bool:
        """Read and tokenise one task, retrying it whole on transient storage errors."""
        p = self.p
        policy = storage.policy
        prev = p.previous if p.previous is not None and p.previous.usable else None
        for attempt in range(1, policy.attempts + 1):
            sent = False
            index = None
            try:
                index = TaskIndex(prev, task) if prev is not None else None
                for batch in p.iter_batches(task, p.window_rows):
                    self._pace(q_in, stop)
                    batch, texts, dropped = select_rows(p.spec.input, batch)
                    window = self.plan(batch, texts, index)
                    window.filtered = dropped
                    # the writer wants the columns it keeps, not the texts: a window waits for it
                    # behind several others, and long texts would hold memory all that while
                    batch = batch.select(p.kept_columns)
                    if not put(q_in, (task, batch, window), stop):
                        return False
                    sent = True
                return put(q_in, (task, None, None), stop)
            except RunError as e:
                if p.spec.on_error != "skip":
                    raise
                log.error("skipping %s: %s", task.file.url, e)
                return put(q_in, (task, FAILED, str(e)), stop)
            except Exception as e:  # noqa: BLE001 - transient ones are retried, the rest fail the run
                if not is_transient(e):
                    raise
                if attempt == policy.attempts:
                    raise RunError(f"storage error reading {task.file.url} after {attempt} attempts: "
                                   f"{type(e).__name__}: {e}") from e
                wait = policy.delay(attempt)
                log.warning("storage error reading %s (%s); task restarts in %.1f s", task.file.url, e, wait)
                if sent and not put(q_in, (task, RESET, None), stop):
                    return False
                time.sleep(wait)
            finally:
                if index is not None:
                    index.close()
        return False

    def _pace(self, q_in: queue.Queue, stop) -> None:
        """While the engine is being built, wait once READ_AHEAD_WHILE_BUILDING windows are ready."""
        while (self.building is not None and self.building.is_set() and not stop.is_set()
               and q_in.qsize() >= READ_AHEAD_WHILE_BUILDING):
            time.sleep(0.05)

    def plan(self, batch: pa.RecordBatch, texts: list[str | None], index: TaskIndex | None) -> Window:
        """Which rows of a window reuse a previous vector, and the unique texts left to embed."""
        valid = np.fromiter((t is not None for t in texts), dtype=bool, count=len(texts))
        hashes = text_hashes(texts)
        reuse = np.zeros(len(texts), dtype=bool)
        reused: dict[int, np.ndarray] = {}
        matched = 0
        if index is not None:
            keys, key_valid = id_keys(batch.column(self.p.spec.input.id_column))
            reuse, pos, matched = index.match(keys, key_valid, hashes, valid)
            reused = index.vectors(pos[reuse], self.p.dimensions, self.p.extra_outputs)
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
