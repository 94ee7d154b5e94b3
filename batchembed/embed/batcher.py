"""Token-budget batching: cut a window of rows into engine steps of bounded size.

Rows are sorted by length inside the window (longest first, as
sentence-transformers does) and submitted in that order, so each engine step
holds rows of similar length; results are scattered back by index, so output
order is input order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import RequestFailure


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


@dataclass
class RowPlan:
    """The sequences that give some rows of a Tokenized their vectors, in submission order.

    A chunked row (long_text: chunk) has several sequences, its windows; its vector is their
    token-weighted mean, renormalised."""

    seqs: list[list[int]]  # token ids, in token-budget batch order
    order: np.ndarray  # seqs[k] is sequence order[k] of the unordered list
    rows: int
    owner: np.ndarray | None = None  # per unordered sequence: its row (chunked windows only)
    lengths: np.ndarray | None = None  # per unordered sequence: its tokens (chunked windows only)

    def row_of(self, k: int) -> int:
        """The row whose sequence is `seqs[k]`."""
        j = int(self.order[k])
        return j if self.owner is None else int(self.owner[j])

    def failed_rows(self, bad) -> np.ndarray:
        """bool per row: one of its sequences is among `bad` (positions in `seqs`)."""
        failed = np.zeros(self.rows, dtype=bool)
        failed[[self.row_of(k) for k in bad]] = True
        return failed

    def vectors(self, submitted: np.ndarray) -> np.ndarray:
        """float32 (rows, dimension) L2-normalised rows, from the vectors of `seqs` in order."""
        vectors = np.empty_like(submitted)
        vectors[self.order] = submitted
        if self.owner is None:
            return vectors
        pooled = np.zeros((self.rows, submitted.shape[1]), dtype=np.float64)
        np.add.at(pooled, self.owner, vectors * self.lengths[:, None])
        pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled.astype(np.float32)

    def values(self, submitted: list, merge) -> list:
        """Per row, from per-sequence values in `seqs` order (a sparse or multi-vector value each):
        a chunked row's from its windows, in order, by `merge(list)`."""
        per_seq: list = [None] * len(submitted)
        for k, j in enumerate(self.order.tolist()):
            per_seq[j] = submitted[k]
        if self.owner is None:
            return per_seq
        rows: list[list] = [[] for _ in range(self.rows)]
        for j, k in enumerate(self.owner.tolist()):
            rows[k].append(per_seq[j])
        return [merge(parts) for parts in rows]


def plan_rows(tok, rows: np.ndarray, token_budget: int, max_rows: int) -> RowPlan:
    """What to submit for rows `rows` of a Tokenized, in token-budget batch order (vLLM's
    scheduler then runs our batches as its steps back to back)."""
    def batch_order(lengths: np.ndarray) -> np.ndarray:
        batches = token_budget_batches(lengths, token_budget, max_rows)
        return np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)

    if not tok.chunks:
        order = batch_order(tok.lengths[rows])
        return RowPlan(tok.ids.lists(rows[order].tolist()), order, len(rows))
    seqs, owner = [], []
    for k, i in enumerate(rows.tolist()):
        for ids in tok.chunks.get(i, (tok.ids[i],)):
            seqs.append(ids)
            owner.append(k)
    lengths = np.fromiter((len(x) for x in seqs), dtype=np.int64, count=len(seqs))
    order = batch_order(lengths)
    return RowPlan([seqs[j] for j in order], order, len(rows), np.asarray(owner), lengths)


def embed_isolating(engine, seqs: list[list[int]]):
    """Results of `seqs`, waiting for them; where the engine fails a call (RequestFailure), its
    sequences are submitted again in halves, and halves of halves, until each that fails alone is
    found. Returns (an engine.Pending, done: a failed sequence holds an empty row; why each
    failed, by position). A call with no such sequence costs nothing extra."""
    out = engine.pending(len(seqs))
    bad: dict[int, str] = {}
    todo = [(0, len(seqs))] if seqs else []
    while todo:
        lo, hi = todo.pop()
        try:
            part = engine.submit(seqs[lo:hi])
            while not part.done:
                engine.step()
            out.take(part, lo)
        except RequestFailure as e:
            if hi - lo == 1:
                bad[lo] = str(e)
                out.put(lo, out.empty_row())
            else:
                mid = (lo + hi) // 2
                todo += [(mid, hi), (lo, mid)]
    return out, bad


def embed_rows(engine, tok, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense vectors for rows `rows` of a Tokenized, waiting for them: float32 (len(rows),
    dimension), and which rows have one (a row the engine fails alone has none)."""
    plan = plan_rows(tok, rows, engine.token_budget, engine.max_batch_rows)
    pending, bad = embed_isolating(engine, plan.seqs)
    return plan.vectors(pending.matrix()), ~plan.failed_rows(bad)
