"""long_text: chunk: a long text is cut into overlapping windows, each embedded, pooled into one vector."""

from __future__ import annotations

import json

import numpy as np
import torch
from helpers import make_job, read_output, write_parquet

from batchembed.run import run_job

WORDS = "river mountain lantern copper orchard harbour violin meadow quartz falcon".split()
MATHS = "algebra theorem proof lemma integral matrix vector tensor manifold prime".split()


def long_text(seed: int, words: int, vocabulary=WORDS) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(vocabulary, size=words).tolist()) + f" end {seed}."


def reference(st_model, text: str, max_length: int, overlap: int) -> np.ndarray:
    """Independent of batchembed: windows of the token ids, [CLS] .. [SEP] each, mean-pooled by the
    model's own transformer, normalised, then averaged weighted by window length."""
    tok = st_model.tokenizer
    body = tok(text, add_special_tokens=False)["input_ids"]
    w = max_length - 2
    starts = list(range(0, max(len(body) - w, 0) + 1, w - overlap))
    if starts[-1] + w < len(body):
        starts.append(len(body) - w)
    total, weight = 0, 0
    for s in starts:
        ids = [tok.cls_token_id, *body[s:s + w], tok.sep_token_id]
        with torch.no_grad():
            hidden = st_model[0].auto_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        v = hidden.mean(dim=0).numpy()
        v = v / np.linalg.norm(v)
        total, weight = total + v * len(ids), weight + len(ids)
    v = total / weight
    return v / np.linalg.norm(v)


def test_long_rows_are_chunked_and_pooled_short_rows_are_untouched(tmp_path, engine, st_model, model_info):
    # the last row starts on one subject and goes on about another: truncation would keep only the first
    texts = [long_text(1, 700), "a short row stays one window", long_text(2, 300), None,
             long_text(3, 200) + " " + long_text(4, 1000, MATHS)]
    write_parquet(tmp_path / "in.parquet", {"id": list(range(5)), "text": texts})
    spec = make_job(tmp_path / "in.parquet", tmp_path / "out", model={"long_text": "chunk", "chunk_overlap": 16})
    stats = run_job(spec, engine=engine, show_progress=False)
    assert stats.chunked == 3 and stats.truncated == 0 and stats.nulls == 1
    got = read_output(tmp_path / "out").column("embedding").to_pylist()
    ml = model_info.max_length
    for i in (0, 2, 4):
        want = reference(st_model, texts[i], ml, 16)
        assert float(np.dot(np.asarray(got[i], np.float32), want)) > 0.999, i
    short = st_model.encode([texts[1]], normalize_embeddings=True)[0]
    assert float(np.dot(np.asarray(got[1], np.float32), short)) > 0.9999
    # a chunked vector is not the truncated one
    truncated = st_model.encode([texts[4]], normalize_embeddings=True)[0]
    assert float(np.dot(np.asarray(got[4], np.float32), truncated)) < 0.9
    m = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert m["model"]["long_text"] == "chunk" and m["model"]["chunk_overlap"] == 16
    assert m["counts"]["chunked"] == 3 and m["job"]["long_text"] == "chunk:16"


def test_windows_fit_the_engine_and_overlap_must_leave_room(model_info):
    import pytest

    from batchembed.embed.tokenizer import Tokenizer
    from batchembed.errors import JobError

    tok = Tokenizer(model_info.path, 32, "passage: ", "chunk", 8)
    t = tok([long_text(5, 200), "short", None])
    windows = t.chunks[0]
    assert 0 in t.chunks and 1 not in t.chunks and len(t.valid) == 3
    assert all(len(w) <= 32 for w in windows) and len(windows) > 5
    prefix = tok._plain.encode("passage: ", add_special_tokens=False).ids
    assert all(w[1:1 + len(prefix)] == prefix for w in windows)  # the prefix in every window
    assert windows[0][1 + len(prefix):][-9:-1] == windows[1][1 + len(prefix):][:8]  # 8 tokens shared
    with pytest.raises(JobError, match="model.chunk_overlap: 40"):
        Tokenizer(model_info.path, 32, "", "chunk", 40)
