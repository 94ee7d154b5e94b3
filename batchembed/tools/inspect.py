"""`batchembed inspect`: what an output holds, for a person or (with --json) a script."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..embed.vectors import vector_matrix
from ..errors import RunError
from ..output.layout import OutputFolder
from ..storage import concurrently


def inspect_output(uri: str, storage_options: dict[str, Any] | None = None, sample_rows: int = 3,
                   norm_rows: int = 10_000, threads: int = 16) -> dict:
    """Rows, columns, dimensions, dtypes, norm statistics over the first `norm_rows`
    vectors, a few rows, and the manifest. Parts' footers are read `threads` at a time."""
    out = OutputFolder.open(uri, storage_options, key="OUTPUT_URI")
    parts = out.part_names()
    if not parts:
        raise RunError(f"no batchembed parts (part-*{out.fmt.suffix}) at {uri}")
    manifest = out.read_manifest()

    def footer(name: str) -> tuple[int, pa.Schema]:
        with out.open_part(name) as part:
            return part.num_rows, part.schema

    footers = concurrently(footer, parts, threads)
    rows = sum(n for n, _ in footers)
    schema = footers[0][1]
    norms: dict[str, list[np.ndarray]] = {}
    sample: list[dict] = []
    def enough() -> bool:  # norm statistics need only the first norm_rows vectors
        return any(sum(len(n) for n in v) >= norm_rows for v in norms.values())

    for name in parts:
        if enough() and len(sample) >= sample_rows:
            break
        with out.open_part(name) as part:
            vector_cols = [fld.name for fld in part.schema if hasattr(fld.type, "list_size")
                           and pa.types.is_floating(fld.type.value_type)]  # packed bits have no norm
            for batch in part.iter_batches(batch_size=4096):
                if len(sample) < sample_rows:
                    for row in batch.slice(0, sample_rows - len(sample)).to_pylist():
                        sample.append({k: (f"[{', '.join(f'{x:.4f}' for x in v[:4])}, ...] ({len(v)})"
                                           if isinstance(v, list) and v else v) for k, v in row.items()})
                for col in vector_cols:
                    arr = batch.column(col).drop_null()
                    if len(arr):
                        m = vector_matrix(arr)
                        norms.setdefault(col, []).append(np.linalg.norm(m, axis=1))
                if enough():
                    break
    columns = []
    for fld in schema:
        entry = {"name": fld.name, "type": str(fld.type)}
        if fld.name in norms:
            n = np.concatenate(norms[fld.name])
            entry.update(dim=fld.type.list_size, norm_min=float(n.min()), norm_max=float(n.max()),
                         norm_mean=float(n.mean()), vectors_checked=int(len(n)))
        columns.append(entry)
    return {"output": uri, "format": out.fmt.name, "finished": out.finished(), "parts": len(parts),
            "rows": rows, "columns": columns, "sample": sample, "manifest": manifest}


def render(info: dict) -> str:
    """A plain-text table of an inspect result."""
    lines = [f"{info['output']}: {info.get('format', 'parquet')}, {info['rows']:,} rows in {info['parts']} parts, "
             f"{'finished (_SUCCESS)' if info['finished'] else 'NOT finished (no _SUCCESS)'}"]
    m = info.get("manifest") or {}
    if m:
        lines.append(f"model {m['model']['name']} ({m['model']['hash'][:19]}), dtype {m['model']['dtype']}, "
                     f"max_length {m['model']['max_length']}, prefix {m['model']['prefix']!r}; "
                     f"made {m.get('created_at')} by batchembed {m['tool']['version']}")
        c = m["counts"]
        lines.append(f"counts: {c['rows']:,} rows, {c['embedded']:,} embedded, {c['nulls']:,} null, "
                     f"{c['truncated']:,} truncated, {c['tokens']:,} tokens, "
                     f"{c.get('failed_rows', 0):,} failed in the engine (_errors/)")
        if (ix := m.get("index")) and ix.get("built"):
            lines.append(f"index: {ix['type']} ({ix['metric']}) on {ix['column']}"
                         + (f", BTREE on {ix['id_index']}" if ix.get("id_index") else "")
                         + f"; built in {ix['seconds']:.1f} s")
    lines.append("")
    lines.append(f"{'column':<24} {'type':<40} {'norm min':>9} {'norm mean':>9} {'norm max':>9}")
    for col in info["columns"]:
        if "dim" in col:
            lines.append(f"{col['name']:<24} {col['type']:<40} {col['norm_min']:>9.5f} {col['norm_mean']:>9.5f} "
                         f"{col['norm_max']:>9.5f}")
        else:
            lines.append(f"{col['name']:<24} {col['type']:<40}")
    lines.append("")
    for row in info["sample"]:
        lines.append("  " + ", ".join(f"{k}={v}" for k, v in row.items()))
    return "\n".join(lines)
