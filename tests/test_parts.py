"""How the input is cut into parts (output.rows_per_part): auto follows the engine count, and the cut
an output was made with is kept by every later run on it. On a fake engine (tests/fake_engine.py)."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from helpers import make_job, write_parquet

from batchembed.job import prepare, record_cut
from batchembed.plan import auto_rows_per_part
from batchembed.run import run_job

ROWS = 5000


@pytest.fixture()
def corpus(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(ROWS)), "text": [f"row {i}" for i in range(ROWS)]},
                  row_group_size=10)
    return tmp_path


def _job(tmp_path, engines: int, out: str = "out", **sections):
    engine = {"data_parallel": engines, "sort_window_rows": 10, **sections.pop("engine", {})}
    return make_job(tmp_path / "in", tmp_path / out, fidelity_check="off", engine=engine, **sections)


def _recorded(out) -> int:
    return json.loads((out / "_parts.json").read_text())["rows_per_part"]


def test_auto_gives_each_of_several_engines_about_30_parts_of_a_window_or_more():
    assert auto_rows_per_part(ROWS, 1, 10)[0] == 1_000_000  # one engine: the cut of every earlier output
    assert auto_rows_per_part(ROWS, 4, 10) == (ROWS // 120, "about 30 parts for each of 4 engines over 5,000 rows")
    assert auto_rows_per_part(ROWS, 4, 100)[0] == 100  # never less than a window
    assert auto_rows_per_part(10**9, 4, 10)[0] == 1_000_000  # nor more than one engine's parts


def test_prepare_cuts_by_the_engines_the_job_gets_and_the_job_s_own_value_stands(corpus):
    p = prepare(_job(corpus, 4), check_output=False, warn=False)
    assert p.settings.engines == 4 and p.rows_per_part == ROWS // 120 and len(p.tasks) == 125
    assert p.worker_spec()["output"]["rows_per_part"] == ROWS // 120  # engine processes plan the same parts
    assert prepare(_job(corpus, 4, shard="0/2"), check_output=False, warn=False).rows_per_part == ROWS // 2 // 120
    assert prepare(_job(corpus, 1), check_output=False, warn=False).rows_per_part == 1_000_000
    given = prepare(_job(corpus, 4, output={"rows_per_part": 50}), check_output=False, warn=False)
    assert (given.rows_per_part, given.rows_per_part_reason) == (50, "output.rows_per_part")


def test_the_first_run_records_its_cut_and_a_resume_with_other_engines_keeps_it(corpus, model_info):
    out = corpus / "out"
    run_job(_job(corpus, 4), engine=FakeEngine(model_info), show_progress=False)
    assert _recorded(out) == ROWS // 120 and len(list(out.glob("part-*.parquet"))) == 125
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["rows_per_part"] == ROWS // 120
    # a run killed after some parts: no _SUCCESS, and a third of the parts without their record
    (out / "_SUCCESS").unlink()
    for record in sorted((out / "_commits").glob("*.json"))[::3]:
        record.unlink()
    engine = FakeEngine(model_info)
    # resumed on a host where auto gives two engines: the output's cut stands, nothing is redone twice
    p = prepare(_job(corpus, 2), warn=False)
    assert p.rows_per_part == ROWS // 120 and "recorded in" in p.rows_per_part_reason
    stats = run_job(_job(corpus, 2), engine=engine, show_progress=False)
    assert (stats.tasks_run, stats.tasks_skipped) == (42, 83) and (out / "_SUCCESS").exists()
    assert len(list(out.glob("part-*.parquet"))) == 125 and _recorded(out) == ROWS // 120


def test_a_run_that_finds_a_cut_recorded_by_another_run_since_it_planned_takes_that_one(corpus):
    p = prepare(_job(corpus, 4), warn=False)
    (corpus / "out").mkdir()
    (corpus / "out" / "_parts.json").write_text(json.dumps({"rows_per_part": 500, "why": "another run"}))
    cut = record_cut(p, cleared=False)
    assert cut.rows_per_part == 500 and len(cut.tasks) == 10 and "recorded in" in cut.rows_per_part_reason
    assert _recorded(corpus / "out") == 500


def test_an_output_made_before_the_record_keeps_its_million_row_cut(corpus, model_info):
    out = corpus / "out"
    run_job(_job(corpus, 1), engine=FakeEngine(model_info), show_progress=False)
    (out / "_parts.json").unlink()  # as outputs of earlier releases are
    (out / "_SUCCESS").unlink()
    p = prepare(_job(corpus, 4), warn=False)
    assert p.rows_per_part == 1_000_000 and "before batchembed 0.8" in p.rows_per_part_reason
    stats = run_job(_job(corpus, 4), engine=FakeEngine(model_info), show_progress=False)
    assert stats.tasks_run == 0 and _recorded(out) == 1_000_000


def test_overwrite_cuts_afresh_and_the_job_s_value_replaces_the_record(corpus, model_info):
    out = corpus / "out"
    run_job(_job(corpus, 4), engine=FakeEngine(model_info), show_progress=False)
    run_job(_job(corpus, 2), engine=FakeEngine(model_info), overwrite=True, show_progress=False)
    assert _recorded(out) == ROWS // 60 and len(list(out.glob("part-*.parquet"))) == 63
    stats = run_job(_job(corpus, 2, output={"rows_per_part": 1000}), engine=FakeEngine(model_info),
                    show_progress=False)
    assert stats.tasks_run == 5 and _recorded(out) == 1000 and len(list(out.glob("part-*.parquet"))) == 5


def test_a_reindex_takes_the_previous_output_s_cut_so_its_parts_are_copied_whole(corpus, model_info):
    run_job(_job(corpus, 4, "v1"), engine=FakeEngine(model_info), show_progress=False)
    engine = FakeEngine(model_info)
    stats = run_job(_job(corpus, 2, "v2", incremental={"previous": str(corpus / "v1")}), engine=engine,
                    show_progress=False)
    assert _recorded(corpus / "v2") == ROWS // 120 and engine.calls == 0 and stats.reused == ROWS
    # a previous output of 0.7 or earlier, whose manifest has no cut, was cut by a million rows
    manifest = json.loads((corpus / "v1" / "_manifest.json").read_text())
    del manifest["rows_per_part"]
    (corpus / "v1" / "_manifest.json").write_text(json.dumps(manifest))
    p = prepare(_job(corpus, 4, "v3", incremental={"previous": str(corpus / "v1")}), warn=False)
    assert p.rows_per_part == 1_000_000 and "previous output" in p.rows_per_part_reason
