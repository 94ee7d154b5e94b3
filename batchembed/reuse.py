"""Reindexing: reuse a previous output's vectors for rows whose id and text did not change.

Every output row carries `text_hash`, a 64-bit hash of its text, so a later run can
tell a changed row from an unchanged one without the old input. With
`incremental: {previous: URI}` a run:

- copies a previous part whole (a server-side copy on object stores) when its input
  file is unchanged and the job is the same, without reading it;
- otherwise, for each task, loads the ids and text hashes of the previous parts made
  from the same input file (one file's worth: memory stays bounded), and reuses the
  stored vector of every row whose id and text hash match; the rest is embedded.

A row that moved to another input file is embedded again (and counted as deleted
from its old file): matching is per input file, which keeps the join streaming.

Reuse needs the same model (content hash), dtype, max_length and prefix, and for
each requested dimension a previous column at least as large (a larger one is
truncated and renormalised, which gives the same vector). Otherwise reuse is
refused, with the reason logged and recorded in the manifest, and every row is
embedded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .embed.matryoshka import l2_normalise
from .embed.vectors import PACKED, SCALAR, vector_matrix
from .errors import JobError, RunError
from .output.layout import LAYOUT, MANIFEST, OutputFolder
from .output.manifest import Manifest
from .output.records import copied_record
from .storage import concurrently, is_transient, retry

if TYPE_CHECKING:
    from .plan import Task

log = logging.getLogger(__name__)

TEXT_HASH = "text_hash"  # uint64 hash of each row's text, written beside its vectors


def _hash64(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def text_hashes(texts: list[str | None]) -> np.ndarray:
    """uint64 per text (blake2b-64 of its UTF-8); 0 where the text is null (mask it)."""
    digests = b"".join(_hash64(t.encode()) if t is not None else b"\0" * 8 for t in texts)
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64) if texts else np.zeros(0, np.uint64)


def id_keys(ids: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 key, valid) per id: integers as themselves, anything else by a 64-bit hash."""
    ids = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    valid = ~np.asarray(ids.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if pa.types.is_integer(ids.type):
        keys = ids.cast(pa.int64()).fill_null(0).to_numpy().view(np.uint64)
        return keys.copy(), valid
    values = ids.to_pylist()
    digests = b"".join(_hash64(v.encode() if isinstance(v, str) else v if isinstance(v, bytes)
                               else repr(v).encode()) if v is not None else b"\0" * 8 for v in values)
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64), valid


@dataclass
class Previous:
    """A previous output, and whether (and how) its vectors can be reused."""

    uri: str
    folder: OutputFolder
    manifest: Manifest
    usable: bool
    reason: str | None  # why reuse is refused
    id_column: str
    sources: dict[int, tuple[str, int]]  # our dimension -> (its column, its dimension)
    same_job: bool  # same job fingerprint: unchanged parts can be copied as they are
    parts: dict[str, dict] = field(default_factory=dict)  # its part name -> manifest entry
    rows: int = 0

    def summary(self) -> dict:
        return {"previous": self.uri, "previous_created_at": self.manifest.created_at,
                "previous_job": self.manifest.job.get("digest"), "reuse": self.usable,
                "refused": self.reason}

    def parts_of(self, task: Task) -> list[str]:
        """Its parts made from the same input file as `task`."""
        prefix = task.part_id[: task.part_id.rindex("-rg") + 3]
        return sorted(n for n in self.parts if n.startswith(prefix))

    def copyable(self, task: Task) -> dict | None:
        """Its manifest entry for `task`'s part when that part can be copied unchanged."""
        entry = self.parts.get(self.folder.part_name(task))
        if (self.usable and self.same_job and entry and entry.get("input") == task.input_fingerprint
                and entry.get("rows") == task.num_rows and "counts" in entry):
            return entry
        return None


def open_previous(uri: str, storage_options: dict, fp, id_column: str | None, out_url: str) -> Previous:
    """Read a previous output's manifest and decide whether its vectors can be reused by a job of
    fingerprint `fp` (job.JobFingerprint).

    A missing or unreadable manifest is a JobError (exit 2); an incompatible job is not
    an error: reuse is refused with the reason, and every row is embedded.
    """
    if not id_column:
        raise JobError("incremental.previous: needs input.id_column, since rows are matched by id")
    folder = OutputFolder.open(uri, storage_options, key="incremental.previous")
    url = folder.url
    if url.rstrip("/") == out_url.rstrip("/"):
        raise JobError(f"incremental.previous is output.uri ({url}): write the new snapshot to another "
                       "output.uri (e.g. one per date) and point previous at the last one")
    manifest = folder.read_manifest()
    if not manifest:
        raise JobError(f"incremental.previous: no {MANIFEST} at {url}; point it at a finished "
                       "batchembed output")
    job = manifest.job
    prev_id = manifest.input.id_column
    now = fp.as_dict()
    reasons = []
    if job.get("layout", 1) < LAYOUT:
        reasons.append("it has no text_hash column (written by batchembed before 0.2)")
    for key in ("model_hash", "dtype", "max_length", "prefix"):
        if job.get(key) != now[key]:
            reasons.append(f"{key} differs ({job.get(key)!r} there, {now[key]!r} now)")
    if job.get("long_text", "truncate") != now.get("long_text", "truncate"):
        reasons.append(f"long_text differs ({job.get('long_text', 'truncate')!r} there, "
                       f"{now.get('long_text', 'truncate')!r} now)")
    if not prev_id:
        reasons.append("it has no id column")
    if job.get("output_dtype") in PACKED:
        reasons.append(f"its vectors are {job.get('output_dtype')} bits, not floats")
    elif job.get("output_dtype") in SCALAR:
        reasons.append(f"its vectors are {job.get('output_dtype')}, not floats")
    elif fp.output_dtype in SCALAR:
        reasons.append(f"this job writes {fp.output_dtype}, whose ranges are each output's own calibration")
    elif job.get("output_dtype") == "float16" and fp.output_dtype == "float32":
        reasons.append("its vectors are float16 and this job writes float32")
    theirs_reps = job.get("representations", {})
    for r in [x for x in (fp.representations.get("outputs") or []) if x != "dense"]:
        if r not in (theirs_reps.get("outputs") or ["dense"]):
            reasons.append(f"it has no {r} column")
        elif theirs_reps.get(r) != fp.representations.get(r):
            reasons.append(f"its {r} settings differ ({theirs_reps.get(r)} there, {fp.representations.get(r)} now)")
    theirs = manifest.embedding.columns
    sources: dict[int, tuple[str, int]] = {}
    for d in fp.dimensions:
        bigger = sorted(D for D in theirs if D >= d)
        if not bigger:
            reasons.append(f"dimension {d} is larger than any it holds ({sorted(theirs)})")
            continue
        D = d if d in theirs else bigger[0]
        sources[d] = (theirs[D], D)
    reason = "; ".join(reasons) or None
    if reason:
        log.warning("incremental: not reusing %s: %s; every row is embedded", url, reason)
    parts = {e.name: e.model_dump() for e in manifest.parts}
    return Previous(uri=url, folder=folder, manifest=manifest, usable=reason is None, reason=reason,
                    id_column=prev_id or "", sources=sources, same_job=job.get("digest") == fp.digest,
                    parts=parts, rows=int(manifest.counts.get("rows", 0)))


def copy_parts(prev: Previous, tasks: list[Task], out: OutputFolder, job: dict,
               threads: int = 16) -> tuple[dict[int, dict], list[Task]]:
    """Copy the previous parts of unchanged inputs as they are, each followed by its commit
    record, which keeps every count and the token histogram of the source. Returns (records
    by task index, the tasks still to run)."""
    todo = [(t, e) for t in tasks if (e := prev.copyable(t))]
    if not todo:
        return {}, tasks

    def copy(item) -> tuple[int, dict]:
        t, entry = item
        name, src_name = out.part_name(t), prev.folder.part_name(t)
        out.copy_part_from(prev.folder, src_name, name)
        source = prev.folder.read_commit(src_name)
        if not source or source.get("rows") != entry["rows"]:  # the manifest's entry has the counts too
            source = {**entry["counts"], "rows": entry["rows"]}
        record = copied_record(name, source, t.input_fingerprint, job, prev.folder.part_url(src_name))
        out.write_commit(name, record)
        return t.index, record

    records = dict(concurrently(copy, todo, threads))
    log.info("incremental: %d unchanged parts copied from %s", len(records), prev.uri)
    return records, [t for t in tasks if t.index not in records]


class TaskIndex:
    """The previous rows of one task's input file: sorted id keys, text hashes, locations."""

    def __init__(self, prev: Previous, task: Task):
        self.prev = prev
        self.part_names = prev.parts_of(task)
        keys, hashes, part_no, rows = [], [], [], []
        for i, name in enumerate(self.part_names):
            table = self._read(name, lambda pf: pf.read(columns=[prev.id_column, TEXT_HASH]))
            k, ok = id_keys(table.column(prev.id_column))
            h = table.column(TEXT_HASH)
            ok &= ~np.asarray(h.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            keys.append(k[ok])
            hashes.append(h.combine_chunks().fill_null(0).to_numpy().astype(np.uint64)[ok])
            part_no.append(np.full(int(ok.sum()), i, dtype=np.int32))
            rows.append(np.flatnonzero(ok))
        def cat(xs, dt):
            return np.concatenate(xs) if xs else np.zeros(0, dt)

        keys_all = cat(keys, np.uint64)
        order = np.argsort(keys_all, kind="stable")
        self.keys = keys_all[order]
        self.hashes = cat(hashes, np.uint64)[order]
        self.part_no = cat(part_no, np.int32)[order]
        self.rows = cat(rows, np.int64)[order]
        self._open = contextlib.ExitStack()
        self._readers: dict[int, Any] = {}  # part -> output.base.PartReader, open until close()
        self._groups: dict[int, tuple[int, dict[str, np.ndarray]]] = {}  # part -> (row group, columns)

    def _read(self, name: str, fn):
        folder = self.prev.folder

        def go():
            with folder.open_part(name) as part:
                return fn(part)

        try:
            return retry(go, folder.part_url(name))
        except FileNotFoundError:
            raise RunError(f"incremental.previous: {folder.part_url(name)} is listed in its manifest "
                           "but gone") from None
        except Exception as e:  # noqa: BLE001
            if is_transient(e) or isinstance(e, RunError):
                raise
            raise RunError(f"incremental.previous: cannot read {folder.part_url(name)}: {e}") from None

    def match(self, keys: np.ndarray, key_valid: np.ndarray, hashes: np.ndarray,
              text_valid: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(reuse mask, position in this index per row, rows whose id was found)."""
        n = len(keys)
        if not len(self.keys):
            return np.zeros(n, bool), np.zeros(n, np.int64), 0
        pos = np.searchsorted(self.keys, keys)
        pos_c = np.minimum(pos, len(self.keys) - 1)
        found = key_valid & (self.keys[pos_c] == keys)
        reuse = found & text_valid & (self.hashes[pos_c] == hashes)
        return reuse, pos_c, int(found.sum())

    def vectors(self, positions: np.ndarray, dimensions: list[int], extras: tuple[str, ...] = ()) -> dict:
        """Stored vectors, reduced to each of our dimensions, for the given index positions; and
        the stored values (Arrow arrays, in position order) of `extras`, sparse and multi_vector,
        whose columns bear their names."""
        out: dict = {d: np.zeros((len(positions), d), np.float32) for d in dimensions}
        if not len(positions):
            return out | {r: None for r in extras}
        parts, rows = self.part_no[positions], self.rows[positions]
        columns = sorted({self.prev.sources[d] for d in dimensions} | {(r, 0) for r in extras})
        pieces: dict[str, list] = {r: [] for r in extras}  # (positions, values) per block
        for i in np.unique(parts):
            sel = np.flatnonzero(parts == i)
            part = self._reader(int(i))
            bounds = np.cumsum([0] + part.block_rows)
            groups = np.searchsorted(bounds, rows[sel], side="right") - 1
            for g in np.unique(groups):
                in_g = sel[groups == g]
                cols = self._group(int(i), int(g), columns)
                local = rows[in_g] - bounds[g]
                for d in dimensions:
                    name, D = self.prev.sources[d]
                    v = cols[name][local]
                    out[d][in_g] = v if D == d else l2_normalise(v[:, :d])
                for r in extras:
                    pieces[r].append((in_g, cols[r].take(pa.array(local))))
        for r in extras:  # back into position order
            at = np.concatenate([i for i, _ in pieces[r]])
            values = pa.concat_arrays([v for _, v in pieces[r]])
            out[r] = values.take(pa.array(np.argsort(at, kind="stable")))
        return out

    def _reader(self, i: int):
        if i not in self._readers:
            folder, name = self.prev.folder, self.part_names[i]
            self._readers[i] = retry(lambda: self._open.enter_context(folder.open_part(name)), folder.part_url(name))
        return self._readers[i]

    def _group(self, i: int, g: int, columns: list[tuple[str, int]]) -> dict[str, np.ndarray]:
        cached = self._groups.get(i)
        if cached and cached[0] == g:
            return cached[1]
        table = retry(lambda: self._reader(i).read_block(g, [c for c, _ in columns]),
                      f"{self.prev.uri}/{self.part_names[i]}")
        arrays = {c: vector_matrix(table.column(c)) if D else table.column(c).combine_chunks() for c, D in columns}
        self._groups[i] = (g, arrays)  # one row group per part: rows come mostly in order
        return arrays

    def close(self) -> None:
        try:
            self._open.close()
        except Exception:  # noqa: BLE001 - closing a read handle must not fail the run
            pass
        self._readers.clear()
        self._groups.clear()
