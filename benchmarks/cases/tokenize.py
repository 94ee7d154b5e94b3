"""The host's cost a row before the GPU: microseconds a row on one thread, long texts tokenised whole
against tokenised only up to a cut before the limit (and that both give the same ids), and the
token ids handed to vLLM (`Engine.submit`: vLLM's add_request for each row, with its engine core in a
process of its own as on a GPU host; the rows are taken back unembedded), each request a copy of the
first one vLLM made (embed/requests.py) or, `submit-processed`, made by vLLM's input processing
(the submitting thread's CPU time a row).
Docstrings joined to --min-chars, at each --lengths max_length.
"""

from __future__ import annotations

import os
import time

from ..corpus import build
from ..harness import Case
from .throughput import MODEL


class Tokenize(Case):
    name = "tokenize"
    help = __doc__
    variants = {"whole": "every text tokenised whole, then truncated", "cut": "tokenised up to a cut (the default)",
                "submit": "token ids handed to vLLM, a row at a time (Engine.submit)",
                "submit-processed": "the same, each request made by vLLM's input processing"}
    columns = [(f"us_per_row_{n}", f"µs a row @ {n}", ".1f") for n in (80, 256, 512)]

    def add_args(self, ap):
        ap.add_argument("--rows", type=int, default=20000)
        ap.add_argument("--min-chars", type=int, default=500)
        ap.add_argument("--lengths", default="80,256,512")
        ap.add_argument("--model", default=MODEL)
        ap.add_argument("--window", type=int, default=8192, help="rows tokenised a call (engine.sort_window_rows)")
        ap.add_argument("--submit-rows", type=int, default=5000, help="rows handed to vLLM at each length")

    def prepare(self, ctx):
        a = ctx.args
        build(ctx.workdir / "corpus", rows=a.rows, files=1, min_chars=a.min_chars)
        self.columns = [(f"us_per_row_{n}", f"µs a row @ {n}", ".1f") for n in a.lengths.split(",")]
        return {}

    def measure(self, variant, ctx):
        if variant.startswith("submit"):  # an engine of its own, in a fresh process
            return {k: v for k, v in self.in_child(variant, ctx).items() if k.startswith("us_per_row")}
        os.environ["RAYON_NUM_THREADS"] = "1"  # the work itself, not a pool's
        import pyarrow.parquet as pq

        from batchembed.embed.tokenizer import Tokenizer
        from batchembed.model import resolve_model_dir

        a = ctx.args
        texts = pq.read_table(ctx.workdir / "corpus").column("text").to_pylist()
        path = resolve_model_dir(a.model)
        r = {}
        for n in (int(x) for x in a.lengths.split(",")):
            tok, whole = Tokenizer(path, n), Tokenizer(path, n)
            whole.cutting = False
            if variant == "whole":
                tok = whole
            else:
                r[f"same_ids_{n}"] = tok(texts).ids == whole(texts).ids
            t0 = time.perf_counter()
            for i in range(0, len(texts), a.window):
                tok(texts[i:i + a.window])
            r[f"us_per_row_{n}"] = round((time.perf_counter() - t0) / len(texts) * 1e6, 1)
        return r

    def child(self, variant, ctx):
        import dataclasses

        import pyarrow.parquet as pq

        from batchembed.config import EngineSpec
        from batchembed.embed.engine import Engine
        from batchembed.embed.tokenizer import Tokenizer
        from batchembed.model import read_model_info

        a = ctx.args
        model = read_model_info(a.model)
        texts = pq.read_table(ctx.workdir / "corpus").column("text").to_pylist()[:a.submit_rows]
        r = {}
        for n in (int(x) for x in a.lengths.split(",")):
            if n > model.max_length:  # beyond the model's positions: no engine takes it
                r[f"us_per_row_{n}"] = None
                continue
            ids = Tokenizer(model.path, n)(texts).ids
            engine = Engine(dataclasses.replace(model, max_length=n), "float32", n, EngineSpec(in_process=False))
            try:
                warm = engine.submit(ids[:64])
                while not warm.done:
                    engine.step()
                if variant == "submit-processed":
                    engine.requests.template = None
                # the submitting thread's CPU time: the engine core computes the first rows meanwhile, on
                # the same cores where the host has few, and its time is not the front end's
                t0 = time.thread_time()
                engine.submit(ids)
                r[f"us_per_row_{n}"] = round((time.thread_time() - t0) / len(ids) * 1e6, 1)
                engine.abort()
            finally:
                engine.close()
        return r


CASE = Tokenize()
