"""The pipeline around the engine, on a fake engine that implements the real Engine interface
(tests/fake_engine.py): ordering, deduplication, reuse and the records, in seconds. The
real engine's own tests are test_run.py and the others."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fake_engine import FakeEngine, fake_vector
from helpers import make_job, read_output, write_parquet

from batchembed.embed.tokenizer import Tokenizer
from batchembed.run import run_job

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


@pytest.fixture()
def fake(model_info):
    return FakeEngine(model_info, token_budget=300, max_batch_rows=7, rows_per_step=5)


def _job(tmp_path, out="out", **sections):
    return make_job(tmp_path / "in", tmp_path / out, fidelity_check="off", **sections)


def test_every_row_gets_its_own_vector_in_input_order(tmp_path, fake, model_info):
    rng = np.random.default_rng(3)
    ids, texts = [], []
    for k in range(3):
        n = 45 + 10 * k
        rows = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 120)))) for _ in range(n)]
        rows[7] = None
        write_parquet(tmp_path / "in" / f"f{k}.parquet", {"id": [f"{k}-{i}" for i in range(n)], "text": rows,
                                                          "title": [f"t{k}/{i}" for i in range(n)]}, row_group_size=16)
        ids += [f"{k}-{i}" for i in range(n)]
        texts += rows
    spec = _job(tmp_path, input={"carry_columns": ["title"]}, output={"rows_per_part": 32},
                engine={"sort_window_rows": 20, "windows_in_flight": 3})
    stats = run_job(spec, engine=fake, show_progress=False)
    out = read_output(tmp_path / "out")
    assert out.column("id").to_pylist() == ids
    assert out.column("title").to_pylist() == [f"t{i.replace('-', '/')}" for i in ids]
    tok = Tokenizer(model_info.path, model_info.max_length)
    emb = out.column("embedding").to_pylist()
    for i, text in enumerate(texts):
        if text is None:
            assert emb[i] is None
        else:
            np.testing.assert_allclose(emb[i], fake_vector(tok([text]).ids[0], model_info.dimension), atol=1e-6)
    assert stats.rows == len(texts) and stats.nulls == 3
    assert stats.embedded + stats.deduplicated == len(texts) - 3
    assert not fake.queue and not fake.closed  # a given engine is left open, with nothing queued


def test_a_text_seen_in_an_earlier_part_is_not_embedded_again(tmp_path, fake):
    texts = [f"text {i % 10}" for i in range(40)]  # 10 texts, each 4 times, across 4 parts
    write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(40)), "text": texts}, row_group_size=10)
    stats = run_job(_job(tmp_path, output={"rows_per_part": 10}), engine=fake, show_progress=False)
    assert fake.sequences == 10 and stats.embedded == 10 and stats.deduplicated == 30
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "out" / "_commits").glob("*.json"))]
    assert [r["embedded"] for r in records] == [10, 0, 0, 0]


def test_a_reindex_that_copies_every_part_keeps_every_count_and_the_histogram(tmp_path, fake):
    texts = ["short", "a longer text " * 30, None, "", "short"] * 8 + ["word " * 400] * 2  # truncated rows too
    write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(len(texts))), "text": texts}, row_group_size=14)
    run_job(_job(tmp_path, "v1", output={"rows_per_part": 14}), engine=fake, show_progress=False)
    calls = fake.calls
    stats = run_job(_job(tmp_path, "v2", output={"rows_per_part": 14}, incremental={"previous": str(tmp_path / "v1")}),
                    engine=fake, show_progress=False)
    assert fake.calls == calls and stats.tokens_run == 0 and stats.reused == len(texts) - 8  # 8 null texts
    v1, v2 = (json.loads((tmp_path / v / "_manifest.json").read_text()) for v in ("v1", "v2"))
    assert v1["counts"]["truncated"] == 2 and v1["counts"]["tokens"] > 0
    moved = {"embedded", "deduplicated", "reused"}
    assert {k: v for k, v in v2["counts"].items() if k not in moved} == {
        k: v for k, v in v1["counts"].items() if k not in moved}
    assert v2["counts"]["reused"] == v1["counts"]["embedded"] + v1["counts"]["deduplicated"]
    assert v2["token_histogram"] == v1["token_histogram"] and sum(v1["token_histogram"]["counts"]) > 0
    assert [p["counts"]["truncated"] for p in v2["parts"]] == [p["counts"]["truncated"] for p in v1["parts"]]


def test_rows_the_engine_fails_are_found_written_as_null_and_listed(tmp_path, model_info):
    from batchembed.errors import RunError

    tok = Tokenizer(model_info.path, model_info.max_length)
    marker = tok(["poison"]).ids[0][1]
    texts = [f"row {i} is fine" for i in range(60)]
    texts[13] = "row 13 carries poison"
    texts[41] = "poison in row 41 too"
    write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(60)), "text": texts}, row_group_size=20)
    engine = FakeEngine(model_info, token_budget=300, max_batch_rows=7, rows_per_step=5, fail_marker=marker)
    spec = _job(tmp_path, output={"rows_per_part": 20})
    with pytest.raises(RunError, match=r"2 rows failed in the engine \(max_failed_rows: 0\).*_errors/"):
        run_job(spec, engine=engine, show_progress=False)
    out = tmp_path / "out"
    table = read_output(out)
    assert table.column("id").to_pylist() == list(range(60))  # every other row written
    emb, hashes = table.column("embedding").to_pylist(), table.column("text_hash").to_pylist()
    assert [i for i, v in enumerate(emb) if v is None] == [13, 41]
    assert hashes[13] is None and hashes[41] is None and hashes[12] is not None  # a reindex tries them again
    np.testing.assert_allclose(emb[12], fake_vector(tok([texts[12]]).ids[0], model_info.dimension), atol=1e-6)
    errors = [json.loads(ln) for f in sorted((out / "_errors").glob("*.jsonl")) for ln in f.read_text().splitlines()]
    assert [(e["id"], e["part_row"]) for e in errors] == [(13, 13), (41, 1)]
    assert all("poison" not in e["error"] and "failed on token" in e["error"] and e["tokens"] > 3 for e in errors)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["counts"]["failed_rows"] == 2 and manifest["complete"] is False
    assert manifest["failed_rows"]["files"] == ["_errors/part-a-rg00000.jsonl", "_errors/part-a-rg00002.jsonl"]
    assert not (out / "_SUCCESS").exists()
    # within the limit the output is finished, the failed rows listed
    ok = run_job(_job(tmp_path, "out2", output={"rows_per_part": 20}, max_failed_rows=0.05), engine=engine,
                 show_progress=False)
    assert ok.failed_rows == 2 and (tmp_path / "out2" / "_SUCCESS").exists()
    # a rerun once the engine takes the rows redoes only the parts with failed rows
    healthy = FakeEngine(model_info)
    again = run_job(spec, engine=healthy, show_progress=False)
    assert again.failed_rows == 0 and again.tasks_run == 2 and again.tasks_skipped == 1
    assert (out / "_SUCCESS").exists() and not list((out / "_errors").glob("*"))
    assert all(v is not None for v in read_output(out).column("embedding").to_pylist())


def test_an_engine_starts_ahead_of_the_first_window_only_for_a_pipeline_with_a_task(tmp_path, fake):
    # an engine process that finds every part taken by the others builds no engine
    import queue

    from batchembed.job import prepare
    from batchembed.pipeline import Pipeline

    write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(20)), "text": [f"t {i}" for i in range(20)]})
    p = prepare(_job(tmp_path))
    asked = []
    pipeline = Pipeline(p, lambda: asked.append(1) or fake)
    assert pipeline.run(queue.Queue(), lambda step: None) == {}
    assert asked == [] and fake.sequences == 0
    tasks = queue.Queue()
    for t in p.tasks:
        tasks.put(t)
    assert len(pipeline.run(tasks, lambda step: None)) == len(p.tasks)
    assert asked == [1] and fake.sequences == 20



def test_the_reader_waits_one_window_ahead_while_the_engine_is_built(tmp_path, fake):
    # tokenising five windows ahead took the cores the engines' builds needed (eight bge-base engines
    # on an H100 host built in 6.7-7.6 s, 5.2-6.0 s with one); the rest is read once the engine is up
    import queue
    import time

    from batchembed.job import prepare
    from batchembed.pipeline import Pipeline

    write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(100)), "text": [f"t {i}" for i in range(100)]})
    p = prepare(_job(tmp_path, engine={"sort_window_rows": 10}))
    tokenised = []
    seen_while_building = []

    def build():
        before = len(tokenised)  # the reader may start before the engine thread does
        deadline = time.monotonic() + 60  # a loaded machine may take a while for the first window
        while not tokenised and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)  # then long enough for the reader to tokenise every window, were it let
        seen_while_building.append((before, len(tokenised)))
        return fake

    pipeline = Pipeline(p, build)
    tokenize = pipeline.reader.tokenizer
    pipeline.reader.tokenizer = lambda texts: tokenised.append(len(texts)) or tokenize(texts)
    tasks = queue.Queue()
    for t in p.tasks:
        tasks.put(t)
    assert len(pipeline.run(tasks, lambda step: None)) == len(p.tasks)
    # one window queued while the build runs, beyond what the reader had read before the build began
    # (the engine thread's start and the reader's race; on a loaded machine more than one): never
    # the ten it could read
    [(before, seen)] = seen_while_building
    assert seen <= max(before, 1) + 1 and seen < 10 and len(tokenised) == 10 and fake.sequences == 100
    assert not pipeline.embedder.building.is_set()


def test_an_engine_that_cannot_be_replaced_names_the_failure_it_was_to_replace(tmp_path, model_info, monkeypatch):
    # the replacement's own error (on CPU: memory the dead in-process engine still holds) must
    # not hide the first failure, which is the cause
    from batchembed.errors import EngineFailure, RunError
    from batchembed.executors import base

    class Dying(FakeEngine):
        def step(self) -> None:
            raise EngineFailure("Unsupported attention configuration (test)")

        def kill(self) -> None:
            self.closed = True

    starts = []

    def start_engine(p, *args, **kwargs):
        starts.append(p)
        if len(starts) == 1:
            return Dying(model_info)
        raise RunError("the vLLM engine failed to start: ValueError: too little memory for the KV cache (test)")

    monkeypatch.setattr(base, "start_engine", start_engine)
    write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(20)), "text": [f"row {i}" for i in range(20)]})
    with pytest.raises(RunError) as e:
        run_job(_job(tmp_path), show_progress=False)
    assert len(starts) == 2
    assert "too little memory for the KV cache (test)" in str(e.value)
    assert "it was to replace an engine that failed: Unsupported attention configuration (test)" in str(e.value)


def test_a_tokenised_window_holds_compact_ids_and_only_the_columns_the_writer_keeps(tmp_path):
    # windows wait in queues (docs: Memory): neither the texts nor lists of Python ints go with them
    import queue
    import threading

    from batchembed.embed.tokenizer import TokenIds
    from batchembed.job import prepare
    from batchembed.pipeline.read import ReadStage

    texts = ["word " * 300, "short", None, "x" * 5000]
    write_parquet(tmp_path / "in" / "a.parquet", {"id": [1, 2, 3, 4], "text": texts, "title": list("abcd"),
                                                  "body": ["big"] * 4})
    p = prepare(_job(tmp_path, input={"carry_columns": ["title"]}))
    tasks, q_in = queue.Queue(), queue.Queue()
    for t in p.tasks:
        tasks.put(t)
    ReadStage(p).run(tasks, q_in, threading.Event())
    _, batch, w = q_in.get()
    assert batch.schema.names == ["id", "title"] and batch.column("title").to_pylist() == list("abcd")
    assert isinstance(w.tok.ids, TokenIds) and w.tok.ids.flat.dtype == np.int32
    whole = Tokenizer(p.model.path, p.max_length)([t for t in texts if t is not None])
    assert sorted(map(tuple, w.tok.ids)) == sorted(map(tuple, whole.ids))  # the unique texts, by hash
    assert w.tok.ids.lists([2, 0]) == [w.tok.ids[2], w.tok.ids[0]] and len(w.tok.ids[0]) > 0
