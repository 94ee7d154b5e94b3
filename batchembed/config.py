"""The job file: YAML in, one validated `JobSpec` out, or a `JobError` naming every bad key.

Validation happens here, once, at the edge. `${VAR}` and `${VAR:-default}` are
filled from the environment after parsing, so secrets never live in the file;
`--set a.b=value` overrides are applied before validation, so an override is
checked exactly like the file.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import JobError

log = logging.getLogger(__name__)


def _count_or_auto(v: int | str) -> int | str:
    if v != "auto" and v < 1:
        raise ValueError("must be at least 1, or auto")
    return v


CountOrAuto = Annotated[int | Literal["auto"], AfterValidator(_count_or_auto)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputSpec(_Strict):
    uri: str = Field(description="fsspec URL of a Parquet file, a directory or a glob")
    format: str = Field("parquet", description="the input format (inputs/__init__.py lists them)")
    text_column: str = Field("text", description="the string column to embed; a null text keeps its row with a "
                             "null vector")
    text_sql: str | None = Field(None, description="the text as a polars SQL expression over the input "
                                 "columns instead of text_column, e.g. title || '\\n\\n' || body")
    where: str | None = Field(None, description="a polars SQL condition: only rows where it is true are "
                              "embedded and written, e.g. lang = 'en' AND body IS NOT NULL")
    id_column: str | None = Field(None, description="a column copied to the output unchanged, to join the vectors "
                                  "back; reindexing matches rows by it")
    carry_columns: list[str] = Field([], description="more input columns copied to the output unchanged")
    storage_options: dict[str, Any] = Field({}, description="passed to fsspec for input.uri, e.g. "
                                            "{endpoint_url: \"${S3_ENDPOINT}\"}; never written to the output")

    @field_validator("text_sql", "where")
    @classmethod
    def _parses(cls, v):
        if v is None:
            return v
        if not v.strip():
            raise ValueError("is empty")
        import polars as pl

        try:
            pl.sql_expr(v)
        except Exception as e:  # noqa: BLE001 - polars raises several kinds for bad SQL
            raise ValueError(f"is not a polars SQL expression: {e}") from None
        return v


class ModelSpec(_Strict):
    name: str = Field(description="local dir | Hugging Face id in the local cache | package:<python package>")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the engine's compute precision; auto: vLLM's choice on a GPU, on a CPU the narrowest "
        "float it computes natively (bfloat16 with avx512_bf16 or AMX, float16 with avx512_fp16, else float32)")
    max_length: int | None = Field(None, ge=2, description="tokens; default: the model's limit")
    prefix: str = Field("", description='put before every text, e.g. "passage: " (E5, BGE)')
    instruction: str = Field("", description="for instruction-tuned embedders, e.g. 'Given a web search "
                             "query, retrieve relevant passages'; goes before every text through "
                             "instruction_format")
    instruction_format: str = Field("Instruct: {instruction}\nQuery: ", description="how model.instruction is "
                                    "put before every text (then model.prefix); must contain {instruction}")
    long_text: Literal["truncate", "chunk"] = Field(
        "truncate", description="a text longer than max_length: truncate it, or chunk it into windows of "
        "max_length tokens, embed each and pool them (token-weighted mean, renormalised) into one vector; "
        "its sparse weights: each id's largest over the windows; its multi-vector: the windows' vectors")
    chunk_overlap: int = Field(32, ge=0, description="long_text: chunk: tokens each window shares with the next")

    @field_validator("instruction_format")
    @classmethod
    def _has_slot(cls, v):
        if "{instruction}" not in v:
            raise ValueError("must contain {instruction}, e.g. 'Instruct: {instruction}\\nQuery: '")
        return v

    @property
    def text_prefix(self) -> str:
        """What goes before every text: the formatted instruction (if any), then `prefix`."""
        head = self.instruction_format.replace("{instruction}", self.instruction) if self.instruction else ""
        return head + self.prefix


class SparseSpec(_Strict):
    top_k: int | None = Field(None, ge=1, description="keep each row's k largest weights (the rest are "
                              "counted in the manifest as pruned); default: every non-zero weight")
    min_weight: float = Field(0.0, ge=0, description="drop weights below this (counted as pruned)")


class MultiVectorSpec(_Strict):
    dtype: Literal["float32", "float16", "int8"] = Field(
        "float32", description="each token vector's values; int8: round(127 x value), the vectors being "
        "unit length (divide by 127 to read them back)")


class EmbeddingSpec(_Strict):
    outputs: list[Literal["dense", "sparse", "multi_vector"]] = Field(
        ["dense"], description="the representations written for each row, all from one forward pass: dense "
        "(one vector; the columns below), sparse (vocabulary weights: SPLADE, BGE-M3) and multi_vector (one "
        "vector per token: ColBERT, BGE-M3); what a model offers is read from its folder")
    dimensions: list[int] | None = Field(None, description="Matryoshka dimensions: each vector is truncated to "
                                         "each, then L2-renormalised; one column per dimension; default: the "
                                         "model's dimension")
    output_dtype: Literal["float32", "float16", "int8", "uint8", "binary", "ubinary"] = Field(
        "float32", description="int8 / uint8: 256 steps per dimension between the min and max of a "
        "calibration sample; binary / ubinary: one sign bit per dimension, 8 to a byte; both as "
        "sentence-transformers' quantize_embeddings")
    calibration_rows: int = Field(10_000, ge=2, description="int8 / uint8: rows (the first in plan order) "
                                  "whose embeddings give each dimension's range; stored as "
                                  "_calibration.json in the output and used for every part")

    sparse: SparseSpec = Field(SparseSpec(), description="outputs: sparse: how the weights are pruned")
    multi_vector: MultiVectorSpec = Field(MultiVectorSpec(), description="outputs: multi_vector: how the "
                                          "token vectors are stored")

    @field_validator("dimensions", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        return [v] if isinstance(v, int) else v

    @field_validator("outputs", mode="before")
    @classmethod
    def _outputs_list(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("outputs")
    @classmethod
    def _valid_outputs(cls, v):
        if not v:
            raise ValueError("must list at least one of dense, sparse, multi_vector")
        if len(set(v)) != len(v):
            raise ValueError(f"outputs repeat: {v}")
        return v

    @field_validator("dimensions")
    @classmethod
    def _valid_dims(cls, v):
        if v is None:
            return v
        if not v:
            raise ValueError("must list at least one dimension")
        bad = [d for d in v if d < 1]
        if bad:
            raise ValueError(f"dimension {bad[0]} is < 1")
        if len(set(v)) != len(v):
            raise ValueError(f"dimensions repeat: {v}")
        return v


class IndexSpec(_Strict):
    type: Literal["ivf_pq", "ivf_hnsw_sq"] = Field(description="Lance's vector index: IVF with product "
                                                   "quantisation, or IVF with an HNSW graph over int8 "
                                                   "scalar-quantised vectors in each partition")
    metric: Literal["cosine", "dot", "l2"] = Field("cosine", description="the vectors are L2-normalised: "
                                                   "cosine and dot rank alike")
    column: str | None = Field(None, description="the embedding column; default: the largest dimension's")
    num_partitions: int | None = Field(None, ge=1, description="IVF partitions; default about sqrt(rows), "
                                       "at most rows/256")
    num_sub_vectors: int | None = Field(None, ge=1, description="ivf_pq: PQ sub-vectors (must divide the "
                                        "dimension); default Lance's")
    id_index: bool = Field(True, description="also a BTREE index on input.id_column, for lookups by id")


class OutputSpec(_Strict):
    uri: str = Field(description="fsspec directory for the parts, _manifest.json and _SUCCESS")
    format: Literal["parquet", "lance"] = Field("parquet", description="parquet: one file per part; lance: "
                                                "one Lance dataset (pip install 'batchembed[lance]')")
    storage_options: dict[str, Any] = Field({}, description="passed to fsspec (and to Lance) for output.uri")
    rows_per_part: CountOrAuto = Field(
        "auto", description="a part (a file of the output, and the unit of work an engine takes) holds the "
        "input's row groups up to this many rows. auto: up to 1,000,000 with one engine; with several, about "
        "30 parts for each, so that they finish together. The first run on an output records the cut in "
        "_parts.json and every later run on it (a resume, another shard) keeps it unless the job sets this")
    lease_s: float = Field(60, ge=2, description="runs on one output share its parts: a run claims a part "
                           "before embedding it and renews its claims every third of this; a killed run's "
                           "claims lapse after this long and another run takes its parts over")
    compression: Literal["zstd", "snappy", "lz4", "gzip", "none"] = Field(
        "zstd", description="Parquet's; Lance chooses its own encodings")
    index: IndexSpec | None = Field(None, description="format lance: a vector index built once every part "
                                    "is committed (kept on a rerun when it covers every row)")


class EngineSpec(_Strict):
    token_budget: int | None = Field(None, ge=16, description="most tokens in one engine step; "
                                     "default 4096 on CPU, 65536 on GPU")
    max_batch_rows: int | None = Field(None, ge=1, description="most rows in one engine step; "
                                       "default 256 on CPU, 4096 on GPU")
    sort_window_rows: int = Field(8192, ge=1, description="rows read, tokenised and length-sorted together")
    windows_in_flight: int = Field(2, ge=1, description="windows queued on the engine at once: with 2 it "
                                   "starts the next window while the last one's vectors are collected; 1 "
                                   "lets it drain at every window's end")
    data_parallel: CountOrAuto = Field(
        "auto", description="engines pulling parts from one list (engine processes on this machine, or Ray "
        "actors with executor: ray): one per GPU, or several on one GPU (small models: one engine's Python "
        "front end is the limit), or one per slice of the CPU cores. auto: on a GPU, as many as the GPUs' "
        "compute takes for this model and model.max_length, at most what the host's cores feed; on CPU and "
        "with executor: ray, 1. The choice and its reason are logged, shown by plan and recorded in the "
        "manifest; `batchembed tune` measures it instead")
    enforce_eager: bool | None = Field(None, description="true: no torch.compile or CUDA graphs; default: "
                                       "eager for encoders (BERT-like) and on CPU, compiled for decoder "
                                       "embedders (Qwen3-Embedding) on a GPU (the first start compiles, "
                                       "vLLM caches it)")
    in_process: bool | None = Field(None, description="run vLLM's engine core and its worker inside the "
                                    "engine's own process instead of two processes of their own. On CPU (the "
                                    "default there) vLLM starts those by spawning, each importing vLLM again: "
                                    "in process it starts about 3x faster, runs as fast and uses half the "
                                    "memory, but an engine that hangs ends its process (exit 1; with "
                                    "data_parallel, that engine process is replaced) instead of being "
                                    "replaced in place. Default: true on CPU, false on GPU")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="share of the GPU's memory the "
                                                 "engines may take; default 0.9, split between engines "
                                                 "sharing a GPU")
    vllm_args: dict[str, Any] = Field({}, description="passed to vllm.LLM as keyword arguments")
    stall_timeout_s: float | None = Field(None, gt=0, description="an engine that gives back no vector for "
                                          "this long while work is queued is declared hung and replaced; "
                                          "default: 10 times the slowest step seen so far, at least 60 s")
    max_restarts: int = Field(3, ge=0, description="engines replaced in one run (died or hung) before the run "
                              "stops with exit 1, every committed part kept")
    dedup_cache_mb: int = Field(64, ge=0, description="recent vectors kept by text hash, so a text seen "
                                "again is not embedded again (identical texts in one window always are "
                                "embedded once); the one part of the run's memory that grows with the "
                                "corpus, up to this bound; 0 turns the cache off")


class RetrySpec(_Strict):
    attempts: int = Field(6, ge=1, description="tries of each storage operation, the first included")
    backoff_s: float = Field(1.0, ge=0, description="first wait; doubles each try, capped at 30 s")


class IncrementalSpec(_Strict):
    previous: str = Field(description="a finished batchembed output: rows whose id and text are unchanged "
                          "reuse its vectors")
    storage_options: dict[str, Any] | None = Field(None, description="default: output.storage_options")


class RaySpec(_Strict):
    address: str | None = Field(None, description="Ray cluster address, e.g. ray://head:10001 or auto; "
                                "none starts a local Ray")
    engines: int | None = Field(None, ge=1, description="deprecated: engine.data_parallel, which counts the "
                                "engine actors as it counts engine processes; read as it, with a warning")
    num_cpus_per_engine: float = Field(1, gt=0, description="CPUs Ray reserves for each engine actor")
    num_gpus_per_engine: float = Field(0, ge=0, description="1 for one GPU each; 0.25 packs four per GPU, "
                                       "each with that share of its memory (unless engine.gpu_memory_utilization "
                                       "says otherwise)")
    start_timeout_s: float = Field(300, gt=0, description="how long the engine actors may wait for the "
                                   "cluster's CPUs and GPUs (an autoscaler adding nodes) before the run stops "
                                   "with exit 1 naming what was asked and what the cluster has; a local Ray "
                                   "that can never fit them is refused at once")


class JobSpec(_Strict):
    name: str = Field(description="the job's name, for logs and the manifest")
    input: InputSpec = Field(description="the corpus to embed")
    model: ModelSpec = Field(description="the embedding model and how texts are prepared for it")
    embedding: EmbeddingSpec = Field(EmbeddingSpec(), description="what is written for each row")
    output: OutputSpec = Field(description="where and how the vectors are written")
    engine: EngineSpec = Field(EngineSpec(), description="vLLM's engine; the defaults suit CPU and GPU")
    on_error: Literal["fail", "skip"] = Field(
        "fail", description="skip: an unreadable input file is recorded and the rest still run (exit 1)")
    retry: RetrySpec = Field(RetrySpec(), description="storage errors: retried with exponential backoff")
    incremental: IncrementalSpec | None = Field(None, description="reindexing: reuse an earlier output's "
                                                "vectors for unchanged rows (or run --previous URI)")
    fidelity_check: Literal["auto", "off"] = Field(
        "auto", description="auto: when an engine starts, embed the first 16 rows with the engine and with "
        "sentence-transformers (when installed and the model is one) and refuse to run if they disagree")
    fidelity_min_cosine: float = Field(0.98, gt=0, le=1, description="the lowest per-row cosine accepted")
    max_failed_rows: float = Field(0, ge=0, description="rows the engine may fail (each alone: a null vector "
                                   "and a line in _errors/) before the run exits 1: a count, or a fraction "
                                   "of the rows below 1; either way every other row is written")
    executor: Literal["local", "ray"] = Field("local", description="local: this machine (engine.data_parallel "
                                              "engine processes); ray: one Ray actor per engine, anywhere")
    ray: RaySpec = Field(RaySpec(), description="executor: ray only")
    shard: str | None = Field(None, description="i/N: run only shard i (0-based) of N; the last to finish "
                              "writes the manifest")

    @model_validator(mode="after")
    def _one_engine_count(self):
        # ray.engines was the engine count of executor: ray; engine.data_parallel is the one key now
        engines = self.ray.engines
        if engines is None:
            return self
        if "data_parallel" in self.engine.model_fields_set and self.engine.data_parallel != engines:
            raise ValueError(f"ray.engines: {engines} and engine.data_parallel: {self.engine.data_parallel} "
                             "disagree; ray.engines is deprecated: keep engine.data_parallel alone")
        log.warning("ray.engines is deprecated: write engine.data_parallel: %d (it counts Ray's engine actors "
                    "too)", engines)
        self.engine.data_parallel, self.ray.engines = engines, None
        return self

    @field_validator("fidelity_check", mode="before")
    @classmethod
    def _fidelity_from_yaml(cls, v):
        # YAML 1.1 reads a bare `off` as false (and `on` as true): `fidelity_check: off` must work
        return {False: "off", True: "auto"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("shard", mode="before")
    @classmethod
    def _valid_shard(cls, v):
        if v is None:
            return v
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(v))
        if not m or not int(m.group(1)) < int(m.group(2)):
            raise ValueError(f"{v!r} is not i/N with 0 <= i < N, e.g. 3/16")
        return f"{int(m.group(1))}/{int(m.group(2))}"

    @property
    def shard_of(self) -> tuple[int, int] | None:
        if self.shard is None:
            return None
        i, n = self.shard.split("/")
        return int(i), int(n)


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _key_lines(node: yaml.Node, path: tuple = ()) -> dict[tuple, int]:
    """Map each key path in a composed YAML tree to its 1-based line."""
    lines: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            p = path + (key_node.value,)
            lines[p] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, p))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            lines.update(_key_lines(item, path + (i,)))
    return lines


def _fill_env(value: Any, path: tuple, problems: list[tuple[tuple, str]]) -> Any:
    if isinstance(value, dict):
        return {k: _fill_env(v, path + (k,), problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_env(v, path + (i,), problems) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        problems.append((path, f"environment variable {name} is not set"))
        return ""

    return _ENV.sub(sub, value)


def _apply_override(raw: dict, assignment: str) -> None:
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise JobError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set embedding.dimensions=[256,64]")
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise JobError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise JobError(f"--set {key}: value is not valid YAML: {e}") from None


def _loc(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def load_job(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read, fill and validate a job file. Raises JobError listing every problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise JobError(f"cannot read job file {path}: {e.strerror or e}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise JobError(f"{path}: not valid YAML: {e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(f"{path}: a job file is a mapping of keys (name, input, model, ...), got {type(raw).__name__}")
    lines = _key_lines(node) if node is not None else {}

    for assignment in overrides:
        _apply_override(raw, assignment)

    env_problems: list[tuple[tuple, str]] = []
    raw = _fill_env(raw, (), env_problems)

    def where(loc: tuple) -> str:
        for n in range(len(loc), 0, -1):
            if loc[:n] in lines:
                return f"{path}:{lines[loc[:n]]}: "
        return f"{path}: "

    messages = [f"{where(p)}{_loc(p)}: {msg}" for p, msg in env_problems]
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as e:
        for err in e.errors():
            loc = tuple(err["loc"])
            if err["type"] == "extra_forbidden":
                msg = f"unknown key '{loc[-1]}'"
            elif err["type"] == "missing":
                msg = "required key is missing"
            else:
                msg = err["msg"]
                if msg.startswith("Value error, "):
                    msg = msg[len("Value error, "):]
            messages.append(f"{where(loc)}{_loc(loc)}: {msg}")
        spec = None
    if messages:
        raise JobError("invalid job:\n  " + "\n  ".join(messages))
    return spec
