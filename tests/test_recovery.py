"""Runs that heal themselves: the engine's process killed (as the OOM killer does) or stopped (a
hung engine) mid-run; the run replaces the engine and finishes, every row once, vectors right."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import job_dict, write_parquet

from batchembed.embed.watchdog import child_pids

BIN = os.path.join(os.path.dirname(sys.executable), "batchembed")


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
    engine = {"sort_window_rows": 40, **({"stall_timeout_s": 10} if fault == "stop" else {})}
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 40}, engine=engine,
                   fidelity_check="off")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    commits = tmp_path / "out" / "_commits"
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([BIN, "run", str(tmp_path / "job.yaml"), "--no-progress"], stdout=subprocess.PIPE,
                            stderr=log, start_new_session=True, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not (commits.exists() and any(commits.iterdir())):
        time.sleep(0.05)
    core = engine_core(proc.pid)
    assert proc.poll() is None and core, (tmp_path / "run.log").read_text()[-3000:]
    os.kill(core, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    stdout, _ = proc.communicate(timeout=300)
    text = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert ("is gone" if fault == "kill" else "no vector came back for") in text, text[-3000:]
    assert "engine restarted in" in text and "Traceback" not in text
    assert not os.path.exists(f"/proc/{core}") or _comm(core) == "", "the failed engine's process outlived it"
    left = subprocess.run(["ps", "-o", "stat=", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert [st for st in left if not st.startswith("Z")] == [], "processes of the run outlived it"
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["rows"] == len(ids) and summary["tasks_run"] == 12
    out = pq.read_table(tmp_path / "out")
    assert out.column("id").to_pylist() == ids  # every row once, in order
    ref = st_model.encode(texts, normalize_embeddings=True)
    got = np.stack(out.column("embedding").to_numpy(zero_copy_only=False))
    assert float((got * ref).sum(axis=1).min()) > 0.9999
