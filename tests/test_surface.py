"""Output precisions, instructions and JSON logs, as a user sets them in the job file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import yaml
from helpers import job_dict, make_job, read_output, write_parquet

from batchembed.run import run_job
from batchembed.tools.verify import verify_output

BIN = os.path.join(os.path.dirname(sys.executable), "batchembed")
TEXTS = [f"sentence number {i} about {'cats' if i % 2 else 'the stock market'} and more" for i in range(40)]


def test_binary_and_ubinary_match_sentence_transformers_quantisation(tmp_path, engine):
    from sentence_transformers.quantization import quantize_embeddings

    write_parquet(tmp_path / "in.parquet", {"id": list(range(40)), "text": TEXTS[:39] + [None]})
    run_job(make_job(tmp_path / "in.parquet", tmp_path / "f32", embedding={"dimensions": [384, 64]}),
            engine=engine, show_progress=False)
    floats = read_output(tmp_path / "f32")
    for precision in ("binary", "ubinary"):
        out = tmp_path / precision
        spec = make_job(tmp_path / "in.parquet", out, embedding={"dimensions": [384, 64], "output_dtype": precision})
        run_job(spec, engine=engine, show_progress=False)
        t = read_output(out)
        for d in (384, 64):
            col = t.column(f"embedding_{d}")
            assert col.type.list_size == d // 8 and col.to_pylist()[39] is None
            ref = np.asarray(floats.column(f"embedding_{d}").to_pylist()[:39], dtype=np.float32)
            want = quantize_embeddings(ref, precision=precision)
            got = np.asarray(col.to_pylist()[:39], dtype=want.dtype)
            assert np.array_equal(got, want), precision
        problems, _ = verify_output(str(out))
        assert problems == []
        assert json.loads((out / "_manifest.json").read_text())["embedding"]["packed_bits"] is True


def test_instruction_goes_before_every_text_like_a_prompt(tmp_path, engine, st_model):
    write_parquet(tmp_path / "in.parquet", {"id": list(range(8)), "text": TEXTS[:8]})
    instruction = "Given a web search query, retrieve relevant passages"
    spec = make_job(tmp_path / "in.parquet", tmp_path / "out", model={"instruction": instruction})
    run_job(spec, engine=engine, show_progress=False)
    got = np.asarray(read_output(tmp_path / "out").column("embedding").to_pylist(), dtype=np.float32)
    want = st_model.encode(TEXTS[:8], prompt=f"Instruct: {instruction}\nQuery: ", normalize_embeddings=True)
    assert float(np.min(np.sum(got * want, axis=1))) > 0.9999
    plain = st_model.encode(TEXTS[:8], normalize_embeddings=True)
    assert float(np.min(np.sum(got * plain, axis=1))) < 0.99  # the instruction really changed the input
    m = json.loads((tmp_path / "out" / "_manifest.json").read_text())["model"]
    assert m["instruction"] == instruction and m["text_prefix"] == f"Instruct: {instruction}\nQuery: "


def test_bad_precision_settings_name_the_key(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "text": ["x"]})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tmp_path / "in.parquet", tmp_path / "out",
                                           embedding={"dimensions": [100], "output_dtype": "binary"},
                                           model={"instruction_format": "no slot"})))
    r = subprocess.run([BIN, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "model.instruction_format: must contain {instruction}" in r.stderr
    job.write_text(yaml.safe_dump(job_dict(tmp_path / "in.parquet", tmp_path / "out",
                                           embedding={"dimensions": [100], "output_dtype": "binary"})))
    r = subprocess.run([BIN, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "embedding.dimensions: 100 is not a multiple of 8" in r.stderr


def test_log_json_writes_one_object_per_line(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "text": ["x"]})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tmp_path / "in.parquet", tmp_path / "out", embedding={"dimensions": [100]})))
    r = subprocess.run([BIN, "--log-json", "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stderr.splitlines() if line.strip()]
    assert any(e["level"] == "WARNING" and "Matryoshka" in e["message"] for e in lines)
    assert all({"time", "level", "logger", "message"} <= set(e) for e in lines)


def test_validate_lists_every_problem_at_once(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "body": ["x"]})
    job = tmp_path / "job.yaml"
    d = job_dict(tmp_path / "in.parquet", tmp_path / "out", embedding={"dimensions": [100], "output_dtype": "binary"})
    d["model"]["name"] = str(tmp_path / "no-such-model")
    job.write_text(yaml.safe_dump(d))
    r = subprocess.run([BIN, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "3 problem(s)" in r.stderr and "no-such-model" in r.stderr
    assert "embedding.dimensions: 100 is not a multiple of 8" in r.stderr
    assert "input.text_column 'text' not in" in r.stderr


def test_int8_and_uint8_use_one_calibration_for_every_part(tmp_path, engine):
    from sentence_transformers.util.quantization import quantize_embeddings

    texts = [f"calibration text {i} on {'rivers' if i % 3 else 'mountains'} and {'tea' * (i % 4)}" for i in range(48)]
    for k in range(2):  # two files, two parts: the second part must use the ranges of the first rows
        write_parquet(tmp_path / "in" / f"f{k}.parquet", {"id": list(range(k * 24, k * 24 + 24)),
                                                           "text": texts[k * 24:(k + 1) * 24]})
    dims = {"dimensions": [384, 64]}
    run_job(make_job(tmp_path / "in", tmp_path / "f32", embedding=dims), engine=engine, show_progress=False)
    floats = read_output(tmp_path / "f32")
    for precision in ("int8", "uint8"):
        out = tmp_path / precision
        spec = make_job(tmp_path / "in", out, embedding={**dims, "output_dtype": precision, "calibration_rows": 20})
        run_job(spec, engine=engine, show_progress=False)
        cal = json.loads((out / "_calibration.json").read_text())
        manifest = json.loads((out / "_manifest.json").read_text())
        assert cal["rows"] == 20 and manifest["embedding"]["calibration"]["digest"] == cal["digest"]
        t = read_output(out)
        for d in (384, 64):
            ref = np.asarray(floats.column(f"embedding_{d}").to_pylist(), dtype=np.float32)
            want = quantize_embeddings(ref, precision=precision, calibration_embeddings=ref[:20])
            got = np.asarray(t.column(f"embedding_{d}").to_pylist(), dtype=want.dtype)
            assert t.column(f"embedding_{d}").type.value_type == ("int8" if precision == "int8" else "uint8")
            diff = np.abs(got.astype(int) - want.astype(int))
            # separate engine calls: a value on a step boundary may land one step off
            assert diff.max() <= 1 and (diff == 0).mean() > 0.97, (precision, d, diff.max(), (diff == 0).mean())
        assert verify_output(str(out))[0] == []
    # a resumed run reads the stored ranges: a redone part comes out the same
    out = tmp_path / "int8"
    before = read_output(out).column("embedding_64").to_pylist()
    part = sorted(out.glob("part-*.parquet"))[1]
    part.unlink()
    for c in (out / "_commits").glob("*.json"):
        if part.stem in c.name:
            c.unlink()
    (out / "_SUCCESS").unlink()
    spec = make_job(tmp_path / "in", out, embedding={**dims, "output_dtype": "int8", "calibration_rows": 20})
    again = run_job(spec, engine=engine, show_progress=False)
    assert again.tasks_run == 1 and read_output(out).column("embedding_64").to_pylist() == before
