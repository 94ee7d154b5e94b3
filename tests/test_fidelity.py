"""The fidelity guard: the engine's vectors against sentence-transformers' before any part."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from helpers import job_dict, make_job, write_parquet

from batchembed.embed.engine import Engine
from batchembed.errors import RunError
from batchembed.fidelity import Reference, cosines
from batchembed.job import prepare
from batchembed.run import run_job

TEXTS = [f"row {i} is about {'cats' if i % 2 else 'the stock market'} and more" for i in range(20)]


def test_cosine_is_a_cosine_whatever_the_norms():
    """bf16 vectors come back with norms a little off 1: the check must not read that as agreement."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 8))
    b = a + 0.1 * rng.normal(size=(4, 8))
    scaled = cosines(a * 1.003, b * 1.002)
    assert np.allclose(scaled, cosines(a, b)) and (scaled <= 1).all()
    assert np.allclose(cosines(a, a * 5), 1) and np.allclose(cosines(a, -a), -1)
    assert cosines(np.zeros((1, 3)), np.ones((1, 3)))[0] == 0  # a zero vector: no NaN


def test_agreeing_engine_passes_and_is_recorded(tmp_path, engine):
    write_parquet(tmp_path / "in.parquet", {"id": list(range(20)), "text": TEXTS})
    run_job(make_job(tmp_path / "in.parquet", tmp_path / "out"), engine=engine, show_progress=False)
    f = json.loads((tmp_path / "out" / "_manifest.json").read_text())["fidelity"]
    assert f["status"] == "passed" and f["rows"] == 16 and f["min_cosine"] > 0.999


def _model_with_a_default_prompt(tmp_path, model_info):
    """A sentence-transformers default prompt that vLLM does not apply: every vector would differ."""
    model = tmp_path / "model"
    model.mkdir()
    for f in model_info.path.iterdir():
        if f.name != "config_sentence_transformers.json":
            (model / f.name).symlink_to(f)
    cfg = json.loads((model_info.path / "config_sentence_transformers.json").read_text())
    cfg.update(prompts={"query": "query: "}, default_prompt_name="query")
    (model / "config_sentence_transformers.json").write_text(json.dumps(cfg))
    return model


@pytest.mark.slow  # builds engines of its own
def test_a_model_the_engine_reads_differently_is_refused(tmp_path, model_info):
    """An engine handed to the run: checked in this process."""
    model = _model_with_a_default_prompt(tmp_path, model_info)
    write_parquet(tmp_path / "in.parquet", {"id": list(range(20)), "text": TEXTS})
    spec = make_job(tmp_path / "in.parquet", tmp_path / "out", model={"name": str(model)})
    p = prepare(spec)
    engine = Engine(p.model, p.spec.model.dtype, p.max_length, p.spec.engine)  # unchecked: the run checks it
    try:
        with pytest.raises(RunError, match=r"fidelity check failed .* cosine .* is 0\.[0-8][0-9]* at worst"):
            run_job(spec, engine=engine, show_progress=False)
        assert not list((tmp_path / "out").glob("part-*")) and not (tmp_path / "out" / "_fidelity.json").exists()
        off = make_job(tmp_path / "in.parquet", tmp_path / "out", model={"name": str(model)}, fidelity_check="off")
        run_job(off, engine=engine, show_progress=False)
        assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["fidelity"] == {"status": "off"}
    finally:
        engine.close()


@pytest.mark.slow  # builds engines of its own
def test_an_engine_the_run_starts_is_checked_against_a_reference_made_meanwhile(tmp_path, model_info):
    """The CLI starts its engine; sentence-transformers' side is computed in a process of its own
    while the engine starts (fidelity.Reference), and a disagreement still refuses the run."""
    model = _model_with_a_default_prompt(tmp_path, model_info)
    write_parquet(tmp_path / "in.parquet", {"id": list(range(20)), "text": TEXTS})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tmp_path / "in.parquet", tmp_path / "out", model={"name": str(model)})))
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "batchembed"), "run", str(job),
                        "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 1 and re.search(r"fidelity check failed .* cosine .* is 0\.[0-8][0-9]* at worst", r.stderr)
    assert "Traceback" not in r.stderr
    assert not list((tmp_path / "out").glob("part-*")) and not (tmp_path / "out" / "_fidelity.json").exists()


def test_the_reference_process_gives_sentence_transformers_vectors_or_says_why_not(tmp_path, model_info,
                                                                                   st_model):
    texts = TEXTS[:3]
    ok = Reference(str(model_info.path), model_info.max_length, "", texts)
    try:
        got, vectors = ok.result()
        # its work done, the process gives its memory back: a bare interpreter takes its place,
        # which only waits for the run (procguard._serve)
        deadline = time.monotonic() + 20
        while b"exit_with(" not in open(f"/proc/{ok.process.pid}/cmdline", "rb").read():
            assert time.monotonic() < deadline and ok.process.poll() is None
            time.sleep(0.1)
        with open(f"/proc/{ok.process.pid}/status") as status:
            rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        assert rss_kb < 100_000
    finally:
        ok.close()
    want = st_model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    assert got == texts and np.allclose(vectors, want, atol=1e-5)
    assert not os.path.exists(ok.folder) and ok.process.poll() is not None

    waiting = Reference(str(model_info.path), 128, "", texts)
    try:  # a run stopped by a signal does not wait for it (interrupts.requested by default)
        with pytest.raises(RunError, match="stopped while waiting"):
            waiting.result(stop=lambda: True)
    finally:
        waiting.close()
    assert not os.path.exists(waiting.folder) and waiting.process.poll() is not None

    missing = Reference(str(tmp_path / "no-model"), 128, "", texts)
    try:
        with pytest.raises(RunError, match="could not embed the sample: .*no-model"):
            missing.result()
    finally:
        missing.close()

    killed = Reference(str(model_info.path), 128, "", texts)
    try:
        killed.process.kill()  # as the OOM killer would
        killed.process.wait()
        killed.watch()  # the run's process, while engine processes wait on the folder
        with pytest.raises(RunError, match="its process ended with exit code -9"):
            killed.file().result()
    finally:
        killed.close()


@pytest.mark.slow  # builds engines of its own
def test_a_script_without_a_main_guard_can_run_a_job(tmp_path):
    """The reference's process is a new interpreter, not multiprocessing's spawn, which would run
    the script's top level again (and fail the check) where it has no `if __name__ == "__main__"`."""
    write_parquet(tmp_path / "in.parquet", {"id": list(range(20)), "text": TEXTS})
    script = tmp_path / "nightly.py"
    script.write_text(
        "from batchembed.config import JobSpec\n"
        "from batchembed.run import run_job\n"
        f"spec = JobSpec.model_validate({job_dict(tmp_path / 'in.parquet', tmp_path / 'out')!r})\n"
        "print('rows', run_job(spec, show_progress=False).rows)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "rows 20" in r.stdout, r.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "_fidelity.json").read_text())["status"] == "passed"
