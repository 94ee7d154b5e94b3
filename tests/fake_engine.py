"""A fake engine that implements the real Engine interface (submit / step / abort / embed /
close, with the same Pending results): for fast tests of everything around the engine.

Its vector for a sequence is a pseudo-random unit vector seeded by the sequence's token
ids, so equal texts get equal vectors and any mix-up of rows shows. It counts what it was
asked to embed. `fail_marker`: a token id that makes a step fail, as a poisoned row would.
"""

from __future__ import annotations

import hashlib

import numpy as np

from batchembed.embed.engine import EngineKey, Pending
from batchembed.errors import RequestFailure, RunError


def fake_vector(token_ids: list[int], dimension: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(np.asarray(token_ids, np.int64).tobytes(), digest_size=8).digest(), "little")
    v = np.random.default_rng(seed).standard_normal(dimension).astype(np.float32)
    return v / np.linalg.norm(v)


class FakeEngine:
    def __init__(self, model_info, dtype: str = "float32", max_length: int | None = None,
                 token_budget: int = 512, max_batch_rows: int = 64, rows_per_step: int = 50,
                 fail_marker: int | None = None):
        self.key = EngineKey(str(model_info.path), dtype, max_length or model_info.max_length)
        self.dtype = dtype
        self.dimension = model_info.dimension
        self.token_budget, self.max_batch_rows, self.rows_per_step = token_budget, max_batch_rows, rows_per_step
        self.queue: list[tuple[Pending, int, list[int]]] = []
        self.calls = 0
        self.sequences = 0  # sequences embedded over the engine's life
        self.closed = False
        self.fail_marker = fail_marker

    def pending(self, rows: int) -> Pending:
        return Pending(rows, self.dimension)

    def submit(self, token_ids: list[list[int]]) -> Pending:
        pending = self.pending(len(token_ids))
        if token_ids:
            self.calls += 1
            self.queue += [(pending, i, ids) for i, ids in enumerate(token_ids)]
        return pending

    def step(self) -> None:
        if not self.queue:
            raise RunError("the engine finished its requests but vectors never came back")
        now, self.queue = self.queue[: self.rows_per_step], self.queue[self.rows_per_step:]
        if self.fail_marker is not None and any(self.fail_marker in ids for _, _, ids in now):
            self.queue = []  # the whole step fails, as a real one does on a row it cannot take
            raise RequestFailure(f"the step failed on token {self.fail_marker}")
        for pending, i, ids in now:
            pending.put(i, fake_vector(ids, self.dimension))
        self.sequences += len(now)

    def abort(self) -> None:
        self.queue = []

    def embed(self, token_ids: list[list[int]]) -> np.ndarray:
        pending = self.submit(token_ids)
        while not pending.done:
            self.step()
        return pending.matrix()

    def close(self) -> None:
        self.closed = True

    leave = close
