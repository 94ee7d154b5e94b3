"""Matryoshka reduction: truncate, THEN L2-renormalise.

Slicing an already normalised vector leaves its norm below 1; every reduced
vector here is renormalised. Several dimensions come from one engine pass: the
full vector is computed once and each dimension is cut from it.
"""

from __future__ import annotations

import numpy as np


def l2_normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    # A zero vector (never seen from a real model) stays zero rather than becoming NaN.
    return x / np.where(norms > 0, norms, 1.0)


def reduce(full: np.ndarray, dimensions: list[int]) -> dict[int, np.ndarray]:
    """For each d: normalise(full[:, :d]), float32, shape (rows, d)."""
    if full.ndim != 2:
        raise ValueError(f"expected a (rows, dim) matrix, got shape {full.shape}")
    out = {}
    for d in dimensions:
        if not 1 <= d <= full.shape[1]:
            raise ValueError(f"dimension {d} outside 1..{full.shape[1]}")
        out[d] = l2_normalise(full[:, :d])
    return out


def column_names(dimensions: list[int]) -> dict[int, str]:
    """`embedding` for one dimension, `embedding_<d>` for each of several."""
    if len(dimensions) == 1:
        return {dimensions[0]: "embedding"}
    return {d: f"embedding_{d}" for d in dimensions}
