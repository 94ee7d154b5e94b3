"""What the pipeline's stages share: the Window that travels between them, the control items
beside it, and queue helpers that give up when the run stops."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..embed.batcher import RowPlan
from ..embed.tokenizer import Tokenized

if TYPE_CHECKING:
    from ..embed.engine import Pending

END = object()  # no more work
RESET = "reset"  # the task is being read again from its start: drop what was written of it
FAILED = "failed"  # the task failed and on_error is skip: drop it, record why


@dataclass
class Window:
    """One window of a task's rows on its way through the pipeline."""

    hashes: np.ndarray  # uint64 text hash per row
    valid: np.ndarray  # bool per row: text not null
    reuse: np.ndarray  # rows whose vectors come from the previous output
    reused: dict  # dimension -> (len(reuse), d) vectors; "sparse" / "multi_vector" -> their stored column
    need: np.ndarray  # rows to embed (valid, not reused)
    inverse: np.ndarray  # per need row: its unique text
    uniq: np.ndarray  # text hashes of the unique texts
    tok: Tokenized  # of the unique texts
    matched: int  # rows whose id was found in the previous output
    empty: int
    filtered: int = 0  # rows input.where dropped before this window
    chunked: int = 0  # rows embedded as several windows (long_text: chunk)
    full: np.ndarray | None = None  # (len(uniq), model dimension), set by the engine stage
    extra: dict = field(default_factory=dict)  # "sparse" / "multi_vector" -> a value per unique text
    embedded: int = 0  # unique texts the engine embedded (the rest came from the cache)
    tokens: int = 0
    # while on the engine: which unique texts it embeds, how, and their vectors as they come
    todo: np.ndarray | None = None
    plan: RowPlan | None = None
    pending: "Pending | None" = None
    borrowed: list = field(default_factory=list)  # (unique index, earlier Window, its unique index)
    failed: dict[int, str] = field(default_factory=dict)  # unique index -> why the engine failed it


def put(q: queue.Queue, item, stop) -> bool:
    """Put, waiting for room; False once `stop` is set."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


def get(q: queue.Queue, stop):
    """Get, waiting for an item; END once `stop` is set."""
    while not stop.is_set():
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            continue
    return END


def name_os_thread() -> None:
    """Give the calling thread its Python name in the OS too (Linux; 15 characters), so `top -H`
    and /proc show which of batchembed's threads uses the CPU. Best effort: elsewhere, nothing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, threading.current_thread().name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
