"""int8 / uint8 output: per-dimension ranges from a calibration sample, fixed for the whole output.

Scalar quantisation as sentence-transformers' quantize_embeddings defines it: for each
dimension, [min, max] over calibration embeddings is cut into 255 steps. The ranges must be
the same for every part, shard and resumed run, or vectors written at different times would
not compare. So they are computed once, from the first `embedding.calibration_rows` non-null
rows in plan order (the same rows whichever shard gets there first), and stored beside the
parts as _calibration.json; every later run, shard and engine process reads them from there.
Each part's commit record names the ranges it was written with, and the manifest refuses
parts written with others.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .embed.batcher import embed_rows
from .embed.matryoshka import reduce
from .errors import RunError
from .output.layout import CALIBRATION

if TYPE_CHECKING:
    from .job import Prepared

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    ranges: dict[int, np.ndarray]  # dimension -> (2, d) float32: per-dimension min and max
    rows: int
    digest: str


def _parse(obj: dict) -> Calibration:
    ranges = {int(d): np.asarray(r, dtype=np.float32) for d, r in obj["ranges"].items()}
    return Calibration(ranges, int(obj["rows"]), obj["digest"])


def load(p: Prepared) -> Calibration | None:
    """The output's calibration, if one was made for this job."""
    obj = p.out.read_json(CALIBRATION)
    if not obj or obj.get("job") != p.fingerprint.digest:
        return None
    return _parse(obj)


def require(p: Prepared) -> Calibration:
    c = load(p)
    if c is None:
        raise RunError(f"{p.out.url_of(CALIBRATION)} is missing: int8/uint8 parts need the output's calibration, made "
                       "at the start of the run")
    return c


def ensure(p: Prepared, engine) -> Calibration:
    """Load the output's calibration, or make it from the first rows in plan order and store it."""
    c = load(p)
    if c is not None:
        return c
    want = p.spec.embedding.calibration_rows
    texts = p.first_texts(want)
    if len(texts) < 2:
        raise RunError(f"embedding.output_dtype {p.spec.embedding.output_dtype}: the input has "
                       f"{len(texts)} non-null text(s), too few to calibrate ranges")
    if len(texts) < 100:
        log.warning("int8 calibration from only %d rows; ranges are more stable from more", len(texts))
    log.info("calibrating %s ranges from the first %d rows", p.spec.embedding.output_dtype, len(texts))
    tok = p.tokenizer()(texts)
    full, ok = embed_rows(engine, tok, np.arange(len(texts)))
    reduced = reduce(full[ok], p.dimensions)  # rows the engine fails alone have no vector to count
    ranges = {d: np.vstack((m.min(axis=0), m.max(axis=0))).astype(np.float32) for d, m in reduced.items()}
    body = {"ranges": {str(d): r.tolist() for d, r in ranges.items()}, "rows": len(texts)}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    # Shards that start together may both get here; the first stored wins, the rest use it.
    again = load(p)
    if again is not None:
        return again
    p.out.write_json(CALIBRATION, {**body, "digest": digest, "job": p.fingerprint.digest,
                                           "precision": p.spec.embedding.output_dtype,
                                           "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")})
    return require(p)
