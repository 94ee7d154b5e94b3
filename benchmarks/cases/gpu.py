"""The GPU suite: whole `batchembed run`s from process start to exit, each job as a user writes it
(default) and as `batchembed tune --write` leaves it (tuned), side by side on one machine.

Variants (texts of exactly max_length tokens: docstrings joined long enough, then truncated):
  startup                      the real MiniLM, 3,000 rows, fidelity check on: process start to exit
  bge-default, bge-tuned       bge-base shape @ 80 tokens (--bge-rows)
  minilm-default, minilm-tuned all-MiniLM-L6-v2 @ 256 tokens (--minilm-rows)
  qwen-default, qwen-tuned     Qwen3-0.6B shape @ 512 tokens (--qwen-rows)
  qwen-fp8                     the Qwen3 job as written with vLLM's fp8 weights, and the fidelity
                               guard's cosine to the bf16 reference beside it
The bge and Qwen3 shapes have random weights (benchmarks/models.py), made on the machine. Each run
records tokens/s over the whole process and while every engine ran, the engines, the share of the
GPU's bf16 FLOP ceiling, the host's busy cores and the GPU's busy share over the middle of the run,
and host cores per million tokens/s. A tuned variant runs `tune` once (timed apart) and reuses its job.
About 12 minutes on an H200 at the defaults; --tiny tries the suite on a CPU with two-layer models.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import yaml

from ..corpus import build
from ..harness import MODEL, Case, Context, job_file
from ..models import make

# model key -> (max_length, min_chars so every text reaches it, rows option, tune engines, tune rows)
JOBS = {"bge": (80, 500, "bge_rows", "4,6,8", 200_000), "minilm": (256, 1000, "minilm_rows", "4,8", 200_000),
        "qwen": (512, 3000, "qwen_rows", "1,2", 4_000)}


class Gpu(Case):
    name = "gpu"
    help = __doc__
    variants = {"startup": "MiniLM, 3,000 rows, process start to exit",
                **{f"{k}-{how}": f"{k} @ {JOBS[k][0]}, {'as written' if how == 'default' else 'as tune wrote it'}"
                   for k in JOBS for how in ("default", "tuned")},
                "qwen-fp8": "qwen @ 512, as written with engine.vllm_args.quantization: fp8"}
    ab_variants = tuple(variants)
    columns = [("engines", "engines", "d"), ("tok_s_running", "tok/s all engines running", ",.0f"),
               ("tok_s_whole", "tok/s whole process", ",.0f"), ("wall_s", "whole s", ".1f"),
               ("engine_start_s", "start-up s", ".1f"), ("flop_share_running", "FLOP ceiling, running", ".0%"),
               ("busy_cores", "busy host cores", ".1f"), ("cores_per_mtok_s", "cores per M tok/s", ".1f"),
               ("gpu_busy_pct", "GPU busy %", ".0f")]

    def add_args(self, ap):
        ap.add_argument("--bge-rows", type=int, default=1_000_000)
        ap.add_argument("--minilm-rows", type=int, default=200_000)
        ap.add_argument("--qwen-rows", type=int, default=100_000)
        ap.add_argument("--models", default=None, help="where the random-weight shapes are made and kept "
                        "(default: ~/.cache/batchembed-benchmarks/models)")
        ap.add_argument("--minilm", default=MODEL, help="the real MiniLM: a folder or package:<name>")
        ap.add_argument("--tune-rows", type=float, default=1.0, help="scale every tune's sample rows")
        ap.add_argument("--tiny", action="store_true", help="two-layer shapes and small corpora, to try the suite")

    def model(self, ctx: Context, key: str) -> str:
        if key == "minilm":
            return ctx.args.minilm
        root = Path(ctx.args.models).expanduser() if ctx.args.models else \
            Path.home() / ".cache" / "batchembed-benchmarks" / "models"
        return str(make(root, {"bge": "bge-base", "qwen": "qwen3-0.6b"}[key], tiny=ctx.args.tiny))

    def prepare(self, ctx):
        params = {}
        for key in {v.split("-")[0] for v in ctx.args.variants.split(",")} & set(JOBS):
            t = time.perf_counter()
            self.model(ctx, key)
            params[f"{key}_model_made_s"] = round(time.perf_counter() - t, 1)
        return params

    def job(self, ctx: Context, key: str) -> str:
        """The job file as a user writes it: input, model, output, nothing about engines."""
        a, w = ctx.args, ctx.workdir
        if key == "startup":
            length, chars, rows = 256, 0, 3000
            name = a.minilm
        else:
            length, chars, opt, _, _ = JOBS[key]
            rows, name = getattr(a, opt), self.model(ctx, key)
        corpus = w / f"corpus-{key}-{rows}"
        if not corpus.exists():
            build(corpus, rows=rows, files=8, min_chars=chars)
        return job_file(ctx, corpus, w / f"out-{key}", file=f"job-{key}", name=name, max_length=length,
                        dtype="auto" if a.tiny else "bfloat16")

    def tuned(self, ctx: Context, key: str) -> tuple[str, dict]:
        path = ctx.workdir / f"tuned-{key}-{ctx.code_label}.yaml"
        info = ctx.workdir / f"tuned-{key}-{ctx.code_label}.json"
        if not path.exists():
            _, _, _, engines, rows = JOBS[key]
            if ctx.args.tiny:
                engines, rows = "1,2", 200
            m = ctx.batchembed("tune", self.job(ctx, key), "--engines", engines, "--rows",
                               str(int(rows * ctx.args.tune_rows)), "--write", str(path), "--json",
                               log=f"tune-{key}-{ctx.code_label}")
            info.write_text(json.dumps({"tune_s": round(m.wall_s, 1), "trials": json.loads(m.stdout)}))
        return str(path), json.loads(info.read_text())

    def measure(self, variant, ctx):
        key, _, how = variant.partition("-")
        job, extra = (self.tuned(ctx, key) if how == "tuned" else (self.job(ctx, key), {}))
        spec = yaml.safe_load(open(job))
        if how == "fp8":
            spec.setdefault("engine", {}).setdefault("vllm_args", {})["quantization"] = "fp8"
            job = str(ctx.workdir / f"job-{key}-fp8.yaml")
            with open(job, "w") as f:
                yaml.safe_dump(spec, f)
        shutil.rmtree(spec["output"]["uri"], ignore_errors=True)
        m = ctx.batchembed("run", job, "--no-progress", log=f"{variant}-{ctx.code_label}")
        s = m.summary()
        running = s.get("steady_tokens_per_s") or s["tokens_per_s"]
        r = {"engines": s["engines"], "rows": s["rows"], "tokens": s["tokens"], "wall_s": round(m.wall_s, 2),
             "tok_s_whole": round(s["tokens"] / m.wall_s), "tok_s_running": round(running),
             "engine_start_s": s["engine_start_seconds"], "tail_s": s.get("tail_seconds"),
             "rows_per_part": _manifest(spec).get("rows_per_part"), "busy_cores": m.busy_cores_mid_run(),
             "gpu_busy_pct": m.gpu_busy_mid_run(), "tree_rss_mb": m.tree_rss_mb,
             "flop_share_running": flop_share(spec["model"]["name"], s["tokens"] / max(1, s["rows"]), running)}
        r["cores_per_mtok_s"] = round(r["busy_cores"] / (running / 1e6), 2) if r["busy_cores"] else None
        if extra:
            r["tune_s"] = extra["tune_s"]
        guard = Path(spec["output"]["uri"]) / "_fidelity.json"
        if guard.exists():  # the engine's vectors against the reference's on a sample, at start
            r["fidelity_min_cosine"] = json.loads(guard.read_text()).get("min_cosine")
        shutil.rmtree(spec["output"]["uri"], ignore_errors=True)
        return r

    def derived(self, medians):
        out = {}
        for key in JOBS:
            d, t = medians.get(f"{key}-default"), medians.get(f"{key}-tuned")
            if d and t:
                out[f"{key}: default / tuned, whole"] = round(d["tok_s_whole"] / t["tok_s_whole"], 3)
                out[f"{key}: default / tuned, running"] = round(d["tok_s_running"] / t["tok_s_running"], 3)
        d, q = medians.get("qwen-default"), medians.get("qwen-fp8")
        if d and q:
            out["qwen: fp8 / bf16, running"] = round(q["tok_s_running"] / d["tok_s_running"], 3)
        return out


def _manifest(spec: dict) -> dict:
    path = Path(spec["output"]["uri"]) / "_manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def flop_share(model: str, tokens_per_row: float, rate: float) -> float | None:
    from batchembed.model import read_model_info
    from batchembed.tune import accelerator_peak
    from batchembed.tune import flop_share as share

    return share(read_model_info(model), tokens_per_row, rate, accelerator_peak()[1])


CASE = Gpu()
