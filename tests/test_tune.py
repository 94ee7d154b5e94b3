"""`batchembed tune`: engine counts measured on a sample of the job's input, the best written
into a copy of the job (the real engine, on this machine's CPU)."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import yaml
from click.testing import CliRunner
from helpers import job_dict, write_parquet

from batchembed.cli import cli
from batchembed.config import load_job
from batchembed.model import flops_per_token
from batchembed.tune import Trial, best

pytestmark = pytest.mark.slow  # whole batchembed processes (make test, not make test-fast)


def test_tune_measures_each_count_and_writes_the_best_into_a_copy_of_the_job(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet",
                  {"id": list(range(500)), "text": [f"row {i}: " + "tuning words " * (i % 9 + 2) for i in range(500)]},
                  row_group_size=100)
    job = job_dict(tmp_path / "in", tmp_path / "out", fidelity_check="off", engine={"sort_window_rows": 25})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    before = (tmp_path / "job.yaml").read_text()
    r = CliRunner().invoke(cli, ["tune", str(tmp_path / "job.yaml"), "--engines", "1,2", "--rows", "300",
                                 "--write", str(tmp_path / "tuned.yaml"), "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout[r.stdout.index("{"):])
    assert [t["engines"] for t in result["trials"]] == [1, 2]
    assert all(t["rows"] == 300 and t["tokens"] > 0 and t["running_tokens_per_s"] > 0 for t in result["trials"])
    tuned = load_job(tmp_path / "tuned.yaml")
    assert tuned.engine.data_parallel in (1, 2) and tuned.output.uri == str(tmp_path / "out")
    assert tuned.output.rows_per_part == "auto"  # it follows the engines (tests/test_parts.py)
    assert (tmp_path / "job.yaml").read_text() == before  # the job file is never changed
    assert not (tmp_path / "out").exists()  # the trials wrote elsewhere
    # the two-engine trial's processes, as they ended, left this process's multiprocessing folder
    # (the forkserver's socket, inherited in their config) in place for the next trial or run
    tempdir = multiprocessing.current_process()._config.get("tempdir")
    assert tempdir and os.path.isdir(tempdir)


def test_best_is_the_fastest_running_and_of_ties_within_1_percent_the_fewest_engines():
    def trials(*rates):
        return [Trial(k, 1, 1, r, r, r / 2, 1.0, 0.0, None) for k, r in rates]

    # tune's sample runs on an H200: Qwen3-0.6B @ 512, then bge-base @ 80
    assert best(trials((1, 455_149), (2, 466_468))).engines == 2
    assert best(trials((6, 1_919_462), (8, 1_974_612))).engines == 8
    assert best(trials((1, 1000), (2, 1009), (4, 990))).engines == 1  # within 1 %: fewer engines
    assert best(trials((2, 1000), (4, 1200), (8, 1100))).engines == 4


def test_flops_per_token_of_a_bert_and_a_decoder_shape():
    bert = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536,
            "hidden_act": "gelu"}
    assert flops_per_token(bert, 0) == 2 * 6 * (4 * 384 * 384 + 2 * 384 * 1536)
    qwen = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "hidden_act": "silu"}
    per_layer = 1024 * 16 * 128 + 2 * 1024 * 8 * 128 + 16 * 128 * 1024 + 3 * 1024 * 3072
    assert flops_per_token(qwen, 512) == 2 * 28 * per_layer + 4 * 28 * 16 * 128 * 512
    assert flops_per_token({}, 80) is None
