"""Writing the output: one Parquet part per task, a commit record per part, the manifest last.

Layout under `output.uri`:
    part-00000.parquet ...       the vectors, next to the ids and carried columns
    _commits/part-00000.json     written after its part: rows, tokens, fingerprints
    manifest.json                after every part is committed
    _SUCCESS                     last of all: a reader that sees it sees a finished output

A part is streamed to a local temporary file row group by row group (memory
stays flat) and committed in one atomic step.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .plan import Task
from .storage import put_file_atomic, write_json_atomic

COMMITS = "_commits"
MANIFEST = "manifest.json"
SUCCESS = "_SUCCESS"


PACKED = {"binary": pa.int8(), "ubinary": pa.uint8()}  # sign bits, 8 dimensions to a byte


SCALAR = {"int8": pa.int8(), "uint8": pa.uint8()}  # one value per dimension, calibrated ranges


def vector_array(matrix: np.ndarray, valid: np.ndarray, dtype: str,
                 ranges: np.ndarray | None = None) -> pa.FixedSizeListArray:
    """A fixed-size-list column from a (rows, d) matrix; rows where `valid` is False are null.

    binary / ubinary follow sentence-transformers' quantize_embeddings: the bits of
    `vector > 0` packed 8 to a byte (numpy packbits, first dimension in the high bit),
    as uint8 (ubinary) or as int8 after subtracting 128 (binary). int8 / uint8 need the
    calibration `ranges` (calibration.quantize)."""
    if dtype in SCALAR:
        from .calibration import quantize

        values = pa.array(quantize(matrix, ranges, dtype).reshape(-1))
        width = matrix.shape[1]
    elif dtype in PACKED:
        packed = np.packbits(matrix > 0, axis=1)
        values = pa.array((packed.astype(np.int16) - 128).astype(np.int8).reshape(-1) if dtype == "binary"
                          else packed.reshape(-1))
        width = packed.shape[1]
    else:
        values = pa.array(np.ascontiguousarray(matrix, dtype=np.float16 if dtype == "float16" else np.float32)
                          .reshape(-1))
        width = matrix.shape[1]
    mask = None if valid.all() else pa.array(~valid)
    return pa.FixedSizeListArray.from_arrays(values, width, mask=mask)


def vector_matrix(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The float32 (rows, d) matrix of a fixed-size-list vector column (its slice, if it is one).
    Null rows come out as whatever their slots hold: drop them first where that matters."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    dim = col.type.list_size
    values = col.values.slice(col.offset * dim, len(col) * dim)
    return values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(len(col), dim)


def vector_type(dim: int, dtype: str) -> pa.DataType:
    if dtype in PACKED:
        return pa.list_(PACKED[dtype], dim // 8)
    if dtype in SCALAR:
        return pa.list_(SCALAR[dtype], dim)
    return pa.list_(pa.float16() if dtype == "float16" else pa.float32(), dim)


def write_commit(fs, root: str, part_name: str, record: dict[str, Any]) -> None:
    """A part's commit record, published after the part itself."""
    write_json_atomic(fs, f"{root}/{COMMITS}/{part_name[:-len('.parquet')]}.json", record)


class PartWriter:
    """Streams one task's output to a local temporary Parquet file; commit() publishes it."""

    def __init__(self, task: Task, schema: pa.Schema, compression: str):
        fd, self.local_path = tempfile.mkstemp(prefix="batchembed-", suffix=".parquet")
        os.close(fd)
        self.task = task
        self.schema = schema
        self._writer = pq.ParquetWriter(self.local_path, schema,
                                        compression=None if compression == "none" else compression)
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table.cast(self.schema) if table.schema != self.schema else table)
        self.rows += table.num_rows

    def commit(self, fs, root: str, record: dict[str, Any]) -> None:
        """Publish the part, then its commit record. Either may be retried; both are idempotent."""
        self._writer.close()
        try:
            put_file_atomic(fs, self.local_path, f"{root}/{self.task.part_name}")
            write_commit(fs, root, self.task.part_name, record)
        finally:
            self.discard()

    def discard(self) -> None:
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - already closed
            pass
        if os.path.exists(self.local_path):
            os.unlink(self.local_path)
