"""The output in users' hands: the docs' reading examples run as written, the folder is a
dataset pyarrow reads as it is, and outputs of the older layout (manifest.json) still work."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fake_engine import FakeEngine
from helpers import docs_example, make_job, write_parquet

from batchembed.run import run_job
from batchembed.tools.verify import verify_output

ROWS = 60


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, model_info):
    """The same corpus written as float32, int8 and binary outputs (fake engine: fast)."""
    tmp = tmp_path_factory.mktemp("reading")
    texts = [f"document {i} about " + " ".join(["alpha", "beta", "gamma"][i % 3] for _ in range(i % 7 + 1))
             for i in range(ROWS)]
    write_parquet(tmp / "in" / "docs.parquet", {"id": list(range(ROWS)), "text": texts}, row_group_size=20)
    engine = FakeEngine(model_info)
    outs = {}
    for dtype in ("float32", "int8", "binary"):
        spec = make_job(tmp / "in", tmp / dtype, fidelity_check="off", output={"rows_per_part": 20},
                        embedding={"output_dtype": dtype, "calibration_rows": ROWS})
        run_job(spec, engine=engine, show_progress=False)
        outs[dtype] = tmp / dtype
    return outs


def _query(outputs, row: int) -> np.ndarray:
    table = pq.read_table(outputs["float32"])
    return np.asarray(table["embedding"][row].values.to_numpy(), dtype=np.float32)


@pytest.mark.parametrize("row", [7])
def test_the_docs_reads_float_output_with_pyarrow_polars_duckdb_lancedb_and_faiss(outputs, tmp_path, row):
    ns = {"OUT": str(outputs["float32"]), "TMP": str(tmp_path), "query": _query(outputs, row)}
    exec(docs_example("float32"), ns)
    assert ns["table"].num_rows == ROWS and ns["df"].height == ROWS
    assert ns["table"].column_names == ["id", "text_hash", "embedding"]
    assert ns["top"][0][0] == row and ns["top"][0][1] == pytest.approx(1.0, abs=1e-5)
    assert ns["hits"][0]["id"] == row
    assert ns["rows"][0][0] == row


@pytest.mark.parametrize("dtype", ["int8", "binary"])
def test_the_docs_searches_quantised_outputs_with_a_quantised_query(outputs, dtype):
    ns = {"OUT": str(outputs[dtype]), "query": _query(outputs, 11)}
    exec(docs_example(dtype), ns)
    assert ns["best"][0] == 11


def test_a_crash_leftover_is_not_read_as_data(outputs, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(outputs["float32"], out)
    (out / ".part-docs-rg00000.parquet.tmp-0123").write_bytes(b"half a file")  # a write cut short
    assert pq.read_table(out).num_rows == ROWS


def test_an_output_of_the_older_layout_is_read_and_moved_on_its_next_change(tmp_path, model_info):
    engine = FakeEngine(model_info)
    write_parquet(tmp_path / "in" / "a.parquet", {"id": [1, 2], "text": ["x", "y"]})
    spec = make_job(tmp_path / "in", tmp_path / "out", fidelity_check="off")
    run_job(spec, engine=engine, show_progress=False)
    out = tmp_path / "out"
    (out / "_manifest.json").rename(out / "manifest.json")  # as batchembed before 0.2 wrote it
    assert verify_output(str(out))[0] == []
    assert run_job(spec, engine=engine, show_progress=False).tasks_run == 0  # complete: left as it is
    assert (out / "manifest.json").exists()
    write_parquet(tmp_path / "in" / "b.parquet", {"id": [3], "text": ["z"]})
    assert run_job(spec, engine=engine, show_progress=False).tasks_run == 1
    assert not (out / "manifest.json").exists()
    assert json.loads((out / "_manifest.json").read_text())["counts"]["rows"] == 3


def test_compare_says_where_two_outputs_differ(outputs, tmp_path):
    """`batchembed compare`: an output against its copy agrees row for row; one row given another
    row's vector is found (exit 1); a quantised output is refused (exit 2)."""
    import shutil

    from click.testing import CliRunner

    from batchembed.cli import cli

    a, b = outputs["float32"], tmp_path / "copy"
    shutil.copytree(a, b)
    r = CliRunner().invoke(cli, ["compare", str(a), str(b), "--json"])
    assert r.exit_code == 0, r.output
    column = json.loads(r.output)["columns"]["embedding"]
    assert column["compared"] == ROWS and column["identical_rows"] == ROWS and column["below"] == 0

    part = sorted(b.glob("part-*.parquet"))[0]
    t = pq.read_table(part)
    vectors = t["embedding"].to_pylist()
    vectors[3] = vectors[4]
    column = pa.array(vectors, t.schema.field("embedding").type)
    t = t.set_column(t.schema.get_field_index("embedding"), "embedding", column)
    pq.write_table(t, part)
    r = CliRunner().invoke(cli, ["compare", str(a), str(b)])
    assert r.exit_code == 1
    assert f"{ROWS - 1:,} identical" in r.output and "1 below 0.999" in r.output

    r = CliRunner().invoke(cli, ["compare", str(a), str(outputs["int8"])])
    assert r.exit_code == 2 and "compare float outputs" in r.output
