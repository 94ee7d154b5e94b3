"""The output folder and everything in it: the one place that knows its layout.

    part-<input file>-rg<first block>.parquet   the vectors, next to the ids and carried columns
                           (with output.format: lance, one Lance dataset at the root holds the
                           parts: data/, _versions/, ...; lance.py)
    _commits/<part>.json   a part's commit record (records.py), published after the part
    _errors/<part>.jsonl   the rows of a part the engine failed, one JSON line each, before it
    _calibration.json      int8 / uint8 ranges, made before any part
    _fidelity.json         the fidelity check's result
    _parts.json            how the input is cut into parts (output.rows_per_part), fixed by the
                           first run on the output and kept by every later one
    _manifest.json         after every part is committed
    _SUCCESS               last of all: a reader that sees it sees a finished output
    _runs/, _claims/       live runs' heartbeats and the parts each is embedding (leases.py)

Every file that is not data starts with `_` (or `.`, for a file being written), so pyarrow,
polars, DuckDB and Spark read the folder as a dataset as it is. Outputs made before the
manifest took its underscore (`manifest.json`) are read as they are, and a run that
changes one moves its manifest to the new name.

Parts are written by the output format (parquet.py, lance.py) to a local file and published by
it in one atomic step, then their record. Resume reads the records back (`state`): a part is
done when its record and the part itself are there.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import JobError, RunError
from ..storage import (
    create_new,
    full_url,
    is_local,
    open_fs,
    read_json,
    remove,
    retry,
    write_bytes_atomic,
    write_json_atomic,
)
from . import get_format, leases
from .base import OutputFormat, PartReader, PartWriter
from .manifest import Manifest, parse

LAYOUT = 2  # output layout version, part of every job's fingerprint: 2 added text_hash
COMMITS = "_commits"
ERRORS = "_errors"
MANIFEST = "_manifest.json"
OLD_MANIFEST = "manifest.json"  # layouts before the underscore: read, and moved on the next write
SUCCESS = "_SUCCESS"
CALIBRATION = "_calibration.json"
FIDELITY = "_fidelity.json"
PARTS = "_parts.json"
# output.rows_per_part of outputs made before PARTS was written, when it was the fixed default
FORMER_ROWS_PER_PART = 1_000_000


@dataclass
class OutputState:
    done: dict[int, dict]  # task index -> commit record, for tasks whose part is complete and current
    stale_records: list[str]  # paths of commit records that no current task will rewrite
    stale_parts: list[str]  # names of parts that no current task will rewrite
    complete: bool  # manifest and _SUCCESS present and every task done
    # task index -> commit record, for tasks planned again for the rows the engine failed in them
    retried: dict[int, dict] = field(default_factory=dict)


def _job_diff(a: dict, b: dict) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} there, {b.get(k)!r} now" for k in keys)


class OutputFolder:
    """An output location (any fsspec URL) and its format."""

    def __init__(self, fs, root: str, fmt: OutputFormat):
        self.fs, self.root, self.fmt = fs, root.rstrip("/"), fmt

    @classmethod
    def open(cls, uri: str, storage_options: dict[str, Any] | None = None, fmt: str | None = None,
             key: str = "output.uri") -> OutputFolder:
        """The output at `uri`, in format `fmt`; None: the format its manifest names (a Lance
        dataset's `_versions/` where there is no manifest yet; Parquet otherwise)."""
        fs, root = open_fs(uri, storage_options or {}, key)
        if is_local(fs) and os.path.isfile(root):
            raise JobError(f"{key}: {uri} is a file, not an output folder")
        if fmt is None:
            folder = cls(fs, root, get_format("parquet"))
            manifest = folder.read_manifest()
            fmt = manifest.format if manifest is not None else (
                "lance" if retry(lambda: fs.exists(folder.path("_versions")), folder.url) else "parquet")
        return cls(fs, root, get_format(fmt))

    @property
    def url(self) -> str:
        return full_url(self.fs, self.root)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        return full_url(self.fs, self.path(name))

    def check_writable(self) -> None:
        """JobError naming output.uri when parts could not be written here: a local path that
        cannot be created or written, a bucket or container that does not exist, or a store
        that refuses a write (a small probe file, written and removed)."""
        fs, root = self.fs, self.root
        try:
            if is_local(fs):
                at = root
                while not os.path.exists(at):
                    at = os.path.dirname(at) or "/"
                if not os.path.isdir(at):
                    raise JobError(f"output.uri: {self.url} cannot be created: {at} is a file")
                if not os.access(at, os.W_OK | os.X_OK):
                    raise JobError(f"output.uri: {self.url} cannot be created or written: {at} is not writable")
                return
            retry(lambda: fs.info(root.split("/", 1)[0]), self.url)  # the bucket: FileNotFoundError if absent
            probe = self.path(f"_batchembed-probe-{uuid.uuid4().hex}")
            write_bytes_atomic(fs, probe, b"")  # a store that is down is retried, then RunError
            remove(fs, probe)
        except (JobError, RunError):
            raise
        except FileNotFoundError as e:
            bucket = root.split("/", 1)[0]
            raise JobError(f"output.uri: {self.url}: the bucket or container {bucket!r} does not exist "
                           f"({e})") from None
        except Exception as e:  # noqa: BLE001 - a store says no in many ways
            raise JobError(f"output.uri: {self.url} cannot be written: {type(e).__name__}: {e}") from None

    def check_apart_from(self, in_fs, in_root: str, input_uri: str) -> None:
        """JobError when the parts would land where the input is read from: the first run would
        write them into the corpus, and every later run would read them as input."""
        if type(in_fs) is not type(self.fs) or in_fs.storage_options != self.fs.storage_options:
            return
        pattern = in_fs._strip_protocol(input_uri).rstrip("/")
        probe = self.path(self.fmt.data_sample)
        if any(c in pattern for c in "*?["):
            if "**" in pattern:
                hit = probe.startswith(in_root.rstrip("/") + "/")
            else:  # segment by segment, as the glob is listed
                a, b = probe.split("/"), pattern.split("/")
                hit = len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))
        else:
            hit = self.root == pattern or self.root.startswith(pattern + "/")
        if hit:
            raise JobError(f"output.uri: {self.url} is inside the input ({input_uri}): its parts would be read "
                           "as input by the next run; write the output elsewhere")

    def part_name(self, task) -> str:
        return task.part_id + self.fmt.suffix

    def _stem(self, part_name: str) -> str:
        return part_name.removesuffix(self.fmt.suffix)

    def _commit_path(self, part_name: str) -> str:
        return self.path(f"{COMMITS}/{self._stem(part_name)}.json")

    def errors_name(self, part_name: str) -> str:
        return f"{ERRORS}/{self._stem(part_name)}.jsonl"

    def part_url(self, part_name: str) -> str:
        return self.fmt.part_url(self, part_name)

    def strays(self) -> list[str]:
        """Data in the output that is no part (an older layout's manifest.json is no stray)."""
        return [x for x in self.fmt.strays(self) if x.rsplit("/", 1)[-1] != OLD_MANIFEST]

    # --- reading ---------------------------------------------------------------------------

    def commit_paths(self) -> list[str]:
        fs, root = self.fs, self.root

        def go() -> list[str]:
            fs.invalidate_cache()
            return fs.glob(f"{root}/{COMMITS}/part-*.json") if fs.exists(f"{root}/{COMMITS}") else []

        return retry(go, self.url)

    def error_files(self) -> list[str]:
        fs, root = self.fs, self.root
        return retry(lambda: fs.glob(f"{root}/{ERRORS}/part-*.jsonl") if fs.exists(f"{root}/{ERRORS}") else [],
                     self.url)

    def part_names(self) -> list[str]:
        """The parts present, by name, sorted."""
        return sorted(self.fmt.parts(self))

    def open_part(self, name: str) -> contextlib.AbstractContextManager[PartReader]:
        return self.fmt.open_part(self, name)

    def read_json(self, name: str) -> Any | None:
        return read_json(self.fs, self.path(name))

    def write_json(self, name: str, obj: Any) -> None:
        write_json_atomic(self.fs, self.path(name), obj)

    def read_commit(self, part_name: str) -> dict | None:
        return read_json(self.fs, self._commit_path(part_name))

    def read_manifest(self) -> Manifest | None:
        """The manifest (output/manifest.py), an older version's migrated; None where there is none."""
        for name in (MANIFEST, OLD_MANIFEST):
            found = self.read_json(name)
            if found:
                return parse(found, self.url_of(name))
        return None

    def recorded_cut(self) -> tuple[int, str] | None:
        """(output.rows_per_part, why) this output's parts are cut by: its record, or for an output made
        before the record (parts or commit records but no PARTS) the fixed default of then; None for an
        output that holds no part yet."""
        found = self.read_json(PARTS)
        if isinstance(found, dict) and isinstance(found.get("rows_per_part"), int):
            return found["rows_per_part"], f"recorded in {self.url_of(PARTS)} by the run that made the output"
        if self.commit_paths() or self.fmt.parts(self):
            return FORMER_ROWS_PER_PART, "the fixed cut of an output made before batchembed 0.8"
        return None

    def record_cut(self, rows_per_part: int, why: str, replace: bool = False) -> int:
        """Record the cut before any part is written, unless another run has recorded one (`replace`:
        the job sets it, and a differing record is rewritten). Returns the cut recorded: every run on
        the output must cut alike, or they would write different parts under one name."""
        body = {"rows_per_part": rows_per_part, "why": why}
        if replace:
            if self.read_json(PARTS) != body:
                self.write_json(PARTS, body)
            return rows_per_part
        if create_new(self.fs, self.path(PARTS), (json.dumps(body, indent=2) + "\n").encode()):
            return rows_per_part
        found = self.read_json(PARTS)
        return found["rows_per_part"] if isinstance(found, dict) and "rows_per_part" in found else rows_per_part

    def finished(self) -> bool:
        return retry(lambda: self.fs.exists(self.path(SUCCESS)), self.url)

    def state(self, tasks, job: dict, failed_inputs: list) -> OutputState:
        """What the output already holds for these tasks. `job` is the job's fingerprint with its
        digest; results of a different job are refused (JobError), never mixed."""
        commit_paths, present = self.commit_paths(), self.fmt.parts(self)
        manifest = self.read_manifest()
        records = [r for r in (read_json(self.fs, c) for c in commit_paths) if r]
        jobs = [r.get("job", {}) for r in records] + ([manifest.job] if manifest else [])
        foreign = [j for j in jobs if j.get("digest", "") != job["digest"]]
        if foreign:
            theirs = {"layout": 1, **{k: v for k, v in foreign[0].items() if k != "digest"}}  # 1: no text_hash
            current = {k: v for k, v in job.items() if k != "digest"}
            raise JobError(f"output.uri {self.url} holds embeddings made by a different job "
                           f"({_job_diff(theirs, current)}); rerun with --overwrite to replace them, "
                           "or write to a new output.uri")
        by_part = {r["part"]: r for r in records}
        finished = manifest is not None and self.finished()
        done, retried = {}, {}
        for t in tasks:
            name = self.part_name(t)
            r = by_part.get(name)
            # a part with rows the engine failed is tried again, unless the output was finished with them
            there = name in present or (r is not None and r.get("rows") == 0 and not self.fmt.empty_parts_kept)
            if r and r.get("input") == t.input_fingerprint and there:
                if finished or not r.get("failed_rows"):
                    done[t.index] = r
                else:
                    retried[t.index] = r
        names = {self.part_name(t) for t in tasks}
        # commit records go before their parts, so a part never outlives its record unnoticed
        stale_records = [c for c in commit_paths
                         if c.rsplit("/", 1)[-1].removesuffix(".json") + self.fmt.suffix not in names]
        stale_parts = sorted(n for n in present if n not in names)
        complete = (finished and len(done) == len(tasks) and not stale_records and not stale_parts
                    and not failed_inputs)
        return OutputState(done, stale_records, stale_parts, complete, retried)

    # --- writing ---------------------------------------------------------------------------

    def writer(self, schema, compression: str) -> PartWriter:
        return self.fmt.writer(schema, compression)

    def commit(self, writer: PartWriter, part_name: str, record: dict, errors: list[dict] | None = None) -> None:
        """Publish a written part (its error file first, when the engine failed rows of it), then its
        commit record. Each may be retried; all are idempotent."""
        writer.close()
        try:
            if errors:
                lines = "".join(json.dumps(e, default=str) + "\n" for e in errors)
                write_bytes_atomic(self.fs, self.path(self.errors_name(part_name)), lines.encode())
            self.fmt.publish(self, writer, part_name)
            self.write_commit(part_name, record)
        finally:
            writer.discard()

    def write_commit(self, part_name: str, record: dict) -> None:
        write_json_atomic(self.fs, self._commit_path(part_name), record)

    def copy_part_from(self, src: OutputFolder, src_name: str, part_name: str) -> None:
        """A part of another output, copied as it is (server-side where the format allows)."""
        self.fmt.copy_part(src, self, src_name, part_name)

    def drop_error_files(self, records) -> None:
        """Remove error files of parts whose current record has no failed rows (redone since)."""
        keep = {self.path(self.errors_name(r["part"])) for r in records if r.get("failed_rows")}
        self.remove([e for e in self.error_files() if e not in keep])

    def unfinish(self) -> None:
        """The output is about to change: it stops looking finished first."""
        for name in (SUCCESS, MANIFEST, OLD_MANIFEST):
            remove(self.fs, self.path(name))

    def finish(self, manifest: Manifest, success: bool) -> None:
        """The manifest, then (when nothing failed) _SUCCESS, last of all."""
        self.write_json(MANIFEST, manifest.to_json())
        if success:
            write_bytes_atomic(self.fs, self.path(SUCCESS), b"")

    def remove(self, paths: list[str]) -> None:
        for path in paths:
            remove(self.fs, path)

    def remove_stale(self, state: OutputState) -> None:
        """What no current task owns: records first, then parts."""
        self.remove(state.stale_records)
        self.fmt.remove_parts(self, state.stale_parts)

    def clear(self) -> None:
        """Remove everything batchembed wrote under the root, marker first."""
        self.remove([self.path(SUCCESS), self.path(MANIFEST), self.path(OLD_MANIFEST), *self.commit_paths()])
        self.fmt.clear(self)
        self.remove([*self.error_files(), self.path(CALIBRATION), self.path(FIDELITY), self.path(PARTS)])
        leases.sweep(self)
