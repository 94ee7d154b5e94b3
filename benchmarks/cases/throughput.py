"""batchembed against what a user would otherwise run, on one corpus (Python docstrings), one model.

Variants, each in a fresh process:
  a  the engine alone: LLM.encode on token ids already in memory (the ceiling while running)
  b  a plain user script: read Parquet, LLM.embed the strings, write Parquet
  c  sentence-transformers encode, the best batch size of a short sweep, Parquet in and out
  d  `batchembed run`, Parquet to Parquet
"steady" leaves out start-up (imports, the engine's build); "whole" is the process from start to exit.
The tree's peak RSS counts every process of the variant. Memory flat as the corpus grows: run d at
--rows N and at 10 N and compare tree_rss_mb.
"""

from __future__ import annotations

import dataclasses
import os
import time

from ..corpus import build
from ..harness import MODEL, Case, job_file


def model_info(args):
    from batchembed.model import read_model_info

    m = read_model_info(args.model)
    return dataclasses.replace(m, max_length=args.max_length) if args.max_length else m


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def make_llm(path, dtype: str, max_len: int):
    """A plain vLLM engine with the settings batchembed gives its own (so the comparison is of
    everything around the engine): no reserved CPU core, no prefix caching, no chunked prefill."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM

    cpu = on_cpu()
    if cpu:
        from batchembed.embed.host import cpu_engine_env

        cpu_engine_env()
    return LLM(model=str(path), runner="pooling", dtype=dtype, max_model_len=max_len, enforce_eager=cpu,
               gpu_memory_utilization=0.1 if cpu else 0.9, seed=0, enable_prefix_caching=False,
               enable_chunked_prefill=False)


def texts_and_ids(corpus):
    import pyarrow.parquet as pq

    table = pq.read_table(corpus, columns=["id", "text"])
    return table, table.column("text").to_pylist()


def write_vectors(table, vectors, path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors = np.asarray(vectors, dtype=np.float32)
    arr = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])
    pq.write_table(pa.table({"id": table.column("id"), "embedding": arr}), path)


class Throughput(Case):
    name = "throughput"
    help = __doc__
    variants = {"a": "engine only, token ids in memory", "b": "plain script: read, LLM.embed, write",
                "c": "sentence-transformers encode", "d": "batchembed run"}
    ab_variants = ("d",)
    columns = [("tok_s_steady", "tok/s steady", ",.0f"), ("tok_s_whole", "tok/s whole process", ",.0f"),
               ("rows_s_whole", "rows/s whole", ",.0f"), ("tree_rss_mb", "peak RSS MB, all processes", ",.0f"),
               ("engine_idle_share", "engine idle", ".1%")]

    def add_args(self, ap):
        ap.add_argument("--rows", type=int, default=30000)
        ap.add_argument("--dtype", default="bfloat16")
        ap.add_argument("--model", default=MODEL, help="a local folder or package:<name>")
        ap.add_argument("--max-length", type=int, help="tokens; default: the model's limit")
        ap.add_argument("--min-chars", type=int, default=0, help="join docstrings into texts of at least this")
        ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to variant d as --set, e.g. engine.data_parallel=2")

    def corpus(self, ctx):
        return ctx.workdir / "corpus"

    def prepare(self, ctx):
        a = ctx.args
        build(self.corpus(ctx), rows=a.rows, files=8, min_chars=a.min_chars)
        return {"max_length": model_info(a).max_length}

    def measure(self, variant, ctx):
        if variant == "d":
            a = ctx.args
            job = job_file(ctx, self.corpus(ctx), ctx.workdir / "d-out", name=a.model, dtype=a.dtype,
                           max_length=model_info(a).max_length)
            m = ctx.batchembed("run", job, "--overwrite", "--no-progress",
                               *[x for kv in a.sets for x in ("--set", kv)], log=f"d-{ctx.code_label}")
            s = m.summary()
            r = {"rows": s["rows"], "tokens": s["tokens"], "steady_s": s["pipeline_seconds"],
                 "whole_s": m.wall_s, "tree_rss_mb": m.tree_rss_mb, "engines": s["engines"],
                 "engine_idle_share": s["engine_idle_share"], "engine_start_s": s["engine_start_seconds"],
                 "busy_cores": m.busy_cores_mid_run()}
        else:
            r = self.in_child(variant, ctx)
        r["tok_s_steady"] = r["tokens"] / r["steady_s"]
        r["tok_s_whole"] = r["tokens"] / r["whole_s"] if variant != "a" else None
        r["rows_s_whole"] = r["rows"] / r["whole_s"] if variant != "a" else None
        return r

    def child(self, variant, ctx):
        a, m = ctx.args, model_info(ctx.args)
        corpus = self.corpus(ctx)
        if variant == "a":
            from vllm import PoolingParams
            from vllm.inputs import TokensPrompt

            from batchembed.embed.tokenizer import Tokenizer

            if on_cpu():
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            tok = Tokenizer(m.path, m.max_length)(texts_and_ids(corpus)[1])
            llm = make_llm(m.path, a.dtype, m.max_length)
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in tok.ids]
            params = PoolingParams(task="embed")
            llm.encode(prompts[:256], pooling_params=params, pooling_task="embed", use_tqdm=False)  # warm-up
            t = time.perf_counter()
            out = llm.encode(prompts, pooling_params=params, pooling_task="embed", use_tqdm=False)
            assert len(out) == len(prompts)
            return {"rows": len(prompts), "tokens": int(tok.lengths.sum()), "steady_s": time.perf_counter() - t}
        if variant == "b":
            table, texts = texts_and_ids(corpus)
            llm = make_llm(m.path, a.dtype, m.max_length)
            t = time.perf_counter()
            out = llm.embed(texts, tokenization_kwargs={"truncation": True, "max_length": m.max_length},
                            use_tqdm=False)
            write_vectors(table, [o.outputs.embedding for o in out], ctx.workdir / "b.parquet")
            return {"rows": len(texts), "tokens": sum(len(o.prompt_token_ids) for o in out),
                    "steady_s": time.perf_counter() - t}
        import torch
        from sentence_transformers import SentenceTransformer

        table, texts = texts_and_ids(corpus)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(a.dtype, torch.float32)
        model = SentenceTransformer(str(m.path), device="cuda" if torch.cuda.is_available() else "cpu",
                                    model_kwargs={"torch_dtype": dtype})
        model.max_seq_length = m.max_length
        sweep = {}
        for bs in (16, 32, 64, 128, 256):
            t = time.perf_counter()
            model.encode(texts[:768], batch_size=bs, normalize_embeddings=True)
            sweep[bs] = time.perf_counter() - t
        best = min(sweep, key=sweep.get)
        t = time.perf_counter()
        write_vectors(table, model.encode(texts, batch_size=best, normalize_embeddings=True), ctx.workdir / "c.parquet")
        steady = time.perf_counter() - t
        tokens = sum(int(model.tokenize(texts[i:i + 1024])["attention_mask"].sum()) for i in range(0, len(texts), 1024))
        return {"rows": len(texts), "tokens": tokens, "steady_s": steady, "batch_size": best}

    def derived(self, medians):
        d = medians.get("d")
        out = {}
        for o in ("a", "b", "c"):
            if d and o in medians:
                out[f"d/{o} steady"] = round(d["tok_s_steady"] / medians[o]["tok_s_steady"], 3)
                if o != "a":
                    out[f"d/{o} whole"] = round(d["tok_s_whole"] / medians[o]["tok_s_whole"], 3)
        return out


CASE = Throughput()
