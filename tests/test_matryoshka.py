import numpy as np
import pytest

from batchembed.embed.matryoshka import column_names, l2_normalise, reduce


def test_truncate_then_renormalise():
    rng = np.random.default_rng(0)
    full = l2_normalise(rng.normal(size=(50, 384)))
    out = reduce(full, [384, 128, 64])
    for d, m in out.items():
        assert m.shape == (50, d)
        np.testing.assert_allclose(np.linalg.norm(m, axis=1), 1.0, atol=1e-6)
        cut = full[:, :d]
        np.testing.assert_allclose(m, cut / np.linalg.norm(cut, axis=1, keepdims=True), rtol=1e-6)
    # the bug this guards against: a plain slice of a normalised vector is shorter than 1
    assert np.linalg.norm(full[:, :64], axis=1).max() < 0.99


def test_dimension_outside_the_model_is_refused():
    with pytest.raises(ValueError):
        reduce(np.ones((2, 8), np.float32), [9])


def test_column_names():
    assert column_names([384]) == {384: "embedding"}
    assert column_names([384, 128]) == {384: "embedding_384", 128: "embedding_128"}
