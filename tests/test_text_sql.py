"""Text from several columns (input.text_sql) and a row filter (input.where), in polars SQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from helpers import job_dict, make_job, read_output, write_parquet

from batchembed.errors import JobError
from batchembed.run import run_job
from batchembed.tools.verify import verify_output

BIN = os.path.join(os.path.dirname(sys.executable), "batchembed")

ROWS = {
    "id": list(range(12)),
    "title": [f"Title {i}" if i != 4 else None for i in range(12)],
    "body": [f"body text number {i} about {'rivers' if i % 3 else 'mountains'}" for i in range(12)],
    "lang": ["en", "de", "en", "en", "en", None, "en", "fr", "en", "en", "de", "en"],
}


def test_text_sql_and_where_embed_the_expression_of_the_kept_rows(tmp_path, engine, st_model):
    # row groups of 4: the filter drops rows in every group, and a whole group keeps 3 of 4
    write_parquet(tmp_path / "in.parquet", ROWS, row_group_size=4)
    spec = make_job(tmp_path / "in.parquet", tmp_path / "out",
                    input={"text_sql": "title || '\n\n' || body", "where": "lang = 'en'"})
    stats = run_job(spec, engine=engine, show_progress=False)
    kept = [i for i, lang in enumerate(ROWS["lang"]) if lang == "en"]  # a null lang is not 'en'
    out = read_output(tmp_path / "out")
    assert out.column("id").to_pylist() == kept
    assert stats.filtered == 12 - len(kept) and stats.rows == len(kept) and stats.nulls == 1  # row 4: null title
    got = out.column("embedding").to_pylist()
    assert got[kept.index(4)] is None
    texts = [f"{ROWS['title'][i]}\n\n{ROWS['body'][i]}" for i in kept if i != 4]
    want = st_model.encode(texts, normalize_embeddings=True)
    have = np.asarray([g for i, g in zip(kept, got) if i != 4], dtype=np.float32)
    assert float(np.min(np.sum(have * want, axis=1))) > 0.9999
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["counts"]["filtered"] == 12 - len(kept)
    assert manifest["input"]["text_sql"] == "title || '\n\n' || body" and manifest["input"]["where"] == "lang = 'en'"
    assert manifest["job"]["columns"]["where"] == "lang = 'en'"
    assert verify_output(str(tmp_path / "out"))[0] == []
    # the same job again: done already; another filter is another job, refused over this output
    again = run_job(spec, engine=engine, show_progress=False)
    assert again.tasks_skipped == 1 and again.tasks_run == 0
    other = make_job(tmp_path / "in.parquet", tmp_path / "out",
                     input={"text_sql": "title || '\n\n' || body", "where": "lang = 'de'"})
    with pytest.raises(JobError, match="different job"):
        run_job(other, engine=engine, show_progress=False)


def test_bad_text_sql_and_where_name_the_key(tmp_path):
    write_parquet(tmp_path / "in.parquet", ROWS)
    job = tmp_path / "job.yaml"

    def validate(**inp):
        job.write_text(yaml.safe_dump(job_dict(tmp_path / "in.parquet", tmp_path / "out", input=inp)))
        r = subprocess.run([BIN, "validate", str(job)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        return r.stderr

    assert "input.text_sql: is not a polars SQL expression" in validate(text_sql="title ||| body")
    assert "input.where 'language' not in" in validate(text_sql="title", where="language = 'en'")
    assert "input.text_sql 'id + 1' gives Int64" in validate(text_sql="id + 1")
    assert "input.where 'title' gives String" in validate(text_sql="body", where="title")
