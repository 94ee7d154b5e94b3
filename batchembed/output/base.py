"""What an output format provides to the layout (layout.py): where the parts of an output live
and how one is published, read, copied and removed. Names, commit records, resume, the
manifest and _SUCCESS are the layout's, the same for every format.

A part is written by a PartWriter to a local file (memory stays flat), then `publish`ed in
one atomic step that replaces whatever the output held under that part's name: a run that
dies anywhere, or two runs that publish the same part, leave it there once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import pyarrow as pa

OutputFolder = Any  # layout.OutputFolder: its fs, root, path(), url; not imported (layout sits above)


class PartWriter(Protocol):
    rows: int
    local_path: str
    schema: pa.Schema

    def write(self, table: pa.Table) -> None:
        """Append rows (cast to the part's schema)."""

    def close(self) -> None:
        """Finish the local file; it is then ready to publish."""

    def discard(self) -> None:
        """Remove the local file (idempotent)."""


class PartReader(Protocol):
    num_rows: int
    schema: pa.Schema
    block_rows: list[int]  # rows per block (Parquet: row group; Lance: fragment)

    def iter_batches(self, columns: list[str] | None = None, batch_size: int = 4096) -> Iterator[pa.RecordBatch]:
        ...

    def read(self, columns: list[str] | None = None) -> pa.Table:
        ...

    def read_block(self, block: int, columns: list[str]) -> pa.Table:
        ...


class OutputFormat(Protocol):
    name: str
    suffix: str  # a part's name is its part id and this (".parquet"; "" where parts are not files)
    data_sample: str  # where a data file lands, relative to the root (the output-inside-input check)
    empty_parts_kept: bool  # False: a part of no rows leaves nothing in the output (its record says so)

    def writer(self, schema: pa.Schema, compression: str) -> PartWriter:
        ...

    def parts(self, folder: OutputFolder) -> set[str]:
        """Names of the parts published in the output."""

    def open_part(self, folder: OutputFolder, name: str) -> AbstractContextManager[PartReader]:
        ...

    def publish(self, folder: OutputFolder, writer: PartWriter, name: str) -> None:
        """Make the closed writer's rows the part `name`, replacing any earlier one, atomically."""

    def copy_part(self, src: OutputFolder, dst: OutputFolder, src_name: str, dst_name: str) -> None:
        """A part of another output (of any format), published here as it is."""

    def remove_parts(self, folder: OutputFolder, names: list[str]) -> None:
        ...

    def clear(self, folder: OutputFolder) -> None:
        """Remove every part (and whatever the format keeps beside them)."""

    def part_url(self, folder: OutputFolder, name: str) -> str:
        """Where a user finds the part, for messages."""

    def strays(self, folder: OutputFolder) -> list[str]:
        """Data in the output that is no part: readers would see it, no manifest counts it."""

    def index_names(self, folder: OutputFolder) -> list[str]:
        """The indexes the output holds (none for formats without)."""


def copy_rows(fmt: Any, src: OutputFolder, dst: OutputFolder, src_name: str, dst_name: str,
              compression: str = "zstd") -> None:
    """Copy a part by reading its rows and publishing them again (between different formats)."""
    with src.open_part(src_name) as part:
        writer = fmt.writer(part.schema, compression)
        try:
            for batch in part.iter_batches():
                writer.write(pa.Table.from_batches([batch], part.schema))
            writer.close()
            fmt.publish(dst, writer, dst_name)
        finally:
            writer.discard()
