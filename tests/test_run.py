"""End to end through the real engine: Parquet in, normalised vectors out."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest
from helpers import SENTENCES, make_job, read_output, write_parquet

from batchembed.embed.matryoshka import l2_normalise
from batchembed.embed.tokenizer import Tokenizer
from batchembed.errors import JobError
from batchembed.run import run_job


def vectors(table: pa.Table, column: str) -> np.ndarray:
    return np.stack(table.column(column).to_numpy(zero_copy_only=False))


def test_fidelity_against_sentence_transformers(tmp_path, engine, st_model):
    texts = SENTENCES * 3
    write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(len(texts))), "text": texts})
    stats = run_job(make_job(tmp_path / "in", tmp_path / "out"), engine=engine, show_progress=False)
    out = read_output(tmp_path / "out")
    ours = vectors(out, "embedding")
    theirs = st_model.encode(texts, convert_to_numpy=True, normalize_embeddings=True, batch_size=8)
    cos = (ours * theirs).sum(axis=1) / np.linalg.norm(theirs, axis=1)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-3)
    assert stats.rows == len(texts) and stats.truncated == 3  # the long sentence, 3 times
    assert stats.empty == 3


def test_one_vector_of_model_dimension_for_any_length(engine, model_info):
    """The per-token bug: output must be (rows, dim) whatever the input length."""
    tok = Tokenizer(model_info.path, model_info.max_length)
    texts = ["x"] + ["word " * n for n in (10, 100, 255, 1000)]
    t = tok(texts)
    assert t.lengths.min() <= 3 and t.lengths.max() == model_info.max_length  # 1000 words truncated
    for ids in t.ids:
        out = engine.embed([ids])
        assert out.shape == (1, model_info.dimension)
    assert engine.embed(t.ids).shape == (len(texts), model_info.dimension)


def test_matryoshka_columns_equal_normalise_truncate_full(tmp_path, engine):
    write_parquet(tmp_path / "in.parquet", {"id": [1, 2, 3, 4], "text": SENTENCES[:4]})
    run_job(make_job(tmp_path / "in.parquet", tmp_path / "out", embedding={"dimensions": [384, 128, 32]}),
            engine=engine, show_progress=False)
    out = read_output(tmp_path / "out")
    assert out.column_names == ["id", "text_hash", "embedding_384", "embedding_128", "embedding_32"]
    assert out.schema.field("embedding_128").type == pa.list_(pa.float32(), 128)
    full = vectors(out, "embedding_384")
    for d in (128, 32):
        reduced = vectors(out, f"embedding_{d}")
        np.testing.assert_allclose(reduced, l2_normalise(full[:, :d]), atol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(reduced, axis=1), 1.0, atol=1e-3)


def test_order_ids_and_carried_columns_across_files_and_row_groups(tmp_path, engine):
    rng = np.random.default_rng(7)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    expected_ids, expected_titles, all_texts = [], [], []
    for k in range(3):
        n = 57 + k * 20
        ids = [f"doc-{k}-{i}" for i in range(n)]
        # lengths vary a lot so that length-sorting really reorders rows inside a window
        texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 200)))) for _ in range(n)]
        titles = [f"title {k}/{i}" for i in range(n)]
        write_parquet(tmp_path / "in" / f"f{k}.parquet",
                      {"id": ids, "text": texts, "title": titles, "score": rng.random(n)}, row_group_size=16)
        expected_ids += ids
        expected_titles += titles
        all_texts += texts
    spec = make_job(tmp_path / "in", tmp_path / "out", input={"carry_columns": ["title", "score"]},
                    engine={"sort_window_rows": 40, "token_budget": 1024, "max_batch_rows": 7},
                    output={"rows_per_part": 32})
    run_job(spec, engine=engine, show_progress=False)
    out = read_output(tmp_path / "out")
    assert out.column("id").to_pylist() == expected_ids
    assert out.column("title").to_pylist() == expected_titles
    assert out.schema.field("score").type == pa.float64()
    # each vector belongs to its own row: compare with embedding the texts one call each
    tok = Tokenizer(engine.key.model_path, 256)
    got = vectors(out, "embedding")
    for i in (0, 5, 60, len(all_texts) - 1):
        ref = engine.embed(tok([all_texts[i]]).ids)[0]
        assert float(got[i] @ ref) > 0.9999
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["counts"]["rows"] == len(expected_ids)
    assert len(manifest["parts"]) > 3  # files were split by row groups (rows_per_part=32)
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_null_text_keeps_its_row_and_empty_text_is_embedded(tmp_path, engine):
    write_parquet(tmp_path / "in.parquet",
                  pa.table({"id": [1, 2, 3, 4], "text": pa.array(["a", None, "", None], pa.string())}))
    stats = run_job(make_job(tmp_path / "in.parquet", tmp_path / "out", embedding={"output_dtype": "float16"}),
                    engine=engine, show_progress=False)
    out = read_output(tmp_path / "out")
    emb = out.column("embedding")
    assert out.column("id").to_pylist() == [1, 2, 3, 4]
    assert emb.is_null().to_pylist() == [False, True, False, True]
    assert out.schema.field("embedding").type == pa.list_(pa.float16(), 384)
    assert abs(np.linalg.norm(np.asarray(emb[2].values.to_numpy(), np.float32)) - 1) < 1e-2
    assert (stats.rows, stats.embedded, stats.nulls, stats.empty) == (4, 2, 2, 1)
    counts = json.loads((tmp_path / "out" / "_manifest.json").read_text())["counts"]
    assert counts["nulls"] == 2 and counts["rows"] == 4


def test_manifest_records_model_and_job(tmp_path, engine, model_info):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "text": ["hello"]})
    run_job(make_job(tmp_path / "in.parquet", tmp_path / "out", model={"prefix": "passage: "},
                     input={"storage_options": {"secret": "do-not-log"}}), engine=engine, show_progress=False)
    text = (tmp_path / "out" / "_manifest.json").read_text()
    m = json.loads(text)
    assert "do-not-log" not in text
    assert m["model"]["hash"].startswith("sha256:") and m["model"]["prefix"] == "passage: "
    assert m["model"]["max_length"] == model_info.max_length and m["embedding"]["dimensions"] == [384]
    assert m["tool"]["name"] == "batchembed" and m["input"]["files"][0]["size"] > 0
    assert set(m["counts"]) >= {"rows", "tokens", "truncated", "nulls"}


def test_rerun_skips_committed_parts_and_corpus_change_redoes_only_that(tmp_path, engine):
    for k in range(3):
        write_parquet(tmp_path / "in" / f"f{k}.parquet", {"id": [k * 10 + i for i in range(5)],
                                                          "text": [f"file {k} row {i}" for i in range(5)]})
    spec = make_job(tmp_path / "in", tmp_path / "out")
    first = run_job(spec, engine=engine, show_progress=False)
    assert first.tasks_run == 3
    again = run_job(spec, engine=engine, show_progress=False)
    assert again.tasks_run == 0 and again.rows == 15
    write_parquet(tmp_path / "in" / "f1.parquet", {"id": [100, 101], "text": ["changed", "rows"]})
    third = run_job(spec, engine=engine, show_progress=False)
    assert third.tasks_run == 1
    # parts are named by input file, so adding a file renames nothing else
    write_parquet(tmp_path / "in" / "f0a.parquet", {"id": [5], "text": ["inserted"]})
    assert run_job(spec, engine=engine, show_progress=False).tasks_run == 1
    (tmp_path / "in" / "f0a.parquet").unlink()
    assert run_job(spec, engine=engine, show_progress=False).tasks_run == 0
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*")) == [
        "part-f0-rg00000.parquet", "part-f1-rg00000.parquet", "part-f2-rg00000.parquet"]
    assert read_output(tmp_path / "out").column("id").to_pylist() == [0, 1, 2, 3, 4, 100, 101, 20, 21, 22, 23, 24]


def test_output_of_a_different_job_is_not_mixed(tmp_path, engine):

    write_parquet(tmp_path / "in.parquet", {"id": [1], "text": ["hello"]})
    run_job(make_job(tmp_path / "in.parquet", tmp_path / "out"), engine=engine, show_progress=False)
    other = make_job(tmp_path / "in.parquet", tmp_path / "out", embedding={"dimensions": [64]})
    with pytest.raises(JobError, match="different job.*dimensions"):
        run_job(other, engine=engine, show_progress=False)
    run_job(other, engine=engine, overwrite=True, show_progress=False)
    assert read_output(tmp_path / "out").column_names == ["id", "text_hash", "embedding"]
    assert read_output(tmp_path / "out").schema.field("embedding").type.list_size == 64
    assert len(list((tmp_path / "out").glob("part-*.parquet"))) == 1


def test_verify_finds_a_tampered_output(tmp_path, engine):
    from batchembed.tools.verify import verify_output

    write_parquet(tmp_path / "in.parquet", {"id": [1, 2, 3], "text": ["a", "b", "c"]})
    run_job(make_job(tmp_path / "in.parquet", tmp_path / "out"), engine=engine, show_progress=False)
    assert verify_output(str(tmp_path / "out"))[0] == []
    part = next((tmp_path / "out").glob("part-*.parquet"))
    t = read_output(tmp_path / "out").slice(0, 2)
    import pyarrow.parquet as pq

    pq.write_table(t, part)
    problems, _ = verify_output(str(tmp_path / "out"))
    assert any("2 rows, the manifest says 3" in p for p in problems)
    (tmp_path / "out" / "_SUCCESS").unlink()
    assert any("unfinished" in p for p in verify_output(str(tmp_path / "out"))[0])


def _sampled_job(tmp_path, engine, **sections):
    """A finished run of SENTENCES (and a null and an empty text) and its job file."""
    import yaml
    from helpers import job_dict

    ids = list(range(len(SENTENCES) + 2))
    write_parquet(tmp_path / "in.parquet", {"id": ids, "text": [*SENTENCES, None, ""]})
    job = job_dict(tmp_path / "in.parquet", tmp_path / "out", **sections)
    run_job(make_job(tmp_path / "in.parquet", tmp_path / "out", **sections), engine=engine, show_progress=False)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.parametrize("output_dtype", ["float32", "int8", "binary"])
def test_verify_sample_compares_stored_vectors_with_sentence_transformers(tmp_path, engine, output_dtype):
    from click.testing import CliRunner

    from batchembed.cli import cli

    job = _sampled_job(tmp_path, engine, embedding={"dimensions": [384, 64], "output_dtype": output_dtype})
    r = CliRunner().invoke(cli, ["verify", str(job), "--sample", "100", "--seed", "7"])
    assert r.exit_code == 0, r.output
    assert f"sample: {len(SENTENCES) - 1} rows of 1 parts re-embedded" in r.output and "--seed 7" in r.output
    assert "not comparable: 1 no vector, 2 empty text" in r.output  # SENTENCES has an empty text too
    r = CliRunner().invoke(cli, ["verify", str(job), "--sample", "3", "--json"])
    sample = json.loads(r.output)["sample"]
    assert r.exit_code == 0 and sample["rows"] + sum(sample["skipped"].values()) == 3
    floor = 0.999 if output_dtype != "binary" else 0.9
    assert all(c["min_cosine"] > floor for c in sample["columns"].values()), sample


def test_verify_sample_finds_a_vector_the_norms_cannot(tmp_path, engine):
    # a row holding another row's vector: every norm is 1 and every count right, so only a
    # comparison with the model's own library finds it
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from batchembed.cli import cli

    job = _sampled_job(tmp_path, engine)
    part = next((tmp_path / "out").glob("part-*.parquet"))
    t = pq.read_table(part)
    emb = t.column("embedding").to_pylist()
    emb[2] = emb[0]
    pq.write_table(t.set_column(t.schema.get_field_index("embedding"), "embedding",
                                pa.array(emb, type=t.schema.field("embedding").type)), part)
    assert CliRunner().invoke(cli, ["verify", str(job)]).exit_code == 0  # the manifest's checks pass
    r = CliRunner().invoke(cli, ["verify", str(job), "--sample", "100"])
    assert r.exit_code == 1, r.output
    assert "embedding: 1 of 6 sampled rows are below fidelity_min_cosine 0.98" in r.output
    assert f"{part.name} row 2 (id 2)" in r.output
    # the texts come from the job's input: an output alone cannot be sampled
    r = CliRunner().invoke(cli, ["verify", str(tmp_path / "out"), "--sample", "5"])
    assert r.exit_code == 2 and "--sample needs the job file" in r.output
    # an input changed since the run is said, not compared
    write_parquet(tmp_path / "in.parquet", {"id": [0], "text": ["changed"]})
    r = CliRunner().invoke(cli, ["verify", str(job), "--sample", "5"])
    assert r.exit_code == 1 and "is gone or changed since the run; not sampled" in r.output, r.output


def test_shards_union_equals_one_unsharded_run(tmp_path, engine):
    from batchembed.errors import RunError
    from batchembed.run import finalize_job

    for k in range(6):
        write_parquet(tmp_path / "in" / f"f{k}.parquet", {"id": [k * 10 + i for i in range(4)],
                                                          "text": [f"shard test {k} {i}" for i in range(4)]})
    full = run_job(make_job(tmp_path / "in", tmp_path / "full"), engine=engine, show_progress=False)
    sharded = [make_job(tmp_path / "in", tmp_path / "sharded", shard=f"{i}/3") for i in range(3)]
    runs = [run_job(sharded[0], engine=engine, show_progress=False)]
    assert not (tmp_path / "sharded" / "_SUCCESS").exists()
    with pytest.raises(RunError, match="not committed yet"):
        finalize_job(make_job(tmp_path / "in", tmp_path / "sharded"))
    runs += [run_job(s, engine=engine, show_progress=False) for s in sharded[1:]]
    assert sum(r.tasks_run for r in runs) == full.tasks_run == 6  # disjoint, and together all
    assert (tmp_path / "sharded" / "_SUCCESS").exists()  # written by the last shard to finish
    a, b = read_output(tmp_path / "full"), read_output(tmp_path / "sharded")
    assert a.column("id").to_pylist() == b.column("id").to_pylist()
    np.testing.assert_allclose(vectors(a, "embedding"), vectors(b, "embedding"), atol=1e-6)
    assert finalize_job(make_job(tmp_path / "in", tmp_path / "sharded")).rows == 24
    with pytest.raises(JobError, match="--overwrite with a shard"):
        run_job(sharded[0], engine=engine, overwrite=True, show_progress=False)


def test_ray_executor_on_a_local_ray(tmp_path, st_model, caplog, run_temp, monkeypatch):
    """executor: ray, one engine actor on a local Ray instance: same rows, same vectors, same commits;
    the actor keeps one pipeline, so a text of the first part is not embedded again in the second,
    and it reports its engine's throughput like the other executors. Ray keeps its session's logs
    and sockets in RAY_TMPDIR/ray (by design, for a user's Ray): here a folder the test removes."""
    monkeypatch.setenv("RAY_TMPDIR", run_temp)
    texts = [f"ray row {i} " + "actors embed parts " * (i % 5 + 1) for i in range(40)]
    texts[25] = texts[3]  # the second part repeats a text of the first
    for k in range(2):
        write_parquet(tmp_path / "in" / f"f{k}.parquet", {"id": list(range(k * 20, k * 20 + 20)),
                                                          "text": texts[k * 20:(k + 1) * 20]})
    spec = make_job(tmp_path / "in", tmp_path / "out", executor="ray",
                    ray={"num_cpus_per_engine": 1})
    with caplog.at_level("INFO", logger="batchembed.executors.ray"):
        stats = run_job(spec, show_progress=False)
    assert stats.tasks_run == 2 and stats.engines == 1 and stats.rows == 40
    assert (stats.embedded, stats.deduplicated) == (39, 1)
    nodes = [r.getMessage() for r in caplog.records if "committed on node" in r.getMessage()]
    assert len(nodes) == 2, nodes  # which node ran which part
    assert stats.steady_tokens_per_s and stats.engine_seconds > 0 and stats.engine_start_seconds > 0
    assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["last_run"]["throughput"]
    out = read_output(tmp_path / "out")
    assert out.column("id").to_pylist() == list(range(40))
    ref = st_model.encode(texts, normalize_embeddings=True)
    assert float((vectors(out, "embedding") * ref).sum(axis=1).min()) > 0.9999
    assert (tmp_path / "out" / "_SUCCESS").exists()
    assert run_job(spec, show_progress=False).tasks_run == 0  # resume works the same
    assert os.listdir(os.path.join(run_temp, "ray"))  # Ray's session went there, not to /tmp/ray


def test_inspect_shows_dims_norms_and_rows(tmp_path, engine):
    from click.testing import CliRunner

    from batchembed.cli import cli

    write_parquet(tmp_path / "in.parquet", pa.table({"id": [1, 2, 3], "text": pa.array(["a", None, "c"])}))
    run_job(make_job(tmp_path / "in.parquet", tmp_path / "out", embedding={"dimensions": [384, 64]}),
            engine=engine, show_progress=False)
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["rows"] == 3 and info["finished"] is True and info["manifest"]["counts"]["nulls"] == 1
    cols = {c["name"]: c for c in info["columns"]}
    assert cols["embedding_64"]["dim"] == 64 and cols["embedding_64"]["vectors_checked"] == 2
    assert abs(cols["embedding_64"]["norm_min"] - 1) < 1e-3 and len(info["sample"]) == 3
    text = CliRunner().invoke(cli, ["inspect", str(tmp_path / "out")]).output
    assert "3 rows in 1 parts of up to 1,000,000 rows, finished" in text and "embedding_384" in text
    # a job file names its output (and its storage options) to inspect and verify as to report
    import yaml
    from helpers import job_dict

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tmp_path / "in.parquet", tmp_path / "out",
                                           embedding={"dimensions": [384, 64]})))
    shown = CliRunner().invoke(cli, ["inspect", str(job)]).output
    assert "3 rows in 1 parts of up to 1,000,000 rows, finished" in shown
    r = CliRunner().invoke(cli, ["verify", str(job)])
    assert r.exit_code == 0 and r.output.startswith("ok: 1 parts, 3 rows"), r.output
    # a nightly job's output is the job file with the run's --set; an output URI takes none
    (tmp_path / "out").rename(tmp_path / "out-2026-12-06")
    moved = f"output.uri={tmp_path / 'out-2026-12-06'}"
    for cmd in (["inspect"], ["verify"], ["report", "-o", str(tmp_path / "r.html")]):
        r = CliRunner().invoke(cli, [*cmd, str(job), "--set", moved])
        assert r.exit_code == 0, (cmd, r.output)
        r = CliRunner().invoke(cli, [*cmd, str(tmp_path / "out-2026-12-06"), "--set", moved])
        assert r.exit_code == 2 and "--set overrides a job file's keys" in r.output, (cmd, r.output)
    (tmp_path / "out-2026-12-06").rename(tmp_path / "out")
    # a file where an output folder belongs is a bad command line, said so (it was a traceback)
    for cmd in ("inspect", "verify"):
        r = CliRunner().invoke(cli, [cmd, str(tmp_path / "in.parquet")])
        assert r.exit_code == 2 and "in.parquet is a file, not an output folder" in r.output, r.output
    (tmp_path / "out" / "_SUCCESS").unlink()  # as a run still in progress leaves it
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "out")])
    assert r.exit_code == 1 and "NOT finished" in r.output and "is not finished (no _SUCCESS)" in r.output


def test_string_and_large_string_columns_mix_across_files(tmp_path, engine):
    write_parquet(tmp_path / "in" / "a.parquet", pa.table({"id": pa.array(["a"], pa.string()), "text": ["x"]}))
    write_parquet(tmp_path / "in" / "b.parquet", pa.table({"id": pa.array(["b"], pa.large_string()),
                                                         "text": pa.array(["y"], pa.large_string())}))
    run_job(make_job(tmp_path / "in", tmp_path / "out"), engine=engine, show_progress=False)
    assert read_output(tmp_path / "out").column("id").to_pylist() == ["a", "b"]
