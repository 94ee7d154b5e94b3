"""A run's figures: what each worker reports, the one builder that adds reports into a
RunResult, and the Stats a run returns and the manifest records. Pure logic."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .output.records import TOTALS

Calls = list[tuple[float, float, int]]  # (start, end, tokens): an engine's busy spans, one per window


@dataclass
class WorkerReport:
    """What one worker (one engine's worth of work) hands back, whichever executor ran it."""

    records: dict[str, dict] = field(default_factory=dict)  # part name -> commit record
    failed: list[dict] = field(default_factory=list)  # tasks abandoned under on_error: skip
    engine_start_seconds: float | None = None  # None: this worker never needed an engine
    engine_seconds: float = 0.0  # busy time
    calls: Calls = field(default_factory=list)
    node: str | None = None  # where it ran (Ray)


@dataclass
class RunResult:
    """What an executor hands back: commit records by part name, failures, engine time."""

    records: dict[str, dict] = field(default_factory=dict)
    failed: list[dict] = field(default_factory=list)
    engines: int = 0
    engine_start_seconds: float = 0.0
    pipeline_seconds: float = 0.0
    engine_seconds: float = 0.0  # busy time of the average engine
    steady_tokens_per_s: float | None = None
    throughput: list = field(default_factory=list)
    tail_seconds: float | None = None  # from the first engine's last call to the last engine's
    window_seconds: float | None = None  # a full window's work (see tail)


def tail(calls: list[Calls]) -> tuple[float | None, float | None]:
    """(tail, window): how long the first engine to run out of work waited for the last one, and
    a full window's work: the median call of those with at least half the tokens of the largest.
    A part's last window is often a remnant (parts of 11,000 rows: a window of 8,192 rows and one
    of 2,808), and the median of every call then fell between the two. With one engine, no tail."""
    largest = max((n for c in calls for _, _, n in c), default=0)
    flat = [t1 - t0 for c in calls for t0, t1, n in c if 2 * n >= largest]
    window = round(float(np.median(flat)), 3) if flat else None
    if len(calls) < 2:
        return None, window
    ends = [c[-1][1] for c in calls]
    return round(max(ends) - min(ends), 3), window


def combine(reports: list[WorkerReport], wall_seconds: float) -> RunResult:
    """One RunResult from every worker's report. Engines may start one after another: start-up
    counts until the last is up, and the pipeline from when the first could work, so
    tokens / pipeline_seconds never credits the later ones with work the first did alone."""
    started = [r for r in reports if r.engine_start_seconds is not None]
    starts = [r.engine_start_seconds for r in started]
    calls = [r.calls for r in started if r.calls]
    return RunResult(
        records={k: v for r in reports for k, v in r.records.items()},
        failed=[f for r in reports for f in r.failed],
        engines=len(started),
        engine_start_seconds=max(starts, default=0.0),
        pipeline_seconds=max(0.0, wall_seconds - min(starts, default=0.0)),
        engine_seconds=sum(r.engine_seconds for r in started) / max(1, len(started)),
        steady_tokens_per_s=steady_rate(calls),
        throughput=throughput(calls),
        tail_seconds=tail(calls)[0],
        window_seconds=tail(calls)[1],
    )


def steady_rate(calls: list[Calls]) -> float | None:
    """Engine tokens/s while every engine was running: from the last engine's first call to
    the first engine's last call, counting calls that straddle either end pro rata. Engine
    start-up and the tail where some engines have run out of work do not dilute it."""
    if not calls:
        return None
    start, end = max(c[0][0] for c in calls), min(c[-1][1] for c in calls)
    if end <= start:
        return None
    tokens = sum(n * max(0.0, min(t1, end) - max(t0, start)) / (t1 - t0)
                 for c in calls for t0, t1, n in c if t1 > t0)
    return round(tokens / (end - start), 1)


def throughput(calls: list[Calls], slices: int = 60) -> list[list[float]]:
    """Engine tokens/s in `slices` equal slices of time from the first engine call to the last,
    all engines together; a call spanning slices counts pro rata. For the report's plot."""
    flat = [c for cs in calls for c in cs if c[1] > c[0]]
    if not flat:
        return []
    start, end = min(c[0] for c in flat), max(c[1] for c in flat)
    width = (end - start) / slices
    tokens = np.zeros(slices)
    for t0, t1, n in flat:
        a, b = int((t0 - start) / width), min(slices - 1, int((t1 - start) / width))
        for i in range(a, b + 1):
            lo, hi = max(t0, start + i * width), min(t1, start + (i + 1) * width)
            tokens[i] += n * max(0.0, hi - lo) / (t1 - t0)
    return [[round((i + 0.5) * width, 2), round(float(tokens[i] / width), 1)] for i in range(slices)]


@dataclass
class Stats:
    """Counts over the whole output (parts done before included) and figures of this run.

    rows = embedded + deduplicated + reused + nulls: `embedded` rows went through the
    engine, `deduplicated` ones had the same text as a row embedded in this run,
    `reused` ones took the previous output's vector (incremental), and `deleted`
    counts rows of the previous output whose id is gone. `tokens` are engine tokens
    (a part copied from a previous output keeps the count of its source).
    """

    rows: int = 0
    embedded: int = 0
    reused: int = 0
    deduplicated: int = 0
    deleted: int = 0
    tokens: int = 0
    truncated: int = 0
    chunked: int = 0  # long_text: chunk: rows embedded as several windows
    nulls: int = 0
    empty: int = 0
    filtered: int = 0  # input rows input.where left out (not in the output)
    failed_rows: int = 0  # rows the engine failed alone: a null vector, and a line in _errors/
    sparse_weights: int = 0  # non-zero weights written in the sparse column
    sparse_pruned: int = 0  # weights embedding.sparse's top_k / min_weight dropped
    multi_vectors: int = 0  # token vectors written in the multi-vector column
    tasks_run: int = 0
    tasks_skipped: int = 0
    rows_run: int = 0  # written by this run (the counts above include parts done before)
    tokens_run: int = 0  # through the engine in this run
    failed: int = 0
    engines: int = 0
    seconds: float = 0.0
    engine_start_seconds: float = 0.0  # loading the engine
    pipeline_seconds: float = 0.0  # from the first read to the last commit
    engine_seconds: float = 0.0  # inside engine calls; engine idle share = 1 - this / pipeline_seconds
    steady_tokens_per_s: float | None = None  # while every engine was running (see steady_rate)
    tail_seconds: float | None = None  # engines done waiting for the last one (see tail)
    window_seconds: float | None = None  # a full window's work (see tail)
    throughput: list = field(default_factory=list)  # [seconds, tok/s] per time slice; in the manifest only
    index: dict | None = None  # output.index as built (or kept) by this run, with its build seconds

    def add(self, record: dict) -> None:
        for k in TOTALS:
            setattr(self, k, getattr(self, k) + int(record.get(k, 0)))

    def add_run(self, records: list[dict], result: RunResult) -> None:
        """This run's records and figures."""
        for r in records:
            self.add(r)
            self.rows_run += r["rows"]
            if "copied_from" not in r:
                self.tokens_run += r["tokens"]
        self.tasks_run = len(records)
        self.engines = result.engines
        self.engine_start_seconds += result.engine_start_seconds
        self.pipeline_seconds = result.pipeline_seconds
        self.engine_seconds = result.engine_seconds
        self.steady_tokens_per_s = result.steady_tokens_per_s
        self.tail_seconds, self.window_seconds = result.tail_seconds, result.window_seconds
        self.throughput = result.throughput

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("throughput")
        for k in ("seconds", "engine_start_seconds", "pipeline_seconds", "engine_seconds"):
            d[k] = round(d[k], 3)
        d["engine_idle_share"] = (round(1 - self.engine_seconds / self.pipeline_seconds, 4)
                                  if self.pipeline_seconds else None)
        d["tokens_per_s"] = round(self.tokens_run / self.seconds, 1) if self.seconds else 0.0
        d["rows_per_s"] = round(self.rows_run / self.seconds, 1) if self.seconds else 0.0
        return d
