"""`batchembed verify`: check a finished output against its manifest, reading every part."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..embed.vectors import SCALAR, vector_matrix
from ..output.layout import MANIFEST, SUCCESS, OutputFolder
from ..storage import concurrently


def verify_output(uri: str, storage_options: dict[str, Any] | None = None,
                  threads: int = 16) -> tuple[list[str], dict]:
    """(problems, summary). No problems means: _SUCCESS is there, every part the manifest
    lists exists with its row count and vector columns, every vector has norm 1, no part
    or other data is there that the manifest does not list, and its index is there. Parts
    are read `threads` at a time."""
    out = OutputFolder.open(uri, storage_options, key="OUTPUT_URI")
    manifest = out.read_manifest()
    if manifest is None:
        return [f"no {MANIFEST} at {uri}: not a finished batchembed output"], {}
    problems: list[str] = []
    if not out.finished():
        problems.append(f"no {SUCCESS}: the output is unfinished" +
                        (f" ({len(manifest.get('failed', []))} input files failed)" if manifest.get("failed") else ""))
    columns = manifest["embedding"]["columns"]
    packed = manifest["embedding"].get("packed_bits", False)  # binary / ubinary: 8 dimensions a byte, no norm
    quantized = packed or manifest["embedding"]["output_dtype"] in SCALAR  # no norm to check
    tol = 1e-2 if manifest["embedding"]["output_dtype"] == "float16" else 1e-3
    listed = {p["name"]: p for p in manifest["parts"]}
    present = set(out.part_names())
    for extra in sorted(present - set(listed)):
        problems.append(f"{extra}: a part the manifest does not list")
    for stray in out.strays():
        problems.append(f"{stray}: data that is no batchembed part (readers of the output see its rows)")
    index = manifest.get("index") or {}
    if index.get("built") and index.get("name") not in out.fmt.index_names(out):
        problems.append(f"the manifest lists the index {index.get('name')}, the output has none of that name")
    todo = []
    for name, entry in listed.items():
        if name in present:
            todo.append((name, entry))
        elif entry["rows"] or out.fmt.empty_parts_kept:  # Lance keeps nothing of an empty part
            problems.append(f"{name}: listed in the manifest, missing")

    def check(item) -> tuple[list[str], int, int, float]:
        """One part: (problems, rows, vectors checked, its largest |norm - 1|)."""
        name, entry = item
        found: list[str] = []
        vectors, worst = 0, 0.0
        url = out.part_url(name)
        with out.open_part(name) as part:
            if part.num_rows != entry["rows"]:
                found.append(f"{url}: {part.num_rows} rows, the manifest says {entry['rows']}")
            for dim, col in columns.items():
                field = part.schema.field(col) if col in part.schema.names else None
                width = int(dim) // 8 if packed else int(dim)
                if field is None or getattr(field.type, "list_size", None) != width:
                    found.append(f"{url}: column {col} is {field.type if field else 'missing'}, "
                                 f"expected {width} values per row")
                    continue
                if quantized:
                    continue
                for batch in part.iter_batches(columns=[col]):
                    arr = batch.column(0).drop_null()
                    if len(arr) == 0:
                        continue
                    m = vector_matrix(arr)
                    worst = max(worst, float(np.abs(np.linalg.norm(m, axis=1) - 1).max()))
                    vectors += len(arr)
            return found, part.num_rows, vectors, worst

    results = concurrently(check, todo, threads)
    rows = sum(r[1] for r in results)
    vectors = sum(r[2] for r in results)
    worst = max((r[3] for r in results), default=0.0)
    problems += [p for r in results for p in r[0]]
    if worst > tol:
        problems.append(f"a vector's norm is off 1 by {worst:.2e} (tolerance {tol})")
    if rows != manifest["counts"]["rows"]:
        problems.append(f"parts hold {rows} rows, the manifest counts {manifest['counts']['rows']}")
    summary = {"output": uri, "parts": len(listed), "rows": rows, "vectors_checked": vectors,
               "failed_rows": manifest["counts"].get("failed_rows", 0),
               "max_norm_error": worst, "norms_checked": not quantized, "ok": not problems}
    return problems, summary
