"""`batchembed compare A B`: how far apart two finished outputs of the same corpus are, row by row,
for a setting that should not change the vectors (an engine switch, an engine count, another machine)
or to measure one that does (fp8, a dtype). Rows are matched by the id column; float outputs only
(quantised ones: compare their float runs).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..embed.vectors import multi_vector_rows, sparse_rows, vector_matrix
from ..errors import JobError
from ..fidelity import compare_reps, cosines
from .read import read_output


def _vectors(table: pa.Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows x d float32, whatever a null row's slots hold; the null mask)."""
    col = table[column].combine_chunks()
    return vector_matrix(col), np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool)


def compare_outputs(a_uri: str, b_uri: str, min_cosine: float = 0.999,
                    storage_options: dict[str, Any] | None = None) -> dict:
    """Per shared vector column: rows compared, rows identical to the bit, the least and mean cosine,
    rows below `min_cosine`, the largest difference of one component, rows null in one only; and
    `ok`: no row in one output only, no null in one only, no cosine below `min_cosine`."""
    (a, ma), (b, mb) = read_output(a_uri, storage_options), read_output(b_uri, storage_options)
    for uri, m in ((a_uri, ma), (b_uri, mb)):
        if m["embedding"]["output_dtype"] not in ("float32", "float16"):
            raise JobError(f"{uri}: output_dtype {m['embedding']['output_dtype']}: compare float outputs")
    id_a, id_b = ma["job"]["columns"]["id"], mb["job"]["columns"]["id"]
    if not id_a or not id_b:
        raise JobError(f"{a_uri if not id_a else b_uri}: no id column (input.id_column) to match rows by")
    ids_a, ids_b = a[id_a].to_pylist(), b[id_b].to_pylist()
    where_b = {v: i for i, v in enumerate(ids_b)}
    pairs = [(i, where_b[v]) for i, v in enumerate(ids_a) if v in where_b]
    ia = np.fromiter((p[0] for p in pairs), dtype=np.int64, count=len(pairs))
    ib = np.fromiter((p[1] for p in pairs), dtype=np.int64, count=len(pairs))
    result: dict = {"a": a_uri, "b": b_uri, "rows_a": len(ids_a), "rows_b": len(ids_b),
                    "only_in_a": len(ids_a) - len(pairs), "only_in_b": len(ids_b) - len(pairs),
                    "min_cosine_allowed": min_cosine, "columns": {}}
    ok = result["only_in_a"] == 0 and result["only_in_b"] == 0
    shared = sorted(set(ma["embedding"]["columns"].values()) & set(mb["embedding"]["columns"].values()))
    reps = [r for r in ("sparse", "multi_vector") if ma["embedding"].get(r) and mb["embedding"].get(r)]
    if not shared and not reps:
        raise JobError(f"{a_uri} and {b_uri} share no vector column: {ma['embedding']['columns']} against "
                       f"{mb['embedding']['columns']}")
    for column in shared:
        (va, na), (vb, nb) = _vectors(a, column), _vectors(b, column)
        va, na, vb, nb = va[ia], na[ia], vb[ib], nb[ib]
        both = ~na & ~nb
        cos = cosines(va[both], vb[both])
        r = {"compared": int(both.sum()), "identical_rows": int((va[both] == vb[both]).all(axis=1).sum()),
             "min_cosine": float(cos.min()) if cos.size else None,
             "mean_cosine": float(cos.mean()) if cos.size else None, "below": int((cos < min_cosine).sum()),
             "max_abs_diff": float(np.abs(va[both] - vb[both]).max()) if both.any() else 0.0,
             "null_in_one": int((na != nb).sum())}
        result["columns"][column] = r
        ok = ok and r["null_in_one"] == 0 and r["below"] == 0
    for rep in reps:  # each row's cosine: of its weights (sparse), of each token vector (multi-vector)
        column = ma["embedding"][rep]["column"]
        read = sparse_rows if rep == "sparse" else multi_vector_rows
        ra, rb = read(a.column(column)), read(b.column(column))
        ra, rb = [ra[i] for i in ia.tolist()], [rb[i] for i in ib.tolist()]
        both = [k for k in range(len(ra)) if ra[k] is not None and rb[k] is not None]
        cos = compare_reps({rep: [ra[k] for k in both]}, {rep: [rb[k] for k in both]}).get(rep, np.zeros(0))
        same = sum(all(np.array_equal(x, y) for x, y in zip(ra[k], rb[k])) if rep == "sparse"
                   else np.array_equal(ra[k], rb[k]) for k in both)
        r = {"compared": len(both), "identical_rows": int(same),
             "min_cosine": float(cos.min()) if cos.size else None,
             "mean_cosine": float(cos.mean()) if cos.size else None, "below": int((cos < min_cosine).sum()),
             "max_abs_diff": 0.0 if same == len(both) else float("nan"),
             "null_in_one": sum((ra[k] is None) != (rb[k] is None) for k in range(len(ra)))}
        result["columns"][column] = r
        ok = ok and r["null_in_one"] == 0 and r["below"] == 0
    result["ok"] = ok
    return result


def render(r: dict) -> str:
    lines = [f"{r['a']} ({r['rows_a']:,} rows) against {r['b']} ({r['rows_b']:,} rows): "
             f"{r['only_in_a']:,} only in the first, {r['only_in_b']:,} only in the second"]
    for column, c in r["columns"].items():
        least = "—" if c["min_cosine"] is None else f"{c['min_cosine']:.6f}"
        lines.append(f"  {column}: {c['compared']:,} rows compared, {c['identical_rows']:,} identical; least cosine "
                     f"{least}, {c['below']:,} below {r['min_cosine_allowed']}; largest |difference| "
                     f"{c['max_abs_diff']:.3g}; {c['null_in_one']:,} null in one only")
    lines.append("ok: the outputs agree" if r["ok"] else "differ: see above")
    return "\n".join(lines)
