"""The manifest (output/manifest.py): one typed, versioned model; an output written by batchembed
0.6.0 (tests/fixtures/output-0.6.0, manifest version 1) read by every command, as a user who
upgrades with outputs on disk would; and `plan` showing the engine settings a run then records."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from fake_engine import FakeEngine
from helpers import job_dict, make_job, write_parquet

from batchembed.cli import cli
from batchembed.errors import RunError
from batchembed.output.manifest import VERSION, migrate, parse
from batchembed.run import finalize_job, run_job
from batchembed.tools.read import read_output

FIXTURE = Path(__file__).parent / "fixtures" / "output-0.6.0"
WRITTEN_AT = "/tmp/fx/in/"  # where the input was when 0.6.0 wrote the output


@pytest.fixture()
def old(tmp_path) -> Path:
    """The 0.6.0 output and its input, moved to tmp_path as they were (the input's paths and
    modification times as its fingerprints recorded them): tmp_path/output, tmp_path/input."""
    shutil.copytree(FIXTURE / "input", tmp_path / "input")
    shutil.copytree(FIXTURE / "output", tmp_path / "output")
    for f in (tmp_path / "output").rglob("*.json"):
        f.write_text(f.read_text().replace(WRITTEN_AT, f"{tmp_path}/input/"))
    for entry in json.loads((tmp_path / "output" / "_manifest.json").read_text())["input"]["files"]:
        os.utime(entry["path"], (entry["mtime"], entry["mtime"]))
    return tmp_path


def _job(tmp_path: Path, **sections) -> dict:
    return job_dict(tmp_path / "input", tmp_path / "output", embedding={"dimensions": [384, 64]},
                    fidelity_check="off", **sections)


def test_a_version_1_manifest_is_migrated_and_a_newer_one_refused():
    d = json.loads((FIXTURE / "output" / "_manifest.json").read_text())
    assert "version" not in d  # as 0.6.0 wrote it
    m = parse(d, "fixture")
    assert m.version == VERSION == 2 and m.engine is None
    assert m.embedding.columns == {384: "embedding_384", 64: "embedding_64"} and m.counts["rows"] == 12
    assert [p.rows for p in m.parts] == [6, 6] and m.tool.version == "0.6.0"
    assert parse(m.to_json(), "again") == m  # what this release writes, it reads back as it was
    kept = parse({**d, "written_by_a_later_minor": {"x": 1}}, "fixture").to_json()
    assert kept["written_by_a_later_minor"] == {"x": 1}  # a field it does not know is kept
    with pytest.raises(RunError, match="version 3, written by a newer batchembed; this one \\(2\\) cannot read"):
        migrate({**d, "version": 3})
    with pytest.raises(RunError, match=r"somewhere: not a batchembed manifest this release can read \(counts"):
        parse({k: v for k, v in d.items() if k != "counts"}, "somewhere")


def test_an_output_of_0_6_0_is_read_by_every_command(old, model_info):
    runner = CliRunner()
    out = str(old / "output")
    r = runner.invoke(cli, ["inspect", out])
    assert r.exit_code == 0 and "12 rows in 2 parts, finished" in r.output, r.output
    assert "engine:" not in r.output  # 0.6.0 kept no record of the settings
    r = runner.invoke(cli, ["verify", out])
    assert r.exit_code == 0 and r.output.startswith("ok"), r.output
    r = runner.invoke(cli, ["report", out, "-o", str(old / "report.html")])
    assert r.exit_code == 0 and "batchembed report: fixture-0.6.0" in (old / "report.html").read_text()
    r = runner.invoke(cli, ["compare", out, out])
    assert r.exit_code == 0, r.output
    table, manifest = read_output(out)
    assert table.num_rows == 12 and manifest["version"] == VERSION and manifest["engine"] is None
    (old / "job.yaml").write_text(yaml.safe_dump(_job(old)))
    r = runner.invoke(cli, ["plan", str(old / "job.yaml"), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["parts_done"] == 2, r.output
    # run: every part already done, nothing embedded; finalize writes the current version
    spec = make_job(old / "input", old / "output", embedding={"dimensions": [384, 64]}, fidelity_check="off")
    fake = FakeEngine(model_info)
    assert run_job(spec, engine=fake, show_progress=False).tasks_run == 0 and fake.sequences == 0
    finalize_job(spec)
    now = json.loads((old / "output" / "_manifest.json").read_text())
    assert now["version"] == VERSION and now["engine"]["engines"] == 1 and now["counts"]["rows"] == 12
    # a reindex against it (incremental.previous): its vectors reused, one changed row embedded
    texts = [f"document {i}: rivers, hills and the sea" if i != 4 else None for i in range(12)]
    texts[9] = "a changed row"
    for k in range(2):  # rows are matched per input file: the same two files
        rows = slice(6 * k, 6 * k + 6)
        write_parquet(old / "next" / f"f{k}.parquet", {"id": list(range(12))[rows], "text": texts[rows]})
    spec = make_job(old / "next", old / "v2", embedding={"dimensions": [384, 64]}, fidelity_check="off",
                    incremental={"previous": out})
    stats = run_job(spec, engine=FakeEngine(model_info), show_progress=False)
    assert (stats.reused, stats.embedded) == (10, 1)


def test_plan_shows_the_engine_settings_the_run_records(tmp_path, model_info):
    ids = list(range(20))
    write_parquet(tmp_path / "in" / "a.parquet", {"id": ids, "text": [f"row {i}" for i in ids]})
    job = job_dict(tmp_path / "in", tmp_path / "out", fidelity_check="off")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "job.yaml"), "--json"])
    assert r.exit_code == 0, r.output
    planned = json.loads(r.stdout)["engine"]
    assert planned["device"] == "cpu" and planned["engines"] == 1 and planned["dtype"] == "float32"
    assert planned["token_budget"] == 4096 and planned["vllm"] and planned["torch"]
    text = CliRunner().invoke(cli, ["validate", str(tmp_path / "job.yaml")]).output
    assert "engine: 1 engine(s) on cpu, float32, eager, steps of 4,096 tokens / 256 rows" in text, text
    run_job(make_job(tmp_path / "in", tmp_path / "out", fidelity_check="off"), engine=FakeEngine(model_info),
            show_progress=False)
    assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["engine"] == planned
    shown = CliRunner().invoke(cli, ["inspect", str(tmp_path / "out")]).output
    assert "engine: 1 engine(s) on cpu, float32" in shown, shown
