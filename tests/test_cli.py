"""The command as a user runs it: a real process, the real exit code."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from helpers import job_dict, left_in, read_output, write_parquet

from batchembed.embed.host import cpu_dtype, cpu_flags

pytestmark = pytest.mark.slow  # whole batchembed processes (make test, not make test-fast)

BIN = os.path.join(os.path.dirname(sys.executable), "batchembed")


def test_run_exits_0_with_summary_and_json(tmp_path):
    from helpers import group_alive

    write_parquet(tmp_path / "in.parquet", {"id": [1, 2, 3], "text": ["a", "b", None]})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tmp_path / "in.parquet", tmp_path / "out")))
    # output to files, not pipes: vLLM's engine child can hold a pipe open after exit
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        # vLLM's cache as a fresh machine has it: empty
        env = os.environ | {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
        proc = subprocess.Popen([BIN, "--log-level", "debug", "run", str(job), "--set", "embedding.dimensions=[64]",
                                 "--set", "model.dtype=auto"],
                                stdout=out, stderr=err, start_new_session=True, env=env)
        rc = proc.wait(timeout=300)
    stderr = (tmp_path / "stderr").read_text()
    assert rc == 0, stderr[-3000:]
    # the engine (in this process on CPU) is not torn down before the exit, and nothing outlives the run
    assert "engine left to the process's exit" in stderr
    assert group_alive(proc.pid) == [], "a process of the run outlived it"
    summary = json.loads((tmp_path / "stdout").read_text())  # stdout: the summary alone, vLLM's log on stderr
    assert summary["rows"] == 3 and summary["nulls"] == 1 and summary["tokens"] > 0
    assert "3 rows (2 embedded, 0 duplicates, 1 null" in stderr
    assert read_output(tmp_path / "out").schema.field("embedding").type.list_size == 64
    assert (tmp_path / "out" / "_SUCCESS").exists()
    # vLLM inspected the model's class in this process, not in a new interpreter importing vLLM
    # again (that one leaves its result in the cache's modelinfos folder)
    assert not (tmp_path / "vllm-cache" / "modelinfos").exists()
    assert stderr.count("vLLM inspected the model class vllm.model_executor.models.bert.BertEmbeddingModel in "
                        "this process") == 1
    # model.dtype auto: the narrowest float this CPU computes natively, not vLLM's float16 for every x86 CPU
    native = cpu_dtype("auto", cpu_flags())
    assert native == "auto" or (f"model.dtype auto on this CPU: {native}" in stderr
                                and f"'dtype': '{native}'" in stderr), stderr[-3000:]


def test_validate_and_plan_load_no_engine(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", {"id": [1, 2], "text": ["a", "b"]})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tmp_path / "in", tmp_path / "out")))
    r = subprocess.run([BIN, "validate", str(job)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "1 files, 2 rows" in r.stdout, r.stderr
    r = subprocess.run([BIN, "plan", str(job), "--json"], capture_output=True, text=True, timeout=120)
    plan = json.loads(r.stdout)
    assert plan["rows"] == 2 and plan["parts_done"] == 0 and plan["rows_pending"] == 2
    r = subprocess.run([BIN, "validate", str(job), "--set", "model.dtype=float8"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "model.dtype" in r.stderr
    # an earlier output that is a file (it was a traceback)
    r = subprocess.run([BIN, "validate", str(job), "--set", f"incremental.previous={job}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and f"incremental.previous: {job} is a file, not an output folder" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_version_and_help():
    r = subprocess.run([BIN, "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "batchembed" in r.stdout
    r = subprocess.run([BIN, "run", "-h"], capture_output=True, text=True)
    assert r.returncode == 0 and "batchembed run jobs/quickstart.yaml" in r.stdout


def test_two_engine_processes_give_the_same_output(tmp_path, run_temp):
    """engine.data_parallel=2 on CPU: two engine processes started together, one core each, one
    task queue; with --log-json their lines are JSON too, tagged with the engine."""
    import numpy as np
    from helpers import group_alive

    texts = [f"row {i} " + "data parallel engines " * (i % 7 + 1) for i in range(120)]
    for k in range(4):
        write_parquet(tmp_path / "in" / f"f{k}.parquet", {"id": list(range(k * 30, k * 30 + 30)),
                                                          "text": texts[k * 30:(k + 1) * 30]})
    job = tmp_path / "job.yaml"
    # windows of 10 rows, so parts of 30 are worth splitting: the few-parts warning is due
    engine = {"data_parallel": 2, "sort_window_rows": 10}
    job.write_text(yaml.safe_dump(job_dict(tmp_path / "in", tmp_path / "out", engine=engine,
                                           embedding={"dimensions": [384, 64]})))
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        env = os.environ | {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),  # empty, as on a fresh machine
                            "TMPDIR": run_temp}
        proc = subprocess.Popen([BIN, "--log-json", "--log-level", "debug", "run", str(job)], stdout=out,
                                stderr=err, env=env, start_new_session=True)
        rc = proc.wait(timeout=400)
    assert rc == 0, (tmp_path / "stderr").read_text()[-3000:]
    # the engine processes and their forkserver end with the run (the forkserver ended 2 s after it)
    assert group_alive(proc.pid) == [], "a process of the run outlived it"
    # and leave nothing in the temp folder: not multiprocessing's pymp-* folder (the forkserver's
    # socket), which the run's quick exit used to skip, nor vLLM's sockets or store files
    assert left_in(run_temp) == []
    summary = json.loads((tmp_path / "stdout").read_text())  # the summary alone, engine processes' vLLM too
    assert summary["engines"] == 2 and summary["tasks_run"] == 4
    lines = [json.loads(line) for line in (tmp_path / "stderr").read_text().splitlines() if line.startswith("{")]
    starts = {e["engine"]: e["message"] for e in lines if e["message"].startswith("starting vLLM engine")}
    assert set(starts) == {0, 1}, lines
    # no bar of vLLM's over the weight files: the run reports its own progress
    assert "checkpoint shards" not in (tmp_path / "stderr").read_text()
    assert any(e["level"] == "WARNING" and e["message"].startswith("4 parts for 2 engines") for e in lines)
    # the job's warnings once, though each engine process prepares the job again
    assert sum("does not declare Matryoshka" in e["message"] for e in lines) == 1, lines
    assert "engine 1/2 {'VLLM_CPU_OMP_THREADS_BIND'" in starts[0] and "engine 2/2" in starts[1]
    # the forkserver inspected the model's class before forking them: no engine process did
    assert not (tmp_path / "vllm-cache" / "modelinfos").exists()
    assert not [e for e in lines if "inspected the model class" in e["message"]]
    # and froze the heap of its imports, which the engines' builds then skip as they collect
    frozen = [int(e["message"].split(": ")[1].split()[0]) for e in lines
              if e["message"].startswith("the heap before the build")]
    assert len(frozen) == 2 and min(frozen) > 100_000, frozen
    out = read_output(tmp_path / "out")
    assert out.column("id").to_pylist() == list(range(120))
    from sentence_transformers import SentenceTransformer

    from batchembed.model import read_model_info

    st = SentenceTransformer(str(read_model_info(job_dict("", "")["model"]["name"]).path), device="cpu")
    ref = st.encode(texts, normalize_embeddings=True)
    got = np.stack(out.column("embedding_384").to_numpy(zero_copy_only=False))
    assert float((got * ref).sum(axis=1).min()) > 0.9999


def test_other_libraries_log_at_warning_unless_debug_is_asked_for():
    import logging

    from batchembed.logs import setup_logging

    def shown(name: str, level: int) -> bool:
        record = logging.LogRecord(name, level, __file__, 1, "m", None, None)
        return logging.getLogger(name).isEnabledFor(level) and all(
            h.filter(record) for h in logging.getLogger().handlers)

    try:
        setup_logging("INFO")
        logging.getLogger("ray").setLevel(logging.INFO)  # as Ray does to its own logger
        assert shown("batchembed.run", logging.INFO)
        for name in ("azure.core.pipeline.policies.http_logging_policy", "aiobotocore.credentials", "ray"):
            assert not shown(name, logging.INFO) and shown(name, logging.WARNING), name
        setup_logging("DEBUG")
        assert shown("azure.core", logging.DEBUG) and shown("ray", logging.INFO)
        assert shown("batchembed.run", logging.DEBUG)
    finally:
        setup_logging("WARNING")


def test_a_run_that_ends_before_its_engines_leaves_no_forkserver_behind(tmp_path, run_temp):
    """engine.data_parallel starts the forkserver (vLLM's import for the engine processes) before
    the job is planned; a job refused while planning must not leave it importing after the exit."""
    from helpers import group_alive

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tmp_path / "missing" / "*.parquet", tmp_path / "out",
                                           engine={"data_parallel": 2})))
    proc = subprocess.Popen([BIN, "run", str(job), "--no-progress"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "run.log", "w"), env=os.environ | {"TMPDIR": run_temp},
                            start_new_session=True)
    assert proc.wait(timeout=120) == 2
    assert "no Parquet files" in (tmp_path / "run.log").read_text()
    assert group_alive(proc.pid) == [], "a process of the run outlived it"
    assert left_in(run_temp) == []  # nothing left in its temp folder either
