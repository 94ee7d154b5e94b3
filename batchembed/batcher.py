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


def embed_rows(engine, tok, rows: np.ndarray) -> np.ndarray:
    """Vectors for rows `rows` of a Tokenized, in one engine call, sequences in token-budget
    batch order (vLLM's scheduler then runs our batches as its steps back to back).

    A chunked row (long_text: chunk) is the token-weighted mean of its windows' vectors,
    renormalised. Returns float32 (len(rows), dimension), L2-normalised rows."""
    if not tok.chunks:
        batches = token_budget_batches(tok.lengths[rows], engine.token_budget, engine.max_batch_rows)
        order = np.concatenate(batches)  # positions in rows
        out = np.empty((len(rows), engine.dimension), dtype=np.float32)
        out[order] = engine.embed([tok.ids[i] for i in rows[order].tolist()])
        return out
    seqs, owner = [], []
    for k, i in enumerate(rows.tolist()):
        for ids in tok.chunks.get(i, (tok.ids[i],)):
            seqs.append(ids)
            owner.append(k)
    lengths = np.fromiter((len(x) for x in seqs), dtype=np.int64, count=len(seqs))
    order = np.concatenate(token_budget_batches(lengths, engine.token_budget, engine.max_batch_rows))
    vectors = np.empty((len(seqs), engine.dimension), dtype=np.float32)
    vectors[order] = engine.embed([seqs[j] for j in order])
    pooled = np.zeros((len(rows), engine.dimension), dtype=np.float64)
    np.add.at(pooled, np.asarray(owner), vectors * lengths[:, None])
    pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    return pooled.astype(np.float32)
