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
