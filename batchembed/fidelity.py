"""The fidelity guard: before a run, the engine and the model's own library must agree.

vLLM re-implements each model. When it pools differently, skips a module of the
sentence-transformers pipeline (a 2_Dense projection, a default prompt), or truncates
differently, every vector of a 100 M-row run is quietly wrong. So when an engine starts,
before its first vector, a sample of the corpus (the first rows in plan order) is embedded both by the
engine and by sentence-transformers, and the run refuses to start (exit 1) when a row's
cosine is below `fidelity_min_cosine`. The result is stored as _fidelity.json in the
output (a resumed run does not repeat it) and copied into the manifest.
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib.util
import logging
from typing import TYPE_CHECKING

import numpy as np

from .embed.batcher import embed_isolating
from .embed.tokenizer import Tokenizer
from .errors import RunError
from .output.layout import FIDELITY

if TYPE_CHECKING:
    from .job import Prepared

log = logging.getLogger(__name__)
SAMPLE_ROWS = 16
MAX_REFERENCE_BYTES = 4 * 2**30  # weights loaded on CPU beside the engine for the check


def recorded(p: Prepared) -> dict | None:
    """The check's result for this job, if a run of it made one."""
    obj = p.out.read_json(FIDELITY)
    return obj if obj and obj.get("job") == p.fingerprint.digest else None


def needed(p: Prepared) -> bool:
    return p.spec.fidelity_check != "off" and recorded(p) is None


def ensure(p: Prepared, engine) -> None:
    """Check a freshly started engine unless this job's check is off or already done."""
    if needed(p):
        check(p, engine)


@functools.lru_cache(maxsize=2)
def _reference(path: str, max_length: int):
    from sentence_transformers import SentenceTransformer

    try:  # its per-weight progress bar is noise in a run's log
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    st = SentenceTransformer(path, device="cpu")
    st.max_seq_length = max_length
    return st


def _skip_reason(p: Prepared) -> str | None:
    if not (p.model.path / "modules.json").is_file():
        return "the model folder has no modules.json (not a sentence-transformers model)"
    if importlib.util.find_spec("sentence_transformers") is None:
        return "sentence-transformers is not installed"
    weights = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in p.model.path.glob(pattern))
    if weights > MAX_REFERENCE_BYTES:
        return (f"the model's weights are {weights / 2**30:.1f} GiB, too large to load a second time on CPU "
                "for the check; fidelity_check: off silences this")
    return None


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two (rows, dim) matrices, in float64.

    Both sides come back "normalised", but in bf16 their norms are off by up to a few parts in
    a thousand, so a bare dot product read above 1 (mean 1.0005 for MiniLM bf16 on an H200)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.sum(a * b, axis=1) / np.where(norms > 0, norms, 1.0)


def check(p: Prepared, engine) -> dict:
    """Run the check (or record why it was skipped); raise RunError when the two disagree."""
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    result: dict = {"job": p.fingerprint.digest, "checked_at": now, "min_cosine_required": p.spec.fidelity_min_cosine}
    reason = _skip_reason(p)
    texts = p.first_texts(SAMPLE_ROWS) if reason is None else []
    if reason is None and not texts:
        reason = "the input has no non-null text"
    if reason is not None:
        log.warning("fidelity check skipped: %s", reason)
        result.update(status="skipped", reason=reason)
    else:
        ours, bad = embed_isolating(engine, Tokenizer(p.model.path, p.max_length, p.spec.model.text_prefix)(texts).ids)
        if bad:  # rows the engine fails alone are the run's to report (_errors/), not a disagreement
            ours = np.delete(ours, list(bad), axis=0)
            texts = [t for i, t in enumerate(texts) if i not in bad]
        theirs = _reference(str(p.model.path), p.max_length).encode(
            [p.spec.model.text_prefix + t for t in texts], normalize_embeddings=True, convert_to_numpy=True,
            show_progress_bar=False)
        theirs = np.asarray(theirs, dtype=np.float32)
        if ours.shape != theirs.shape:
            result.update(status="failed", rows=len(texts),
                          reason=f"the engine gives {ours.shape[1]} values per row, sentence-transformers "
                                 f"{theirs.shape[1]} (a projection module such as 2_Dense not applied?)")
        else:
            cos = cosines(ours, theirs)
            result.update(rows=len(texts), min_cosine=round(float(cos.min()), 6),
                          mean_cosine=round(float(cos.mean()), 6),
                          status="passed" if cos.min() >= p.spec.fidelity_min_cosine else "failed")
            if result["status"] == "failed":
                result["reason"] = (f"cosine between the engine's and sentence-transformers' vectors is "
                                    f"{cos.min():.4f} at worst (mean {cos.mean():.4f}) over {len(texts)} rows, "
                                    f"below {p.spec.fidelity_min_cosine}")
        log.info("fidelity check %s: %s", result["status"],
                 {k: result[k] for k in ("rows", "min_cosine", "mean_cosine") if k in result})
    if result["status"] == "failed":
        raise RunError(f"fidelity check failed for {p.model.path}: {result['reason']}. The engine may pool "
                       "differently, skip a module or a default prompt of the model; nothing was written. "
                       "Set fidelity_check: off to run anyway")
    p.out.write_json(FIDELITY, result)
    return result
