"""Lance output against Parquet, and what a Lance index costs, on this machine.

    .venv/bin/python scripts/lance_benchmark.py [--out out/lance-bench] [--index-rows 100000] [--repeat 3]

1. The output stage alone: the demo's vectors (5,000 rows, embedding_384 + embedding_128, ids,
   titles, text hashes; made by `make demo` first if missing) written part by part through each
   format's writer and publish, the code path every part of a run takes. Best of --repeat.
2. The whole `batchembed run` of jobs/quickstart.yaml, once per format (the engine included).
3. Index builds over --index-rows unit vectors of 384 dimensions, ivf_pq and ivf_hnsw_sq through
   batchembed's own build_index, with recall@10 against exact search for 100 queries (nprobes
   20; ivf_pq re-ranks 10x the candidates with the stored vectors, refine_factor 10). The
   vectors are the demo's 5,000 real MiniLM vectors, each with 20 noisy copies (cosine ~0.9 to
   it): build time does not depend on what vectors mean, recall does, and uniform random
   vectors in 384 dimensions have no neighbours worth the name.

Writes OUT/results.json and OUT/results.md.
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchembed.config import IndexSpec  # noqa: E402
from batchembed.output.layout import OutputFolder  # noqa: E402


def demo_vectors() -> pa.Table:
    out = ROOT / "out" / "quickstart-emb"
    if not (out / "_SUCCESS").exists():
        subprocess.run(["make", "demo"], cwd=ROOT, check=True)
    return pq.read_table(out)


def write_stage(table: pa.Table, fmt: str, where: Path, rows_per_part: int) -> float:
    """Seconds to write and publish `table` as parts of `rows_per_part` rows."""
    import shutil

    shutil.rmtree(where, ignore_errors=True)
    folder = OutputFolder.open(str(where), fmt=fmt)
    started = time.perf_counter()
    for i, start in enumerate(range(0, table.num_rows, rows_per_part)):
        w = folder.writer(table.schema, "zstd")
        chunk = table.slice(start, rows_per_part)
        for batch in chunk.to_batches(max_chunksize=1024):
            w.write(pa.Table.from_batches([batch]))
        w.close()
        folder.fmt.publish(folder, w, f"part-bench-rg{i:05d}{folder.fmt.suffix}")
        w.discard()
    return time.perf_counter() - started


def whole_run(fmt: str, out: Path) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(ROOT / ".venv" / "bin" / "batchembed"), "run", str(ROOT / "jobs" / "quickstart.yaml"), "--no-progress",
           "--set", f"output.uri={out}", "--set", f"output.format={fmt}"]
    started = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    summary = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    return {"format": fmt, "wall_s": round(wall, 2), "rows": summary["rows"],
            "rows_per_s_whole": round(summary["rows"] / wall, 1), "run_seconds": summary["seconds"],
            "engine_start_s": summary["engine_start_seconds"], "pipeline_s": summary["pipeline_seconds"]}


def clustered(centres: np.ndarray, rows: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    v = centres[np.arange(rows) % len(centres)]
    v = v + rng.standard_normal(v.shape).astype(np.float32) * (0.5 / np.sqrt(v.shape[1]))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def index_build(v: np.ndarray, where: Path, kind: str) -> dict:
    import shutil

    import lance

    rows = len(v)
    rng = np.random.default_rng(1)
    table = pa.table({"id": np.arange(rows, dtype=np.int64),
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), 384)})
    shutil.rmtree(where, ignore_errors=True)
    write_stage(table, "lance", where, 50_000)
    folder = OutputFolder.open(str(where), fmt="lance")
    info = folder.fmt.build_index(folder, IndexSpec(type=kind), "embedding", "id", changed=True)
    ds = lance.dataset(str(where))
    queries = rng.choice(rows, 100, replace=False)
    exact = np.argsort(-(v[queries] @ v.T), axis=1)[:, :10]
    hits = 0
    started = time.perf_counter()
    for q, truth in zip(queries, exact):
        near = {"column": "embedding", "q": v[q], "k": 10, "nprobes": 20,
                **({"refine_factor": 10} if kind == "ivf_pq" else {})}
        got = ds.to_table(nearest=near, columns=["id"]).column("id").to_numpy()
        hits += len(set(got) & set(truth))
    per_query = (time.perf_counter() - started) / len(queries)
    return {"type": kind, "rows": rows, "build_s": info["seconds"], "recall_at_10": hits / (10 * len(queries)),
            "query_ms": round(per_query * 1000, 2), "nprobes": 20, "num_partitions": info["num_partitions"],
            "num_sub_vectors": info["num_sub_vectors"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "out" / "lance-bench"))
    ap.add_argument("--index-rows", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows-per-part", type=int, default=1000)
    ap.add_argument("--skip-runs", action="store_true", help="no whole `batchembed run`s")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import lance

    table = demo_vectors()
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
                     "pylance": lance.__version__, "rows": table.num_rows, "write_stage": [], "runs": [],
                     "index": []}
    for fmt in ("parquet", "lance"):
        best = min(write_stage(table, fmt, out / f"stage-{fmt}", a.rows_per_part) for _ in range(a.repeat))
        results["write_stage"].append({"format": fmt, "seconds": round(best, 3),
                                       "rows_per_s": round(table.num_rows / best),
                                       "parts": -(-table.num_rows // a.rows_per_part)})
        print(results["write_stage"][-1], flush=True)
    if not a.skip_runs:
        for fmt in ("parquet", "lance"):
            results["runs"].append(whole_run(fmt, out / f"run-{fmt}"))
            print(results["runs"][-1], flush=True)
    from batchembed.embed.vectors import vector_matrix

    vectors = clustered(vector_matrix(table.column("embedding_384").combine_chunks()), a.index_rows)
    for kind in ("ivf_pq", "ivf_hnsw_sq"):
        results["index"].append(index_build(vectors, out / f"index-{kind}", kind))
        print(results["index"][-1], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    md = [f"machine: {results['machine']}; pylance {results['pylance']}", "",
          "| output stage, demo vectors | seconds | rows/s |", "|---|---|---|"]
    md += [f"| {w['format']} ({w['parts']} parts) | {w['seconds']} | {w['rows_per_s']:,} |"
           for w in results["write_stage"]]
    if results["runs"]:
        md += ["", "| whole `batchembed run` (make demo's job) | wall s | rows/s | engine start s |", "|---|---|---|---|"]
        md += [f"| {r['format']} | {r['wall_s']} | {r['rows_per_s_whole']:,} | {r['engine_start_s']} |"
               for r in results["runs"]]
    md += ["", f"| index, {a.index_rows:,} x 384 | build s | recall@10 | ms/query |", "|---|---|---|---|"]
    md += [f"| {i['type']} | {i['build_s']} | {i['recall_at_10']:.2f} | {i['query_ms']} |" for i in results["index"]]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
