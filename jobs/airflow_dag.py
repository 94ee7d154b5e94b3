"""Example Airflow 3 DAG: one batchembed job spread over N shards, nightly.

Each mapped task runs `batchembed run JOB --shard i/N`. Retries are safe: a rerun skips
every part already committed (resume is the default), so a retried or duplicated task never
loses or doubles a row. The last shard to finish writes _manifest.json and _SUCCESS; the
`finalize` task makes sure of it and fails while any part is missing; `verify` reads every
part back (and with BATCHEMBED_VERIFY_SAMPLE=N re-embeds N random rows to compare).

Exit codes decide retries: 2 means the job or the command line is invalid (nothing was
started; retrying will not help), so the task fails at once, without retries; 1 (a failed
run), 130 and 143 (stopped by a signal) are retried, and the retry resumes. When Airflow
stops a task (a timeout, a kill), batchembed gets SIGTERM, keeps its committed parts and
exits 143. tests/test_airflow_dag.py imports this file with real Airflow and checks both.

Settings come from the environment of the scheduler and workers, with these defaults.
"""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timedelta

from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowException, AirflowFailException

JOB = os.environ.get("BATCHEMBED_JOB", "/opt/jobs/wiki.yaml")  # a job file like jobs/s3-example.yaml
OUTPUT = os.environ.get("BATCHEMBED_OUTPUT", "s3://corpus/wiki-emb/")  # its output.uri, for verify
SHARDS = int(os.environ.get("BATCHEMBED_SHARDS", "16"))
SAMPLE = int(os.environ.get("BATCHEMBED_VERIFY_SAMPLE", "0"))  # rows verify re-embeds to compare (0: none)
BATCHEMBED = os.environ.get("BATCHEMBED_BIN", "/opt/batchembed/.venv/bin/batchembed")


def batchembed(*args: str) -> None:
    """Run one batchembed command; exit 2 fails the task without retries, any other failure retries."""
    proc = subprocess.Popen([BATCHEMBED, *args])
    try:
        code = proc.wait()
    except BaseException:  # the task timed out or was killed: let batchembed stop cleanly, parts kept
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if code == 2:
        raise AirflowFailException(f"batchembed {args[0]}: the job or command is invalid (exit 2): fix it; "
                                   "retrying will not help")
    if code != 0:
        raise AirflowException(f"batchembed {args[0]} exited {code}; a retry resumes from the committed parts")


with DAG(
    dag_id="batchembed_wiki",
    start_date=datetime(2026, 1, 1),
    schedule="0 2 * * *",
    catchup=False,
    default_args={"retries": 3, "retry_delay": timedelta(minutes=2), "retry_exponential_backoff": True},
    max_active_tasks=SHARDS,  # one per GPU worker
) as dag:

    @task(execution_timeout=timedelta(hours=6))
    def embed(shard: str) -> None:
        # one engine per task: give each its own GPU through the worker's CUDA_VISIBLE_DEVICES
        batchembed("run", JOB, "--shard", shard, "--no-progress")

    @task
    def finalize() -> None:
        batchembed("finalize", JOB)

    @task
    def verify() -> None:
        # --sample compares stored vectors with sentence-transformers' (docs/fidelity.md)
        batchembed(*(["verify", JOB, "--sample", str(SAMPLE)] if SAMPLE else ["verify", OUTPUT]))

    embed.expand(shard=[f"{i}/{SHARDS}" for i in range(SHARDS)]) >> finalize() >> verify()
