"""Parquet input: footers for planning, record batches of some row groups for the run.

Only footers are read to plan (row counts, row groups, schema), and only the
needed columns are read to run, a batch at a time: a file is never in memory whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import JobError, RunError
from ..storage import full_url, is_transient, open_fs, retry
from .base import Footer, InputFile

_GLOB_CHARS = set("*?[")


def static_prefix(path: str) -> str:
    """The folder part of an input path before any glob character (the root of part names)."""
    cut = min((path.index(c) for c in _GLOB_CHARS if c in path), default=None)
    return path[:cut].rsplit("/", 1)[0] if cut is not None else path


class ParquetInput:
    name = "parquet"

    def list_files(self, uri: str, storage_options: dict[str, Any]) -> tuple[Any, str, list[str]]:
        """Every *.parquet file under a directory (files and folders whose names start with `_`
        or `.` are not data, as pyarrow and Spark read a dataset), a glob's matches, or one file."""
        fs, path = open_fs(uri, storage_options, "input.uri")
        path = path.rstrip("/") or "/"

        def listing() -> tuple[str, list[str]]:
            if _GLOB_CHARS & set(path):
                return static_prefix(path), [p for p in fs.glob(path) if fs.isfile(p)]
            if fs.isdir(path):
                return path, [p for p in fs.find(path) if p.endswith(".parquet")
                              and not any(part.startswith(("_", ".")) for part in p[len(path):].split("/"))]
            if fs.exists(path):
                return path.rsplit("/", 1)[0], [path]
            return path, []

        try:
            root, files = retry(listing, uri)
        except (FileNotFoundError, PermissionError) as e:
            raise JobError(f"input.uri: {uri}: {e}") from None
        if not files:
            where = ""
            if "://" not in uri and not os.path.isabs(os.path.expanduser(uri)):
                where = f" (a relative path is read from the current folder, {os.getcwd()})"
            raise JobError(f"input.uri: no Parquet files at {uri}{where}")
        return fs, root, sorted(files)

    def read_footer(self, fs, path: str) -> Footer:
        url = full_url(fs, path)

        def read() -> pq.FileMetaData:
            with fs.open(path, "rb") as f:
                return pq.ParquetFile(f).metadata

        try:
            meta = retry(read, url)
            schema = meta.schema.to_arrow_schema()
        except FileNotFoundError:
            raise RunError(f"input file vanished while planning: {url}") from None
        except (pa.ArrowException, OSError, ValueError) as e:
            raise RunError(f"cannot read Parquet file {url}: {e}") from None
        return Footer(meta.num_rows, tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups)), schema)

    def iter_batches(self, fs, file: InputFile, blocks: list[int], columns: list[str],
                     batch_rows: int) -> Iterator[pa.RecordBatch]:
        try:
            with fs.open(file.path, "rb") as f:
                pf = pq.ParquetFile(f)
                yield from pf.iter_batches(batch_size=batch_rows, row_groups=blocks, columns=columns,
                                           use_threads=False)
        except FileNotFoundError:
            raise RunError(f"input file vanished during the run: {file.url}") from None
        except Exception as e:  # noqa: BLE001 - sorted into transient (re-raised) and corrupt
            if is_transient(e):
                raise
            raise RunError(f"cannot read Parquet file {file.url}: {type(e).__name__}: {e}") from None
