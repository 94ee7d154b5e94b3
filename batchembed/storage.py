"""Storage through fsspec: listing inputs, fingerprints, and atomic writes.

A file written here is either absent or complete: locally it is written under a
temporary name and renamed; on object stores it is one PUT of a finished local
file, which becomes visible only when whole.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

from .errors import JobError, RunError

log = logging.getLogger(__name__)

_GLOB_CHARS = set("*?[")


def open_fs(uri: str, storage_options: dict[str, Any], key: str):
    """(filesystem, path) for a URL, with an install hint when the protocol's package is missing."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(uri, **storage_options)
    except ImportError as e:
        raise JobError(f"{key}: {uri}: {e}") from None
    except ValueError as e:
        raise JobError(f"{key}: {uri}: {e}") from None


def is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def full_url(fs, path: str) -> str:
    """A path as a URL a user can paste (s3://bucket/key, or a local path)."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def list_parquet_files(uri: str, storage_options: dict[str, Any]) -> tuple[Any, list[str]]:
    """Sorted Parquet files under a file, directory or glob URL."""
    fs, path = open_fs(uri, storage_options, "input.uri")
    try:
        if _GLOB_CHARS & set(path):
            files = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            files = [p for p in fs.find(path) if p.endswith(".parquet")
                     and not any(part.startswith(("_", ".")) for part in p[len(path):].split("/"))]
        elif fs.exists(path):
            files = [path]
        else:
            files = []
    except (FileNotFoundError, PermissionError) as e:
        raise JobError(f"input.uri: {uri}: {e}") from None
    except OSError as e:
        raise RunError(f"input.uri: cannot list {uri}: {e}") from None
    if not files:
        raise JobError(f"input.uri: no Parquet files at {uri}")
    return fs, sorted(files)


def fingerprint(fs, path: str) -> dict[str, Any]:
    """What identifies one version of an input file: path, size, and etag or mtime."""
    info = fs.info(path)
    fp: dict[str, Any] = {"path": full_url(fs, path), "size": info.get("size")}
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    if etag:
        fp["etag"] = str(etag).strip('"')
    else:
        mtime = info.get("mtime") or info.get("LastModified") or info.get("updated")
        fp["mtime"] = mtime.isoformat() if hasattr(mtime, "isoformat") else mtime
    return fp


def put_file_atomic(fs, local_path: str, remote_path: str) -> None:
    if is_local(fs):
        fs.makedirs(os.path.dirname(remote_path), exist_ok=True)
        tmp = f"{remote_path}.tmp-{uuid.uuid4().hex}"
        fs.put_file(local_path, tmp)
        os.replace(tmp, remote_path)
    else:
        fs.put_file(local_path, remote_path)


def write_bytes_atomic(fs, remote_path: str, data: bytes) -> None:
    if is_local(fs):
        fs.makedirs(os.path.dirname(remote_path), exist_ok=True)
        tmp = f"{remote_path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, remote_path)
    else:
        fs.pipe_file(remote_path, data)


def write_json_atomic(fs, remote_path: str, obj: Any) -> None:
    write_bytes_atomic(fs, remote_path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(fs, path: str) -> Any | None:
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        log.warning("ignoring unreadable %s", path)
        return None
