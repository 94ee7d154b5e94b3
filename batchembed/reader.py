"""Reading the corpus: Parquet footers for planning, record batches for the run.

Only footers are read to plan (row counts, row groups, schema), and only the
needed columns are read to run, a batch at a time: a file is never in memory whole.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from .config import InputSpec
from .errors import JobError, RunError
from .storage import fingerprint, full_url, is_transient, retry


@dataclass(frozen=True)
class InputFile:
    path: str  # as the filesystem names it
    url: str  # as the user would write it
    rel: str  # path below the input root: names the output parts
    num_rows: int
    row_group_rows: tuple[int, ...]
    schema: pa.Schema  # of the columns the job reads
    fingerprint: dict[str, Any]


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t))


def _sql(expression: str):
    import polars as pl

    return pl.sql_expr(expression)


def _column_keys(spec: InputSpec) -> dict[str, str]:
    """Each input column the job reads -> the job key that names it (for messages)."""
    keys: dict[str, str] = {}
    if spec.text_sql:
        keys.update({c: "input.text_sql" for c in _sql(spec.text_sql).meta.root_names()})
    else:
        keys[spec.text_column] = "input.text_column"
    if spec.where:
        keys.update({c: "input.where" for c in _sql(spec.where).meta.root_names() if c not in keys})
    if spec.id_column:
        keys.setdefault(spec.id_column, "input.id_column")
    for c in spec.carry_columns:
        keys.setdefault(c, "input.carry_columns")
    return keys


def needed_columns(spec: InputSpec) -> list[str]:
    return list(_column_keys(spec))


def select_rows(spec: InputSpec, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, list[str | None], int]:
    """The rows the job keeps (input.where) and their texts (input.text_column or input.text_sql).

    Returns (kept rows, their texts, rows dropped). A row whose condition is null is dropped,
    as in SQL; a text expression that is null (e.g. a null operand of ||) is a null text.
    """
    if not spec.text_sql and not spec.where:
        return batch, batch.column(spec.text_column).to_pylist(), 0
    import polars as pl

    df = pl.from_arrow(batch)
    dropped = 0
    if spec.where:
        keep = df.select(_sql(spec.where).fill_null(False)).to_series()
        dropped = len(keep) - int(keep.sum())
        if dropped:
            df = df.filter(keep)
            batch = batch.filter(keep.to_arrow())
    if spec.text_sql:
        texts = df.select(_sql(spec.text_sql).cast(pl.String)).to_series().to_list()
    else:
        texts = batch.column(spec.text_column).to_pylist()
    return batch, texts, dropped


def _check_sql(spec: InputSpec, schema: pa.Schema, url: str) -> None:
    """Evaluate text_sql / where on no rows of this file's columns: types and names, before any work."""
    import polars as pl

    empty = pl.from_arrow(schema.empty_table())
    for key, expression, want in (("input.text_sql", spec.text_sql, "a string"),
                                  ("input.where", spec.where, "a true/false condition")):
        if not expression:
            continue
        try:
            dtype = empty.select(_sql(expression)).dtypes[0]
        except Exception as e:  # noqa: BLE001 - polars raises several kinds
            raise JobError(f"{key} {expression!r} fails on the columns of {url}: {e}") from None
        ok = dtype in (pl.String, pl.Null) if key == "input.text_sql" else dtype in (pl.Boolean, pl.Null)
        if not ok:
            raise JobError(f"{key} {expression!r} gives {dtype} on {url}, not {want}")


def _read_footer(fs, path: str) -> pq.FileMetaData:
    with fs.open(path, "rb") as f:
        return pq.ParquetFile(f).metadata


def _inspect_one(fs, root: str, path: str, spec: InputSpec) -> InputFile:
    url = full_url(fs, path)
    try:
        meta = retry(lambda: _read_footer(fs, path), url)
        schema = meta.schema.to_arrow_schema()
    except FileNotFoundError:
        raise RunError(f"input file vanished while planning: {url}") from None
    except (pa.ArrowException, OSError, ValueError) as e:
        raise RunError(f"cannot read Parquet file {url}: {e}") from None
    keys = _column_keys(spec)
    cols = list(keys)
    missing = [c for c in cols if c not in schema.names]
    if missing:
        which = ", ".join(f"{keys[c]} {c!r}" for c in missing)
        raise JobError(f"{which} not in {url}; its columns are: {', '.join(schema.names)}")
    if not spec.text_sql:
        text_type = schema.field(spec.text_column).type
        if not _is_text(text_type) and not pa.types.is_null(text_type):
            raise JobError(f"input.text_column {spec.text_column!r} in {url} is {text_type}, not a string column")
    if spec.text_sql or spec.where:
        _check_sql(spec, pa.schema([schema.field(c) for c in cols]), url)
    return InputFile(
        path=path,
        url=url,
        rel=path[len(root):].lstrip("/") if path.startswith(root) else path.rsplit("/", 1)[-1],
        num_rows=meta.num_rows,
        row_group_rows=tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups)),
        schema=pa.schema([schema.field(c) for c in cols]),
        fingerprint=fingerprint(fs, path),
    )


def inspect_inputs(fs, root: str, paths: list[str], spec: InputSpec, skip_unreadable: bool = False,
                   threads: int = 16) -> tuple[list[InputFile], list[dict]]:
    """Footers of every input file, read in parallel (object stores are latency-bound).

    Returns (readable files, failures). A file that cannot be read fails the whole
    call, unless `skip_unreadable`, when it is listed in the failures instead.
    """

    def one(path: str) -> InputFile | dict:
        try:
            return _inspect_one(fs, root, path, spec)
        except RunError as e:
            if not skip_unreadable:
                raise
            return {"file": full_url(fs, path), "error": str(e)}

    with ThreadPoolExecutor(max_workers=min(threads, max(1, len(paths)))) as pool:
        results = list(pool.map(one, paths))
    files = [r for r in results if isinstance(r, InputFile)]
    failed = [r for r in results if isinstance(r, dict)]
    if not files:
        return files, failed
    first = files[0]
    for f in files[1:]:
        for name in first.schema.names:
            a, b = first.schema.field(name).type, f.schema.field(name).type
            if a != b and not (_is_text(a) and _is_text(b)):
                raise JobError(f"column {name!r} is {a} in {first.url} but {b} in {f.url}")
    return files, failed


def iter_batches(fs, file: InputFile, row_groups: list[int], columns: list[str],
                 batch_rows: int) -> Iterator[pa.RecordBatch]:
    """Record batches of the given row groups, only the given columns.

    Corrupt data raises RunError naming the file; a transient storage error is
    left as it is, for the caller to retry the whole task.
    """
    try:
        with fs.open(file.path, "rb") as f:
            pf = pq.ParquetFile(f)
            yield from pf.iter_batches(batch_size=batch_rows, row_groups=row_groups, columns=columns,
                                       use_threads=False)
    except FileNotFoundError:
        raise RunError(f"input file vanished during the run: {file.url}") from None
    except Exception as e:  # noqa: BLE001 - sorted into transient (re-raised) and corrupt
        if is_transient(e):
            raise
        raise RunError(f"cannot read Parquet file {file.url}: {type(e).__name__}: {e}") from None


def first_texts(p, n: int) -> list[str]:
    """The first `n` non-null texts in plan order (the same rows for every shard and rerun)."""
    texts: list[str] = []
    for task in p.tasks:
        for batch in iter_batches(p.in_fs, task.file, list(task.row_groups), needed_columns(p.spec.input), 8192):
            texts += [t for t in select_rows(p.spec.input, batch)[1] if t is not None]
            if len(texts) >= n:
                return texts[:n]
    return texts
