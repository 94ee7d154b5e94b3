"""`python -m benchmarks CASE [options]`: see benchmarks/__init__.py."""

from __future__ import annotations

import importlib
import sys

from .harness import run_case

CASES = {  # name -> module in benchmarks/cases/
    "throughput": "CPU or GPU: batchembed against the bare engine, a plain vLLM script and sentence-transformers",
    "startup": "a small job's whole process, start-up split into vLLM's import and the engine's build",
    "reindex": "a full run, the same corpus again, then 1 % of rows edited, each with --previous",
    "lance": "the output stage as Parquet and as Lance, and index builds",
    "tokenize": "the host's tokenising cost per row: whole texts against the cut before the limit",
    "representations": "dense, sparse and multi-vector in one run against one run each (BGE-M3 shape)",
    "memory": "peak RSS of whole runs at N, 10 N and 100 N rows of a corpus with long and hostile rows",
    "gpu": "the GPU suite: start-up, and bge-base, MiniLM and Qwen3 shapes as written and as tuned",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in CASES:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown case {argv[0]!r}\n", file=sys.stderr)
        print("usage: python -m benchmarks CASE [options]   (CASE --help for its options)\n\ncases:")
        for name, text in CASES.items():
            print(f"  {name:<11} {text}")
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    module = importlib.import_module(f"benchmarks.cases.{argv[0]}")
    return run_case(module.CASE, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
