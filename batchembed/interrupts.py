"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (a scheduler's timeout, Airflow's included).

The first signal asks the run to stop: no new work is taken, the part being written is
dropped (only whole, committed parts stay), the engines are shut down, and the command
exits 130 (SIGINT) or 143 (SIGTERM) with one line saying what is committed. A second
signal ends the process at once. Engine processes do not take the signals themselves:
their parent stops them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

STOP = threading.Event()  # set by the first signal
_signal: int | None = None


def install() -> None:
    """Handle SIGINT and SIGTERM in this (the main) thread for the rest of the process."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handle)


def ignore() -> None:
    """In an engine process: leave the signals to the parent, which stops it through its queue."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _handle(signum, frame) -> None:
    global _signal
    if _signal is not None:  # the second: now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _signal = signum
    STOP.set()
    # the engine's processes may die of the same Ctrl-C; what vLLM says about that is noise now
    logging.getLogger("vllm").setLevel(logging.CRITICAL + 1)
    logging.getLogger("batchembed").warning("%s: stopping; parts being written are dropped, committed parts "
                                            "are kept (again to stop at once)", signal.Signals(signum).name)


def requested() -> int | None:
    """The signal that asked the run to stop, if one did."""
    return _signal


class Either:
    """A stop flag that is set when either of two is (threading.Event's is_set / set)."""

    def __init__(self, own, other):
        self.own, self.other = own, other

    def is_set(self) -> bool:
        return self.own.is_set() or self.other.is_set()

    def set(self) -> None:
        self.own.set()
