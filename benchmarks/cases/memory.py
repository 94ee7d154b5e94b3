"""Memory as the corpus grows: whole `batchembed run`s as a new user runs them (a job with no engine
settings and two Matryoshka dimensions) on a corpus with long and hostile rows (corpus.py
--hostile), at --rows N, 10 N and 100 N rows (variants x1, x10, x100), each from a fresh process.

Each run records the peak RSS of its process tree, and its largest RSS over the first and the second
half of the run: memory follows the pipeline's windows up to their bound (docs: Memory), so a run
long enough to reach it holds it through its second half. `glibc-x1` and `glibc-x10` run without
TCMalloc (where batchembed would restart itself with it: on a CPU), to see what the allocator does.
"""

from __future__ import annotations

import shutil

from ..corpus import build
from ..harness import MODEL, Case, job_file
from ..models import make

SCALES = {"x1": 1, "x10": 10, "x100": 100}


class Memory(Case):
    name = "memory"
    help = __doc__
    variants = {**{k: f"{k[1:]} x --rows" for k in SCALES},
                **{f"glibc-{k}": f"{k[1:]} x --rows, glibc's malloc" for k in ("x1", "x10")}}
    default_variants = "x1,x10,x100"
    columns = [("rows", "rows", ",d"), ("wall_s", "whole s", ".1f"), ("tokens", "engine tokens", ",d"),
               ("tree_rss_mb", "peak RSS MB", ",d"), ("first_half_rss_mb", "first half MB", ",d"),
               ("second_half_rss_mb", "second half MB", ",d")]

    def add_args(self, ap):
        ap.add_argument("--rows", type=int, default=4000, help="N: the x1 corpus (default 4,000)")
        ap.add_argument("--model", default=MODEL)
        ap.add_argument("--max-length", type=int, default=256)
        ap.add_argument("--dimensions", default="256,128")
        ap.add_argument("--tiny", action="store_true", help="a two-layer random-weight MiniLM shape instead of "
                        "--model (the pipeline's memory, sooner, on a CPU)")

    def measure(self, variant, ctx):
        a, w = ctx.args, ctx.workdir
        rows = a.rows * SCALES[variant.rpartition("-")[2]]
        corpus = w / f"corpus-{rows}"
        if not corpus.exists():
            build(corpus, rows=rows, files=8, hostile=True, row_group_rows=5000)
        model = str(make(w / "models", "minilm", tiny=True)) if a.tiny else a.model
        out = w / "out"
        shutil.rmtree(out, ignore_errors=True)
        job = job_file(ctx, corpus, out, name=model, max_length=a.max_length)
        env = ctx.env(_BATCHEMBED_ALLOCATOR="1") if variant.startswith("glibc") else None
        m = ctx.batchembed("run", job, "--no-progress", "--set", f"embedding.dimensions=[{a.dimensions}]",
                           env=env, log=f"{variant}-{ctx.code_label}")
        s = m.summary()
        first, second = m.rss_halves_mb()
        shutil.rmtree(out, ignore_errors=True)
        return {"rows": s["rows"], "wall_s": round(m.wall_s, 2), "tokens": s["tokens"], "engines": s["engines"],
                "tree_rss_mb": m.tree_rss_mb, "first_half_rss_mb": first, "second_half_rss_mb": second}

    def derived(self, medians):
        out = {}
        for a, b in (("x1", "x10"), ("x10", "x100"), ("glibc-x1", "glibc-x10")):
            if a in medians and b in medians:
                out[f"peak RSS {b} / {a}"] = round(medians[b]["tree_rss_mb"] / medians[a]["tree_rss_mb"], 3)
        return out


CASE = Memory()
