"""Whether vLLM's import will read bytecode, or compile its packages from source on every run.

Python compiles a module that has no valid bytecode cache (`__pycache__/*.pyc`) as it imports it,
and writes none back where PYTHONDONTWRITEBYTECODE is set (many container images set it) or the
package's folder is read-only. pip compiles at install; an image whose packages were copied in,
or installed with bytecode left out, has none, and then every run compiles torch, transformers,
sympy, scipy, ... again: vLLM's import took 17.5 s instead of 8.2 s on the 2-core development
machine (`PYTHONPYCACHEPREFIX` at an empty folder against the venv's bytecode), and 26-31 s
instead of 11.3 s on a lent H100 host whose image had no bytecode for torch and sympy.

The run says so once, before the import, with the command that fixes it for good.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# what vLLM's import spends most of its time in (python -X importtime), vLLM first
PACKAGES = ("vllm", "torch", "transformers", "sympy", "scipy", "openai")

_warned = False


def _has_bytecode(source: Path) -> bool:
    """Whether `source` has a cache the import system would accept: the right magic number and,
    for a timestamp-based cache, the source's mtime and size; hash-based caches are taken as
    they are (their check, where asked for, costs a read of the source, not a compile)."""
    try:
        cached = Path(importlib.util.cache_from_source(str(source)))
        head = cached.read_bytes()[:16]
        st = source.stat()
    except (OSError, NotImplementedError, ValueError):
        return False
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(head[4:8], "little")
    if flags & 1:  # hash-based
        return True
    mtime, size = int.from_bytes(head[8:12], "little"), int.from_bytes(head[12:16], "little")
    return mtime == (int(st.st_mtime) & 0xFFFFFFFF) and size == (st.st_size & 0xFFFFFFFF)


def missing(packages=PACKAGES, share: float = 0.5) -> dict[str, Path]:
    """The packages (name -> folder) where more than `share` of the top-level modules have no
    valid bytecode. Finds them without importing them."""
    out = {}
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        folder = Path(spec.origin).parent
        sources = sorted(folder.glob("*.py")) if spec.submodule_search_locations else [Path(spec.origin)]
        if sources and sum(not _has_bytecode(s) for s in sources) > share * len(sources):
            out[name] = folder
    return out


def writes_back(folder: Path) -> bool:
    """Whether this interpreter would write the bytecode it compiles for modules in `folder`."""
    if sys.dont_write_bytecode:
        return False
    if sys.pycache_prefix:
        return True  # written under the prefix, wherever that is
    return os.access(folder, os.W_OK) and (not (folder / "__pycache__").exists()
                                           or os.access(folder / "__pycache__", os.W_OK))


def warn_if_compiling(packages=PACKAGES) -> None:
    """Before vLLM's import, once a process: where the packages it reads have no bytecode, say
    what that costs and how to fix it. Nothing when the first package (vLLM) is imported already."""
    global _warned
    if _warned or packages[0] in sys.modules:
        return
    _warned = True
    gone = missing(packages)
    if not gone:
        return
    folders = sorted({str(f.parent) for f in gone.values()})
    fix = f"{Path(sys.executable).name} -m compileall -q -j 0 {' '.join(folders)}"
    every = [n for n, f in gone.items() if not writes_back(f)]
    if every:
        why = ("PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode
               else "their folders are read-only")
        log.warning("no Python bytecode for %s, and this interpreter writes none (%s): every run "
                    "compiles them again while importing vLLM (26-31 s against 11 s with bytecode on "
                    "an H100 host). Compile them once, e.g. where the image is built: "
                    "`%s`", ", ".join(every), why, fix)
    else:
        log.info("no Python bytecode yet for %s: this run's vLLM import compiles and writes it "
                 "(once; or ahead: `%s`)", ", ".join(gone), fix)
