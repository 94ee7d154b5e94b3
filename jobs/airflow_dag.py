"""Example Airflow DAG: one batchembed job spread over N shards, nightly.

Each mapped task runs `batchembed run JOB --shard i/N`. Retries are safe: a
rerun skips every part already committed (resume is the default), so a retried
or duplicated task never loses or doubles a row. The last shard to finish
writes manifest.json and _SUCCESS; the `finalize` task makes sure of it and
fails while any part is missing.

Exit codes a scheduler needs: 0 done; 1 the run failed (retry it); 2 the job or
command line is invalid (nothing was started: retrying will not help, fix the job).

Not tested here (no Airflow in the test environment); the commands it runs are.
"""

from datetime import datetime, timedelta

from airflow import DAG
from airflow.operators.bash import BashOperator

JOB = "/opt/jobs/wiki.yaml"  # a job file like jobs/s3-example.yaml
SHARDS = 16
BATCHEMBED = "/opt/batchembed/.venv/bin/batchembed"

with DAG(
    dag_id="batchembed_wiki",
    start_date=datetime(2026, 1, 1),
    schedule="0 2 * * *",
    catchup=False,
    default_args={"retries": 3, "retry_delay": timedelta(minutes=2), "retry_exponential_backoff": True},
    max_active_tasks=SHARDS,  # one per GPU worker
) as dag:
    shards = BashOperator.partial(
        task_id="embed",
        # one engine per task: give each its own GPU through the worker's CUDA_VISIBLE_DEVICES
        append_env=True,
    ).expand(bash_command=[f"{BATCHEMBED} run {JOB} --shard {i}/{SHARDS} --no-progress" for i in range(SHARDS)])

    finalize = BashOperator(task_id="finalize", bash_command=f"{BATCHEMBED} finalize {JOB}")
    verify = BashOperator(task_id="verify",
                          bash_command=f"{BATCHEMBED} verify s3://corpus/wiki-emb/ --storage-option "
                                       "endpoint_url=$S3_ENDPOINT", append_env=True)

    shards >> finalize >> verify
