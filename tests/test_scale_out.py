"""Scale-out that heals: a Ray engine actor killed -9 mid-run is replaced and the run finishes; a Ray
that cannot hold the actors asked is refused in bounded time; runs that meet on one output (local
disk and S3) share its parts, and the parts of one killed -9 midway are taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import BIN, group_alive, job_dict, start_run, write_parquet

from batchembed.embed.watchdog import descendant_pids

pytestmark = pytest.mark.slow  # whole batchembed processes (make test, not make test-fast)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _corpus(folder, parts: int, rows: int = 40) -> tuple[list[int], list[str]]:
    ids = list(range(parts * rows))
    texts = [f"row {i}: " + "runs that share one output embed each part once " * (i % 4 + 2) for i in ids]
    write_parquet(folder / "docs.parquet", {"id": ids, "text": texts}, row_group_size=rows)
    return ids, texts


def _vectors(table) -> np.ndarray:
    return np.stack(table.column("embedding").to_numpy(zero_copy_only=False))


def test_a_ray_actor_killed_is_replaced_and_the_run_finishes(tmp_path, st_model, run_temp):
    ids, texts = _corpus(tmp_path / "in", parts=16)
    job = job_dict(tmp_path / "in", tmp_path / "out", executor="ray", output={"rows_per_part": 40},
                   engine={"sort_window_rows": 40, "max_restarts": 1}, ray={"num_cpus_per_engine": 1},
                   fidelity_check="off")
    env = os.environ | {"RAY_TMPDIR": run_temp, "TMPDIR": run_temp}
    proc = start_run(tmp_path, job, stdout=subprocess.PIPE, env=env)
    actor = next((p for p in descendant_pids(proc.pid) if _cmdline(p).startswith("ray::EngineActor")), None)
    assert actor, [_cmdline(p)[:80] for p in descendant_pids(proc.pid)]
    os.kill(actor, signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=400)
    text = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "engine actor 0 was lost with part" in text and "restart 1 of at most 1" in text, text[-3000:]
    assert "Traceback" not in text
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["rows"] == len(ids)
    out = pq.read_table(tmp_path / "out")
    assert out.column("id").to_pylist() == ids  # every row once, in order
    ref = st_model.encode(texts, normalize_embeddings=True)
    assert float((_vectors(out) * ref).sum(axis=1).min()) > 0.9999
    assert group_alive(proc.pid) == [], "processes of the run outlived it"


def test_a_ray_too_small_for_the_engines_asked_is_refused_at_once(tmp_path, run_temp):
    _corpus(tmp_path / "in", parts=4)
    job = job_dict(tmp_path / "in", tmp_path / "out", executor="ray", output={"rows_per_part": 40},
                   engine={"data_parallel": 3}, ray={"num_cpus_per_engine": os.cpu_count()}, fidelity_check="off")
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    t0 = time.monotonic()
    r = subprocess.run([BIN, "run", str(tmp_path / "job.yaml"), "--no-progress"], capture_output=True, text=True,
                       env=os.environ | {"RAY_TMPDIR": run_temp, "TMPDIR": run_temp}, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert (f"3 engine actor(s) (engine.data_parallel) of {os.cpu_count()} CPU(s) and 0 GPU(s) each" in last
            and f"the Ray cluster has {os.cpu_count()} CPUs" in last), last
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 120
    assert not list((tmp_path / "out").glob("part-*"))


def _runs_at_once(tmp_path, job: dict, fs, out: str, n: int, env: dict) -> None:
    """`n` runs of `job` started at once on one output (`out` on `fs`); the first is killed -9 (its
    whole process group, as a lost machine) once it has committed a part. The others finish: every row
    once, no part embedded by two live runs, the killed run's claimed parts taken over."""
    procs = [start_run(tmp_path, job, stdout=subprocess.PIPE, env=env, name=f"run{i}", started=False)
             for i in range(n)]

    def records(folder: str) -> list[dict]:
        fs.invalidate_cache()
        found = []
        for path in fs.glob(f"{out}/{folder}/*.json"):
            try:
                found.append(json.loads(fs.cat_file(path)))
            except (FileNotFoundError, json.JSONDecodeError):
                pass  # removed or replaced meanwhile
        return found

    killed = None
    deadline = time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and procs[0].poll() is None:
        beat = next((b for b in records("_runs") if b["pid"] == procs[0].pid), None)
        if beat and any(c.get("run") == beat["run"] for c in records("_commits")):
            killed = beat["run"]
        time.sleep(0.1)
    assert killed, (tmp_path / "run0.log").read_text()[-3000:]
    os.killpg(procs[0].pid, signal.SIGKILL)
    procs[0].wait()
    held = [os.path.basename(p).rsplit(".", 2)[0] for p in fs.glob(f"{out}/_claims/*.json")
            if json.loads(fs.cat_file(p))["run"] == killed]
    summaries = []
    for i, proc in enumerate(procs[1:], 1):
        stdout, _ = proc.communicate(timeout=600)
        log = (tmp_path / f"run{i}.log").read_text()
        assert proc.returncode == 0, log[-3000:]
        assert "Traceback" not in log
        summaries.append(json.loads(stdout.strip().splitlines()[-1]))
    logs = "".join((tmp_path / f"run{i}.log").read_text() for i in range(1, n))
    commits = records("_commits")
    by_run = {}
    for c in commits:
        by_run[c["run"]] = by_run.get(c["run"], 0) + 1
    # each survivor's parts are exactly the records that name it: none was embedded by two live runs
    assert sum(s["tasks_run"] for s in summaries) == len(commits) - by_run.get(killed, 0), (by_run, summaries)
    assert by_run.get(killed) and all(by_run.values())
    by_part = {c["part"].split(".")[0]: c["run"] for c in commits}
    # what the killed run had claimed and not committed (it claims a few parts ahead), another run
    # took over and committed
    lost = [part for part in held if by_part[part] != killed]
    assert lost, held
    for part in lost:
        assert f"part {part}: the claim of run {killed} lapsed" in logs, logs[-3000:]
    assert not fs.glob(f"{out}/_claims/*.json")  # the finished output keeps no claims
    assert fs.exists(f"{out}/_SUCCESS")
    for proc in procs:
        assert group_alive(proc.pid) == [], "processes of a run outlived it"


def test_three_runs_on_one_output_share_it_and_take_over_a_killed_ones_parts(tmp_path, st_model):
    ids, texts = _corpus(tmp_path / "in", parts=24)
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 40},
                   engine={"sort_window_rows": 40}, fidelity_check="off")
    _runs_at_once(tmp_path, job, fsspec.filesystem("file"), str(tmp_path / "out"), 3, dict(os.environ))
    out = pq.read_table(tmp_path / "out")
    assert out.column("id").to_pylist() == ids  # every row once, in order
    ref = st_model.encode(texts, normalize_embeddings=True)
    assert float((_vectors(out) * ref).sum(axis=1).min()) > 0.9999


def test_two_runs_on_one_s3_output_share_it_and_take_over_a_killed_ones_parts(tmp_path, s3_env):
    from test_s3 import corpus, read_s3_output, s3_job

    fs = s3_env.fs()
    ids = corpus(fs, "corpus/meet/in", files=8, rows=60, words=20)
    job = s3_job("meet", output={"rows_per_part": 30}, engine={"sort_window_rows": 30}, fidelity_check="off")
    env = {**os.environ, **s3_env.env, "TEST_S3_ENDPOINT": s3_env.endpoint}
    _runs_at_once(tmp_path, job, fs, "corpus/meet/out", 2, env)
    assert read_s3_output(fs, "corpus/meet/out").column("id").to_pylist() == ids  # every row once
