"""Which columns a job reads, which rows it keeps (input.where) and their texts
(input.text_column or input.text_sql): the same for every input format."""

from __future__ import annotations

import pyarrow as pa

from ..config import InputSpec
from ..errors import JobError


def is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t))


def _sql(expression: str):
    import polars as pl

    return pl.sql_expr(expression)


def column_keys(spec: InputSpec) -> dict[str, str]:
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
    return list(column_keys(spec))


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


def check_columns(spec: InputSpec, schema: pa.Schema, url: str) -> None:
    """The text column is text; text_sql / where evaluate, on no rows of this file's columns, to a
    string and a true/false condition: types and names checked before any work."""
    if not spec.text_sql:
        text_type = schema.field(spec.text_column).type
        if not is_text(text_type) and not pa.types.is_null(text_type):
            raise JobError(f"input.text_column {spec.text_column!r} in {url} is {text_type}, not a string column")
    if not (spec.text_sql or spec.where):
        return
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
