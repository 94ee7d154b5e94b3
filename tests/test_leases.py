"""Claims on parts (output/leases.py) and the run's schedule over them (executors/schedule.py): runs
that meet on one output share its parts; a claim of a run that stopped beating is taken over; a run
waits for parts another live run holds only while that run lives. Fast: two Leases in one process
stand for two runs, and a heartbeat written by hand for a run on another machine."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from helpers import make_job, read_output, write_parquet

from batchembed.errors import RunError
from batchembed.executors import schedule as schedule_module
from batchembed.executors.schedule import WAIT, Restarts, Schedule
from batchembed.job import prepare
from batchembed.output.leases import CLAIMS, RUNS, Leases, _process_space, sweep
from batchembed.run import run_job


@pytest.fixture()
def prepared(tmp_path):
    ids = list(range(60))
    write_parquet(tmp_path / "in" / "docs.parquet", {"id": ids, "text": [f"row {i}" for i in ids]},
                  row_group_size=10)
    return prepare(make_job(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 10},
                            fidelity_check="off"))


def _heartbeat(out, run: str, expires_in: float, processes: str = "elsewhere/pid:[1]", pid: int = 1,
               started: str | None = "1") -> None:
    path = out.path(f"{RUNS}/{run}.json")
    out.fs.makedirs(out.path(RUNS), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"run": run, "host": "elsewhere", "processes": processes, "pid": pid, "started": started,
                   "expires": time.time() + expires_in}, f)


def _claim(out, part: str, run: str) -> None:
    out.fs.makedirs(out.path(CLAIMS), exist_ok=True)
    with open(out.path(f"{CLAIMS}/{part}.0.json"), "w") as f:
        json.dump({"run": run}, f)


def test_a_part_is_claimed_by_one_run_until_it_lets_go(prepared):
    a, b = Leases(prepared.out, 30), Leases(prepared.out, 30)
    try:
        assert a.claim("p1") is None and a.claim("p1") is None  # claimed, and ours on asking again
        assert b.claim("p1") == a.run and b.holder("p1") == a.run
        assert b.claim("p2") is None and a.claim("p2") == b.run
        a.close()  # a run that ends removes its heartbeat: its claims lapse at once
        assert not (Path(prepared.out.root) / RUNS / f"{a.run}.json").exists()
        b._seen.clear()
        assert b.claim("p1") is None and b.holder("p1") is None
        assert json.loads((Path(prepared.out.root) / CLAIMS / "p1.1.json").read_text())["run"] == b.run
    finally:
        a.close()
        b.close()


def test_a_claim_lapses_with_its_runs_heartbeat(prepared):
    out = prepared.out
    _heartbeat(out, "remote-live", expires_in=30)
    _heartbeat(out, "remote-gone", expires_in=-1)  # a run elsewhere that stopped beating
    dead = subprocess.Popen(["true"])
    dead.wait()
    _heartbeat(out, "here-killed", expires_in=30, processes=_process_space(), pid=dead.pid, started="0")
    for part, run in [("p1", "remote-live"), ("p2", "remote-gone"), ("p3", "here-killed"), ("p4", "never-beat")]:
        _claim(out, part, run)
    me = Leases(out, 30)
    try:
        assert me.claim("p1") == "remote-live"  # held: its run beats
        assert me.claim("p2") is None  # lapsed: taken over
        assert me.claim("p3") is None  # a run of this machine whose process is gone: at once
        assert me.claim("p4") is None  # a claim without any heartbeat holds nothing
        assert json.loads((Path(out.root) / CLAIMS / "p2.1.json").read_text())["run"] == me.run
        assert me.claim("p5") is None  # unclaimed: generation 0
        other = Leases(out, 30)
        assert other.claim("p2") == me.run and other.holder("p5") == me.run  # the highest generation holds
        other.close()
    finally:
        me.close()
    # claims stay until the output is finished, so their generations keep no gaps
    assert len(list((Path(out.root) / CLAIMS).iterdir())) == 8
    sweep(out)  # a finished output: every claim goes, and the heartbeats of runs that stopped
    assert not (Path(out.root) / CLAIMS).exists()  # nor its empty folder
    assert sorted(p.name for p in (Path(out.root) / RUNS).iterdir()) == ["remote-live.json"]


def test_two_runs_taking_over_one_lapsed_claim_at_once_cannot_both_win(prepared):
    """Both read the lapsed claim before either writes: the takeover is an exclusive create of the
    next generation, so the second to create it finds the first's claim and leaves the part to it."""
    out = prepared.out
    _claim(out, "p1", "gone")  # a claim whose run never beats
    a, b = Leases(out, 30), Leases(out, 30)
    create = a._create

    def b_first(path, record):  # b takes the part over between a's read and a's write
        assert b.claim("p1") is None
        return create(path, record)

    a._create = b_first
    try:
        assert a.claim("p1") == b.run and b.holder("p1") is None and a.holder("p1") == b.run
        assert "p1" not in a.mine and "p1" in b.mine
    finally:
        a.close()
        b.close()


def test_two_schedules_share_the_parts_and_wait_for_the_others(prepared, monkeypatch):
    monkeypatch.setattr(schedule_module, "_RECHECK_S", 0.0)
    p = prepared
    a, b = Schedule(p, p.tasks, Leases(p.out, 30)), Schedule(p, p.tasks, Leases(p.out, 30))
    try:
        got_a = [a.take("w").part_id, a.take("w").part_id]
        got_b = []
        while (t := b.take("w")) not in (None, WAIT):
            got_b.append(t.part_id)
        assert len(got_b) == len(p.tasks) - 2 and not set(got_a) & set(got_b)
        assert b.take("w") is WAIT  # a's two parts: a lives, so b waits
        first = next(t for t in p.tasks if t.part_id == got_a[0])
        p.out.write_commit(p.out.part_name(first), {"part": p.out.part_name(first), "input": first.input_fingerprint})
        assert b.take("w") is WAIT and b.done_elsewhere == {got_a[0]}
        a.leases.close()  # a stops (its claims lapse): b takes the part left over
        b.leases._seen.clear()
        assert b.take("w").part_id == got_a[1] and b.take("w") is None
    finally:
        a.close()
        b.close()


def test_a_part_committed_by_another_run_since_planning_is_not_taken_again(prepared):
    """Another run committed a part after this one planned, then stopped holding it (it ended, or was
    killed before it moved on from that part): the claim is ours, the work is not."""
    p = prepared
    a, b = Schedule(p, p.tasks, Leases(p.out, 30)), Schedule(p, p.tasks, Leases(p.out, 30))
    try:
        first = a.take("w")
        p.out.write_commit(p.out.part_name(first), {"part": p.out.part_name(first), "input": first.input_fingerprint})
        a.leases.close()  # its claims lapse, as after its end
        b.leases._seen.clear()
        got = []
        while (t := b.take("w")) not in (None, WAIT):
            got.append(t.part_id)
        assert first.part_id not in got and len(got) == len(p.tasks) - 1
        assert b.done_elsewhere == {first.part_id}
    finally:
        a.close()
        b.close()


def test_a_part_planned_for_its_failed_rows_is_tried_once_more_not_by_every_run(prepared, monkeypatch):
    """A part committed with failed rows is planned again, to retry them: the record the plan saw does
    not count as done, whether the part is taken here or held elsewhere. Another record with failed
    rows (another run's retry since) does."""
    monkeypatch.setattr(schedule_module, "_RECHECK_S", 0.0)
    p = prepared
    old, held, fresh = p.tasks[:3]

    def commit(t, run: str) -> dict:
        name = p.out.part_name(t)
        r = {"part": name, "input": t.input_fingerprint, "failed_rows": 1, "run": run}
        p.out.write_commit(name, r)
        return p.out.read_commit(name)

    seen = {t.index: commit(t, "earlier") for t in (old, held, fresh)}
    other = Leases(p.out, 30)
    me = Schedule(p, p.tasks, Leases(p.out, 30), retried=seen)
    try:
        assert other.claim(held.part_id) is None
        commit(fresh, other.run)  # another run's retry, since this one planned
        got = []
        while (t := me.take("w")) not in (None, WAIT):
            got.append(t.part_id)
        assert old.part_id in got and fresh.part_id not in got and held.part_id not in got
        assert me.done_elsewhere == {fresh.part_id} and me.elsewhere == {held.part_id}
        assert me.take("w") is WAIT  # the record this run planned to retry is not the retry
        commit(held, other.run)
        assert me.take("w") is None and me.done_elsewhere == {fresh.part_id, held.part_id}
    finally:
        other.close()
        me.close()


def test_one_restart_budget_for_the_whole_run():
    r = Restarts(2, [0, 0, 0])
    assert r.take(1) == 1 and r.take(2) == 2 and r.take(0) is None and r.used() == 2
    with pytest.raises(RunError, match=r"failed 3 times in this run \(engine.max_restarts: 2\), last: gone"):
        r.spend("gone")


def test_a_run_waits_for_a_live_claim_only_while_its_run_beats(tmp_path, model_info, caplog):
    """Another run (on another machine) claimed a part and stopped beating a few seconds later:
    this run embeds the rest, waits, then takes that part over, and the output is whole."""
    ids = list(range(40))
    write_parquet(tmp_path / "in" / "docs.parquet", {"id": ids, "text": [f"row {i}" for i in ids]},
                  row_group_size=10)
    spec = make_job(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 10}, fidelity_check="off")
    p = prepare(spec)
    held = p.tasks[0].part_id
    _heartbeat(p.out, "elsewhere", expires_in=3)
    _claim(p.out, held, "elsewhere")
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="batchembed"):
        stats = run_job(spec, engine=FakeEngine(model_info), show_progress=False)
    assert time.monotonic() - t0 >= 2  # it waited for the live claim
    text = caplog.text
    assert f"part {held}: claimed by run elsewhere" in text and "the claim of run elsewhere lapsed" in text
    assert stats.tasks_run == 4 and read_output(tmp_path / "out").column("id").to_pylist() == ids
    commits = [json.loads(f.read_text()) for f in (tmp_path / "out" / "_commits").iterdir()]
    assert len({c["run"] for c in commits}) == 1  # each commit names the run that embedded it
    assert not (tmp_path / "out" / CLAIMS).exists() and not (tmp_path / "out" / RUNS).exists()
