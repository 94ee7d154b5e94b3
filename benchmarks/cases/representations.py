"""Every representation from one pass: a BGE-M3 shape writing dense, sparse and multi-vector columns
in one run, against three runs of one representation each, whole processes on the same corpus.
The model is random-weight, made by benchmarks/models.py (`--tiny` for a two-layer one).
"""

from __future__ import annotations

import json
import shutil

from ..corpus import build
from ..harness import Case, job_file
from ..models import make

OUTPUTS = {"all": ["dense", "sparse", "multi_vector"], "dense": ["dense"], "sparse": ["sparse"],
           "multi_vector": ["multi_vector"]}


class Representations(Case):
    name = "representations"
    help = __doc__
    variants = {"all": "dense, sparse and multi-vector in one run", "dense": "dense only",
                "sparse": "sparse only", "multi_vector": "multi-vector only"}
    ab_variants = ("all",)
    columns = [("wall_s", "whole process s", ".1f"), ("tokens_run", "engine tokens", ",.0f"),
               ("steady_tok_s", "tok/s while running", ",.0f"), ("bytes_per_row", "output B/row", ",.0f"),
               ("tree_rss_mb", "peak RSS MB", ",.0f")]

    def add_args(self, ap):
        ap.add_argument("--rows", type=int, default=60)
        ap.add_argument("--max-length", type=int, default=128)
        ap.add_argument("--tiny", action="store_true", help="a two-layer BGE-M3 (trying the case out)")

    def prepare(self, ctx):
        model = make(ctx.workdir / "models", "bge-m3", tiny=ctx.args.tiny)
        build(ctx.workdir / "corpus", rows=ctx.args.rows)
        return {"model": str(model), "model_shape": "bge-m3-tiny" if ctx.args.tiny else "bge-m3 (XLM-R large)"}

    def measure(self, variant, ctx):
        w = ctx.workdir
        out = w / f"out-{variant}"
        shutil.rmtree(out, ignore_errors=True)
        model = make(w / "models", "bge-m3", tiny=ctx.args.tiny)
        job = job_file(ctx, w / "corpus", out, file=f"job-{variant}", name=str(model), dtype="auto",
                       max_length=ctx.args.max_length)
        m = ctx.batchembed("run", job, "--no-progress", "--set", f"embedding.outputs={json.dumps(OUTPUTS[variant])}",
                           log=f"{variant}-{ctx.code_label}")
        s = m.summary()
        size = sum(f.stat().st_size for f in out.glob("part-*.parquet"))
        return {"wall_s": round(m.wall_s, 2), "tokens_run": s["tokens_run"], "rows": s["rows"],
                "steady_tok_s": s.get("steady_tokens_per_s"),
                "bytes_per_row": round(size / max(s["rows"], 1)), "tree_rss_mb": m.tree_rss_mb}

    def derived(self, medians):
        if all(v in medians for v in OUTPUTS):
            three = sum(medians[v]["wall_s"] for v in ("dense", "sparse", "multi_vector"))
            return {"three runs / one run": round(three / medians["all"]["wall_s"], 2)}
        return {}


CASE = Representations()
