"""Lance output against Parquet, and what a Lance index costs.

Variants:
  stage-parquet, stage-lance  the output stage alone: 5,000 demo rows (ids, titles, text hashes, two
                              vector columns) written and published part by part through each format
  run-parquet, run-lance      the whole `batchembed run` of the demo job, once per format
  index-ivf_pq, index-ivf_hnsw_sq  an index over --index-rows vectors of 384 dimensions (the demo's
                              real MiniLM vectors, each with noisy copies: recall needs neighbours),
                              recall@10 against exact search over 100 queries (nprobes 20; ivf_pq
                              re-ranks 10x the candidates)
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..corpus import build
from ..harness import MODEL, Case, job_file


class Lance(Case):
    name = "lance"
    help = __doc__
    variants = {"stage-parquet": "output stage, Parquet (zstd)", "stage-lance": "output stage, Lance",
                "run-parquet": "whole run, Parquet", "run-lance": "whole run, Lance",
                "index-ivf_pq": "ivf_pq build and search", "index-ivf_hnsw_sq": "ivf_hnsw_sq build and search"}
    columns = [("seconds", "seconds", ".2f"), ("rows_per_s", "rows/s", ",.0f"), ("recall_at_10", "recall@10", ".2f"),
               ("query_ms", "ms a query", ".1f")]

    def add_args(self, ap):
        ap.add_argument("--rows", type=int, default=5000)
        ap.add_argument("--rows-per-part", type=int, default=1000)
        ap.add_argument("--index-rows", type=int, default=100_000)

    def job(self, ctx, out):
        return job_file(ctx, ctx.workdir / "corpus", out, name=MODEL, dtype="auto")

    def prepare(self, ctx):
        a = ctx.args
        build(ctx.workdir / "corpus", rows=a.rows)
        vectors = ctx.workdir / "vectors"
        if not (vectors / "_SUCCESS").exists():
            ctx.batchembed("run", self.job(ctx, vectors), "--no-progress", "--set", "embedding.dimensions=[384,128]",
                           "--set", f"output.rows_per_part={a.rows_per_part}", log="vectors")
        return {}

    def measure(self, variant, ctx):
        a, w = ctx.args, ctx.workdir
        table = pq.read_table(w / "vectors")
        kind, fmt = variant.split("-", 1)
        if kind == "stage":
            t = write_stage(table, fmt, w / f"stage-{fmt}", a.rows_per_part)
            return {"seconds": round(t, 3), "rows_per_s": round(table.num_rows / t)}
        if kind == "run":
            out = w / f"run-{fmt}"
            shutil.rmtree(out, ignore_errors=True)
            m = ctx.batchembed("run", self.job(ctx, out), "--no-progress", "--set", "embedding.dimensions=[384,128]",
                               "--set", f"output.rows_per_part={a.rows_per_part}", "--set", f"output.format={fmt}",
                               log=f"run-{fmt}")
            return {"seconds": round(m.wall_s, 2), "rows_per_s": round(m.summary()["rows"] / m.wall_s, 1)}
        from batchembed.embed.vectors import vector_matrix

        v = clustered(vector_matrix(table.column("embedding_384").combine_chunks()), a.index_rows)
        return index_build(v, w / f"index-{fmt}", fmt)


def write_stage(table: pa.Table, fmt: str, where, rows_per_part: int) -> float:
    """Seconds to write and publish `table` as parts of `rows_per_part` rows, as a run's writer does."""
    from batchembed.output.layout import OutputFolder

    shutil.rmtree(where, ignore_errors=True)
    folder = OutputFolder.open(str(where), fmt=fmt)
    started = time.perf_counter()
    for i, start in enumerate(range(0, table.num_rows, rows_per_part)):
        w = folder.writer(table.schema, "zstd")
        for batch in table.slice(start, rows_per_part).to_batches(max_chunksize=1024):
            w.write(pa.Table.from_batches([batch]))
        w.close()
        folder.fmt.publish(folder, w, f"part-bench-rg{i:05d}{folder.fmt.suffix}")
        w.discard()
    return time.perf_counter() - started


def clustered(centres: np.ndarray, rows: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    v = centres[np.arange(rows) % len(centres)]
    v = v + rng.standard_normal(v.shape).astype(np.float32) * (0.5 / np.sqrt(v.shape[1]))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def index_build(v: np.ndarray, where, kind: str) -> dict:
    import lance

    from batchembed.config import IndexSpec
    from batchembed.output.layout import OutputFolder

    rows = len(v)
    table = pa.table({"id": np.arange(rows, dtype=np.int64),
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), v.shape[1])})
    write_stage(table, "lance", where, 50_000)
    folder = OutputFolder.open(str(where), fmt="lance")
    info = folder.fmt.build_index(folder, IndexSpec(type=kind), "embedding", "id", changed=True)
    ds = lance.dataset(str(where))
    queries = np.random.default_rng(1).choice(rows, 100, replace=False)
    exact = np.argsort(-(v[queries] @ v.T), axis=1)[:, :10]
    hits, started = 0, time.perf_counter()
    for q, truth in zip(queries, exact):
        near = {"column": "embedding", "q": v[q], "k": 10, "nprobes": 20,
                **({"refine_factor": 10} if kind == "ivf_pq" else {})}
        hits += len(set(ds.to_table(nearest=near, columns=["id"]).column("id").to_numpy()) & set(truth))
    return {"seconds": info["seconds"], "recall_at_10": hits / (10 * len(queries)),
            "query_ms": round((time.perf_counter() - started) / len(queries) * 1000, 2),
            "num_partitions": info["num_partitions"], "num_sub_vectors": info["num_sub_vectors"]}


CASE = Lance()
