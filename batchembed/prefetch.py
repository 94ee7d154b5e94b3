"""Read the engine's native libraries into the page cache, in parallel, while the job is prepared.

On a fresh machine (a spot GPU, a new Airflow worker) nothing of torch, CUDA's libraries or vLLM
is in memory yet, and importing them and creating the first CUDA context fault gigabytes of
shared libraries in page by page, one file after another: on a fresh H200 the first engine took
52 s to start where the next took 13 s (notes/performance.md). Reading those files with many
threads at once is disk-bound instead of latency-bound. It changes nothing but the page cache,
and costs a directory walk when the files are already cached.

`BATCHEMBED_PREFETCH=0` turns it off.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

PACKAGES = ("torch", "vllm", "nvidia", "triton", "flash_attn", "vllm_flash_attn", "flashinfer", "xformers",
            "transformers", "tokenizers")
CHUNK = 8 << 20


def library_files(packages=PACKAGES) -> list[str]:
    """The shared libraries of the engine's packages (found without importing them)."""
    files = []
    for pkg in packages:
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        for root in (spec.submodule_search_locations or []) if spec else []:
            for d, _, names in os.walk(root):
                files += [os.path.join(d, n) for n in names if ".so" in n]
    return files


def _read(path: str) -> int:
    n = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                n += len(chunk)
    except OSError:
        pass
    return n


def prefetch(threads: int = 32) -> tuple[int, float]:
    """(bytes read, seconds): every library file read once, largest first."""
    started = time.perf_counter()
    files = sorted(library_files(), key=lambda p: -os.path.getsize(p) if os.path.exists(p) else 0)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        total = sum(pool.map(_read, files))
    return total, time.perf_counter() - started


def start_prefetch() -> threading.Thread | None:
    """prefetch() on a daemon thread (a run that ends first does not wait for it)."""
    if os.environ.get("BATCHEMBED_PREFETCH", "1") == "0":
        return None

    def go() -> None:
        total, seconds = prefetch()
        log.debug("prefetch: %.2f GB of engine libraries read in %.1f s", total / 1e9, seconds)

    t = threading.Thread(target=go, name="batchembed-prefetch", daemon=True)
    t.start()
    return t
