"""Build a corpus of real English text available offline: the docstrings of the
Python standard library, read with `ast` (nothing is imported), as Parquet.

    python -m benchmarks.corpus OUT_DIR [--rows N] [--files K] [--min-chars C] [--hostile]

`make demo` builds its corpus with it, and every benchmark case builds its own.

Writes OUT_DIR/docs-0000.parquet ... with columns id (int64), title (string),
text (string), in a fixed order, so every run makes the same corpus. More rows
than docstrings cycle through them, each cycle's texts numbered ("2. ...") so
every text stays unique: batchembed embeds a repeated text once, which would
flatter it in a benchmark.

--hostile makes rows a real corpus has and a clean one lacks, in a fixed mix: 5 % of the texts
repeated fifty times over (tens of KB), 2 % led by right-to-left marks, NULs and emoji,
1 % one word of 20,000 characters, 1 % empty, 1 % null.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def docstrings():
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in ("test", "tests", "idlelib", "site-packages", "lib2to3") for p in rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        doc = ast.get_docstring(tree)
        if doc:
            yield module, doc
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 20:
                    yield f"{module}.{node.name}", doc


def build(out_dir, rows: int = 5000, files: int = 4, min_chars: int = 0, row_group_rows: int = 1000,
          hostile: bool = False) -> Path:
    """The corpus as `main` writes it, from Python; returns its folder."""
    args = [str(out_dir), "--rows", str(rows), "--files", str(files), "--min-chars", str(min_chars),
            "--row-group-rows", str(row_group_rows), *(["--hostile"] if hostile else [])]
    if main(args, quiet=True) != 0:
        raise SystemExit("no docstrings found in the standard library")
    return Path(out_dir)


def main(argv=None, quiet: bool = False) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--rows", type=int, default=5000, help="rows in all (default 5000)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--row-group-rows", type=int, default=1000)
    ap.add_argument("--min-chars", type=int, default=0, help="join successive docstrings up to this length")
    ap.add_argument("--hostile", action="store_true", help="long, odd, empty and null rows among the texts")
    args = ap.parse_args(argv)

    pool = list(docstrings())
    if args.min_chars:
        joined, title, text = [], None, ""
        for t, d in pool:
            title, text = title or t, f"{text}\n\n{d}" if text else d
            if len(text) >= args.min_chars:
                joined.append((title, text))
                title, text = None, ""
        pool = joined
    if not pool:
        print("no docstrings found in the standard library", file=sys.stderr)
        return 1
    rows = [pool[i % len(pool)] if i < len(pool) else
            (pool[i % len(pool)][0], f"{i // len(pool) + 1}. {pool[i % len(pool)][1]}") for i in range(args.rows)]
    if args.hostile:
        rows = [(t, _hostile(i, d)) for i, (t, d) in enumerate(rows)]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("docs-*.parquet"):
        old.unlink()
    per_file = -(-len(rows) // args.files)
    for k in range(args.files):
        chunk = rows[k * per_file:(k + 1) * per_file]
        if not chunk:
            break
        start = k * per_file
        table = pa.table({
            "id": pa.array(range(start, start + len(chunk)), pa.int64()),
            "title": [t for t, _ in chunk],
            "text": pa.array([d for _, d in chunk], pa.string()),
        })
        tmp = out / f".docs-{k:04d}.parquet.tmp"
        pq.write_table(table, tmp, row_group_size=args.row_group_rows)
        os.replace(tmp, out / f"docs-{k:04d}.parquet")
    if not quiet:
        print(f"demo corpus: {len(rows):,} docstrings ({len(pool):,} distinct) in {min(args.files, k + 1)} files -> {out}")
    return 0


def _hostile(i: int, text: str) -> str | None:
    """Row i's text in the --hostile mix (by its position in each hundred rows: the same every run)."""
    k = (i * 37) % 100  # spread over every file and window
    if k < 5:
        return " ".join([text] * 50)
    if k < 7:
        return "\u202e\u0000 \U0001F600 " * 50 + text
    if k < 8:
        return "x" * 20_000
    if k < 9:
        return ""
    if k < 10:
        return None
    return text


if __name__ == "__main__":
    sys.exit(main())
