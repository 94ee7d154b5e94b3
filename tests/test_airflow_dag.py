"""jobs/airflow_dag.py imported by real Airflow 3 (a venv of its own, .venv-airflow, which
.ci/run makes with scripts/setup_airflow.sh): its tasks, and which exit codes it retries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # another venv and whole batchembed processes (make test only)

ROOT = Path(__file__).resolve().parents[1]
AIRFLOW_PY = Path(os.environ.get("BATCHEMBED_AIRFLOW_PYTHON", ROOT / ".venv-airflow" / "bin" / "python"))
BIN = os.path.join(os.path.dirname(sys.executable), "batchembed")

CHECK = r'''
import importlib.util, sys
from airflow.sdk.exceptions import AirflowException, AirflowFailException

spec = importlib.util.spec_from_file_location("dag_file", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
dag = mod.dag
tasks = {t.task_id: t for t in dag.tasks}
assert set(tasks) == {"embed", "finalize", "verify"}, tasks
assert tasks["embed"].retries == 3 and tasks["embed"].downstream_task_ids == {"finalize"}
assert tasks["finalize"].downstream_task_ids == {"verify"}
assert tasks["embed"].op_kwargs_expand_input.value["shard"] == ["0/3", "1/3", "2/3"]
try:                                   # exit 2: a bad job is not retried
    mod.batchembed("run", sys.argv[2] + "/no-such-job.yaml")
except AirflowFailException as e:
    print("exit 2 ->", type(e).__name__)
try:                                   # exit 1: a failed run is retried
    mod.batchembed("inspect", sys.argv[2])
except AirflowFailException:
    raise SystemExit("exit 1 must be retried")
except AirflowException as e:
    print("exit 1 ->", type(e).__name__)
mod.batchembed("--version")            # exit 0: nothing raised
print("exit 0 -> ok")
'''


def test_the_dag_imports_in_airflow_3_and_retries_only_what_a_retry_can_fix(tmp_path):
    if not AIRFLOW_PY.exists():
        if os.environ.get("BATCHEMBED_REQUIRE_AIRFLOW"):  # CI: it must run
            pytest.fail(f"no Airflow at {AIRFLOW_PY}: scripts/setup_airflow.sh makes it")
        pytest.skip("no Airflow venv (scripts/setup_airflow.sh makes .venv-airflow)")
    env = {**os.environ, "BATCHEMBED_SHARDS": "3", "BATCHEMBED_BIN": BIN, "BATCHEMBED_JOB": str(tmp_path / "job.yaml"),
           "AIRFLOW_HOME": str(tmp_path / "airflow"), "PYTHONWARNINGS": "error::DeprecationWarning:dag_file"}
    r = subprocess.run([str(AIRFLOW_PY), "-c", CHECK, str(ROOT / "jobs" / "airflow_dag.py"), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("exit ")] == [
        "exit 2 -> AirflowFailException", "exit 1 -> AirflowException", "exit 0 -> ok"]
    assert "Deprecat" not in r.stderr, r.stderr[-3000:]
