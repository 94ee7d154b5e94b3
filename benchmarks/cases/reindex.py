"""What a reindex costs: a full run, the same corpus again, then 1 % of its rows edited (spread over
every file, so no file is copied whole), each a whole `batchembed run` with `--previous` the run
before, as cron runs it. The edited step is the one `--code REF` compares.
"""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from ..corpus import build
from ..harness import MODEL, Case, job_file


def edit(corpus, share: float) -> int:
    """Edit `share` of the rows of every file in place (same ids, new text)."""
    edited = 0
    for f in sorted(corpus.glob("*.parquet")):
        t = pq.read_table(f)
        texts = t.column("text").to_pylist()
        for i in range(0, len(texts), max(1, round(1 / share))):
            texts[i] = f"Edited: {texts[i]}"
            edited += 1
        t = t.set_column(t.schema.get_field_index("text"), "text", pa.array(texts, pa.string()))
        pq.write_table(t, f, row_group_size=1000)
    return edited


class Reindex(Case):
    name = "reindex"
    help = __doc__
    variants = {"full": "a full run", "unchanged": "the same corpus again, --previous the full run",
                "edited": "1 % of the rows edited, --previous the unchanged run"}
    ab_variants = ("edited",)
    columns = [("wall_s", "whole process s", ".1f"), ("embedded", "embedded", ",.0f"), ("reused", "reused", ",.0f"),
               ("tokens_run", "engine tokens", ",.0f"), ("tree_rss_mb", "peak RSS MB", ",.0f")]

    def add_args(self, ap):
        ap.add_argument("--rows", type=int, default=20000)
        ap.add_argument("--changed", type=float, default=0.01)
        ap.add_argument("--model", default=MODEL)

    def prepare(self, ctx):
        a = ctx.args
        for name in ("corpus", "corpus-edited"):
            build(ctx.workdir / name, rows=a.rows)
        return {"edited_rows": edit(ctx.workdir / "corpus-edited", a.changed)}

    def measure(self, variant, ctx):
        w = ctx.workdir
        corpus, out, previous = {"full": ("corpus", "v1", None), "unchanged": ("corpus", "v2", "v1"),
                                 "edited": ("corpus-edited", "v3", "v2")}[variant]
        if previous and not (w / previous / "_SUCCESS").exists():
            raise SystemExit(f"reindex: variant {variant} needs the one before it (run --variants full,unchanged,edited)")
        shutil.rmtree(w / out, ignore_errors=True)
        job = job_file(ctx, w / corpus, w / out, name=ctx.args.model, dtype="auto")
        m = ctx.batchembed("run", job, "--no-progress", "--set", "embedding.dimensions=[384,128]",
                           *(["--previous", str(w / previous)] if previous else []), log=f"{variant}-{ctx.code_label}")
        s = m.summary()
        return {"wall_s": round(m.wall_s, 2), "embedded": s["embedded"], "reused": s["reused"],
                "deduplicated": s["deduplicated"], "tokens_run": s["tokens_run"], "tree_rss_mb": m.tree_rss_mb}

    def derived(self, medians):
        if "full" in medians and "edited" in medians:
            return {"full / edited": round(medians["full"]["wall_s"] / medians["edited"]["wall_s"], 2)}
        return {}


CASE = Reindex()
