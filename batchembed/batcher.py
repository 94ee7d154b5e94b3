"""Token-budget batching: cut a window of rows into engine calls of bounded size.

Rows are sorted by length inside the window (longest first, as
sentence-transformers does), so each call holds rows of similar length, and
the caller scatters results back by index, so output order is input order.
"""

from __future__ import annotations

import numpy as np


def token_budget_batches(lengths: np.ndarray, token_budget: int, max_rows: int) -> list[np.ndarray]:
    """Split row indices into batches of at most `token_budget` tokens and `max_rows` rows.

    A row longer than the budget still gets a batch of its own; nothing is dropped.
    Every index in range(len(lengths)) appears in exactly one batch.
    """
    if token_budget < 1 or max_rows < 1:
        raise ValueError("token_budget and max_rows must be >= 1")
    order = np.argsort(-np.asarray(lengths), kind="stable")
    batches: list[np.ndarray] = []
    start, tokens = 0, 0
    for pos, i in enumerate(order):
        n = int(lengths[i])
        if pos > start and (tokens + n > token_budget or pos - start >= max_rows):
            batches.append(order[start:pos])
            start, tokens = pos, 0
        tokens += n
    if start < len(order):
        batches.append(order[start:])
    return batches
