"""Parquet output: one Parquet file per part, streamed to a local temporary file row group by
row group (memory stays flat) and published by the layout in one atomic step."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq


class ParquetPartWriter:
    def __init__(self, schema: pa.Schema, compression: str):
        fd, self.local_path = tempfile.mkstemp(prefix="batchembed-", suffix=".parquet")
        os.close(fd)
        self.schema = schema
        self._writer = pq.ParquetWriter(self.local_path, schema,
                                        compression=None if compression == "none" else compression)
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table.cast(self.schema) if table.schema != self.schema else table)
        self.rows += table.num_rows

    def close(self) -> None:
        self._writer.close()

    def discard(self) -> None:
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - already closed
            pass
        if os.path.exists(self.local_path):
            os.unlink(self.local_path)


class ParquetPartReader:
    def __init__(self, handle):
        self._pf = pq.ParquetFile(handle)
        self.num_rows = self._pf.metadata.num_rows
        self.schema = self._pf.schema_arrow
        self.block_rows = [self._pf.metadata.row_group(g).num_rows for g in range(self._pf.num_row_groups)]

    def iter_batches(self, columns: list[str] | None = None, batch_size: int = 4096) -> Iterator[pa.RecordBatch]:
        return self._pf.iter_batches(columns=columns, batch_size=batch_size)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        return self._pf.read(columns=columns)

    def read_block(self, block: int, columns: list[str]) -> pa.Table:
        return self._pf.read_row_group(block, columns=columns)


class ParquetOutput:
    name = "parquet"
    suffix = ".parquet"

    def writer(self, schema: pa.Schema, compression: str) -> ParquetPartWriter:
        return ParquetPartWriter(schema, compression)

    def reader(self, handle) -> ParquetPartReader:
        return ParquetPartReader(handle)
