"""Units of work: one task per input file, or per range of its blocks (Parquet row groups).

A task writes exactly one output part, with an id fixed by its input file's path and
first block, so a rerun finds the same ids and adding or removing a file renames no other
file's parts. Pure logic: no I/O here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from .inputs.base import InputFile
from .output.layout import FORMER_ROWS_PER_PART


@dataclass(frozen=True)
class Task:
    index: int
    file: InputFile
    row_groups: tuple[int, ...]  # the input format's blocks (Parquet: row groups)
    num_rows: int
    first_row: int  # offset of the task's first row in its file

    @property
    def part_id(self) -> str:
        """The part's name without the output format's suffix: from the input file's path and
        first block."""
        stem = self.file.rel[: -len(".parquet")] if self.file.rel.endswith(".parquet") else self.file.rel
        first = self.row_groups[0] if self.row_groups else 0
        return f"part-{stem.replace('/', '__')}-rg{first:05d}"

    @property
    def input_fingerprint(self) -> dict[str, Any]:
        return {**self.file.fingerprint, "row_groups": [self.row_groups[0], self.row_groups[-1] + 1]
                if self.row_groups else [0, 0]}


# Parts each engine should get: engines pull parts as they finish, so the first one out of work
# waits for the others up to a part's work, about half a part on average: 1/60 of the run.
PARTS_PER_ENGINE = 30


def rows_per_part_for(rows: int, engines: int, window_rows: int) -> int:
    """output.rows_per_part that gives `engines` engines about PARTS_PER_ENGINE parts each of
    `rows`, but at least one window (engine.sort_window_rows): a smaller part is a smaller
    window, and smaller engine steps."""
    return max(window_rows, rows // (PARTS_PER_ENGINE * max(1, engines)))


def auto_rows_per_part(rows: int, engines: int, window_rows: int) -> tuple[int, str]:
    """output.rows_per_part: auto, and why, for `engines` engines sharing `rows` rows. One engine takes
    parts of up to FORMER_ROWS_PER_PART rows (the cut of every output before auto); several take about
    PARTS_PER_ENGINE parts each (rows_per_part_for), no larger, so that they finish together."""
    if engines < 2:
        return FORMER_ROWS_PER_PART, "one engine: parts of up to a million rows"
    n = min(FORMER_ROWS_PER_PART, rows_per_part_for(rows, engines, window_rows))
    return n, f"about {PARTS_PER_ENGINE} parts for each of {engines} engines over {rows:,} rows"


def shard_tasks(tasks: list[Task], shard: tuple[int, int] | None) -> list[Task]:
    """Shard `index` of `count`: deterministic, disjoint, and as even as the tasks allow (shard
    sizes differ by at most one task). Tasks are dealt round the shards in the order of a hash
    of their part ids, so big and small files mix, and every shard of a run, planning the
    same listing, deals the same way."""
    if shard is None:
        return list(tasks)
    index, count = shard
    order = sorted(tasks, key=lambda t: hashlib.sha1(t.part_id.encode()).hexdigest())
    mine = {t.index for t in order[index::count]}
    return [t for t in tasks if t.index in mine]


def make_tasks(files: list[InputFile], rows_per_part: int) -> list[Task]:
    """Cut each file into runs of whole blocks of at most `rows_per_part` rows (one block may exceed it)."""
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
