"""Ctrl-C and a scheduler's SIGTERM: the run stops taking work, keeps only whole committed
parts, shuts its engines down, and exits 130 / 143 with one line; a rerun finishes the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pyarrow.parquet as pq
import pytest
from helpers import BIN, group_alive, job_dict, start_run, write_parquet

pytestmark = pytest.mark.slow  # whole batchembed processes (make test, not make test-fast)


# Ctrl-C reaches a terminal's whole foreground group; Airflow's BashOperator sends SIGTERM to
# its command's process group on a timeout or a kill
@pytest.mark.parametrize("sig,to_group,code", [(signal.SIGINT, True, 130), (signal.SIGTERM, True, 143)])
def test_a_signal_stops_the_run_cleanly_and_a_rerun_resumes(tmp_path, sig, to_group, code):
    ids = list(range(600))
    texts = [f"row {i}: " + "signals stop a run between parts " * 12 for i in ids]
    write_parquet(tmp_path / "in" / "docs.parquet", {"id": ids, "text": texts}, row_group_size=50)
    job = job_dict(tmp_path / "in", tmp_path / "out", output={"rows_per_part": 50},
                   engine={"sort_window_rows": 50}, fidelity_check="off")
    commits = tmp_path / "out" / "_commits"
    proc = start_run(tmp_path, job)  # a session of its own: Ctrl-C reaches the whole group
    if to_group:
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    assert proc.wait(timeout=60) == code, (tmp_path / "run.log").read_text()[-3000:]
    text = (tmp_path / "run.log").read_text()
    assert "Traceback" not in text and "EngineDeadError" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"batchembed: interrupted by {signal.Signals(sig).name}: ") and "parts are committed" in last
    time.sleep(1)
    assert group_alive(proc.pid) == [], "processes of the run outlived it"
    out = tmp_path / "out"
    parts = sorted(p.name for p in out.glob("part-*.parquet"))
    recorded = sorted(p.name.replace(".json", ".parquet") for p in commits.glob("*.json"))
    assert parts == recorded and 0 < len(parts) < 12  # whole parts only, each with its record
    assert not (out / "_SUCCESS").exists() and not list(out.glob(".*"))
    done = int(last.split(": ")[2].split(" of ")[0])
    assert done == len(parts)
    again = subprocess.run([BIN, "run", str(tmp_path / "job.yaml"), "--no-progress"], capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["tasks_skipped"] == len(parts) and summary["tasks_skipped"] + summary["tasks_run"] == 12
    assert pq.read_table(out).column("id").to_pylist() == ids  # every row once
