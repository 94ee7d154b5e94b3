"""`_manifest.json`: one typed, versioned model that the run writes (run.write_manifest) and every
reader reads (verify, inspect, report, read, reuse, fidelity, the layout), as the job file is one
model (config.JobSpec).

Versions (`version`; docs/output.md has the fields):
    1   batchembed 0.2 to 0.6: no `version` key; no record of the engines' settings
    2   `version`, and `engine`: the engines' settings as resolved before they started
        (embed/settings.py EngineSettings)
An older manifest is read through `migrate`, step by step up to this version; one from a newer
batchembed is refused with the version it has and the one this release reads. Sections hold their
fields by name; a field a later minor release adds is kept as it is (extra="allow"), so a rewrite
by this release does not drop it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import RunError

VERSION = 2


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow")


class Tool(_Section):
    name: str = "batchembed"
    version: str


class ModelRecord(_Section):
    name: str
    hash: str
    dimension: int
    dtype: str
    max_length: int
    prefix: str | None = None
    instruction: str | None = None
    instruction_format: str | None = None
    text_prefix: str | None = None
    long_text: str = "truncate"
    chunk_overlap: int | None = None
    is_matryoshka: bool = False


class EmbeddingRecord(_Section):
    outputs: list[str] = ["dense"]
    dimensions: list[int]
    columns: dict[int, str]  # dimension -> its column (in JSON, the dimension as a string key)
    output_dtype: str = "float32"
    normalised: str = "l2"
    text_hash: str | None = "text_hash"
    packed_bits: bool = False
    calibration: dict[str, Any] | None = None
    sparse: dict[str, Any] | None = None
    multi_vector: dict[str, Any] | None = None


class InputRecord(_Section):
    uri: str
    text_column: str | None = None
    text_sql: str | None = None
    where: str | None = None
    id_column: str | None = None
    carry_columns: list[str] = []
    files: list[dict[str, Any]] = []


class PartEntry(_Section):
    name: str
    rows: int
    input: dict[str, Any] = {}
    counts: dict[str, int] = {}


class FailedRows(_Section):
    count: int = 0
    allowed: int = 0
    files: list[str] = []


class Manifest(_Section):
    version: int = VERSION
    tool: Tool
    name: str
    created_at: str | None = None
    complete: bool = True
    job: dict[str, Any]  # the job's fingerprint and digest (job.JobFingerprint), versioned by its `layout`
    format: str = "parquet"
    model: ModelRecord
    embedding: EmbeddingRecord
    input: InputRecord
    counts: dict[str, int]
    incremental: dict[str, Any] | None = None
    fidelity: dict[str, Any] | None = None
    rows_per_part: int | None = None  # the input's cut into parts (layout.PARTS); None before 0.8
    parts: list[PartEntry] = []
    failed: list[dict[str, Any]] = []
    failed_rows: FailedRows = Field(default_factory=FailedRows)
    index: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None  # embed/settings.py EngineSettings.as_dict(); None before version 2
    last_run: dict[str, Any] = {}
    token_histogram: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _from_1(d: dict) -> dict:
    """Version 1 (0.2 to 0.6) to 2: the same fields, no record of the engine settings."""
    return {**d, "version": 2, "engine": None}


_MIGRATIONS = {1: _from_1}


def migrate(d: dict) -> dict:
    """A manifest's JSON object in this version's shape."""
    version = d.get("version", 1)
    if not isinstance(version, int) or version > VERSION:
        raise RunError(f"the manifest is of version {version}, written by a newer batchembed; this one "
                       f"({VERSION}) cannot read it: upgrade batchembed")
    while version < VERSION:
        d = _MIGRATIONS[version](d)
        version = d["version"]
    return d


def parse(d: dict, where: str) -> Manifest:
    """The Manifest of JSON object `d`, read from `where` (named in the error)."""
    try:
        return Manifest.model_validate(migrate(d))
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        raise RunError(f"{where}: not a batchembed manifest this release can read ({field}: {first['msg']})") from None
