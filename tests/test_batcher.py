import numpy as np
import pytest

from batchembed.embed.batcher import token_budget_batches


@pytest.mark.parametrize("seed", range(5))
def test_every_row_once_within_budget_and_row_cap(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 257, size=1000)
    batches = token_budget_batches(lengths, token_budget=2048, max_rows=64)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(1000))
    for b in batches:
        assert len(b) <= 64
        assert lengths[b].sum() <= 2048
        assert (np.diff(lengths[b]) <= 0).all()  # longest first inside the window


def test_a_row_longer_than_the_budget_gets_its_own_batch():
    batches = token_budget_batches(np.array([5, 500, 5]), token_budget=100, max_rows=10)
    assert [b.tolist() for b in batches] == [[1], [0, 2]]


def test_empty_window():
    assert token_budget_batches(np.array([], dtype=np.int64), 100, 10) == []


def test_a_failed_rows_zeros_stack_with_the_engines_tensors():
    """embed_isolating fills a row the engine failed alone with numpy zeros beside vLLM's tensors."""
    import torch

    from batchembed.embed.engine import Pending

    p = Pending(3, 4)
    p.put(0, torch.ones(4, dtype=torch.bfloat16))
    p.put(1, p.empty_row())
    p.put(2, torch.full((4,), 2.0))
    m = p.matrix()
    assert m.dtype == np.float32 and m.tolist() == [[1.0] * 4, [0.0] * 4, [2.0] * 4]
