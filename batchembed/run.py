"""A run: prepare the job (job.py), see what the output already holds (output/layout.py),
copy what a previous output can give (reuse.py), hand what is pending to an executor
(executors/), then write the manifest and _SUCCESS."""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
import time

from . import __version__, calibration, fidelity, interrupts, scratch
from .config import JobSpec
from .embed.matryoshka import column_names
from .embed.vectors import MULTI_VECTOR, PACKED, SCALAR, SPARSE
from .errors import BatchembedError, Interrupted, JobError, RunError
from .executors.base import engine_key, release, start_engine
from .executors.schedule import Schedule
from .job import Prepared, index_column, planned_engines, prepare, record_cut
from .model import read_model_info
from .output import leases
from .output.layout import CALIBRATION, ERRORS, MANIFEST, SUCCESS, OutputState
from .output.leases import Leases
from .output.manifest import VERSION as MANIFEST_VERSION
from .output.manifest import Manifest
from .output.records import TOTALS, add_histograms, histogram_bin_width, now_utc
from .plan import Task, rows_per_part_for, shard_tasks
from .reuse import TEXT_HASH, copy_parts
from .stats import RunResult, Stats

log = logging.getLogger(__name__)


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


def _warn_few_parts(p: Prepared, pending: list[Task]) -> None:
    """Parts are the unit of work: with few per engine, the last ones run while the rest wait."""
    engines = p.settings.engines
    # The engines that finish first wait for the last part in progress: up to a part's work, a
    # visible share of the job when each engine has only a few parts.
    if engines < 2 or not pending or len(pending) >= 6 * engines:
        return
    rows = sum(t.num_rows for t in pending)
    suggested = rows_per_part_for(rows, engines, p.spec.engine.sort_window_rows)
    if suggested < max(t.num_rows for t in pending):  # parts of less than a window are not worth it
        log.warning("%d parts for %d engines: at the end, engines that are done wait for the last parts, up "
                    "to a part's work each. output.rows_per_part: %d would give about %d parts per engine (a "
                    "part is cut at row-group boundaries, so files need row groups of at most that many rows; "
                    "parts are cut by %s)", len(pending), engines, suggested,
                    max(1, rows // (suggested * engines)), p.rows_per_part_reason)


def _execute(p: Prepared, schedule: Schedule, progress, engine, reference) -> RunResult:
    """The executor the job asks for: Ray, engine.data_parallel engine processes, or this process."""
    if p.spec.executor == "ray":
        from .executors.ray import run_on_ray

        return run_on_ray(p, schedule, progress)
    replicas = 1 if engine is not None else min(p.settings.engines, len(schedule.by_id))
    if replicas > 1:
        from .executors.processes import run_in_processes

        return run_in_processes(p, schedule, progress, replicas, reference)
    from .executors.local import run_local

    return run_local(p, schedule, progress, engine, reference)


def _calibrate(p: Prepared, engine, reference):
    """int8 / uint8: the ranges come before any part, from one engine: the one this run will use
    when it runs one here, else one started (and closed) for them. Returns (the engine this run
    keeps, the one it must close, seconds spent starting)."""
    t0 = time.perf_counter()
    own = None
    try:
        if engine is None:
            engine = own = start_engine(p, reference=reference)
        else:
            fidelity.ensure(p, engine)  # a checked engine calibrates
        seconds = time.perf_counter() - t0
        calibration.ensure(p, engine)
    except BaseException:
        if own is not None:
            release(own)
        raise
    if own is not None and (p.spec.executor == "ray" or p.settings.engines > 1):
        release(own, run_over=False)  # its memory is the engine processes' now
        engine = own = None
    return engine, own, seconds


def _stop_if_interrupted(p: Prepared, job: dict) -> None:
    """Raise Interrupted, saying what is committed, once SIGINT or SIGTERM asked the run to stop."""
    signum = interrupts.requested()
    if signum is None:
        return
    done = len(p.out.state(p.tasks, job, p.failed).done)
    raise Interrupted(signum, f"interrupted by {signal.Signals(signum).name}: {done} of {len(p.tasks)} parts are "
                              f"committed in {p.out.url}; run the same command again to resume")


def run_job(spec: JobSpec, engine=None, overwrite: bool = False, show_progress: bool = True) -> Stats:
    """Run a job to completion, resuming what is committed. Pass `engine` to reuse a loaded one.

    Raises JobError (nothing started), or RunError (failed; with on_error: skip, after
    finishing every readable task and writing a manifest that lists the failures).
    """
    started = time.perf_counter()
    if overwrite and spec.shard_of:
        raise JobError("--overwrite with a shard would let each shard erase the others' parts; "
                       "run --overwrite once unsharded, or write to a new output.uri")
    from .executors.processes import forkserver_ahead

    swept = scratch.sweep()  # what runs killed outright left in the temp folder
    if swept:
        log.info("removed %d scratch file(s) left in %s by runs that were killed", swept, tempfile.gettempdir())
    # vLLM's import for engine processes starts now, while this process plans
    wanted = spec.executor != "ray" and engine is None and planned_engines(spec) > 1
    with forkserver_ahead(wanted, _architectures(spec.model.name) if wanted else ()):
        return _run_job(spec, engine, overwrite, show_progress, started)


def _architectures(model: str) -> tuple[str, ...]:
    """The model's architectures, for the forkserver; none where the model cannot be read (the
    job's check says why, with its exit code)."""
    try:
        return read_model_info(model).architectures
    except Exception:  # noqa: BLE001 - prepare() reports it
        return ()


def _run_job(spec: JobSpec, engine, overwrite: bool, show_progress: bool, started: float) -> Stats:
    shard = spec.shard_of
    p = prepare(spec)
    out = p.out
    if p.settings.engines_reason not in (None, "engine.data_parallel"):
        log.info("engine.data_parallel: %d (%s)", p.settings.engines, p.settings.engines_reason)
    if overwrite:
        out.clear()
    job = p.fingerprint.with_digest()
    state = out.state(p.tasks, job, p.failed)
    if not state.complete and (cut := record_cut(p, cleared=overwrite)) is not p:
        p = cut  # as another run recorded it first, or chosen afresh after --overwrite
        state = out.state(p.tasks, job, p.failed)
    stats = Stats(tasks_skipped=len(state.done))
    for r in state.done.values():
        stats.add(r)
    if state.complete:
        log.info("output %s is complete and current; nothing to do", out.url)
        stats.seconds = time.perf_counter() - started
        return stats

    pending = [t for t in shard_tasks(p.tasks, shard) if t.index not in state.done]
    _warn_few_parts(p, pending)
    if pending or shard is None:
        out.unfinish()
    if engine is not None and pending and engine.key != (key := engine_key(p)):
        raise JobError(f"the engine given was built for {engine.key}, the job needs {key}")
    from tqdm import tqdm

    copied: dict[int, dict] = {}
    if p.previous is not None and pending:
        copied, pending = copy_parts(p.previous, pending, out, job)
    # a reindex's previous output may vouch for this engine already (carried on by a run that
    # embeds nothing too, so that the next one still finds it)
    fidelity.inherit(p)
    # sentence-transformers' side of the fidelity check, computed while the engines start (Ray's
    # workers compute their own)
    reference = fidelity.start_reference(p) if pending and engine is None and spec.executor != "ray" else None
    own = None
    bar = None
    schedule = None
    try:
        if pending and spec.embedding.output_dtype in SCALAR and calibration.load(p) is None:
            engine, own, stats.engine_start_seconds = _calibrate(p, engine, reference)
        bar = tqdm(total=sum(t.num_rows for t in pending), unit="row", disable=not show_progress,
                   dynamic_ncols=True, smoothing=0.1)
        _stop_if_interrupted(p, job)
        if pending:
            # runs that meet on this output share its parts through claims in it (output/leases.py)
            schedule = Schedule(p, pending, Leases(out, spec.output.lease_s), retried=state.retried)
            p.run = schedule.leases.run
            result = _execute(p, schedule, _reporter(bar), engine, reference)
        else:
            result = RunResult()
    except BatchembedError:
        _stop_if_interrupted(p, job)  # an engine that died of the same Ctrl-C is the interruption
        raise
    except Exception as e:  # noqa: BLE001 - anything else is a failed run, with its cause named
        _stop_if_interrupted(p, job)
        raise RunError(f"{type(e).__name__}: {e}") from e
    finally:
        if schedule is not None:
            schedule.close()
        if bar is not None:
            bar.close()
        if own is not None:
            release(own)
        if reference is not None:
            reference.close()
    _stop_if_interrupted(p, job)
    index = {out.part_name(t): t.index for t in p.tasks}
    run_records = {**copied, **{index[name]: r for name, r in result.records.items()}}
    stats.add_run(list(run_records.values()), result)
    failed = p.failed + result.failed
    stats.failed = len(failed)
    stats.seconds = time.perf_counter() - started
    records = {**state.done, **run_records}
    if shard is not None or (schedule is not None and schedule.done_elsewhere):
        # Other shards, or other runs on this output, may have committed since this one started:
        # the last to finish finalises.
        records = {**out.state(p.tasks, job, p.failed).done, **run_records}
    unfinished = _missing_parts(p, records, failed)
    if unfinished:
        log.info("shard %s: its parts are committed; %d parts of other shards are pending, and the last "
                 "shard to finish (or `batchembed finalize`) writes the manifest", spec.shard, len(unfinished))
    else:
        _finish(p, state, records, stats, failed)
    if failed:
        raise RunError(f"{len(failed)} input file(s) failed and were skipped (on_error: skip), e.g. "
                       f"{failed[0]['file']}: {failed[0]['error']}; the rest is committed and listed in "
                       f"{out.url_of(MANIFEST)}, without {SUCCESS}")
    _check_failed_rows(p, stats)
    return stats


def _representation_columns(p: Prepared) -> dict:
    """The manifest's entries for the sparse and multi-vector columns a job writes."""
    e, found = p.spec.embedding, {}
    if "sparse" in p.outputs:
        found["sparse"] = {"column": SPARSE, "vocab_size": p.model.vocab_size, **e.sparse.model_dump()}
    if "multi_vector" in p.outputs:
        found["multi_vector"] = {"column": MULTI_VECTOR, "dimension": p.model.multi_vector_dimension,
                                 **e.multi_vector.model_dump()}
    return found


def _allowed_failed_rows(p: Prepared, rows: int) -> int:
    limit = p.spec.max_failed_rows
    return int(limit * rows) if 0 < limit < 1 else int(limit)


def _check_failed_rows(p: Prepared, stats: Stats) -> None:
    """RunError (exit 1) naming the error files when more rows failed than max_failed_rows allows."""
    if stats.failed_rows > _allowed_failed_rows(p, stats.rows):
        raise RunError(f"{stats.failed_rows:,} rows failed in the engine (max_failed_rows: "
                       f"{p.spec.max_failed_rows:g}); every other row is written, and the failed ones are listed "
                       f"in {p.out.url_of(ERRORS)}/; a rerun tries their parts again")


def finalize_job(spec: JobSpec) -> Stats:
    """Write the manifest and _SUCCESS of an output whose parts were all committed (by shards)."""
    p = prepare(spec)
    state = p.out.state(p.tasks, p.fingerprint.with_digest(), p.failed)
    missing = _missing_parts(p, state.done, [])
    if missing:
        raise RunError(f"{len(missing)} of {len(p.tasks)} parts are not committed yet (e.g. {missing[0]}); "
                       "run the shards that hold them, then finalize again")
    stats = Stats(tasks_skipped=len(state.done))
    for r in state.done.values():
        stats.add(r)
    _finish(p, state, state.done, stats, [])
    return stats


def _finish(p: Prepared, state: OutputState, records: dict[int, dict], stats: Stats, failed: list[dict]) -> None:
    """Remove what no task owns any more (and error files of parts redone since), then write the
    manifest (and _SUCCESS)."""
    p.out.remove_stale(state)
    p.out.drop_error_files(records.values())
    leases.sweep(p.out)
    write_manifest(p, records, stats, failed)


def _missing_parts(p: Prepared, records: dict[int, dict], failed: list[dict]) -> list[str]:
    """Parts neither committed nor recorded as failed: while any remain, no manifest."""
    failed_parts = {f.get("part") for f in failed}
    return [name for t in p.tasks if t.index not in records and (name := p.out.part_name(t)) not in failed_parts]


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
    totals = _totals(p, records)
    too_many = totals.failed_rows > _allowed_failed_rows(p, totals.rows)
    cal = None
    if p.spec.embedding.output_dtype in SCALAR:
        cal = calibration.require(p)
        other = sorted(r["part"] for r in records.values() if r.get("calibration") != cal.digest)
        if other:  # shards that calibrated at the same moment, each its own way
            raise RunError(f"{len(other)} part(s) were written with other int8 ranges than "
                           f"{CALIBRATION} holds (e.g. {other[0]}); delete them and their "
                           "commit records, or rerun with --overwrite")
    stats.deleted = totals.deleted
    spec = p.spec
    if spec.output.index is not None and not failed and not too_many:
        stats.index = p.out.fmt.build_index(p.out, spec.output.index, index_column(spec, p.dimensions),
                                            spec.input.id_column, changed=stats.tasks_run > 0)
        log.info("output.index: %s on %s %s in %.1f s", spec.output.index.type, stats.index["column"],
                 "kept" if stats.index.get("kept") else "built", stats.index.get("seconds", 0))
    manifest = Manifest.model_validate({
        "version": MANIFEST_VERSION,
        "tool": {"name": "batchembed", "version": __version__},
        "name": spec.name,
        "created_at": now_utc(),
        "complete": not failed and not too_many,
        "job": p.fingerprint.with_digest(),
        "format": spec.output.format,
        "model": {"name": spec.model.name, "hash": p.fingerprint.model_hash, "dimension": p.model.dimension,
                  "dtype": spec.model.dtype, "max_length": p.max_length, "prefix": spec.model.prefix,
                  "instruction": spec.model.instruction or None,
                  "instruction_format": spec.model.instruction_format if spec.model.instruction else None,
                  "text_prefix": spec.model.text_prefix, "long_text": spec.model.long_text,
                  "chunk_overlap": spec.model.chunk_overlap if spec.model.long_text == "chunk" else None,
                  "is_matryoshka": p.model.is_matryoshka},
        "embedding": {"outputs": list(p.outputs), **_representation_columns(p),
                      "dimensions": p.dimensions, "columns": column_names(p.dimensions),
                      "output_dtype": spec.embedding.output_dtype, "normalised": "l2", "text_hash": TEXT_HASH,
                      "packed_bits": spec.embedding.output_dtype in PACKED,
                      "calibration": None if cal is None else {
                          "file": CALIBRATION, "rows": cal.rows, "digest": cal.digest,
                          "ranges": {str(d): r.tolist() for d, r in cal.ranges.items()}}},
        "input": {"uri": spec.input.uri, "text_column": spec.input.text_column, "text_sql": spec.input.text_sql,
                  "where": spec.input.where, "id_column": spec.input.id_column,
                  "carry_columns": spec.input.carry_columns, "files": [f.fingerprint for f in p.files]},
        "counts": {k: getattr(totals, k) for k in (*TOTALS, "deleted")},
        "incremental": p.previous.summary() if p.previous is not None else None,
        "fidelity": {"status": "off"} if spec.fidelity_check == "off" else (
            fidelity.recorded(p) or {"status": "not run", "reason": "no row needed the engine"}),
        "rows_per_part": p.rows_per_part,
        "parts": [{"name": r["part"], "rows": r["rows"], "input": r["input"],
                   "counts": {k: r.get(k, 0) for k in TOTALS if k != "rows"}}
                  for t in p.tasks if (r := records.get(t.index))],
        "failed": failed,
        "failed_rows": {"count": totals.failed_rows, "allowed": _allowed_failed_rows(p, totals.rows),
                        "files": sorted(p.out.errors_name(r["part"]) for r in records.values()
                                        if r.get("failed_rows"))},
        "index": stats.index,
        "engine": p.settings.as_dict(),
        "last_run": {**stats.summary(), "throughput": stats.throughput},
        "token_histogram": {"bin_width": histogram_bin_width(p.max_length),
                            "counts": add_histograms(records.values())},
    })
    p.out.finish(manifest, success=not failed and not too_many)
