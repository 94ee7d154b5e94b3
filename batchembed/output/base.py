"""What an output format provides to the layout (layout.py): a writer that streams one part
to a local file, and a reader of a published part. Everything else (names, commit
records, resume, manifest, _SUCCESS) is the layout's, the same for every format."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import pyarrow as pa


class PartWriter(Protocol):
    rows: int
    local_path: str

    def write(self, table: pa.Table) -> None:
        """Append rows (cast to the part's schema)."""

    def close(self) -> None:
        """Finish the local file; it is then ready to publish."""

    def discard(self) -> None:
        """Remove the local file (idempotent)."""


class PartReader(Protocol):
    num_rows: int
    schema: pa.Schema
    block_rows: list[int]  # rows per block (Parquet: row group)

    def iter_batches(self, columns: list[str] | None = None, batch_size: int = 4096) -> Iterator[pa.RecordBatch]:
        ...

    def read(self, columns: list[str] | None = None) -> pa.Table:
        ...

    def read_block(self, block: int, columns: list[str]) -> pa.Table:
        ...


class OutputFormat(Protocol):
    name: str
    suffix: str  # of a part's file name, e.g. ".parquet"

    def writer(self, schema: pa.Schema, compression: str) -> PartWriter:
        ...

    def reader(self, handle) -> PartReader:
        """A reader over an open binary file handle of a published part."""
