"""Parquet output: one Parquet file per part beside the layout's files, streamed to a local
temporary file row group by row group (memory stays flat) and published in one atomic step
(a rename on local disk, one PUT on an object store): a part's name is its file's name."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from .. import scratch
from ..storage import full_url, is_local, put_file_atomic, remove, retry
from .base import copy_rows


class ParquetPartWriter:
    def __init__(self, schema: pa.Schema, compression: str):
        self.local_path = scratch.file(".parquet")
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
    data_sample = "part-x.parquet"
    empty_parts_kept = True

    def writer(self, schema: pa.Schema, compression: str) -> ParquetPartWriter:
        return ParquetPartWriter(schema, compression)

    def parts(self, folder) -> set[str]:
        fs, root = folder.fs, folder.root

        def go() -> set[str]:
            fs.invalidate_cache()
            return set(fs.glob(f"{root}/part-*{self.suffix}")) if fs.exists(root) else set()

        return {p.rsplit("/", 1)[-1] for p in retry(go, folder.url)}

    @contextlib.contextmanager
    def open_part(self, folder, name: str) -> Iterator[ParquetPartReader]:
        with folder.fs.open(folder.path(name), "rb") as f:
            yield ParquetPartReader(f)

    def publish(self, folder, writer, name: str) -> None:
        put_file_atomic(folder.fs, writer.local_path, folder.path(name))

    def copy_part(self, src, dst, src_name: str, dst_name: str) -> None:
        """Server-side on one object store; a rename of a copy on local disk."""
        if src.fmt.name != self.name:
            copy_rows(self, src, dst, src_name, dst_name)
            return
        a, b = src.path(src_name), dst.path(dst_name)
        same_fs = type(src.fs) is type(dst.fs) and src.fs.storage_options == dst.fs.storage_options
        if is_local(src.fs) and is_local(dst.fs):
            put_file_atomic(dst.fs, a, b)  # a temporary file beside it, then a rename
        elif same_fs:
            retry(lambda: dst.fs.copy(a, b), full_url(dst.fs, b))
        else:
            with tempfile.TemporaryDirectory(prefix=scratch.prefix("copy")) as d:
                retry(lambda: src.fs.get_file(a, f"{d}/part"), full_url(src.fs, a))
                put_file_atomic(dst.fs, f"{d}/part", b)

    def remove_parts(self, folder, names: list[str]) -> None:
        for name in names:
            remove(folder.fs, folder.path(name))

    def clear(self, folder) -> None:
        self.remove_parts(folder, sorted(self.parts(folder)))

    def part_url(self, folder, name: str) -> str:
        return folder.url_of(name)

    def strays(self, folder) -> list[str]:
        """Files beside the parts that dataset readers would read as data (no leading _ or .)."""
        fs, root = folder.fs, folder.root
        names = retry(lambda: [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] if fs.exists(root) else [],
                      folder.url)
        return sorted(folder.url_of(n) for n in names
                      if not n.startswith(("_", ".")) and not (n.startswith("part-") and n.endswith(self.suffix)))

    def index_names(self, folder) -> list[str]:
        return []
