"""The GPU benchmark table from the results of scripts/gpu_benchmark.sh, as markdown.

    python3 scripts/gpu_table.py OUT_DIR [OUT_DIR...]

Reads every OUT_DIR/NAME.results.json and OUT_DIR/*/*/results.json (scripts/benchmark.py's),
one row per case: each variant's steady tok/s, batchembed's whole-process tok/s, the ratios,
engine idle, peak RSS and the share of the FLOP ceiling.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# bf16 FLOP ceilings on one H200, tok/s, from ../shared/gpu/README.md (the figures the
# performance issue measures against); shapes it does not list get none.
CEILING = {("minilm", 80): 36e6, ("bge-base", 80): 4.6e6, ("bge-base", 512): 4.2e6,
           ("qwen3-0.6b", 80): 0.89e6, ("qwen3-0.6b", 512): 0.84e6}


def rate(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x / 1e3:.0f} k"


def row(report: dict) -> tuple[tuple, str]:
    res = report["results"]
    model = report["model"].rstrip("/").rsplit("/", 1)[-1]
    length = report["max_length"]
    d = res.get("d", {})
    settings = [s for s in d.get("settings", []) if not s.startswith("output.rows_per_part")]
    engines = d.get("engines", 1)
    steady = {k: res[k]["tok_s_steady"] if k in res else None for k in "abcd"}
    all_running = d.get("tok_s_all_engines") if engines > 1 else None
    ratios = [f"{steady['d'] / steady[o]:.2f}" if steady["d"] and steady[o] else "—" for o in "abc"]
    ceiling = CEILING.get((model, length))
    best = all_running or steady["d"]
    share = (f"{best / ceiling:.0%} / {d['tok_s_whole'] / ceiling:.0%}" if ceiling and d else "—")
    tokens = next(iter(res.values()))["tokens"]
    cells = [f"{model} @ {length}", f"{report['rows']:,} ({tokens / 1e6:.1f} M tok)",
             ", ".join(settings) or "defaults",
             rate(steady["a"]), rate(steady["b"]), rate(steady["c"]),
             f"**{rate(best)}**" if d else "—", rate(d.get("tok_s_whole")), *ratios,
             f"{d['engine_idle_share']:.1%}" if d.get("engine_idle_share") is not None else "—",
             f"{d['engine_start_s']:.0f} s" if d.get("engine_start_s") is not None else "—",
             f"{d['peak_rss_mb']:,.0f}" if d else "—", share]
    return (model, length, report["rows"], str(settings)), "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    # a case's results.json and its flat copy NAME.results.json are one case: the same bytes
    texts = {f.read_bytes() for out in argv for pattern in ("*.results.json", "*/*/results.json")
             for f in Path(out).glob(pattern)}
    reports = [json.loads(t) for t in sorted(texts)]
    if not reports:
        print(f"no results.json under {', '.join(argv)}", file=sys.stderr)
        return 1
    machine = sorted({r["machine"] for r in reports})
    print(f"Machine: {'; '.join(machine)}. {reports[0]['dtype']} unless the settings say otherwise; "
          f"steady tok/s excludes process and engine start-up, whole includes them.\n")
    print("| model @ tokens | rows | batchembed settings | (a) engine | (b) plain script | "
          "(c) sentence-transformers | (d) batchembed steady | (d) whole process | d/a | d/b | d/c | "
          "engine idle | engine start | (d) peak RSS MB | share of FLOP ceiling (steady / whole) |")
    print("|" + "---|" * 15)
    for _, line in sorted(row(r) for r in reports):
        print(line)
    print("\nWith several engines, (d) steady is the rate while every engine ran.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
