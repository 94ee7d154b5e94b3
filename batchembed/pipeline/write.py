"""The writing stage: each window's rows as output columns (Matryoshka reduction, the output
dtype), streamed into its part; at the task's end the part is checked against its input's
row count and committed with its record."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .. import calibration
from ..embed.matryoshka import reduce
from ..embed.vectors import (
    SCALAR,
    multi_vector_array,
    multi_vector_rows,
    prune,
    sparse_array,
    sparse_rows,
    vector_array,
)
from ..errors import RunError
from ..output.records import COUNTS, HISTOGRAM_BINS, commit_record, empty_counts, histogram_bin_width
from .base import END, FAILED, get

if TYPE_CHECKING:
    from ..job import Prepared
    from ..output.base import PartWriter
    from ..plan import Task


class _Part:
    """One task's part while it is written: its writer, counts and token histogram."""

    def __init__(self, task: Task, writer: PartWriter):
        self.task, self.writer = task, writer
        self.counts = empty_counts()
        self.histogram = np.zeros(HISTOGRAM_BINS, dtype=np.int64)
        self.errors: list[dict] = []  # rows the engine failed: their id, row in the part, reason, tokens


class WriteStage:
    def __init__(self, p: Prepared):
        self.p = p
        self.keep = p.kept_columns
        self.width = histogram_bin_width(p.max_length)
        # int8 / uint8: the output's calibration, made before any pipeline starts
        self.calibration = calibration.require(p) if p.spec.embedding.output_dtype in SCALAR else None
        self.job = p.fingerprint.with_digest()
        self.schema = p.output_schema

    def run(self, q_out: queue.Queue, stop, progress: Callable[[dict], None], records: dict[str, dict],
            failed: list[dict]) -> None:
        """Write until END; committed parts' records go into `records` (by part name), tasks
        abandoned under on_error: skip into `failed`."""
        part: _Part | None = None
        try:
            while True:
                item = get(q_out, stop)
                if item is END:
                    return
                task, batch, w = item
                if isinstance(batch, str):  # RESET or FAILED
                    if part is not None:
                        part.writer.discard()
                        progress(dict(rows=-part.counts["rows"], tokens=-part.counts["tokens"]))
                        part = None
                    if batch == FAILED:
                        failed.append({"file": task.file.url, "part": self.p.out.part_name(task), "error": w})
                    continue
                if part is None:
                    part = _Part(task, self.p.out.writer(self.schema, self.p.spec.output.compression))
                if batch is None:
                    name, record = self._commit(part)
                    records[name] = record
                    part = None
                    continue
                progress(self._write(part, batch, w))
        finally:
            if part is not None:
                part.writer.discard()

    def _write(self, part: _Part, batch: pa.RecordBatch, w) -> dict:
        p = self.p
        valid = w.valid
        if w.failed:  # null vector, and no text hash: a reindex embeds the row again
            failed = np.zeros(len(w.uniq), dtype=bool)
            failed[list(w.failed)] = True
            rows = w.need[failed[w.inverse]]
            valid = valid.copy()
            valid[rows] = False
            ids = batch.column(p.spec.input.id_column).to_pylist() if p.spec.input.id_column else None
            for r in rows.tolist():
                u = int(w.inverse[np.searchsorted(w.need, r)])
                part.errors.append({"id": ids[r] if ids else None, "part_row": part.writer.rows + r,
                                    "error": w.failed[u], "tokens": int(w.tok.lengths[u])})
        arrays = [batch.column(c) for c in self.keep]
        arrays.append(pa.array(w.hashes, type=pa.uint64(), mask=~valid))
        embedded = reduce(w.full[w.inverse], p.dimensions)
        for d in p.dimensions:
            matrix = np.zeros((batch.num_rows, d), dtype=np.float32)
            matrix[w.need] = embedded[d]
            if len(w.reuse):
                matrix[w.reuse] = w.reused[d]
            arrays.append(vector_array(matrix, valid, p.spec.embedding.output_dtype,
                                       self.calibration.ranges[d] if self.calibration else None))
        extra_counts = dict.fromkeys(("sparse_weights", "sparse_pruned", "multi_vectors"), 0)
        for r in p.extra_outputs:
            arrays.append(self._extra_column(r, w, batch.num_rows, valid, extra_counts))
        # by name, then cast by the writer: a carried column may be large_string in one file
        # and string in another
        part.writer.write(pa.Table.from_arrays(arrays, names=self.schema.names))
        step = dict(rows=batch.num_rows, embedded=w.embedded, reused=len(w.reuse),
                    deduplicated=len(w.need) - w.embedded, matched=w.matched, tokens=w.tokens,
                    truncated=int(w.tok.truncated[w.inverse].sum()), nulls=int((~w.valid).sum()),
                    chunked=w.chunked, empty=w.empty, filtered=w.filtered,
                    failed_rows=int((w.valid & ~valid).sum()), **extra_counts)
        for k in COUNTS:
            part.counts[k] += step[k]
        if len(w.inverse):
            part.histogram += np.bincount(np.minimum(w.tok.lengths[w.inverse] // self.width, HISTOGRAM_BINS - 1),
                                          minlength=HISTOGRAM_BINS)
        return step

    def _extra_column(self, r: str, w, num_rows: int, valid: np.ndarray, counts: dict) -> pa.Array:
        """The window's sparse or multi-vector column: embedded rows from the engine stage, reused
        rows from the previous output; sparse weights pruned as embedding.sparse says."""
        e = self.p.spec.embedding
        rows: list = [None] * num_rows
        for row, u in zip(w.need.tolist(), w.inverse.tolist()):
            rows[row] = w.extra[r][u]
        if len(w.reuse):
            stored = sparse_rows(w.reused[r]) if r == "sparse" else multi_vector_rows(w.reused[r])
            for row, value in zip(w.reuse.tolist(), stored):
                rows[row] = value
        if r == "sparse":
            for i in np.flatnonzero(valid).tolist():
                if rows[i] is None:
                    continue
                before = len(rows[i][0])
                if e.sparse.top_k is not None or e.sparse.min_weight > 0:
                    rows[i] = prune(*rows[i], e.sparse.top_k, e.sparse.min_weight)
                counts["sparse_weights"] += len(rows[i][0])
                counts["sparse_pruned"] += before - len(rows[i][0])
            return sparse_array(rows, valid)
        counts["multi_vectors"] += sum(len(rows[i]) for i in np.flatnonzero(valid).tolist() if rows[i] is not None)
        return multi_vector_array(rows, self.p.model.multi_vector_dimension, e.multi_vector.dtype, valid)

    def _commit(self, part: _Part) -> tuple[str, dict]:
        task, counts = part.task, part.counts
        if part.writer.rows + counts["filtered"] != task.num_rows:
            raise RunError(f"{task.file.url}: read {part.writer.rows + counts['filtered']} rows, its footer says "
                           f"{task.num_rows}")
        name = self.p.out.part_name(task)
        extra = {"calibration": self.calibration.digest} if self.calibration is not None else {}
        if self.p.run:
            extra["run"] = self.p.run
        record = commit_record(name, counts, part.histogram, task.input_fingerprint, self.job, **extra)
        self.p.out.commit(part.writer, name, record, part.errors)
        return name, record
