"""What every input format gives the planner: a file's rows, blocks and schema (footers only).

A format (parquet.py, registered in __init__.py) lists the files under a URL, reads one
file's footer and streams record batches of some of its blocks. The checks of the job's
columns against each file are the same for every format and live here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from ..config import InputSpec
from ..errors import JobError, RunError
from ..storage import concurrently, fingerprint, full_url
from .rows import check_columns, column_keys, is_text


@dataclass(frozen=True)
class Footer:
    num_rows: int
    block_rows: tuple[int, ...]  # rows per block (Parquet: row group), the unit a task is cut in
    schema: pa.Schema


class InputFormat(Protocol):
    name: str

    def list_files(self, uri: str, storage_options: dict[str, Any]) -> tuple[Any, str, list[str]]:
        """(filesystem, root, sorted file paths) under a file, directory or glob URL."""

    def read_footer(self, fs, path: str) -> Footer:
        """Rows, blocks and schema, without reading data. Raises RunError naming the file."""

    def iter_batches(self, fs, file: "InputFile", blocks: list[int], columns: list[str],
                     batch_rows: int) -> Iterator[pa.RecordBatch]:
        """Record batches of the given blocks and columns. Corrupt data raises RunError naming the
        file; a transient storage error is left as it is, for the caller to retry the task."""


@dataclass(frozen=True)
class InputFile:
    path: str  # as the filesystem names it
    url: str  # as the user would write it
    rel: str  # path below the input root: names the output parts
    num_rows: int
    row_group_rows: tuple[int, ...]  # rows per block
    schema: pa.Schema  # of the columns the job reads
    fingerprint: dict[str, Any]


def _inspect_one(fmt: InputFormat, fs, root: str, path: str, spec: InputSpec) -> InputFile:
    url = full_url(fs, path)
    footer = fmt.read_footer(fs, path)
    keys = column_keys(spec)
    cols = list(keys)
    missing = [c for c in cols if c not in footer.schema.names]
    if missing:
        which = ", ".join(f"{keys[c]} {c!r}" for c in missing)
        raise JobError(f"{which} not in {url}; its columns are: {', '.join(footer.schema.names)}")
    schema = pa.schema([footer.schema.field(c) for c in cols])
    check_columns(spec, schema, url)
    return InputFile(
        path=path,
        url=url,
        rel=path[len(root):].lstrip("/") if path.startswith(root) else path.rsplit("/", 1)[-1],
        num_rows=footer.num_rows,
        row_group_rows=footer.block_rows,
        schema=schema,
        fingerprint=fingerprint(fs, path),
    )


# the input files a schema problem names, the first included
MAX_FILES_NAMED = 4


def inspect_inputs(fmt: InputFormat, fs, root: str, paths: list[str], spec: InputSpec,
                   skip_unreadable: bool = False, threads: int = 16) -> tuple[list[InputFile], list[dict]]:
    """Footers of every input file, read in parallel (object stores are latency-bound).

    Returns (readable files, failures). A file that cannot be read fails the whole
    call, unless `skip_unreadable`, when it is listed in the failures instead.
    """

    def one(path: str) -> InputFile | dict | JobError:
        try:
            return _inspect_one(fmt, fs, root, path, spec)
        except JobError as e:  # every file's, below
            return e
        except RunError as e:
            if not skip_unreadable:
                raise
            return {"file": full_url(fs, path), "error": str(e)}

    results = concurrently(one, paths, threads)
    wrong = [str(r) for r in results if isinstance(r, JobError)]
    if len(wrong) == 1:
        raise JobError(wrong[0])
    if wrong:  # a corpus whose schema drifted: the files that do not fit, not one per rerun
        named = "".join(f"\n    {w}" for w in wrong[:MAX_FILES_NAMED])
        rest = f"\n    ... and {len(wrong) - MAX_FILES_NAMED} more" if len(wrong) > MAX_FILES_NAMED else ""
        raise JobError(f"{len(wrong)} of {len(paths)} input files do not fit the job:{named}{rest}")
    files = [r for r in results if isinstance(r, InputFile)]
    failed = [r for r in results if isinstance(r, dict)]
    if not files:
        return files, failed
    first = files[0]
    for f in files[1:]:
        for name in first.schema.names:
            a, b = first.schema.field(name).type, f.schema.field(name).type
            if a != b and not (is_text(a) and is_text(b)):
                raise JobError(f"column {name!r} is {a} in {first.url} but {b} in {f.url}")
    return files, failed
