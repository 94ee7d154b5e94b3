"""Storage through fsspec: listing inputs, fingerprints, and atomic writes.

A file written here is either absent or complete: locally it is written under a
temporary name and renamed; on object stores it is one PUT of a finished local
file, which becomes visible only when whole.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import JobError, RunError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RetryPolicy:
    attempts: int = 6
    backoff_s: float = 1.0  # doubles each attempt, capped at 30 s

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return min(self.backoff_s * 2 ** (attempt - 1), 30.0)


# Set once per run from the job's `retry` section (job.prepare).
policy = RetryPolicy()


def is_transient(e: BaseException) -> bool:
    """Worth retrying: the store or the network hiccuped; not a missing file or a refusal."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    module = type(e).__module__ or ""
    if module.startswith(("botocore", "aiohttp", "urllib3", "requests", "google.api_core", "azure.core")):
        return "Credentials" not in type(e).__name__
    import pyarrow as pa

    if isinstance(e, pa.ArrowException):  # corrupt data, not a flaky store
        return False
    # An OSError with an errno is the OS's (ECONNRESET, EIO...); pyarrow's "Corrupt snappy
    # compressed data" and the like carry none.
    return isinstance(e, OSError) and e.errno is not None


def concurrently(fn: Callable[[Any], T], items: list, threads: int = 16) -> list[T]:
    """fn over items, `threads` at a time, results in order: object stores are latency-bound,
    so reading or copying many small objects one after another waits on each round trip."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(items)))) as pool:
        return list(pool.map(fn, items))


def is_refusal(e: BaseException) -> bool:
    """The store refused us: no credentials, wrong ones, or no permission (not worth retrying)."""
    name = type(e).__name__
    return isinstance(e, PermissionError) or "Credential" in name or "Authentication" in name


def retry(fn: Callable[[], T], what: str) -> T:
    """Call fn, retrying transient storage errors with exponential backoff.

    After the last attempt, raises RunError naming `what` (a URL: never credentials); so it does
    at once where the store refuses access.
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sorted by is_transient
            if is_refusal(e):
                hint = "; check the credentials (the environment's, or the job's storage_options)" if "://" in what \
                    else ""
                raise RunError(f"access refused at {what}: {type(e).__name__}: {e}{hint}") from e
            if not is_transient(e):
                raise
            if attempt == policy.attempts:
                raise RunError(f"storage error at {what} after {attempt} attempts: {type(e).__name__}: {e}") from e
            wait = policy.delay(attempt)
            log.warning("storage error at %s (%s: %s); retry %d/%d in %.1f s", what, type(e).__name__, e,
                        attempt, policy.attempts - 1, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


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


def fingerprint(fs, path: str) -> dict[str, Any]:
    """What identifies one version of an input file: path, size, and etag or mtime."""
    info = retry(lambda: fs.info(path), full_url(fs, path))
    fp: dict[str, Any] = {"path": full_url(fs, path), "size": info.get("size")}
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    if etag:
        fp["etag"] = str(etag).strip('"')
    else:
        mtime = info.get("mtime") or info.get("LastModified") or info.get("updated")
        fp["mtime"] = mtime.isoformat() if hasattr(mtime, "isoformat") else mtime
    return fp


def put_file_atomic(fs, local_path: str, remote_path: str) -> None:
    """Publish a finished local file at remote_path."""
    retry(lambda: _publish(fs, remote_path, local_path=local_path), full_url(fs, remote_path))


def write_bytes_atomic(fs, remote_path: str, data: bytes) -> None:
    retry(lambda: _publish(fs, remote_path, data=data), full_url(fs, remote_path))


def _publish(fs, remote_path: str, local_path: str | None = None, data: bytes | None = None) -> None:
    """Locally: write a temporary file beside the target, fsync, rename. Elsewhere: one PUT."""
    if not is_local(fs):
        if data is None:
            fs.put_file(local_path, remote_path)
        else:
            fs.pipe_file(remote_path, data)
        return
    os.replace(_temp_beside(remote_path, local_path, data), remote_path)


def _temp_beside(path: str, local_path: str | None = None, data: bytes | None = None) -> str:
    """A finished, fsynced temporary file beside local `path` holding `data` (or `local_path`'s
    bytes), under a dot-name, which dataset readers skip: a crash mid-write leaves nothing they
    would read. Its path, to rename or link into place."""
    head, name = os.path.split(path)
    os.makedirs(head, exist_ok=True)
    tmp = os.path.join(head, f".{name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        if data is None:
            with open(local_path, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def create_new(fs, path: str, data: bytes) -> bool:
    """Write `data` at `path` unless something is there already: False when something was. Locally a
    finished temporary file hard-linked into place (exclusive, and never seen half-written); on S3 a
    conditional PUT (If-None-Match). A store that takes no condition is written plainly: the caller
    reads the file back to learn who won."""
    if is_local(fs):
        tmp = _temp_beside(path, data=data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True

    def put() -> bool:
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:  # s3fs reads S3's 412 Precondition Failed as EINVAL
            if e.errno == errno.EINVAL and "condition" in str(e).lower():
                return False
            raise
        except TypeError:  # a filesystem without exclusive writes
            fs.pipe_file(path, data)
        return True

    return retry(put, full_url(fs, path))


def write_json_atomic(fs, remote_path: str, obj: Any) -> None:
    write_bytes_atomic(fs, remote_path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(fs, path: str) -> Any | None:
    """A small JSON object, or None where it is absent or unreadable."""

    def read() -> bytes:
        with fs.open(path, "rb") as f:
            return f.read()

    try:
        return json.loads(retry(read, full_url(fs, path)))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        log.warning("ignoring unreadable %s", path)
        return None


def remove(fs, path: str) -> None:
    """Delete a file if it is there (retried)."""

    def rm() -> None:
        try:
            fs.rm(path)
        except FileNotFoundError:
            pass

    retry(rm, full_url(fs, path))
