"""Watching an engine's processes: when one is gone, or no vector has come back for the stall
timeout while sequences are queued, the engine is declared failed, what is left of its
processes is killed, and the step waiting on it is woken with the reason (engine.Engine.step
then raises EngineFailure, and the pipeline starts a new engine: executors/base.py).

vLLM's front end itself waits for ever when its engine process dies by SIGKILL or stops
(SIGSTOP, or a hung kernel): nothing comes back on its socket, and its step never returns.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import signal
import threading
import time

from ..logs import exit_now
from ..procguard import identity, is_alive, proc_stat

log = logging.getLogger(__name__)

MIN_STALL_S = 60.0  # the derived stall timeout is never shorter
STALL_STEPS = 10  # ... nor shorter than this many of the slowest step seen so far


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (Linux /proc; elsewhere none)."""
    pids: list[int] = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError), open(task) as f:
            pids += [int(x) for x in f.read().split()]
    return pids


def descendant_pids(pid: int) -> list[int]:
    out, todo = [], child_pids(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += child_pids(p)
    return out


def tree(pids: list[int]) -> list[tuple[int, str]]:
    """Each process and everything it started, as identities."""
    return [i for p in pids for q in [p, *descendant_pids(p)] if (i := identity(q)) is not None]


def kill_tree(procs: list[tuple[int, str]]) -> None:
    """SIGKILL each process that is still itself, and whatever it started since."""
    for proc in procs:
        if is_alive(proc) or (proc_stat(proc[0]) or [""])[0] == "Z":
            for pid in [*descendant_pids(proc[0]), proc[0]]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def wait_gone(procs: list[tuple[int, str]], timeout: float) -> bool:
    """Wait until none of `procs` runs (gone, or a zombie holding nothing); whether they all went."""
    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Watchdog:
    """A thread that checks an engine once a second. `busy()` says whether sequences are queued;
    `progress()` is called by the engine whenever vectors come back (or work starts)."""

    def __init__(self, procs: list[tuple[int, str]], busy, wake, stall_timeout_s: float | None,
                 in_process: bool = False, queued=None, before_exit=None):
        self.procs, self.busy, self.wake, self.fixed = procs, busy, wake, stall_timeout_s
        self.queued = queued  # what is queued, in words, for a stall's message
        self.before_exit = before_exit  # an engine in this process: its scratch, removed before the exit
        self.in_process = in_process
        self.failure: str | None = None
        self.slowest = 0.0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchembed-watchdog", daemon=True)
        self._thread.start()

    @property
    def stall_timeout_s(self) -> float:
        return self.fixed if self.fixed is not None else max(MIN_STALL_S, STALL_STEPS * self.slowest)

    def progress(self, step_seconds: float | None = None) -> None:
        self._last = time.monotonic()
        if step_seconds is not None:
            self.slowest = max(self.slowest, step_seconds)

    def _check(self) -> str | None:
        gone = [p for p in self.procs if not is_alive(p)]
        if gone:
            return f"engine process {gone[0][0]} is gone"
        waited = time.monotonic() - self._last
        if self.busy() and waited > self.stall_timeout_s:
            return f"no vector came back for {waited:.0f} s with {self._queued()} (engine.stall_timeout_s: " \
                   f"{self.stall_timeout_s:.0f})"
        return None

    def _queued(self) -> str:
        if self.queued is not None:
            try:
                return self.queued()
            except RuntimeError:  # the queue changed while it was read: the engine is not stalled after all
                pass
        return "sequences queued"

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            reason = self._check()
            if reason is not None:
                self.failure = reason
                if self.in_process:
                    if self.before_exit is not None:
                        with contextlib.suppress(Exception):
                            self.before_exit()
                    _end_this_process(reason)
                log.warning("engine failed: %s; ending its processes", reason)
                kill_tree(self.procs)
                self.wake(reason)
                return

    def stop(self) -> None:
        """Stop checking; once this returns, no check runs (one in progress is waited for)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)


def _end_this_process(reason: str) -> None:
    """An engine in this process (engine.in_process) that hangs holds the step that waits on it:
    nothing here can wake or replace it. End the process with exit 1: committed parts stand and
    a rerun resumes; with data_parallel, the supervisor starts another engine process and hands
    this one's unfinished parts out again."""
    log.error("engine failed: %s. It runs in this process (engine.in_process), which cannot replace it: "
              "ending the process (exit 1); committed parts are kept and a rerun resumes. With "
              "engine.in_process: false an engine runs in processes of its own and is replaced in place",
              reason)
    exit_now(1)
