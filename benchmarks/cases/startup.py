"""A small job's whole process, from start to exit, in the states a machine can be in.

Variants, each a `batchembed run` of a small docstring corpus (MiniLM) in a process of its own:
  warm         the machine as it is (vLLM's cache and Python's bytecode in place)
  fresh-vllm   vLLM's cache empty (VLLM_CACHE_ROOT at a new folder), as on a fresh machine
  no-bytecode  no Python bytecode found or written, as in an image installed without it
The log's "up: import X s, build Y s" line splits the start into vLLM's import and the engine's build.
"""

from __future__ import annotations

import re
import shutil
import tempfile

from ..corpus import build
from ..harness import MODEL, Case, job_file

UP = re.compile(r"up: import ([\d.]+) s, build ([\d.]+) s")


class Startup(Case):
    name = "startup"
    help = __doc__
    variants = {"warm": "the machine as it is", "fresh-vllm": "vLLM's cache empty",
                "no-bytecode": "no Python bytecode"}
    default_variants = "warm"
    ab_variants = tuple(variants)
    columns = [("whole_s", "whole process s", ".1f"), ("import_s", "vLLM import s", ".1f"),
               ("build_s", "engine build s", ".1f"), ("tree_rss_mb", "peak RSS MB", ",.0f")]

    def add_args(self, ap):
        ap.add_argument("--rows", type=int, default=300)
        ap.add_argument("--model", default=MODEL)
        ap.add_argument("--dtype", default="auto")
        ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")

    def prepare(self, ctx):
        build(ctx.workdir / "corpus", rows=ctx.args.rows)
        return {}

    def measure(self, variant, ctx):
        a = ctx.args
        out = ctx.workdir / "out"
        shutil.rmtree(out, ignore_errors=True)
        job = job_file(ctx, ctx.workdir / "corpus", out, name=a.model, dtype=a.dtype)
        scratch = tempfile.mkdtemp(prefix="bm-startup-")
        extra = {"fresh-vllm": {"VLLM_CACHE_ROOT": scratch},
                 "no-bytecode": {"PYTHONPYCACHEPREFIX": scratch, "PYTHONDONTWRITEBYTECODE": "1"}}.get(variant, {})
        log = f"{variant}-{ctx.code_label}"
        m = ctx.batchembed("run", job, "--no-progress", *[x for kv in a.sets for x in ("--set", kv)],
                           env=ctx.env(**extra), log=log)
        shutil.rmtree(scratch, ignore_errors=True)
        up = UP.search((ctx.workdir / f"{log}.log").read_text())
        s = m.summary()
        return {"whole_s": round(m.wall_s, 2), "import_s": float(up.group(1)) if up else None,
                "build_s": float(up.group(2)) if up else None, "tree_rss_mb": m.tree_rss_mb,
                "rows": s["rows"], "tokens": s["tokens"], "tok_s_whole": round(s["tokens"] / m.wall_s, 1)}


CASE = Startup()
