"""A run: check the job (prepare), see what the output already holds (resume), stream
what is pending through the pipeline (pipeline.py), then write the manifest."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from . import __version__, calibration, fidelity, storage
from .config import JobSpec
from .errors import BatchembedError, JobError, RunError
from .matryoshka import column_names
from .model import ModelInfo, model_content_hash, read_model_info
from .incremental import TEXT_HASH, Previous, copy_parts, open_previous
from .pipeline import HISTOGRAM_BINS, TOTALS, Pipeline, histogram_bin_width, now_utc, record_base
from .plan import JobFingerprint, Task, in_shard, make_tasks
from .reader import InputFile, inspect_inputs, iter_batches, needed_columns, select_rows
from .storage import (RetryPolicy, full_url, list_parquet_files, open_fs, read_json, remove, retry,
                      write_bytes_atomic, write_json_atomic)
from .tokenizer import make_tokenizer, model_tokenizer
from .writer import COMMITS, MANIFEST, PACKED, SCALAR, SUCCESS, vector_type

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """Everything known before the engine loads."""

    spec: JobSpec
    model: ModelInfo
    max_length: int
    dimensions: list[int]
    files: list[InputFile]
    tasks: list[Task]
    in_fs: Any
    out_fs: Any
    out_root: str
    fingerprint: JobFingerprint
    warnings: list[str] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)  # unreadable inputs, with on_error: skip
    previous: Previous | None = None  # incremental: the output whose vectors may be reused

    @property
    def output_schema(self) -> pa.Schema:
        schema = self.files[0].schema
        cols = [c for c in [self.spec.input.id_column, *self.spec.input.carry_columns] if c]
        fields = [schema.field(c) for c in dict.fromkeys(cols)]
        fields.append(pa.field(TEXT_HASH, pa.uint64()))
        names = column_names(self.dimensions)
        fields += [pa.field(names[d], vector_type(d, self.spec.embedding.output_dtype)) for d in self.dimensions]
        return pa.schema(fields)


def _check_model_fit(spec: JobSpec, model: ModelInfo, max_length: int, dims: list[int], warnings: list[str]) -> None:
    if max_length > model.position_limit:
        raise JobError(f"model.max_length: {max_length} is more than {model.path.name} allows "
                       f"({model.position_limit} positions)")
    if max_length > model.max_length:
        warnings.append(f"model.max_length {max_length} is above the {model.max_length} tokens the model was "
                        "trained with; quality may drop past that")
    too_big = [d for d in dims if d > model.dimension]
    if too_big:
        raise JobError(f"embedding.dimensions: {too_big[0]} is larger than the model's dimension {model.dimension}")
    if any(d < model.dimension for d in dims) and not model.is_matryoshka:
        warnings.append(f"embedding.dimensions {dims}: the model does not declare Matryoshka training "
                        "(is_matryoshka / matryoshka_dimensions in config.json); truncated vectors may lose "
                        "much more quality than for a Matryoshka model")
    if model.matryoshka_dimensions:
        untrained = [d for d in dims if d not in model.matryoshka_dimensions and d != model.dimension]
        if untrained:
            warnings.append(f"embedding.dimensions {untrained} are not among the model's trained Matryoshka "
                            f"dimensions {list(model.matryoshka_dimensions)}")
    if spec.engine.token_budget is not None and spec.engine.token_budget < max_length:
        raise JobError(f"engine.token_budget: {spec.engine.token_budget} is below model.max_length {max_length}; "
                       "one full-length row must fit in a call")


def _check_columns(spec: JobSpec, dims: list[int] | None) -> None:
    if spec.embedding.output_dtype in PACKED and dims and any(d % 8 for d in dims):
        raise JobError(f"embedding.dimensions: {next(d for d in dims if d % 8)} is not a multiple of 8, which "
                       f"output_dtype {spec.embedding.output_dtype} needs (8 dimensions to a byte)")
    ours = {*column_names(dims or [0]).values(), TEXT_HASH} if dims else {"embedding", TEXT_HASH}
    clash = [c for c in [spec.input.id_column, *spec.input.carry_columns] if c in ours]
    if clash:
        key = "input.id_column" if clash[0] == spec.input.id_column else "input.carry_columns"
        raise JobError(f"{key}: {clash[0]!r} is also the name of an output column batchembed writes "
                       f"({', '.join(sorted(ours))}); rename it in the input or leave it out")


def _read_inputs(spec: JobSpec):
    in_fs, in_root, paths = list_parquet_files(spec.input.uri, spec.input.storage_options)
    files, failed = inspect_inputs(in_fs, in_root, paths, spec.input, skip_unreadable=spec.on_error == "skip")
    if not files:
        raise RunError(f"no input file could be read ({len(failed)} failed), e.g. {failed[0]['error']}")
    return in_fs, files, failed


def prepare(spec: JobSpec, all_problems: bool = False) -> Prepared:
    """Check the job against the model, the input (footers only) and the output location.

    Raises JobError (or RunError for input that cannot be read) at the first problem;
    with `all_problems` (validate), every check that does not depend on a failed one
    runs, and one JobError lists every problem found.
    """
    problems: list[str] = []

    def check(fn):
        try:
            return fn()
        except (JobError, RunError) as e:
            if not all_problems:
                raise
            problems.append(str(e))
            return None

    warnings: list[str] = []
    model = check(lambda: read_model_info(spec.model.name))
    max_length, dims = spec.model.max_length, spec.embedding.dimensions
    if model is not None:
        max_length = max_length or model.max_length
        dims = dims or [model.dimension]
        check(lambda: _check_model_fit(spec, model, max_length, dims, warnings))
        if spec.model.long_text == "chunk":  # the windows must leave room for text
            check(lambda: model_tokenizer(model.path, max_length, spec.model))
    check(lambda: _check_columns(spec, dims))
    storage.policy = RetryPolicy(spec.retry.attempts, spec.retry.backoff_s)
    inputs = check(lambda: _read_inputs(spec))
    out = check(lambda: open_fs(spec.output.uri, spec.output.storage_options, "output.uri"))
    fp = previous = None
    if model is not None and out is not None:
        fp = JobFingerprint(
            model_hash=model_content_hash(model.path),
            dimensions=tuple(dims),
            output_dtype=spec.embedding.output_dtype,
            dtype=spec.model.dtype,
            max_length=max_length,
            prefix=spec.model.text_prefix,
            columns={"text": spec.input.text_column, "id": spec.input.id_column,
                     "carry": list(spec.input.carry_columns),
                     # only when set: outputs made before these keys existed keep their digest
                     **{k: v for k, v in (("text_sql", spec.input.text_sql), ("where", spec.input.where)) if v}},
            long_text="truncate" if spec.model.long_text == "truncate" else f"chunk:{spec.model.chunk_overlap}",
        )
        if spec.incremental is not None:
            inc = spec.incremental
            options = inc.storage_options if inc.storage_options is not None else spec.output.storage_options
            previous = check(lambda: open_previous(inc.previous, options, fp, spec.input.id_column,
                                                   full_url(out[0], out[1].rstrip("/"))))
    if problems:
        raise JobError(f"{len(problems)} problem(s) with the job:\n  " + "\n  ".join(problems))
    for w in warnings:
        log.warning(w)
    in_fs, files, failed = inputs
    out_fs, out_root = out[0], out[1].rstrip("/")
    return Prepared(spec, model, max_length, dims, files, make_tasks(files, spec.output.rows_per_part), in_fs,
                    out_fs, out_root, fp, warnings, failed, previous)


def estimate_tokens(p: Prepared, sample_rows: int = 2000) -> int:
    """Tokens the whole corpus will take, from the first rows of up to 4 files."""
    tok = make_tokenizer(p)
    seen_rows = seen_tokens = 0
    per_file = max(1, sample_rows // min(4, len(p.files)))
    for f in p.files[:4]:
        if not f.row_group_rows:
            continue
        for batch in iter_batches(p.in_fs, f, [0], needed_columns(p.spec.input), per_file):
            t = tok(select_rows(p.spec.input, batch)[1])
            seen_rows, seen_tokens = seen_rows + len(t.valid), seen_tokens + int(t.lengths.sum())
            break
    total_rows = sum(f.num_rows for f in p.files)
    return round(seen_tokens / seen_rows * total_rows) if seen_rows else 0


@dataclass
class OutputState:
    done: dict[int, dict]  # task index -> commit record, for tasks whose part is complete and current
    stale: list[str]  # paths of our files that no current task will rewrite
    complete: bool  # manifest and _SUCCESS present and every task done


def _job_diff(a: dict, b: dict) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} there, {b.get(k)!r} now" for k in keys)


def _our_files(p: Prepared) -> tuple[list[str], set[str]]:
    """(commit records, part files) under the output root."""
    fs, root = p.out_fs, p.out_root

    def listing() -> tuple[list[str], set[str]]:
        fs.invalidate_cache()
        commits = fs.glob(f"{root}/{COMMITS}/part-*.json") if fs.exists(f"{root}/{COMMITS}") else []
        parts = set(fs.glob(f"{root}/part-*.parquet")) if fs.exists(root) else set()
        return commits, parts

    return retry(listing, full_url(fs, root))


def clear_output(p: Prepared) -> None:
    """Remove everything batchembed wrote under the output root, marker first."""
    fs, root = p.out_fs, p.out_root
    commit_paths, part_paths = _our_files(p)
    for path in [f"{root}/{SUCCESS}", f"{root}/{MANIFEST}", *commit_paths, *sorted(part_paths),
                 f"{root}/{calibration.CALIBRATION}", f"{root}/{fidelity.FIDELITY}"]:
        remove(fs, path)


def output_state(p: Prepared) -> OutputState:
    """What the output already holds. Refuses (JobError) to mix results of a different job."""
    fs, root = p.out_fs, p.out_root
    commit_paths, part_paths = _our_files(p)
    manifest = read_json(fs, f"{root}/{MANIFEST}")
    records = [r for r in (read_json(fs, c) for c in commit_paths) if r]
    current = p.fingerprint.as_dict()
    foreign = [r for r in records + ([manifest] if manifest else []) if r.get("job", {}).get("digest", "")
               != p.fingerprint.digest]
    if foreign:
        theirs = {"layout": 1, **{k: v for k, v in foreign[0]["job"].items() if k != "digest"}}  # 1: no text_hash
        raise JobError(f"output.uri {full_url(fs, root)} holds embeddings made by a different job "
                       f"({_job_diff(theirs, current)}); rerun with --overwrite to replace them, "
                       "or write to a new output.uri")
    by_part = {r["part"]: r for r in records}
    done = {}
    for t in p.tasks:
        r = by_part.get(t.part_name)
        if r and r.get("input") == t.input_fingerprint and f"{root}/{t.part_name}" in part_paths:
            done[t.index] = r
    live = {f"{root}/{t.part_name}" for t in p.tasks}
    names = {t.part_name for t in p.tasks}
    # commit records go before their parts, so a part never outlives its record unnoticed
    stale = [c for c in commit_paths if c.rsplit("/", 1)[-1].replace(".json", ".parquet") not in names]
    stale += sorted(x for x in part_paths if x not in live)
    complete = (manifest is not None and retry(lambda: fs.exists(f"{root}/{SUCCESS}"), full_url(fs, root))
                and len(done) == len(p.tasks) and not stale and not p.failed)
    return OutputState(done, stale, complete)


@dataclass
class Stats:
    """Counts over the whole output (parts done before included) and figures of this run.

    rows = embedded + deduplicated + reused + nulls: `embedded` rows went through the
    engine, `deduplicated` ones had the same text as a row embedded in this run,
    `reused` ones took the previous output's vector (incremental), and `deleted`
    counts rows of the previous output whose id is gone. `tokens` are engine tokens.
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
    tasks_run: int = 0
    tasks_skipped: int = 0
    rows_run: int = 0  # embedded by this run (the counts above include parts done before)
    tokens_run: int = 0
    failed: int = 0
    engines: int = 0
    seconds: float = 0.0
    engine_start_seconds: float = 0.0  # loading the engine
    pipeline_seconds: float = 0.0  # from the first read to the last commit
    engine_seconds: float = 0.0  # inside engine calls; engine idle share = 1 - this / pipeline_seconds
    steady_tokens_per_s: float | None = None  # while every engine was running (see steady_rate)
    throughput: list = field(default_factory=list)  # [seconds, tok/s] per time slice; in the manifest only

    def add(self, other: dict) -> None:
        for k in TOTALS:
            setattr(self, k, getattr(self, k) + int(other.get(k, 0)))

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


_ENGINE_START = threading.Lock()  # engines start one at a time: placement goes through os.environ


def make_engine(p: Prepared, replica: int = 0, replicas: int = 1):
    from .engine import Engine

    with _ENGINE_START:
        return Engine(p.model, p.spec.model.dtype, p.max_length, p.spec.engine, replica, replicas)


@dataclass
class RunResult:
    """What an executor hands back: commit records by task index, failures, engine time."""

    records: dict[int, dict] = field(default_factory=dict)
    failed: list[dict] = field(default_factory=list)
    engines: int = 0
    engine_start_seconds: float = 0.0
    pipeline_seconds: float = 0.0
    engine_seconds: float = 0.0  # busy time of the average engine
    steady_tokens_per_s: float | None = None
    throughput: list = field(default_factory=list)


def _reporter(bar):
    """A thread-safe progress callback that feeds the bar rows and tokens/s."""
    lock = threading.Lock()
    started = time.perf_counter()
    tokens = 0

    def progress(step: dict) -> None:
        nonlocal tokens
        with lock:  # called from a writer or supervisor thread, not the one that made the bar
            tokens += step["tokens"]
            bar.update(step["rows"])
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - started, 1e-9):,.0f} tok/s", refresh=False)

    return progress


def _run_local(p: Prepared, engine, pending: list[Task], progress) -> RunResult:
    """The local executor: the given engine, or an engine of our own started when a window first
    needs it (reading starts meanwhile, and a run that only reuses vectors never loads one), or
    engine.data_parallel engine processes (processes.py)."""
    replicas = 1 if engine is not None else min(p.spec.engine.data_parallel, len(pending))
    if replicas > 1:
        from .processes import run_in_processes

        return run_in_processes(p, pending, progress, replicas)
    result = RunResult()
    started: list = []

    def make():
        if engine is not None:
            return engine
        t0 = time.perf_counter()
        e = make_engine(p)
        try:
            fidelity.ensure(p, e)  # part of start-up, timed with it
        except BaseException:
            e.close()
            raise
        started.append(e)
        result.engine_start_seconds = time.perf_counter() - t0
        return e

    task_queue: queue.Queue = queue.Queue()
    for t in pending:
        task_queue.put(t)
    pipelines = [Pipeline(p, make, task_queue, progress)] if pending else []  # several engines: processes
    t0 = time.perf_counter()
    try:
        for pl in pipelines:
            pl.run()
    finally:
        result.pipeline_seconds = time.perf_counter() - t0 - result.engine_start_seconds
        for e in started:
            e.close()
    result.records = {k: v for pl in pipelines for k, v in pl.records.items()}
    result.failed = [f for pl in pipelines for f in pl.failed]
    result.engines = sum(pl.engine is not None for pl in pipelines)
    result.engine_seconds = sum(pl.engine_seconds for pl in pipelines) / max(1, result.engines)
    result.steady_tokens_per_s = steady_rate([pl.calls for pl in pipelines if pl.calls])
    result.throughput = throughput([pl.calls for pl in pipelines if pl.calls])
    return result


def steady_rate(calls: list[list[tuple[float, float, int]]]) -> float | None:
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


def _warn_few_parts(p: Prepared, pending: list[Task]) -> None:
    """Parts are the unit of work: with few per engine, the last ones run while the rest wait
    (measured: 8 parts on 6 engines left them idle 30 % of the time, notes/performance.md)."""
    engines = p.spec.ray.engines if p.spec.executor == "ray" else p.spec.engine.data_parallel
    if engines > 1 and len(pending) < 3 * engines:
        rows = sum(t.num_rows for t in pending)
        log.warning("%d parts for %d engines: the last parts will run on a few engines while the others "
                    "wait. output.rows_per_part: %d would give about 4 parts per engine (a part is cut at "
                    "row-group boundaries, so files need row groups of at most that many rows)",
                    len(pending), engines, max(1, rows // (4 * engines)))


def throughput(calls: list[list[tuple[float, float, int]]], slices: int = 60) -> list[list[float]]:
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


def run_job(spec: JobSpec, engine=None, overwrite: bool = False, show_progress: bool = True) -> Stats:
    """Run a job to completion, resuming what is committed. Pass `engine` to reuse a loaded one.

    Raises JobError (nothing started), or RunError (failed; with on_error: skip, after
    finishing every readable task and writing a manifest that lists the failures).
    """
    started = time.perf_counter()
    shard = spec.shard_of
    if overwrite and shard:
        raise JobError("--overwrite with a shard would let each shard erase the others' parts; "
                       "run --overwrite once unsharded, or write to a new output.uri")
    p = prepare(spec)
    if overwrite:
        clear_output(p)
    state = output_state(p)
    stats = Stats(tasks_skipped=len(state.done))
    for r in state.done.values():
        stats.add(r)
    if state.complete:
        log.info("output %s is complete and current; nothing to do", full_url(p.out_fs, p.out_root))
        stats.seconds = time.perf_counter() - started
        return stats

    fs, root = p.out_fs, p.out_root
    pending = [t for t in p.tasks if t.index not in state.done and in_shard(t, shard)]
    _warn_few_parts(p, pending)
    if pending or shard is None:
        # The output is about to change: it must stop looking finished first.
        for name in (SUCCESS, MANIFEST):
            remove(fs, f"{root}/{name}")

    if engine is not None and pending and engine.key != (key := _engine_key(p)):
        raise JobError(f"the engine given was built for {engine.key}, the job needs {key}")
    from tqdm import tqdm

    copied: dict[int, dict] = {}
    if p.previous is not None and pending:
        copied, pending = copy_parts(p.previous, pending, fs, root, record_base(p))
    own, own_start = None, 0.0
    if pending and spec.embedding.output_dtype in SCALAR and calibration.load(p) is None:
        # int8 ranges come before any part, from one engine: the one this run will use when it
        # runs one here, else one started (and closed) for them
        t0 = time.perf_counter()
        try:
            if engine is None:
                engine = own = make_engine(p)
            fidelity.ensure(p, engine)  # a checked engine calibrates
            own_start = time.perf_counter() - t0
            calibration.ensure(p, engine)
        except BaseException:
            if own is not None:
                own.close()
            raise
        if own is not None and (spec.executor == "ray" or spec.engine.data_parallel > 1):
            own.close()
            engine = own = None
    bar = tqdm(total=sum(t.num_rows for t in pending), unit="row", disable=not show_progress,
               dynamic_ncols=True, smoothing=0.1)
    try:
        if spec.executor == "ray" and pending:
            from .ray_executor import run_on_ray

            result = run_on_ray(p, pending, _reporter(bar))
        else:
            result = _run_local(p, engine, pending, _reporter(bar))
    except BatchembedError:
        raise
    except Exception as e:  # noqa: BLE001 - anything else is a failed run, with its cause named
        raise RunError(f"{type(e).__name__}: {e}") from e
    finally:
        bar.close()
        if own is not None:
            own.close()
    result.records.update(copied)
    for r in result.records.values():
        stats.add(r)
        stats.rows_run += r["rows"]
        stats.tokens_run += r["tokens"]
    stats.tasks_run = len(result.records)
    stats.engines = result.engines
    stats.engine_start_seconds = result.engine_start_seconds + own_start
    stats.pipeline_seconds = result.pipeline_seconds
    stats.engine_seconds = result.engine_seconds
    stats.steady_tokens_per_s = result.steady_tokens_per_s
    stats.throughput = result.throughput
    pipeline_failed = result.failed

    failed = p.failed + pipeline_failed
    stats.failed = len(failed)
    stats.seconds = time.perf_counter() - started
    run_records = result.records
    records = {**state.done, **run_records}
    if shard is not None:
        # Other shards may have committed since this one started: the last to finish finalises.
        records = {**output_state(p).done, **run_records}
    unfinished = _missing_parts(p, records, failed)
    if unfinished:
        log.info("shard %s: its parts are committed; %d parts of other shards are pending, and the last "
                 "shard to finish (or `batchembed finalize`) writes the manifest", spec.shard, len(unfinished))
    else:
        _finish(p, state.stale, records, stats, failed)
    if failed:
        raise RunError(f"{len(failed)} input file(s) failed and were skipped (on_error: skip), e.g. "
                       f"{failed[0]['file']}: {failed[0]['error']}; the rest is committed and listed in "
                       f"{full_url(fs, root)}/{MANIFEST}, without {SUCCESS}")
    return stats


def finalize_job(spec: JobSpec) -> Stats:
    """Write the manifest and _SUCCESS of an output whose parts were all committed (by shards)."""
    p = prepare(spec)
    state = output_state(p)
    missing = _missing_parts(p, state.done, [])
    if missing:
        raise RunError(f"{len(missing)} of {len(p.tasks)} parts are not committed yet (e.g. {missing[0]}); "
                       "run the shards that hold them, then finalize again")
    stats = Stats(tasks_skipped=len(state.done))
    for r in state.done.values():
        stats.add(r)
    _finish(p, state.stale, state.done, stats, [])
    return stats


def _missing_parts(p: Prepared, records: dict[int, dict], failed: list[dict]) -> list[str]:
    """Parts neither committed nor recorded as failed: while any remain, no manifest."""
    failed_parts = {f.get("part") for f in failed}
    return [t.part_name for t in p.tasks if t.index not in records and t.part_name not in failed_parts]


def _finish(p: Prepared, stale: list[str], records: dict[int, dict], stats: Stats, failed: list[dict]) -> None:
    """Remove what no task owns any more, then write the manifest (and _SUCCESS)."""
    for path in stale:
        remove(p.out_fs, path)
    write_manifest(p, records, stats, failed)


def _engine_key(p: Prepared):
    from .engine import EngineKey

    return EngineKey(str(p.model.path), p.spec.model.dtype, p.max_length)


def _totals(p: Prepared, records: dict[int, dict]) -> Stats:
    """Counts over the given commit records; `deleted` against the previous output."""
    totals = Stats()
    for r in records.values():
        totals.add(r)
    if p.previous is not None:
        totals.deleted = max(0, p.previous.rows - sum(int(r.get("matched", 0)) for r in records.values()))
    return totals


def write_manifest(p: Prepared, records: dict[int, dict], stats: Stats, failed: list[dict]) -> None:
    """The manifest, then _SUCCESS, once every task is committed. With failures: the
    manifest lists them, and no _SUCCESS is written."""
    missing = _missing_parts(p, records, failed)
    if missing:
        raise RunError(f"not every part is committed ({len(missing)} missing, e.g. {missing[0]}); no manifest written")
    cal = None
    if p.spec.embedding.output_dtype in SCALAR:
        cal = calibration.require(p)
        other = sorted(r["part"] for r in records.values() if r.get("calibration") != cal.digest)
        if other:  # shards that calibrated at the same moment, each its own way
            raise RunError(f"{len(other)} part(s) were written with other int8 ranges than "
                           f"{calibration.CALIBRATION} holds (e.g. {other[0]}); delete them and their "
                           "commit records, or rerun with --overwrite")
    totals = _totals(p, records)
    stats.deleted = totals.deleted
    spec = p.spec
    manifest = {
        "tool": {"name": "batchembed", "version": __version__},
        "name": spec.name,
        "created_at": now_utc(),
        "complete": not failed,
        "job": {**p.fingerprint.as_dict(), "digest": p.fingerprint.digest},
        "model": {"name": spec.model.name, "hash": p.fingerprint.model_hash, "dimension": p.model.dimension,
                  "dtype": spec.model.dtype, "max_length": p.max_length, "prefix": spec.model.prefix,
                  "instruction": spec.model.instruction or None,
                  "instruction_format": spec.model.instruction_format if spec.model.instruction else None,
                  "text_prefix": spec.model.text_prefix, "long_text": spec.model.long_text,
                  "chunk_overlap": spec.model.chunk_overlap if spec.model.long_text == "chunk" else None,
                  "is_matryoshka": p.model.is_matryoshka},
        "embedding": {"dimensions": p.dimensions, "columns": column_names(p.dimensions),
                      "output_dtype": spec.embedding.output_dtype, "normalised": "l2", "text_hash": TEXT_HASH,
                      "packed_bits": spec.embedding.output_dtype in PACKED,
                      "calibration": None if cal is None else {
                          "file": calibration.CALIBRATION, "rows": cal.rows, "digest": cal.digest,
                          "ranges": {str(d): r.tolist() for d, r in cal.ranges.items()}}},
        "input": {"uri": spec.input.uri, "text_column": spec.input.text_column, "text_sql": spec.input.text_sql,
                  "where": spec.input.where, "id_column": spec.input.id_column,
                  "carry_columns": spec.input.carry_columns, "files": [f.fingerprint for f in p.files]},
        "counts": {k: getattr(totals, k) for k in (*TOTALS, "deleted")},
        "incremental": p.previous.summary() if p.previous is not None else None,
        "fidelity": {"status": "off"} if spec.fidelity_check == "off" else (
            fidelity.recorded(p) or {"status": "not run", "reason": "no row needed the engine"}),
        "parts": [{"name": r["part"], "rows": r["rows"], "input": r["input"],
                   "counts": {k: r.get(k, 0) for k in TOTALS if k != "rows"}}
                  for t in p.tasks if (r := records.get(t.index))],
        "failed": failed,
        "last_run": {**stats.summary(), "throughput": stats.throughput},
        "token_histogram": {"bin_width": histogram_bin_width(p.max_length), "counts": sum(
            (np.asarray(r.get("length_histogram", 0)) for r in records.values()),
            np.zeros(HISTOGRAM_BINS, dtype=np.int64)).tolist()},
    }
    write_json_atomic(p.out_fs, f"{p.out_root}/{MANIFEST}", manifest)
    if not failed:
        write_bytes_atomic(p.out_fs, f"{p.out_root}/{SUCCESS}", b"")
