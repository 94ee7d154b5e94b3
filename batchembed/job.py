"""A job, prepared: checked against the model, the input (footers only) and the output
location, and cut into tasks, before any engine loads. Everything below the executors
works from a `Prepared`."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from . import inputs, storage
from .config import JobSpec
from .embed.heads import document_marker
from .embed.matryoshka import column_names
from .embed.settings import EngineSettings, resolve
from .embed.tokenizer import Tokenizer, model_tokenizer
from .embed.vectors import MULTI_VECTOR, PACKED, SPARSE, SPARSE_TYPE, multi_vector_type, vector_type
from .errors import JobError, RunError
from .inputs.base import InputFile, inspect_inputs
from .inputs.rows import needed_columns, select_rows
from .model import REPRESENTATIONS, ModelInfo, model_content_hash, read_model_info
from .output.layout import FORMER_ROWS_PER_PART, LAYOUT, PARTS, OutputFolder
from .plan import Task, auto_rows_per_part, make_tasks
from .reuse import TEXT_HASH, open_previous
from .storage import RetryPolicy

log = logging.getLogger(__name__)

# the bytes a window's multi-vectors take, for rows of the average length (Prepared.window_rows)
MULTI_VECTOR_WINDOW_BYTES = 256 * 2**20


@dataclass(frozen=True)
class JobFingerprint:
    """Everything that changes the vectors. Outputs made under different ones never mix."""

    model_hash: str
    dimensions: tuple[int, ...]
    output_dtype: str
    dtype: str
    max_length: int
    prefix: str
    columns: dict[str, Any] = field(default_factory=dict)
    long_text: str = "truncate"  # or "chunk:<overlap>"
    output_format: str = "parquet"
    representations: dict[str, Any] = field(default_factory=dict)  # beyond dense: outputs and their settings

    def as_dict(self) -> dict[str, Any]:
        d = {"layout": LAYOUT, "model_hash": self.model_hash, "dimensions": list(self.dimensions),
             "output_dtype": self.output_dtype, "dtype": self.dtype, "max_length": self.max_length,
             "prefix": self.prefix, "columns": self.columns}
        if self.long_text != "truncate":  # only when set: outputs made before it keep their digest
            d["long_text"] = self.long_text
        if self.output_format != "parquet":  # the same: Parquet outputs keep their digest
            d["output_format"] = self.output_format
        if self.representations:  # the same: dense-only outputs keep their digest
            d["representations"] = self.representations
        return d

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def with_digest(self) -> dict[str, Any]:
        """As commit records and the manifest carry it."""
        return {**self.as_dict(), "digest": self.digest}


@dataclass
class Prepared:
    """Everything known before the engine loads."""

    spec: JobSpec
    model: ModelInfo
    max_length: int
    dimensions: list[int]
    files: list[InputFile]
    tasks: list[Task]
    input_format: Any  # inputs.base.InputFormat
    in_fs: Any
    out: OutputFolder
    fingerprint: JobFingerprint
    warnings: list[str] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)  # unreadable inputs, with on_error: skip
    previous: Any = None  # reuse.Previous: the output whose vectors may be reused (incremental)
    run: str | None = None  # this run's id (output/leases.py), named in each part's commit record
    settings: EngineSettings | None = None  # the engines', resolved once (embed/settings.py)
    rows_per_part: int = 0  # the cut of the input into parts (cut_parts), and why
    rows_per_part_reason: str = ""

    def worker_spec(self) -> dict:
        """The job as an engine process or Ray actor prepares it again: with this run's cut, so that
        its parts are the ones this run schedules."""
        spec = self.spec.model_dump(mode="json")
        spec["output"]["rows_per_part"] = self.rows_per_part
        return spec

    @property
    def kept_columns(self) -> list[str]:
        """The input's columns written beside the vectors: the id, then input.carry_columns."""
        return [c for c in dict.fromkeys([self.spec.input.id_column, *self.spec.input.carry_columns]) if c]

    @property
    def output_schema(self) -> pa.Schema:
        schema = self.files[0].schema
        fields = [schema.field(c) for c in self.kept_columns]
        fields.append(pa.field(TEXT_HASH, pa.uint64()))
        names = column_names(self.dimensions)
        fields += [pa.field(names[d], vector_type(d, self.spec.embedding.output_dtype)) for d in self.dimensions]
        if "sparse" in self.outputs:
            fields.append(pa.field(SPARSE, SPARSE_TYPE))
        if "multi_vector" in self.outputs:
            fields.append(pa.field(MULTI_VECTOR, multi_vector_type(self.model.multi_vector_dimension,
                                                                   self.spec.embedding.multi_vector.dtype)))
        return pa.schema(fields)

    @property
    def outputs(self) -> tuple[str, ...]:
        """The representations the job writes, in the order of REPRESENTATIONS."""
        return tuple(r for r in REPRESENTATIONS if r in self.spec.embedding.outputs)

    @property
    def extra_outputs(self) -> tuple[str, ...]:
        """The representations beside dense vectors (sparse, multi_vector) the job writes."""
        return tuple(r for r in self.outputs if r != "dense")

    @functools.cached_property
    def window_rows(self) -> int:
        """Rows read, tokenised and length-sorted together: engine.sort_window_rows, fewer where a
        window's multi-vectors would pass MULTI_VECTOR_WINDOW_BYTES, at the tokens a row takes on
        average in the first rows (estimate_tokens; about twelve windows are alive at once: the
        docs' Memory section). Not by max_length: where rows are short, that bound leaves a GPU
        windows of a few thousand tokens, too few to fill its steps."""
        rows = self.spec.engine.sort_window_rows
        if "multi_vector" in self.outputs:
            total = sum(f.num_rows for f in self.files)
            per_row = estimate_tokens(self) / total if total else self.max_length
            row_bytes = max(per_row, 1.0) * (self.model.multi_vector_dimension or 1) * 4
            rows = min(rows, max(16, int(MULTI_VECTOR_WINDOW_BYTES // row_bytes)))
        return rows

    def tokenizer(self) -> Tokenizer:
        return model_tokenizer(self.model.path, self.max_length, self.spec.model, document_marker(self.model))

    def iter_batches(self, task: Task, batch_rows: int) -> Iterator[pa.RecordBatch]:
        """The task's rows, the columns the job reads, `batch_rows` at a time."""
        return self.input_format.iter_batches(self.in_fs, task.file, list(task.row_groups),
                                              needed_columns(self.spec.input), batch_rows)

    def first_texts(self, n: int) -> list[str]:
        """The first `n` non-null texts in plan order (the same rows for every shard and rerun)."""
        texts: list[str] = []
        for task in self.tasks:
            for batch in self.iter_batches(task, 8192):
                texts += [t for t in select_rows(self.spec.input, batch)[1] if t is not None]
                if len(texts) >= n:
                    return texts[:n]
        return texts


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
    step = spec.engine.vllm_args.get("max_num_batched_tokens")
    if isinstance(step, int) and step < max_length:
        # vLLM would split a longer row's prefill across engine steps: a compiled decoder with
        # last-token pooling then returns wrong vectors for it in vLLM 0.24 (vLLM PR 48901)
        raise JobError(f"engine.vllm_args.max_num_batched_tokens: {step} is below model.max_length {max_length}; "
                       "a row split across engine steps can get a wrong vector (set engine.token_budget instead)")


def _check_outputs(spec: JobSpec, model: ModelInfo) -> None:
    """The representations asked for are ones the model gives, and the keys set fit them."""
    e = spec.embedding
    missing = [r for r in e.outputs if r not in model.outputs]
    if missing:
        raise JobError(f"embedding.outputs: {missing[0]} is not something {model.path.name} gives: it is a "
                       f"{model.family} model, which gives {', '.join(model.outputs)} (set embedding.outputs: "
                       f"[{', '.join(model.outputs)}] or a subset)")
    if "dense" not in e.outputs:
        if e.dimensions is not None:
            raise JobError("embedding.dimensions: applies to dense vectors, and embedding.outputs has no dense")
        if e.output_dtype != "float32":
            raise JobError("embedding.output_dtype: applies to dense vectors, and embedding.outputs has no dense "
                           "(multi-vectors take embedding.multi_vector.dtype)")
    if model.family != "dense" and (spec.model.prefix or spec.model.instruction):
        raise JobError(f"model.prefix / model.instruction: a {model.family} model takes its documents as they are "
                       "(a ColBERT model's document marker is put in by batchembed)")


def _check_columns(spec: JobSpec, dims: list[int] | None) -> None:
    if spec.embedding.output_dtype in PACKED and dims and any(d % 8 for d in dims):
        raise JobError(f"embedding.dimensions: {next(d for d in dims if d % 8)} is not a multiple of 8, which "
                       f"output_dtype {spec.embedding.output_dtype} needs (8 dimensions to a byte)")
    ours = {*column_names(dims or [0]).values(), TEXT_HASH} if dims else {"embedding", TEXT_HASH}
    ours |= {c for r, c in ((("sparse", SPARSE), ("multi_vector", MULTI_VECTOR))) if r in spec.embedding.outputs}
    clash = [c for c in [spec.input.id_column, *spec.input.carry_columns] if c in ours]
    if clash:
        key = "input.id_column" if clash[0] == spec.input.id_column else "input.carry_columns"
        raise JobError(f"{key}: {clash[0]!r} is also the name of an output column batchembed writes "
                       f"({', '.join(sorted(ours))}); rename it in the input or leave it out")


def index_column(spec: JobSpec, dims: list[int]) -> str:
    """The column output.index is built on: the one named, or the largest dimension's."""
    return spec.output.index.column or column_names(dims)[max(dims)]


def _check_index(spec: JobSpec, dims: list[int]) -> None:
    ix = spec.output.index
    if ix is None:
        return
    if not dims:
        raise JobError("output.index: indexes the dense vectors, and embedding.outputs has no dense")
    if spec.output.format != "lance":
        raise JobError(f"output.index: needs output.format: lance (this job writes {spec.output.format}; "
                       "a Parquet output is indexed by whatever reads it, as docs/output.md shows)")
    if spec.embedding.output_dtype not in ("float32", "float16"):
        raise JobError(f"output.index: Lance's vector indexes take float vectors, and this job writes "
                       f"{spec.embedding.output_dtype} (embedding.output_dtype); write float16 to index them, "
                       "or leave output.index out and search the stored vectors as docs/output.md shows")
    names = column_names(dims)
    column = index_column(spec, dims)
    if column not in names.values():
        raise JobError(f"output.index.column: {column!r} is not one of the embedding columns "
                       f"({', '.join(names.values())})")
    d = next(d for d, c in names.items() if c == column)
    if ix.type == "ivf_pq" and ix.num_sub_vectors and d % ix.num_sub_vectors:
        raise JobError(f"output.index.num_sub_vectors: {ix.num_sub_vectors} does not divide {column}'s "
                       f"dimension {d}")


def _read_inputs(spec: JobSpec):
    fmt = inputs.get_format(spec.input.format)
    in_fs, in_root, paths = fmt.list_files(spec.input.uri, spec.input.storage_options)
    files, failed = inspect_inputs(fmt, in_fs, in_root, paths, spec.input, skip_unreadable=spec.on_error == "skip")
    if not files:
        raise RunError(f"no input file could be read ({len(failed)} failed), e.g. {failed[0]['error']}")
    return fmt, in_fs, in_root, files, failed


def _fingerprint(spec: JobSpec, model: ModelInfo, max_length: int, dims: list[int]) -> JobFingerprint:
    return JobFingerprint(
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
        output_format=spec.output.format,
        representations=_representations(spec),
    )


def _representations(spec: JobSpec) -> dict[str, Any]:
    """What the fingerprint says of the outputs beyond dense (nothing for a dense-only job)."""
    e = spec.embedding
    if list(e.outputs) == ["dense"]:
        return {}
    d: dict[str, Any] = {"outputs": [r for r in REPRESENTATIONS if r in e.outputs]}
    if "sparse" in e.outputs:
        d["sparse"] = e.sparse.model_dump()
    if "multi_vector" in e.outputs:
        d["multi_vector"] = e.multi_vector.model_dump()
    return d


def prepare(spec: JobSpec, all_problems: bool = False, check_output: bool = True, warn: bool = True) -> Prepared:
    """Check the job against the model, the input (footers only) and the output location.

    Raises JobError (or RunError for input that cannot be read) at the first problem;
    with `all_problems` (validate), every check that does not depend on a failed one
    runs, and one JobError lists every problem found. `check_output`: the output location
    must be writable (a probe file on object stores) and apart from the input. `warn`: log
    the job's warnings (an engine process preparing the job again does not).
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
        check(lambda: _check_outputs(spec, model))
        dims = (dims or [model.dimension]) if "dense" in spec.embedding.outputs else []
        check(lambda: _check_model_fit(spec, model, max_length, dims, warnings))
        if spec.model.long_text == "chunk":  # the windows must leave room for text
            check(lambda: model_tokenizer(model.path, max_length, spec.model))
    check(lambda: _check_columns(spec, dims))
    check(lambda: _check_index(spec, dims))
    storage.policy = RetryPolicy(spec.retry.attempts, spec.retry.backoff_s)
    read = check(lambda: _read_inputs(spec))
    out = check(lambda: OutputFolder.open(spec.output.uri, spec.output.storage_options, spec.output.format))
    if out is not None and check_output:
        if check(lambda: out.check_writable() or True) and read is not None:
            check(lambda: out.check_apart_from(read[1], read[2], spec.input.uri))
    fp = previous = None
    if model is not None and out is not None:
        fp = _fingerprint(spec, model, max_length, dims)
        if spec.incremental is not None:
            inc = spec.incremental
            options = inc.storage_options if inc.storage_options is not None else spec.output.storage_options
            previous = check(lambda: open_previous(inc.previous, options, fp, spec.input.id_column, out.url))
    if problems:
        raise JobError(f"{len(problems)} problem(s) with the job:\n  " + "\n  ".join(problems))
    for w in warnings if warn else ():
        log.warning(w)
    fmt, in_fs, _, files, failed = read
    p = Prepared(spec, model, max_length, dims, files, [], fmt, in_fs, out, fp, warnings, failed, previous)
    return _cut(p, *cut_parts(p, recorded=True))


def cut_parts(p: Prepared, recorded: bool) -> tuple[int, str]:
    """output.rows_per_part for this run, and why: the job's; else (with `recorded`) the one the
    output was made with; else a reindex's previous output's, so that its unchanged parts are copied
    whole; else auto (plan.auto_rows_per_part) for the engines this job gets."""
    spec = p.spec
    if spec.output.rows_per_part != "auto":
        return spec.output.rows_per_part, "output.rows_per_part"
    found = p.out.recorded_cut() if recorded else None
    if found is not None:
        return found
    if p.previous is not None and p.previous.same_job:  # a manifest of 0.7 or earlier: the fixed cut of then
        before = p.previous.manifest.rows_per_part or FORMER_ROWS_PER_PART
        return before, f"the previous output's ({p.previous.uri}), so that its unchanged parts are copied whole"
    rows = sum(f.num_rows for f in p.files)
    engines = engine_settings(spec, p.model, p.max_length, None, rows).engines
    return auto_rows_per_part(rows // (spec.shard_of[1] if spec.shard_of else 1), engines,
                              spec.engine.sort_window_rows)


def _cut(p: Prepared, rows_per_part: int, why: str) -> Prepared:
    """`p` with its input cut into parts of up to `rows_per_part` rows, and the engine settings for
    that many parts."""
    tasks = make_tasks(p.files, rows_per_part)
    rows = sum(f.num_rows for f in p.files)
    return replace(p, tasks=tasks, rows_per_part=rows_per_part, rows_per_part_reason=why,
                   settings=engine_settings(p.spec, p.model, p.max_length, len(tasks), rows))


def record_cut(p: Prepared, cleared: bool) -> Prepared:
    """Before any part is written: the run's cut recorded in the output (the first run on an output
    fixes it for every later one, or runs meeting on it would write different parts under one name),
    and `p` cut as recorded, which another run may have done first. `cleared`: the output was just
    emptied (--overwrite), so what it recorded is gone and the cut is chosen afresh."""
    n, why = cut_parts(p, recorded=False) if cleared else (p.rows_per_part, p.rows_per_part_reason)
    got = p.out.record_cut(n, why, replace=p.spec.output.rows_per_part != "auto")
    if got != n:
        n, why = got, f"recorded in {p.out.url_of(PARTS)} by the run that made the output"
    return p if n == p.rows_per_part else _cut(p, n, why)


def engine_settings(spec: JobSpec, model: ModelInfo, max_length: int, parts: int | None,
                    rows: int | None = None) -> EngineSettings:
    """The run's engine settings, before any engine starts: on this host, or for Ray's actors, on
    GPUs when they ask for any (a share of one each with ray.num_gpus_per_engine below 1)."""
    if spec.executor == "ray":
        gpus = spec.ray.num_gpus_per_engine
        return resolve(model, spec.model.dtype, max_length, spec.engine, device="cuda" if gpus else "cpu",
                       per_engine_gpus=gpus or None, parts=parts, rows=rows)
    return resolve(model, spec.model.dtype, max_length, spec.engine, parts=parts, rows=rows)


def planned_engines(spec: JobSpec) -> int:
    """The engine count of the job on this host before it is prepared (no more than its parts once
    it is); 1 where the model cannot be read (the job's check says why)."""
    if spec.engine.data_parallel != "auto":
        return int(spec.engine.data_parallel)
    try:
        model = read_model_info(spec.model.name)
    except (JobError, RunError):
        return 1
    return engine_settings(spec, model, spec.model.max_length or model.max_length, 0).engines


def estimate_tokens(p: Prepared, sample_rows: int = 2000) -> int:
    """Tokens the whole corpus will take, from the first rows of up to 4 files."""
    tok = p.tokenizer()
    seen_rows = seen_tokens = 0
    per_file = max(1, sample_rows // min(4, len(p.files)))
    for f in p.files[:4]:
        if not f.row_group_rows:
            continue
        task = Task(-1, f, (0,), f.row_group_rows[0], 0)
        for batch in p.iter_batches(task, per_file):
            t = tok(select_rows(p.spec.input, batch)[1])
            seen_rows, seen_tokens = seen_rows + len(t.valid), seen_tokens + int(t.lengths.sum())
            break
    total_rows = sum(f.num_rows for f in p.files)
    return round(seen_tokens / seen_rows * total_rows) if seen_rows else 0
