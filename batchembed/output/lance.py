"""Lance output (`output.format: lance`): one Lance dataset at output.uri holds every part, beside
the layout's own files (_commits/, _manifest.json, _SUCCESS, which Lance ignores).

A part is written to a local Arrow IPC file, then to one Lance data file, data/<part>__<uuid>.lance
(invisible until committed), and published by one Lance transaction based on the version just
read: an Update that swaps the part's earlier fragment for the new one, or, for a part not there
yet, a Merge that adds it. Both are Lance's compare-and-swap: they fail when another commit came
in between that touched the same fragment (Update) or any fragment (Merge), where an Append would
not. A publish that fails so is tried again on the new version, unless the part itself changed
meanwhile: then another run published it, and ours is dropped. So a part is there once, whoever
publishes it and however often, and a kill at any point leaves the dataset as it was or with the
part. Which fragment is which part is its data file's name.

After every part is committed, `build_index` builds the vector index (output.index) and a
scalar index on the id column; an index that already covers every row is kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

os.environ.setdefault("LANCE_LOG", "error")  # Lance's own log: its warnings are for its developers
import lance  # noqa: E402 - pylance; the registry (output/__init__.py) gives its install hint when missing
from lance.file import LanceFileWriter  # noqa: E402
from lance.fragment import DataFile, LanceFragment  # noqa: E402

try:
    from lance.commit import CommitConflictError as _CONFLICT  # noqa: E402
except ImportError:  # older pylance: told by its message
    _CONFLICT = ()

from .. import scratch
from ..errors import RunError
from ..storage import full_url, is_local, retry
from .base import copy_rows

log = logging.getLogger(__name__)
SEP = "__"  # data/<part>__<uuid>.lance
DIRS = ("_versions", "_transactions", "_indices", "_deletions", "_refs", "data")
COMMIT_ATTEMPTS = 50
INDEX_TYPES = {"ivf_pq": "IVF_PQ", "ivf_hnsw_sq": "IVF_HNSW_SQ"}


def lance_options(fs) -> dict[str, str]:
    """fsspec storage options (s3fs, gcsfs, adlfs) as Lance's object store takes them."""
    opts = dict(getattr(fs, "storage_options", None) or {})
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    out: dict[str, str] = {}
    if protocol in ("s3", "s3a"):
        names = {"key": "aws_access_key_id", "secret": "aws_secret_access_key", "token": "aws_session_token",
                 "endpoint_url": "aws_endpoint", "region_name": "aws_region"}
        client = opts.pop("client_kwargs", {}) or {}
        for k, v in {**client, **opts}.items():
            if k in names and v is not None:
                out[names[k]] = str(v)
            elif k == "anon" and v:
                out["aws_skip_signature"] = "true"
        endpoint = out.get("aws_endpoint") or os.environ.get("AWS_ENDPOINT_URL", "")
        if endpoint.startswith("http://"):
            out["allow_http"] = "true"
        if endpoint:
            out.setdefault("aws_region", os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION",
                                                                                         "us-east-1")))
    else:
        out = {k: str(v) for k, v in opts.items() if isinstance(v, (str, int, float, bool))}
    return out


class LancePartWriter:
    """Rows of one part, streamed to a local Arrow IPC file (memory stays flat)."""

    def __init__(self, schema: pa.Schema, compression: str):
        self.local_path = scratch.file(".arrow")
        self.schema = schema
        self._sink = pa.OSFile(self.local_path, "wb")
        self._writer = pa.ipc.new_file(self._sink, schema)
        self.rows = 0
        self._closed = False

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table.cast(self.schema) if table.schema != self.schema else table)
        self.rows += table.num_rows

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()
            self._sink.close()

    def discard(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
        if os.path.exists(self.local_path):
            os.unlink(self.local_path)

    def reader(self) -> pa.RecordBatchReader:
        f = pa.ipc.open_file(pa.memory_map(self.local_path))
        return pa.RecordBatchReader.from_batches(self.schema, (f.get_batch(i) for i in range(f.num_record_batches)))


class LancePartReader:
    def __init__(self, ds, fragment_ids: list[int]):
        self._frags = [ds.get_fragment(i) for i in fragment_ids]
        self.schema = ds.schema
        self.block_rows = [f.count_rows() for f in self._frags]
        self.num_rows = sum(self.block_rows)

    def iter_batches(self, columns: list[str] | None = None, batch_size: int = 4096) -> Iterator[pa.RecordBatch]:
        for f in self._frags:
            yield from f.to_batches(columns=columns, batch_size=batch_size)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        schema = self.schema if columns is None else pa.schema([self.schema.field(c) for c in columns])
        return pa.Table.from_batches(list(self.iter_batches(columns)), schema)

    def read_block(self, block: int, columns: list[str]) -> pa.Table:
        return self._frags[block].to_table(columns=columns)


def part_of(fragment) -> str | None:
    """The part a fragment holds, from its data file's name; None for rows batchembed did not write."""
    name = fragment.metadata.files[0].path.rsplit("/", 1)[-1] if fragment.metadata.files else ""
    return name.split(SEP, 1)[0] if SEP in name and name.endswith(".lance") else None


def _live(ds) -> dict[str, list]:
    parts: dict[str, list] = {}
    for f in ds.get_fragments():
        parts.setdefault(part_of(f), []).append(f)
    return parts


class LanceOutput:
    name = "lance"
    suffix = ""
    data_sample = "data/x.lance"
    empty_parts_kept = False  # Lance keeps no fragment of no rows: an empty part is its record alone

    def writer(self, schema: pa.Schema, compression: str) -> LancePartWriter:
        return LancePartWriter(schema, compression)

    # --- the dataset ----------------------------------------------------------------------

    def _uri(self, folder) -> str:
        return full_url(folder.fs, folder.root)

    def _exists(self, folder) -> bool:
        return retry(lambda: folder.fs.exists(folder.path("_versions")), folder.url)

    def dataset(self, folder, version: int | None = None):
        """The dataset (latest version), or None when there is none yet."""
        if not self._exists(folder):
            return None
        try:
            return retry(lambda: lance.dataset(self._uri(folder), version=version,
                                               storage_options=lance_options(folder.fs)), folder.url)
        except ValueError as e:  # _versions/ is there, its first manifest not yet: being created
            if "not found" in str(e).lower():
                return None
            raise

    def _create(self, folder, schema: pa.Schema) -> None:
        """Create the dataset unless it is there: exclusively, whoever else (thread, engine process,
        another run) creates it at the same moment. Lance's own create (`write_dataset`, mode
        "create") checks first and commits an Overwrite after, and an Overwrite conflicts with no
        other commit: a create that lost the race would commit over the winner's first parts and
        empty the dataset. Committed here with no retries, the create writes the first version or
        fails, and a failure with the dataset there is another's create."""
        if is_local(folder.fs):
            os.makedirs(folder.root, exist_ok=True)
        try:
            lance.LanceDataset.commit(self._uri(folder), lance.LanceOperation.Overwrite(schema, []),
                                      storage_options=lance_options(folder.fs), max_retries=0)
        except Exception as e:  # noqa: BLE001 - another created it first, or the store said no
            if not self._exists(folder):
                raise RunError(f"output.uri: cannot create a Lance dataset at {folder.url}: {e}") from None

    def _commit(self, folder, operation, ds) -> bool:
        """Commit `operation` based on `ds`'s version: False when another commit preempted it."""
        try:
            lance.LanceDataset.commit(self._uri(folder), operation, read_version=ds.version,
                                      storage_options=lance_options(folder.fs), max_retries=0)
            return True
        except Exception as e:  # noqa: BLE001 - a conflict is tried again; anything else fails the run
            if type(e).__name__ != "CommitConflictError" and "conflict" not in str(e).lower():
                raise RunError(f"cannot commit to the Lance dataset at {folder.url}: {e}") from None
            return False

    @staticmethod
    def _backoff(attempt: int) -> None:
        time.sleep(random.uniform(0, min(2.0, 0.02 * 2 ** min(attempt, 7))))

    # --- the OutputFormat protocol ----------------------------------------------------------

    def parts(self, folder) -> set[str]:
        ds = self.dataset(folder)
        return {p for p in _live(ds) if p is not None} if ds is not None else set()

    @contextlib.contextmanager
    def open_part(self, folder, name: str) -> Iterator[LancePartReader]:
        ds = self.dataset(folder)
        if ds is None:
            raise FileNotFoundError(self.part_url(folder, name))
        # a part of no rows has no fragment: it reads as empty (whether a part should be there
        # is for its commit record and the manifest to say)
        yield LancePartReader(ds, [f.fragment_id for f in _live(ds).get(name, ())])

    def publish(self, folder, writer: LancePartWriter, name: str) -> None:
        if writer.rows == 0:  # Lance keeps no fragment of no rows: only an earlier one goes
            self.remove_parts(folder, [name])
            return
        uri, opts = self._uri(folder), lance_options(folder.fs)
        file = f"{name}{SEP}{uuid.uuid4().hex}.lance"

        def upload() -> None:
            out = LanceFileWriter(f"{uri}/data/{file}", writer.schema, storage_options=opts)
            for batch in writer.reader():
                out.write_batch(batch)
            out.close()

        retry(upload, f"{folder.url}/data/{file}")
        seen = None
        for attempt in range(COMMIT_ATTEMPTS):
            ds = self.dataset(folder)
            if ds is None:  # none yet, or another thread or run creating it
                self._create(folder, writer.schema)
                if self.dataset(folder) is None:
                    self._backoff(attempt)
                continue
            live = _live(ds)
            old = sorted(f.fragment_id for f in live.get(name, ()))
            if seen is None:
                seen = old
            elif old != seen:  # another run published this part since: it is there, once
                self._drop_file(folder, file)
                return
            frag = _leaf_fields(LanceFragment.create_from_file(file, ds, 0), writer.schema)
            if old:
                op = lance.LanceOperation.Update(removed_fragment_ids=old, new_fragments=[frag])
            else:
                frag.id = max([f.fragment_id for fs in live.values() for f in fs], default=-1) + 1
                everything = [f.metadata for fs in live.values() for f in fs]
                op = lance.LanceOperation.Merge(everything + [frag], ds.lance_schema)
            if self._commit(folder, op, ds):
                return
            self._backoff(attempt)
        raise RunError(f"cannot commit to the Lance dataset at {folder.url}: {COMMIT_ATTEMPTS} conflicting "
                       "commits in a row (many runs writing it at once?)")

    def _drop_file(self, folder, file: str) -> None:
        with contextlib.suppress(Exception):
            folder.fs.rm(folder.path(f"data/{file}"))

    def copy_part(self, src, dst, src_name: str, dst_name: str) -> None:
        copy_rows(self, src, dst, src_name, dst_name)

    def remove_parts(self, folder, names: list[str]) -> None:
        for attempt in range(COMMIT_ATTEMPTS):
            ds = self.dataset(folder)
            gone = sorted(f.fragment_id for n, fs in (_live(ds) if ds is not None else {}).items()
                          if n in names for f in fs)
            if not gone or self._commit(folder, lance.LanceOperation.Update(removed_fragment_ids=gone), ds):
                return
            self._backoff(attempt)
        raise RunError(f"cannot remove parts from the Lance dataset at {folder.url}: conflicting commits")

    def strays(self, folder) -> list[str]:
        """Fragments in the dataset that are no part of batchembed's: rows readers see, no manifest counts."""
        ds = self.dataset(folder)
        return [f"{folder.url}: fragment {f.fragment_id}" for f in _live(ds).get(None, ())] if ds is not None else []

    def clear(self, folder) -> None:
        for d in DIRS:
            path = folder.path(d)
            if retry(lambda p=path: folder.fs.exists(p), folder.url):
                retry(lambda p=path: folder.fs.rm(p, recursive=True), full_url(folder.fs, path))

    def part_url(self, folder, name: str) -> str:
        return f"{folder.url} (Lance dataset, part {name})"

    # --- indexes ----------------------------------------------------------------------------

    def index_names(self, folder) -> list[str]:
        ds = self.dataset(folder)
        return self._indexes(ds) if ds is not None else []

    def build_index(self, folder, spec: Any, column: str, id_column: str | None, changed: bool) -> dict[str, Any]:
        """The vector index `spec` (config.IndexSpec) on `column`, and a BTREE on the id column.
        The same index is kept when this run changed no part (`changed`) and it covers every row."""
        ds = self.dataset(folder)
        info: dict[str, Any] = {"type": spec.type, "metric": spec.metric, "column": column,
                                "num_partitions": spec.num_partitions, "num_sub_vectors": spec.num_sub_vectors,
                                "id_index": id_column if spec.id_index else None}
        # the name says what was asked for: the same request finds its index and keeps it
        name = (f"{column}_{spec.type}_{spec.metric}_p{spec.num_partitions or 'auto'}"
                f"_s{spec.num_sub_vectors or 'auto'}")
        id_name = f"{id_column}_btree"
        rows = ds.count_rows() if ds is not None else 0
        if rows == 0:
            return {**info, "built": False, "reason": "no rows"}
        started = time.perf_counter()
        info["kept"] = not changed and self._covers(ds, name)
        if not info["kept"]:
            for other in self._indexes(ds):
                if other.startswith(f"{column}_") and other != name:
                    ds.drop_index(other)  # an index asked for before, with other settings
            kwargs = {k: v for k, v in (("num_partitions", spec.num_partitions),
                                        ("num_sub_vectors", spec.num_sub_vectors)) if v}
            if "num_partitions" not in kwargs:  # about sqrt(rows), and at least 256 rows to train each
                kwargs["num_partitions"] = max(1, min(int(rows ** 0.5), rows // 256))
            if spec.type == "ivf_pq" and "num_sub_vectors" not in kwargs:  # 16 dimensions each, or near that
                d = ds.schema.field(column).type.list_size
                kwargs["num_sub_vectors"] = next(k for k in range(max(1, d // 16), 0, -1) if d % k == 0)
            info.update(num_partitions=kwargs.get("num_partitions"), num_sub_vectors=kwargs.get("num_sub_vectors"))
            info["kept"] = self._index(folder, name, lambda d: d.create_index(
                column, INDEX_TYPES[spec.type], name=name, metric=spec.metric, replace=True, **kwargs),
                f"output.index: building {spec.type} on {column} of {folder.url} failed")
        if id_column and spec.id_index:
            ds = self.dataset(folder)
            if changed or not self._covers(ds, id_name):
                self._index(folder, id_name, lambda d: d.create_scalar_index(id_column, "BTREE", name=id_name,
                                                                             replace=True),
                             f"output.index: the BTREE on {id_column} of {folder.url} failed")
        info["seconds"] = round(time.perf_counter() - started, 3)
        return {**info, "name": name, "built": True}

    def _index(self, folder, name: str, create, failed: str) -> bool:
        """create(dataset), on the dataset as it is now. Two runs that finish at once (shards, a
        rerun beside a run) both build the index: Lance commits one and tells the other of a
        retryable conflict, after which the index the other built is kept if it covers every row,
        and the build is tried again otherwise. Returns whether another run's index was kept."""
        for attempt in range(3):
            try:
                create(self.dataset(folder))
                return False
            except Exception as e:  # noqa: BLE001 - Lance says what it could not train, and why
                conflict = isinstance(e, _CONFLICT) or "commit conflict" in str(e).lower()
                if not conflict or attempt == 2:
                    raise RunError(f"{failed}: {e}") from None
                if self._covers(self.dataset(folder), name):
                    log.info("%s: built by a run that finished at the same time; kept", name)
                    return True
        return False

    @staticmethod
    def _indexes(ds) -> list[str]:
        try:
            return [i.name for i in ds.describe_indices()]
        except Exception:  # noqa: BLE001 - older pylance
            return [i["name"] for i in ds.list_indices()]

    @staticmethod
    def _covers(ds, name: str) -> bool:
        try:
            return ds.stats.index_stats(name).get("num_unindexed_rows", 1) == 0
        except Exception:  # noqa: BLE001 - no such index
            return False


def _leaf_ids(schema: pa.Schema) -> list[int]:
    """Lance's field ids of the columns a data file stores: ids go depth first over the fields (a
    list's item and a struct's children have ids of their own); a column is stored per leaf (a
    fixed-size list, a vector, is one)."""
    ids: list[int] = []
    counter = iter(range(1 << 30))

    def visit(t: pa.DataType) -> None:
        i = next(counter)
        if pa.types.is_struct(t):
            for k in range(t.num_fields):
                visit(t.field(k).type)
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            visit(t.value_type)
        else:
            ids.append(i)

    for f in schema:
        visit(f.type)
    return ids


def _leaf_fields(frag, schema: pa.Schema):
    """A fragment made by LanceFragment.create_from_file names every field id of its file, nested
    ones included, where Lance wants those of the stored columns (its commit refuses a file whose
    ids and columns differ in number: a sparse or multi-vector column)."""
    files = []
    for f in frag.files:
        if len(f.fields) != len(f.column_indices):
            f = DataFile(f.path, _leaf_ids(schema), list(f.column_indices), f.file_major_version,
                         f.file_minor_version, f.file_size_bytes)
        files.append(f)
    frag.files = files
    return frag
