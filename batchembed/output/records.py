"""Commit records: what a part holds, written beside it once it is published. Built here
and only here, whether the part was embedded or copied from a previous output.

A record carries the part's name, its counts, a histogram of the token lengths of its
embedded rows, the fingerprint of its input (file and blocks) and the job's identity.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np

# counted per part (commit records) and per run (Stats)
COUNTS = ("rows", "embedded", "reused", "deduplicated", "matched", "tokens", "truncated", "chunked", "nulls",
          "empty", "filtered", "failed_rows", "sparse_weights", "sparse_pruned", "multi_vectors")
TOTALS = tuple(k for k in COUNTS if k != "matched")  # added up over parts (matched only feeds `deleted`)
HISTOGRAM_BINS = 32  # token lengths of the embedded rows, per part and in the manifest


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def histogram_bin_width(max_length: int) -> int:
    return max(1, -(-max_length // HISTOGRAM_BINS))


def empty_counts() -> dict[str, int]:
    return dict.fromkeys(COUNTS, 0)


def commit_record(part: str, counts: dict[str, int], histogram, input_fingerprint: dict[str, Any],
                  job: dict[str, Any], **extra) -> dict[str, Any]:
    """The record of one committed part. `job` is the job's fingerprint with its digest."""
    return {"part": part, **{k: int(counts.get(k, 0)) for k in COUNTS},
            "length_histogram": [int(x) for x in np.asarray(histogram, dtype=np.int64)],
            "input": input_fingerprint, "job": job, "committed_at": now_utc(), **extra}


def copied_record(part: str, source: dict[str, Any], input_fingerprint: dict[str, Any], job: dict[str, Any],
                  copied_from: str) -> dict[str, Any]:
    """The record of a part copied unchanged from a previous output: every count and the token
    histogram of its source, its rows now reused rather than embedded (rows = reused + nulls)."""
    counts = {**{k: source.get(k, 0) for k in COUNTS}, "embedded": 0, "deduplicated": 0,
              "reused": source["rows"] - source.get("nulls", 0), "matched": source["rows"]}
    histogram = source.get("length_histogram") or np.zeros(HISTOGRAM_BINS, dtype=np.int64)
    return commit_record(part, counts, histogram, input_fingerprint, job, copied_from=copied_from)


def add_histograms(records) -> list[int]:
    return sum((np.asarray(r.get("length_histogram", 0)) for r in records),
               np.zeros(HISTOGRAM_BINS, dtype=np.int64)).tolist()
