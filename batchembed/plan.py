"""Units of work: one task per input file, or per range of its row groups.

A task writes exactly one output part, with a name fixed by its place in the
sorted input listing, so a rerun finds the same names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .reader import InputFile


@dataclass(frozen=True)
class Task:
    index: int
    file: InputFile
    row_groups: tuple[int, ...]
    num_rows: int
    first_row: int  # offset of the task's first row in its file

    @property
    def part_name(self) -> str:
        """Stable under corpus changes: named by the input file's path and first row group,
        so adding or removing one file renames no other file's parts."""
        stem = self.file.rel[: -len(".parquet")] if self.file.rel.endswith(".parquet") else self.file.rel
        first = self.row_groups[0] if self.row_groups else 0
        return f"part-{stem.replace('/', '__')}-rg{first:05d}.parquet"

    @property
    def input_fingerprint(self) -> dict[str, Any]:
        return {**self.file.fingerprint, "row_groups": [self.row_groups[0], self.row_groups[-1] + 1]
                if self.row_groups else [0, 0]}


def in_shard(task: Task, shard: tuple[int, int] | None) -> bool:
    """Deterministic, disjoint assignment of tasks to shards, stable when the corpus
    changes: by a hash of the part name, not by position in the listing."""
    if shard is None:
        return True
    index, count = shard
    return int(hashlib.sha1(task.part_name.encode()).hexdigest(), 16) % count == index


def make_tasks(files: list[InputFile], rows_per_part: int) -> list[Task]:
    """Cut each file into runs of whole row groups of at most `rows_per_part` rows (one group may exceed it)."""
    tasks: list[Task] = []
    for f in files:
        groups: list[int] = []
        rows = first = offset = 0
        for g, n in enumerate(f.row_group_rows):
            if groups and rows + n > rows_per_part:
                tasks.append(Task(len(tasks), f, tuple(groups), rows, first))
                groups, rows, first = [], 0, offset
            groups.append(g)
            rows += n
            offset += n
        if groups or not f.row_group_rows:
            tasks.append(Task(len(tasks), f, tuple(groups), rows, first))
    return tasks


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

    def as_dict(self) -> dict[str, Any]:
        from .incremental import LAYOUT

        d = {"layout": LAYOUT, "model_hash": self.model_hash, "dimensions": list(self.dimensions),
             "output_dtype": self.output_dtype, "dtype": self.dtype, "max_length": self.max_length,
             "prefix": self.prefix, "columns": self.columns}
        if self.long_text != "truncate":  # only when set: outputs made before it keep their digest
            d["long_text"] = self.long_text
        return d

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]
