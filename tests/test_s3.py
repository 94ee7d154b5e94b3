"""Object storage against a real S3 server (SeaweedFS on loopback)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import job_dict

from batchembed.config import JobSpec
from batchembed.errors import RunError
from batchembed.run import run_job
from batchembed.tools.verify import verify_output

BIN = os.path.join(os.path.dirname(sys.executable), "batchembed")


def put_parquet(fs, path: str, table: dict, row_group_size: int | None = None) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table(table), buf, row_group_size=row_group_size)
    fs.pipe(path, buf.getvalue())


def read_s3_output(fs, prefix: str) -> pa.Table:
    parts = sorted(fs.glob(f"{prefix}/part-*.parquet"))
    return pa.concat_tables([pq.read_table(fs.open(p, "rb")) for p in parts])


def corpus(fs, prefix: str, files: int, rows: int, words: int = 12) -> list[int]:
    ids = []
    for k in range(files):
        batch = list(range(k * 1000, k * 1000 + rows))
        put_parquet(fs, f"{prefix}/f{k:02d}.parquet",
                    {"id": batch, "text": [f"document {i} " + "lorem ipsum dolor " * words for i in batch]},
                    row_group_size=max(1, rows // 2))
        ids += batch
    return ids


def s3_job(name: str, endpoint: str = "${TEST_S3_ENDPOINT}", **sections) -> dict:
    opts = {"endpoint_url": endpoint}
    job = job_dict(f"s3://corpus/{name}/in/", f"s3://corpus/{name}/out/", **sections)
    job["input"]["storage_options"] = opts
    job["output"]["storage_options"] = opts
    return job


def test_s3_in_and_out_with_env_credentials(tmp_path, s3_env, engine):
    from batchembed.config import load_job

    fs = s3_env.fs()
    ids = corpus(fs, "corpus/basic/in", files=3, rows=20)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(s3_job("basic")))
    spec = load_job(tmp_path / "job.yaml")
    stats = run_job(spec, engine=engine, show_progress=False)
    assert stats.rows == 60 and stats.tasks_run == 3
    out = read_s3_output(fs, "corpus/basic/out")
    assert out.column("id").to_pylist() == ids
    manifest = fs.cat("corpus/basic/out/_manifest.json").decode()
    assert s3_env.env["AWS_SECRET_ACCESS_KEY"] not in manifest and s3_env.endpoint not in manifest
    assert json.loads(manifest)["input"]["files"][0]["etag"]
    assert fs.exists("corpus/basic/out/_SUCCESS")
    problems, summary = verify_output("s3://corpus/basic/out/", {"endpoint_url": s3_env.endpoint})
    assert problems == [] and summary["rows"] == 60
    assert run_job(spec, engine=engine, show_progress=False).tasks_run == 0
    # stored vectors against sentence-transformers, the texts read back from the input on S3
    from click.testing import CliRunner

    from batchembed.cli import cli

    r = CliRunner().invoke(cli, ["verify", str(tmp_path / "job.yaml"), "--sample", "10", "--seed", "1"])
    assert r.exit_code == 0 and "sample: 10 rows of 3 parts re-embedded" in r.output, r.output


def test_incremental_run_with_its_previous_output_on_s3(s3_env, engine):
    fs = s3_env.fs()
    corpus(fs, "corpus/inc/in", files=3, rows=20)
    first = JobSpec.model_validate(s3_job("inc", s3_env.endpoint))
    run_job(first, engine=engine, show_progress=False)
    # one file changes one row, the others stay as they were
    put_parquet(fs, "corpus/inc/in/f01.parquet",
                {"id": list(range(1000, 1020)),
                 "text": ["an edited row"] + [f"document {i} " + "lorem ipsum dolor " * 12 for i in range(1001, 1020)]},
                row_group_size=10)
    job = s3_job("inc", s3_env.endpoint, incremental={"previous": "s3://corpus/inc/out/"})
    job["output"]["uri"] = "s3://corpus/inc/out2/"
    stats = run_job(JobSpec.model_validate(job), engine=engine, show_progress=False)
    assert (stats.rows, stats.embedded, stats.reused, stats.deleted) == (60, 1, 59, 0)
    # the two unchanged files' parts were copied on the server, the changed one rewritten
    records = [json.loads(fs.cat(p)) for p in fs.glob("corpus/inc/out2/_commits/*.json")]
    assert sorted(bool(r.get("copied_from")) for r in records) == [False, True, True]
    old, new = read_s3_output(fs, "corpus/inc/out"), read_s3_output(fs, "corpus/inc/out2")
    assert new.column("id").to_pylist() == old.column("id").to_pylist()
    changed = [i for i, (a, b) in enumerate(zip(old.column("embedding").to_pylist(),
                                                 new.column("embedding").to_pylist())) if a != b]
    assert changed == [20]
    problems, _ = verify_output("s3://corpus/inc/out2/", {"endpoint_url": s3_env.endpoint})
    assert problems == []


def test_server_restart_mid_run_is_retried_and_the_run_completes(s3_env, engine):
    fs = s3_env.fs()
    ids = corpus(fs, "corpus/restart/in", files=8, rows=120, words=30)
    spec = JobSpec.model_validate(s3_job("restart", s3_env.endpoint, retry={"attempts": 8, "backoff_s": 0.5}))
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(stats=run_job(spec, engine=engine, show_progress=False)))
    runner.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not fs.glob("corpus/restart/out/_commits/*.json"):
        time.sleep(0.2)
        fs.invalidate_cache()
    assert fs.glob("corpus/restart/out/_commits/*.json"), "no part was committed before the restart"
    s3_env.restart(down_for=2.0)
    runner.join(timeout=300)
    assert "stats" in result, "the run did not finish after the server came back"
    fs = s3_env.fs()
    out = read_s3_output(fs, "corpus/restart/out")
    assert sorted(out.column("id").to_pylist()) == ids
    assert out.column("id").to_pylist() == ids
    assert fs.exists("corpus/restart/out/_SUCCESS")


def test_persistent_storage_failure_exits_1_naming_the_url(tmp_path, s3_env):
    from s3server import _pick_ports

    dead = f"http://127.0.0.1:{_pick_ports(1)[0]}"
    pq.write_table(pa.table({"id": [1], "text": ["x"]}), tmp_path / "in.parquet")
    job = job_dict(tmp_path / "in.parquet", "s3://corpus/dead/out/", retry={"attempts": 2, "backoff_s": 0.1})
    job["output"]["storage_options"] = {"endpoint_url": dead}
    spec = JobSpec.model_validate(job)
    with pytest.raises(RunError) as e:
        run_job(spec, show_progress=False)
    msg = str(e.value)
    assert "s3://corpus/dead/out" in msg and "after 2 attempts" in msg
    assert s3_env.env["AWS_SECRET_ACCESS_KEY"] not in msg


def test_a_missing_bucket_is_refused_before_any_engine(tmp_path, s3_env):
    from click.testing import CliRunner

    from batchembed.cli import cli

    pq.write_table(pa.table({"id": [1], "text": ["x"]}), tmp_path / "in.parquet")
    job = job_dict(tmp_path / "in.parquet", "s3://no-such-bucket/emb/")
    job["output"]["storage_options"] = {"endpoint_url": s3_env.endpoint}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    for command in (["validate"], ["run", "--no-progress"]):
        r = CliRunner().invoke(cli, [command[0], str(tmp_path / "job.yaml"), *command[1:]])
        assert r.exit_code == 2, r.output
        assert "output.uri: s3://no-such-bucket/emb" in r.output and "'no-such-bucket' does not exist" in r.output


def test_credentials_the_store_refuses_are_said_at_once_naming_the_url(tmp_path, s3_env):
    # wrong keys (PermissionError from s3fs) or none at all (botocore's NoCredentialsError) were
    # tracebacks, or six attempts over a minute; now one line naming the URL, exit 1 (validate: 2)
    import fsspec

    fs = fsspec.filesystem("s3", endpoint_url=s3_env.endpoint)
    corpus(fs, "corpus/refused/in", files=1, rows=4)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(s3_job("refused", s3_env.endpoint)))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for creds in ({"AWS_ACCESS_KEY_ID": "wrong", "AWS_SECRET_ACCESS_KEY": "wrong"}, {}):
        for command, code in ((["verify"], 1), (["validate"], 2), (["run", "--no-progress"], 1)):
            t0 = time.monotonic()
            r = subprocess.run([BIN, command[0], str(tmp_path / "job.yaml"), *command[1:]], capture_output=True,
                               text=True, env=clean | creds, timeout=120)
            assert r.returncode == code, (command, creds, r.stderr[-2000:])
            assert "access refused at s3://corpus/refused/" in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert ("PermissionError" if creds else "NoCredentialsError") in r.stderr
            assert "retry" not in r.stderr and time.monotonic() - t0 < 60, r.stderr  # not retried


def test_kill_9_at_several_points_then_rerun_gives_every_row_exactly_once(tmp_path, s3_env):
    """The CLI as Airflow runs it, killed with SIGKILL mid-run twice, then run to the end by
    two processes at once."""
    fs = s3_env.fs()
    ids = corpus(fs, "corpus/kill/in", files=10, rows=150, words=25)
    job = s3_job("kill", engine={"sort_window_rows": 50})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, **s3_env.env, "TEST_S3_ENDPOINT": s3_env.endpoint}

    def start(i: int, core: int | None = None) -> subprocess.Popen:
        log = open(tmp_path / f"run{i}.log", "w")
        # two runs at once get a core each, as an operator would pin them: two CPU engines
        # spinning two OpenMP threads each on the same two cores slowed to minutes per part
        pin = {"VLLM_CPU_OMP_THREADS_BIND": f"{core}-{core}"} if core is not None else {}
        return subprocess.Popen([BIN, "run", str(tmp_path / "job.yaml"), "--no-progress"], stdout=log,
                                stderr=subprocess.STDOUT, env={**env, **pin}, start_new_session=True)

    def commits() -> int:
        fs.invalidate_cache()
        return len(fs.glob("corpus/kill/out/_commits/*.json"))

    for i, kill_after in enumerate((1, 4)):  # once after the first commit, once further on
        proc = start(i)
        deadline = time.monotonic() + 240
        while commits() < kill_after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, (tmp_path / f"run{i}.log").read_text()[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the CLI and vLLM's engine processes
        proc.wait()
        assert not fs.exists("corpus/kill/out/_SUCCESS")
    # the retry Airflow makes, twice at once (a duplicate scheduler run): both finish, no row doubles,
    # and they share the parts left instead of each embedding all of them
    before = commits()
    cores = sorted(os.sched_getaffinity(0))
    procs = [start(9, cores[0]), start(10, cores[-1])] if len(cores) >= 2 else [start(9), start(10)]
    for i, proc in zip((9, 10), procs):
        assert proc.wait(timeout=400) == 0, (tmp_path / f"run{i}.log").read_text()[-3000:]
    out = read_s3_output(fs, "corpus/kill/out")
    assert out.column("id").to_pylist() == ids  # every row once, in order
    problems, _ = verify_output("s3://corpus/kill/out/", {"endpoint_url": s3_env.endpoint})
    assert problems == []
    summaries = [json.loads([ln for ln in (tmp_path / f"run{i}.log").read_text().splitlines()
                             if ln.startswith("{")][-1]) for i in (9, 10)]
    assert sum(s["tasks_run"] for s in summaries) == 10 - before, summaries
    assert len(fs.glob("corpus/kill/out/part-*.parquet")) == 10
