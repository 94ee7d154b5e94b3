"""Reading an output from Python: its rows as one Arrow table, and a query vector made
comparable with its stored vectors (the same dimension, renormalised, and for int8 / uint8 /
binary outputs quantised the way the output was).

    from batchembed.tools.read import read_output, query_vector
    table, manifest = read_output("out/quickstart-emb/")
    q = query_vector(manifest, full_vector)        # for the `embedding` column
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..embed.matryoshka import l2_normalise
from ..embed.vectors import PACKED, SCALAR, quantize
from ..errors import RunError
from ..output.layout import MANIFEST, SUCCESS, OutputFolder


def read_output(uri: str, storage_options: dict[str, Any] | None = None, columns: list[str] | None = None,
                unfinished: bool = False) -> tuple[pa.Table, dict]:
    """(every row of a finished output, its manifest: the JSON object of the current version, an
    older output's migrated, output/manifest.py). Refuses (RunError) an output without
    _SUCCESS unless `unfinished`, when the parts committed so far are read."""
    out = OutputFolder.open(uri, storage_options, key="OUTPUT_URI")
    manifest = out.read_manifest()
    if not unfinished and (manifest is None or not out.finished()):
        raise RunError(f"{out.url} is not a finished batchembed output (no {SUCCESS} or {MANIFEST}); "
                       "read it with unfinished=True to get the parts committed so far")
    tables = []
    for name in out.part_names():
        with out.open_part(name) as part:
            tables.append(part.read(columns))
    if not tables:
        raise RunError(f"no parts at {out.url}")
    return pa.concat_tables(tables, promote_options="permissive"), manifest.to_json() if manifest else {}


def query_vector(manifest: dict, vector, dimension: int | None = None) -> np.ndarray:
    """A query's full vector (from the same model and prefix conventions) as the output stores
    dimension `dimension` (default: the only or the largest): truncated and renormalised, then
    float16, int8 / uint8 with the output's calibration ranges, or sign bits packed as uint8
    (compare with the stored bytes as uint8, by Hamming distance)."""
    emb = manifest["embedding"]
    d = dimension or max(emb["dimensions"])
    if d not in emb["dimensions"]:
        raise ValueError(f"dimension {d} is not stored; the output has {emb['dimensions']}")
    q = l2_normalise(np.asarray(vector, dtype=np.float32).reshape(1, -1)[:, :d])
    dtype = emb["output_dtype"]
    if dtype in SCALAR:
        ranges = np.asarray(emb["calibration"]["ranges"][str(d)], dtype=np.float32)
        return quantize(q, ranges, dtype)[0]
    if dtype in PACKED:
        return np.packbits(q > 0, axis=1)[0]
    return q[0].astype(np.float16 if dtype == "float16" else np.float32)


def stored_bits(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A binary / ubinary column's bytes as uint8 (rows, d/8): binary stores each byte minus 128."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values = col.values.to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
    return (values.astype(np.int16) + 128).astype(np.uint8) if values.dtype == np.int8 else values
