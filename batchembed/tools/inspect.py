"""`batchembed inspect`: what an output holds, for a person or (with --json) a script."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..embed.settings import EngineSettings
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
    sizes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # sparse / multi-vector: (entries, bytes) per row
    extras = [e["column"] for r in ("sparse", "multi_vector")
              if manifest is not None and (e := getattr(manifest.embedding, r))]
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
                        sample.append({k: _shown(v) for k, v in row.items()})
                for col in extras:
                    if col in batch.schema.names:
                        sizes.setdefault(col, []).append(_sizes(batch.column(col)))
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
        if fld.name in sizes:
            n = np.concatenate([a for a, _ in sizes[fld.name]])
            b = np.concatenate([x for _, x in sizes[fld.name]])
            per = "weights" if pa.types.is_struct(fld.type) else "vectors"
            if len(n):
                entry.update({f"{per}_per_row_min": int(n.min()), f"{per}_per_row_mean": float(n.mean()),
                              f"{per}_per_row_max": int(n.max()), "bytes_per_row_mean": float(b.mean()),
                              "rows_checked": int(len(n))})
        columns.append(entry)
    return {"output": uri, "format": out.fmt.name, "finished": out.finished(), "parts": len(parts),
            "rows": rows, "columns": columns, "sample": sample,
            "manifest": manifest.to_json() if manifest is not None else None}


def _shown(v):
    """A sample row's value, short: the first values of a vector, the size of a sparse or
    multi-vector one."""
    if isinstance(v, dict) and set(v) == {"indices", "values"}:
        pairs = ", ".join(f"{i}:{w:.3f}" for i, w in list(zip(v["indices"], v["values"]))[:3])
        return f"{{{pairs}{', ...' if len(v['indices']) > 3 else ''}}} ({len(v['indices'])} weights)"
    if isinstance(v, list) and v and isinstance(v[0], list):
        return f"[{len(v)} vectors of {len(v[0])}]"
    if isinstance(v, list) and v:
        return f"[{', '.join(f'{x:.4f}' for x in v[:4])}, ...] ({len(v)})"
    return v


def _sizes(col) -> tuple[np.ndarray, np.ndarray]:
    """Per non-null row of a sparse or multi-vector column: its weights or vectors, and bytes."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    col = col.drop_null()
    if pa.types.is_struct(col.type):
        lists = col.field("indices")
        n = np.diff(lists.offsets.to_numpy())
        return n, n * 8.0  # an int32 id and a float32 weight each
    n = np.diff(col.offsets.to_numpy())
    inner = col.type.value_type
    return n, n * inner.list_size * inner.value_type.bit_width / 8


def render(info: dict) -> str:
    """A plain-text table of an inspect result."""
    m = info.get("manifest") or {}
    cut = f" of up to {m['rows_per_part']:,} rows" if m.get("rows_per_part") else ""
    lines = [f"{info['output']}: {info.get('format', 'parquet')}, {info['rows']:,} rows in {info['parts']} parts{cut}, "
             f"{'finished (_SUCCESS)' if info['finished'] else 'NOT finished (no _SUCCESS)'}"]
    if m:
        lines.append(f"model {m['model']['name']} ({m['model']['hash'][:19]}), dtype {m['model']['dtype']}, "
                     f"max_length {m['model']['max_length']}, prefix {m['model']['prefix']!r}; "
                     f"made {m.get('created_at')} by batchembed {m['tool']['version']}")
        if m.get("engine"):
            lines.append(f"engine: {EngineSettings.from_dict(m['engine']).describe()}")
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
        elif "bytes_per_row_mean" in col:
            per = "weights" if "weights_per_row_mean" in col else "vectors"
            lines.append(f"{col['name']:<24} {'(' + per + ' per row, bytes per row)':<40} "
                         f"{col[per + '_per_row_min']:>9} {col[per + '_per_row_mean']:>9.1f} "
                         f"{col[per + '_per_row_max']:>9}   {col['bytes_per_row_mean']:,.0f} B/row")
        else:
            lines.append(f"{col['name']:<24} {col['type'][:40]:<40}")
    lines.append("")
    for row in info["sample"]:
        lines.append("  " + ", ".join(f"{k}={v}" for k, v in row.items()))
    return "\n".join(lines)
