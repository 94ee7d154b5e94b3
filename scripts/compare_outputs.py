"""How far apart two finished outputs of the same corpus are, row by row: for a setting that
should not change the vectors (an engine switch, an engine count, another machine) or to
measure one that does (fp8, a dtype). Rows are matched by the id column.

    .venv/bin/python scripts/compare_outputs.py OUT_A OUT_B [--min-cosine 0.999]

Prints, per vector column, the rows compared, the least cosine, how many rows fall below
--min-cosine and the largest absolute difference of one component; then one JSON line with
the same. Exit 1 when a row is in one output only, a vector is null in one only, or a
cosine is below --min-cosine; 2 when an output cannot be read. float32 / float16 outputs only (quantised ones: compare their
float runs)."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pyarrow as pa

from batchembed.embed.vectors import vector_matrix
from batchembed.errors import JobError, RunError
from batchembed.fidelity import cosines
from batchembed.tools.read import read_output


def vectors(table: pa.Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows x d float32, whatever a null row's slots hold; the null mask)."""
    col = table[column].combine_chunks()
    return vector_matrix(col), np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool)


def compare(a_uri: str, b_uri: str, min_cosine: float) -> tuple[dict, bool]:
    (a, ma), (b, mb) = read_output(a_uri), read_output(b_uri)
    if ma["embedding"]["output_dtype"] not in ("float32", "float16"):
        raise SystemExit(f"{a_uri}: output_dtype {ma['embedding']['output_dtype']}: compare float outputs")
    id_a, id_b = ma["job"]["columns"]["id"], mb["job"]["columns"]["id"]
    ids_a, ids_b = a[id_a].to_pylist(), b[id_b].to_pylist()
    where_b = {v: i for i, v in enumerate(ids_b)}
    pairs = [(i, where_b[v]) for i, v in enumerate(ids_a) if v in where_b]
    ia = np.fromiter((p[0] for p in pairs), dtype=np.int64, count=len(pairs))
    ib = np.fromiter((p[1] for p in pairs), dtype=np.int64, count=len(pairs))
    result: dict = {"a": a_uri, "b": b_uri, "rows_a": len(ids_a), "rows_b": len(ids_b),
                    "only_in_a": len(ids_a) - len(pairs), "only_in_b": len(ids_b) - len(pairs), "columns": {}}
    ok = result["only_in_a"] == 0 and result["only_in_b"] == 0
    shared = sorted(set(ma["embedding"]["columns"].values()) & set(mb["embedding"]["columns"].values()))
    for column in shared:
        va, na = vectors(a, column)
        vb, nb = vectors(b, column)
        va, na, vb, nb = va[ia], na[ia], vb[ib], nb[ib]
        both = ~na & ~nb
        cos = cosines(va[both], vb[both])
        diff = float(np.abs(va[both] - vb[both]).max()) if both.any() else 0.0
        r = {"compared": int(both.sum()), "null_in_one": int((na != nb).sum()),
             "min_cosine": float(cos.min()) if cos.size else None,
             "below": int((cos < min_cosine).sum()), "max_abs_diff": diff,
             "identical_rows": int((va[both] == vb[both]).all(axis=1).sum())}
        result["columns"][column] = r
        ok = ok and r["null_in_one"] == 0 and r["below"] == 0
    return result, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--min-cosine", type=float, default=0.999)
    args = ap.parse_args()
    try:
        result, ok = compare(args.a, args.b, args.min_cosine)
    except (JobError, RunError) as e:
        print(f"compare_outputs: {e}", file=sys.stderr)
        return 2
    print(f"{args.a} ({result['rows_a']:,} rows) against {args.b} ({result['rows_b']:,}): "
          f"{result['only_in_a']:,} only in the first, {result['only_in_b']:,} only in the second", file=sys.stderr)
    for column, r in result["columns"].items():
        print(f"  {column}: {r['compared']:,} rows, least cosine {r['min_cosine']}, {r['below']:,} below "
              f"{args.min_cosine}, largest |difference| {r['max_abs_diff']:.3g}, {r['identical_rows']:,} identical, "
              f"{r['null_in_one']:,} null in one only", file=sys.stderr)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
