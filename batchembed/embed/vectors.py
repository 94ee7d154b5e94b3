"""Vector columns: their Arrow types, and matrices encoded into them (float32, float16, int8,
uint8, binary, ubinary) or decoded from them. Quantisation lives here and only here.

binary / ubinary follow sentence-transformers' quantize_embeddings: the bits of
`vector > 0` packed 8 to a byte (numpy packbits, first dimension in the high bit), as
uint8 (ubinary) or as int8 after subtracting 128 (binary). int8 / uint8 cut each
dimension's calibrated [min, max] into 255 steps (calibration.py makes the ranges).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

PACKED = {"binary": pa.int8(), "ubinary": pa.uint8()}  # sign bits, 8 dimensions to a byte
SCALAR = {"int8": pa.int8(), "uint8": pa.uint8()}  # one value per dimension, calibrated ranges
BYTES_PER_DIM = {"float32": 4, "float16": 2, "int8": 1, "uint8": 1, "binary": 1 / 8, "ubinary": 1 / 8}


def quantize(matrix: np.ndarray, ranges: np.ndarray, dtype: str) -> np.ndarray:
    """sentence-transformers' scalar quantisation: 255 steps between each dimension's min and max,
    values outside the calibration range clipped to its ends."""
    starts = ranges[0]
    steps = (ranges[1] - starts) / 255
    steps = np.where(steps == 0, 1, steps)
    q = np.clip(np.floor((matrix - starts) / steps), 0, 255)
    return (q - 128).astype(np.int8) if dtype == "int8" else q.astype(np.uint8)


def vector_type(dim: int, dtype: str) -> pa.DataType:
    if dtype in PACKED:
        return pa.list_(PACKED[dtype], dim // 8)
    if dtype in SCALAR:
        return pa.list_(SCALAR[dtype], dim)
    return pa.list_(pa.float16() if dtype == "float16" else pa.float32(), dim)


def vector_array(matrix: np.ndarray, valid: np.ndarray, dtype: str,
                 ranges: np.ndarray | None = None) -> pa.FixedSizeListArray:
    """A fixed-size-list column from a (rows, d) float matrix; rows where `valid` is False are
    null. int8 / uint8 need the calibration `ranges` of this dimension."""
    if dtype in SCALAR:
        values = pa.array(quantize(matrix, ranges, dtype).reshape(-1))
        width = matrix.shape[1]
    elif dtype in PACKED:
        packed = np.packbits(matrix > 0, axis=1)
        values = pa.array((packed.astype(np.int16) - 128).astype(np.int8).reshape(-1) if dtype == "binary"
                          else packed.reshape(-1))
        width = packed.shape[1]
    else:
        values = pa.array(np.ascontiguousarray(matrix, dtype=np.float16 if dtype == "float16" else np.float32)
                          .reshape(-1))
        width = matrix.shape[1]
    mask = None if valid.all() else pa.array(~valid)
    return pa.FixedSizeListArray.from_arrays(values, width, mask=mask)


def vector_matrix(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The float32 (rows, d) matrix of a fixed-size-list vector column (its slice, if it is one).
    Null rows come out as whatever their slots hold: drop them first where that matters."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    dim = col.type.list_size
    values = col.values.slice(col.offset * dim, len(col) * dim)
    return values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(len(col), dim)


def comparable(col: pa.Array | pa.ChunkedArray, dtype: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """A vector column (no nulls) as a float (rows, d) matrix whose row cosines compare two
    columns stored alike: floats as they are, int8 / uint8 mapped back onto each dimension's
    calibrated range (`ranges`, the middle of each step), sign bits as +1 / -1."""
    m = vector_matrix(col)
    if dtype in SCALAR:
        steps = (ranges[1] - ranges[0]) / 255
        return ranges[0] + ((m + 128 if dtype == "int8" else m) + 0.5) * steps
    if dtype in PACKED:
        packed = (m + 128 if dtype == "binary" else m).astype(np.uint8)
        return np.unpackbits(packed, axis=1).astype(np.float32) * 2 - 1
    return m


# --- sparse and multi-vector columns ---------------------------------------------------------

SPARSE = "sparse"  # the sparse column's name: vocabulary ids and their weights
MULTI_VECTOR = "multi_vector"  # the multi-vector column's name: one vector per kept token
SPARSE_TYPE = pa.struct([pa.field("indices", pa.list_(pa.int32())), pa.field("values", pa.list_(pa.float32()))])
MULTI_DTYPES = {"float32": pa.float32(), "float16": pa.float16(), "int8": pa.int8()}


def multi_vector_type(dim: int, dtype: str) -> pa.DataType:
    return pa.list_(pa.list_(MULTI_DTYPES[dtype], dim))


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def prune(indices: np.ndarray, values: np.ndarray, top_k: int | None, min_weight: float
          ) -> tuple[np.ndarray, np.ndarray]:
    """A sparse row less its weights below `min_weight` and beyond its `top_k` largest (ties: the
    lower id kept); ids stay ascending."""
    keep = values >= min_weight if min_weight > 0 else np.ones(len(values), bool)
    if top_k is not None and int(keep.sum()) > top_k:
        cand = np.flatnonzero(keep)
        order = np.lexsort((indices[cand], -values[cand]))[:top_k]
        keep = np.zeros(len(values), bool)
        keep[cand[order]] = True
    return indices[keep], values[keep]


def _nulls(rows: list, valid: np.ndarray | None) -> np.ndarray:
    """bool per row: None, or not `valid`."""
    null = np.fromiter((r is None for r in rows), dtype=bool, count=len(rows))
    return null if valid is None else null | ~valid


def sparse_array(rows: list, valid: np.ndarray | None = None) -> pa.StructArray:
    """A sparse column from (ids, weights) per row; None (or `valid` False) rows are null."""
    n = len(rows)
    null = _nulls(rows, valid)
    lengths = [0 if null[i] else len(rows[i][0]) for i in range(n)]
    present = [r for i, r in enumerate(rows) if not null[i]]
    ids = np.concatenate([r[0] for r in present]).astype(np.int32) if present else np.zeros(0, np.int32)
    ws = np.concatenate([r[1] for r in present]).astype(np.float32) if present else np.zeros(0, np.float32)
    offsets = pa.array(_offsets(lengths))
    mask = pa.array(null) if null.any() else None
    return pa.StructArray.from_arrays([pa.ListArray.from_arrays(offsets, pa.array(ids)),
                                       pa.ListArray.from_arrays(offsets, pa.array(ws))],
                                      fields=list(SPARSE_TYPE), mask=mask)


def multi_vector_array(rows: list, dim: int, dtype: str, valid: np.ndarray | None = None) -> pa.ListArray:
    """A multi-vector column from a (vectors, dim) float matrix per row; None (or `valid` False)
    rows are null. int8: round(127 x value) of the unit vectors."""
    n = len(rows)
    null = _nulls(rows, valid)
    lengths = [0 if null[i] else len(rows[i]) for i in range(n)]
    present = [rows[i] for i in range(n) if not null[i] and len(rows[i])]
    flat = np.concatenate(present).reshape(-1) if present else np.zeros(0, np.float32)
    if dtype == "int8":
        flat = np.clip(np.rint(flat * 127), -127, 127).astype(np.int8)
    else:
        flat = flat.astype(np.float16 if dtype == "float16" else np.float32, copy=False)
    inner = pa.FixedSizeListArray.from_arrays(pa.array(flat), dim)
    return pa.ListArray.from_arrays(pa.array(_offsets(lengths)), inner,
                                    mask=pa.array(null) if null.any() else None)


def sparse_rows(col: pa.Array | pa.ChunkedArray) -> list:
    """(int32 ids, float32 weights) per row of a sparse column; None for a null row."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    ids, ws = col.field("indices"), col.field("values")
    id_off, w_off = ids.offsets.to_numpy(), ws.offsets.to_numpy()
    id_vals = ids.values.to_numpy(zero_copy_only=False)
    w_vals = ws.values.to_numpy(zero_copy_only=False)
    nulls = col.is_null().to_numpy(zero_copy_only=False)
    return [None if nulls[i] else (id_vals[id_off[i]:id_off[i + 1]], w_vals[w_off[i]:w_off[i + 1]])
            for i in range(len(col))]


def multi_vector_rows(col: pa.Array | pa.ChunkedArray) -> list:
    """A float32 (vectors, d) matrix per row of a multi-vector column (int8 read back as
    value / 127); None for a null row."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    inner = col.values
    dim = inner.type.list_size
    flat = inner.values.to_numpy(zero_copy_only=False).astype(np.float32)
    if pa.types.is_int8(inner.type.value_type):
        flat = flat / 127
    flat = flat[inner.offset * dim:] if inner.offset else flat
    off = col.offsets.to_numpy()
    nulls = col.is_null().to_numpy(zero_copy_only=False)
    return [None if nulls[i] else flat[off[i] * dim:off[i + 1] * dim].reshape(-1, dim) for i in range(len(col))]


def max_per_id(ids: np.ndarray, weights: np.ndarray, drop=()) -> tuple[np.ndarray, np.ndarray]:
    """Per token id its largest weight, ids in `drop` and weights <= 0 left out; ids ascending
    (FlagEmbedding's lexical weights; a chunked row's weights over its windows)."""
    ok = weights > 0
    if len(drop):
        ok &= ~np.isin(ids, list(drop))
    ids, weights = ids[ok], weights[ok]
    if not len(ids):
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    order = np.lexsort((-weights, ids))  # by id, the largest weight first
    ids, weights = ids[order], weights[order]
    first = np.concatenate([[True], ids[1:] != ids[:-1]])
    return ids[first].astype(np.int32), weights[first].astype(np.float32)


def merge_windows(r: str, parts: list):
    """A chunked row's sparse or multi-vector value from its windows' (long_text: chunk): sparse,
    each id's largest weight over the windows (SPLADE's max pooling over all the text's tokens);
    multi-vector, the windows' vectors one after another (MaxSim over the row is then the best
    window's match for each query vector)."""
    if len(parts) == 1:
        return parts[0]
    if r == "sparse":
        return max_per_id(np.concatenate([p[0] for p in parts]).astype(np.int64),
                          np.concatenate([p[1] for p in parts]))
    return np.concatenate(parts)
