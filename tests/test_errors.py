"""Bad input: a clear message naming the key, column or file, the documented exit
code, and nothing left behind that looks finished."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner
from helpers import job_dict, make_job, write_parquet

from batchembed.cli import cli
from batchembed.errors import RunError
from batchembed.run import run_job


def run_cli(tmp_path, job: dict, *args):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return CliRunner().invoke(cli, [*args, "run", str(path), "--no-progress"])


def assert_nothing_finished(out_dir):
    assert not (out_dir / "_SUCCESS").exists() and not (out_dir / "_manifest.json").exists()


def test_missing_text_column_lists_the_columns_there_are(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "body": ["x"], "title": ["t"]})
    r = run_cli(tmp_path, job_dict(tmp_path / "in.parquet", tmp_path / "out"))
    assert r.exit_code == 2, r.output
    assert "input.text_column 'text' not in" in r.output and "in.parquet" in r.output
    assert "id, body, title" in r.output
    assert_nothing_finished(tmp_path / "out")


def test_every_input_file_that_does_not_fit_is_counted_and_the_first_named(tmp_path):
    # a corpus whose schema drifted: one run (or validate) says which files, not one per rerun
    write_parquet(tmp_path / "in" / "a.parquet", {"id": [1], "text": ["fine"]})
    write_parquet(tmp_path / "in" / "b.parquet", {"id": [2], "text": [2.5]})
    for k in range(5):
        write_parquet(tmp_path / "in" / f"c{k}.parquet", {"id": [3], "body": ["x"]})
    r = run_cli(tmp_path, job_dict(tmp_path / "in", tmp_path / "out"))
    assert r.exit_code == 2, r.output
    assert "6 of 7 input files do not fit the job:" in r.output and "... and 2 more" in r.output
    assert "b.parquet is double, not a string column" in r.output
    assert "c0.parquet; its columns are: id, body" in r.output and "c4.parquet" not in r.output
    assert_nothing_finished(tmp_path / "out")


def test_missing_carry_column_is_named(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "text": ["x"]})
    job = job_dict(tmp_path / "in.parquet", tmp_path / "out", input={"carry_columns": ["nope"]})
    r = run_cli(tmp_path, job)
    assert r.exit_code == 2 and "input.carry_columns 'nope'" in r.output


def test_non_string_text_column(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1, 2], "text": [1.5, 2.5]})
    r = run_cli(tmp_path, job_dict(tmp_path / "in.parquet", tmp_path / "out"))
    assert r.exit_code == 2
    assert "input.text_column 'text'" in r.output and "is double, not a string column" in r.output


def test_no_input_files(tmp_path):
    (tmp_path / "empty").mkdir()
    r = run_cli(tmp_path, job_dict(tmp_path / "empty" / "*.parquet", tmp_path / "out"))
    assert r.exit_code == 2 and "input.uri: no Parquet files at" in r.output
    assert not (tmp_path / "out").exists()


def test_corrupt_parquet_names_the_file(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"id": [1], "text": ["fine"]})
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1 this is not parquet at all")
    r = run_cli(tmp_path, job_dict(tmp_path / "in", tmp_path / "out"))
    assert r.exit_code == 1, r.output
    assert "cannot read Parquet file" in r.output and "b.parquet" in r.output
    assert_nothing_finished(tmp_path / "out")


def test_dimension_larger_than_the_model(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "text": ["x"]})
    r = run_cli(tmp_path, job_dict(tmp_path / "in.parquet", tmp_path / "out", embedding={"dimensions": [512]}))
    assert r.exit_code == 2 and "embedding.dimensions: 512 is larger than the model's dimension 384" in r.output


def test_non_matryoshka_model_warns(tmp_path, caplog):
    from batchembed.job import prepare

    write_parquet(tmp_path / "in.parquet", {"id": [1], "text": ["x"]})
    p = prepare(make_job(tmp_path / "in.parquet", tmp_path / "out", embedding={"dimensions": [128]}))
    assert any("does not declare Matryoshka" in w for w in p.warnings)


def test_an_engine_step_smaller_than_one_row_is_refused(tmp_path):
    # a row split across vLLM's engine steps can get a wrong vector (compiled decoders, vLLM PR 48901)
    write_parquet(tmp_path / "in.parquet", {"id": [1], "text": ["x"]})
    for engine, key in [({"token_budget": 100}, "engine.token_budget: 100"),
                        ({"vllm_args": {"max_num_batched_tokens": 100}},
                         "engine.vllm_args.max_num_batched_tokens: 100")]:
        r = run_cli(tmp_path, job_dict(tmp_path / "in.parquet", tmp_path / "out", model={"max_length": 128},
                                       engine=engine))
        assert r.exit_code == 2 and f"{key} is below model.max_length 128" in r.output, r.output
        assert_nothing_finished(tmp_path / "out")


def test_unknown_model_and_bad_key_exit_2(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "text": ["x"]})
    r = run_cli(tmp_path, job_dict(tmp_path / "in.parquet", tmp_path / "out", model={"name": "package:no_such_pkg"}))
    assert r.exit_code == 2 and "no installed Python package named 'no_such_pkg'" in r.output
    r = run_cli(tmp_path, job_dict(tmp_path / "in.parquet", tmp_path / "out", model={"name": "nobody/no-model"}))
    assert r.exit_code == 2 and "not in the local Hugging Face cache" in r.output
    r = run_cli(tmp_path, job_dict(tmp_path / "in.parquet", tmp_path / "out", output={"colour": "red"}))
    assert r.exit_code == 2 and "output.colour: unknown key" in r.output


def test_corruption_found_mid_run_fails_by_name_and_leaves_no_success(tmp_path, engine):
    """The footer reads fine, a data page does not: found only while streaming."""
    good = write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(200)),
                                                         "text": [f"row {i} " * 20 for i in range(200)]})
    data = bytearray(good.read_bytes())
    mid = len(data) // 3
    data[mid:mid + 200] = b"\xff" * 200
    (tmp_path / "in" / "b.parquet").write_bytes(bytes(data))
    with pytest.raises(RunError, match="b.parquet"):
        run_job(make_job(tmp_path / "in", tmp_path / "out"), engine=engine, show_progress=False)
    assert_nothing_finished(tmp_path / "out")
    assert not list((tmp_path / "out").glob("part-b-*"))  # no part of the bad file, whole or partial


def test_on_error_skip_finishes_the_rest_records_the_file_and_fails(tmp_path, engine):
    import json

    write_parquet(tmp_path / "in" / "a.parquet", {"id": [1, 2], "text": ["one", "two"]})
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1 not parquet")
    write_parquet(tmp_path / "in" / "c.parquet", {"id": [3], "text": ["three"]})
    spec = make_job(tmp_path / "in", tmp_path / "out", on_error="skip")
    with pytest.raises(RunError, match="1 input file.*b.parquet"):
        run_job(spec, engine=engine, show_progress=False)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["complete"] is False and manifest["failed"][0]["file"].endswith("b.parquet")
    assert manifest["counts"]["rows"] == 3 and not (tmp_path / "out" / "_SUCCESS").exists()
    # fixed input: the rerun embeds only the file that failed, then finishes
    write_parquet(tmp_path / "in" / "b.parquet", {"id": [9], "text": ["fixed"]})
    stats = run_job(spec, engine=engine, show_progress=False)
    assert stats.tasks_run == 1 and stats.rows == 4 and (tmp_path / "out" / "_SUCCESS").exists()


@pytest.mark.parametrize("command", ["validate", "run"])
def test_an_output_that_cannot_be_written_or_lies_inside_the_input_is_refused_before_any_engine(tmp_path, command):
    write_parquet(tmp_path / "in" / "a.parquet", {"id": [1], "text": ["x"]})
    (tmp_path / "a-file").write_text("not a folder")
    cases = {tmp_path / "a-file" / "out": "cannot be created: ",  # under a file
             tmp_path / "in": "is inside the input",  # the same folder
             tmp_path / "in" / "emb": "is inside the input"}  # a folder inside it
    for out, says in cases.items():
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(job_dict(tmp_path / "in", out)))
        args = [command, str(path)] + (["--no-progress"] if command == "run" else [])
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2, (out, r.output)
        assert "output.uri: " in r.output and says in r.output and "Traceback" not in r.output, r.output
        assert not list((tmp_path / "in").rglob("part-*")) and not list((tmp_path / "in").rglob("_*"))
    # a glob input does not read a folder beside its files
    path.write_text(yaml.safe_dump(job_dict(tmp_path / "in" / "*.parquet", tmp_path / "in" / "emb")))
    assert CliRunner().invoke(cli, ["validate", str(path)]).exit_code == 0


def test_a_relative_input_path_not_found_names_the_folder_it_was_read_from(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job_dict("data/corpus/", str(tmp_path / "out"))))
    r = CliRunner().invoke(cli, ["validate", str(tmp_path / "job.yaml")])
    assert r.exit_code == 2
    assert f"input.uri: no Parquet files at data/corpus/ (a relative path is read from the current folder, " \
           f"{tmp_path / 'elsewhere'})" in r.output
