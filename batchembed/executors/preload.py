"""What the engine processes of `engine.data_parallel` share: imported once, by the forkserver
they are forked from (processes.py), so N engines pay vLLM's import (about 20 s on a fresh GPU
machine, more when six import at once) once instead of N times, and start from a process that
has touched no GPU.

The forkserver leaves SIGINT and SIGTERM to the run's own process, as the engine processes do
(interrupts.ignore), and ends when that process does."""

from __future__ import annotations

import os
import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)

from ..embed.vllm_import import imports_frozen, inspect_here, unused_packages_hidden  # noqa: E402
from .base import ARCHITECTURES_ENV  # noqa: E402

# the heap of these imports, frozen before the engine processes are forked from it: their builds'
# collections skip it, and they share its pages instead of each copying them as they collect; the packages
# no engine uses left out of it (unused_packages_hidden)
with imports_frozen(), unused_packages_hidden():
    _t0 = time.perf_counter()
    from vllm import LLM, PoolingParams  # noqa: F401 - the import itself is the point

    IMPORT_SECONDS = time.perf_counter() - _t0
    # the job's model class, inspected here once rather than in every engine process (about a
    # second each)
    inspect_here(os.environ.get(ARCHITECTURES_ENV, "").split(","))
