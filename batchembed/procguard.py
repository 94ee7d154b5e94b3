"""What vLLM's engine processes do first, when embed/engine.py builds an engine with
BATCHEMBED_ENGINE_PROCESS set (only while it builds one):
- SIGINT and SIGTERM stay blocked: a terminal's Ctrl-C or a scheduler's SIGTERM to the process
  group is batchembed's to handle, which stops the run and then its engines (interrupts.py);
  vLLM's own shutdown ends them with SIGKILL after its grace period;
- with the value "die-with-parent", the process gets SIGKILL when the thread that started it
  ends (Linux), so an engine never outlives a run killed outright (set only when that thread is
  the main thread, which lives as long as the engine).
vLLM starts them by spawn (a new interpreter: it imports batchembed, whose __init__ calls
guard()) or by fork (the hook registered below runs in the child).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading

ENV = "BATCHEMBED_ENGINE_PROCESS"


@contextlib.contextmanager
def starting(extra: dict[str, str] | None = None, with_parent: bool = True):
    """Set, while processes are started in the block, what makes them run guard(), with `extra`
    environment beside it; restored after. `with_parent=False`: signals blocked only, no
    die_with_parent() (the process watches the run itself: exit_with)."""
    main = threading.current_thread() is threading.main_thread()
    env = {**(extra or {}), ENV: "die-with-parent" if main and with_parent else "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def helper(function: str, folder: str) -> subprocess.Popen:
    """A helper process of the run: a new interpreter that runs `function` ("module:name") on
    `folder`, its only way to and from the run. A new interpreter, not multiprocessing's spawn,
    which would run the caller's main module again (a user's script without a main guard would
    start its job twice). Ctrl-C is the run's to handle. If the run's process ends without
    closing it (killed outright), it removes `folder` and ends (exit_with)."""
    code = "import sys; from batchembed.procguard import _serve; _serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    with starting(with_parent=False):
        return subprocess.Popen([sys.executable, "-c", code, function, folder, str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


# what a helper becomes once its work is done: a bare interpreter in its place (its memory, a
# model's, goes back) that only waits, removing the folder if the run's process ends first
_WAITER = ("import shutil, sys, threading; from batchembed.procguard import exit_with; "
           "exit_with(int(sys.argv[2]), lambda: shutil.rmtree(sys.argv[1], ignore_errors=True)); "
           "threading.Event().wait()")


def _serve(function: str, folder: str, run_pid: int) -> None:
    """A helper's life: `function(folder)`, then wait to be ended by the run (end()); if the run's
    process ends first, killed outright, remove the folder and end."""
    import importlib
    import shutil

    watching = exit_with(run_pid, lambda: shutil.rmtree(folder, ignore_errors=True))
    module, name = function.split(":")
    getattr(importlib.import_module(module), name)(folder)
    if watching:  # signals stay blocked across exec
        os.execv(sys.executable, [sys.executable, "-c", _WAITER, folder, str(run_pid)])


def end(process: subprocess.Popen) -> None:
    """Kill a helper if it still runs, and reap it."""
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


def exit_with(run_pid: int, cleanup=None) -> bool:
    """End this process (after `cleanup()`) as soon as the run's process `run_pid` ends, even
    killed outright, or at once if it has ended already: a thread waits on its pidfd (Linux
    5.3+), and True. Elsewhere (False) the process gets SIGKILL when its parent dies, with no
    cleanup."""
    def finish() -> None:
        if cleanup is not None:
            with contextlib.suppress(Exception):
                cleanup()
        os._exit(1)

    try:
        fd = os.pidfd_open(run_pid)
    except ProcessLookupError:
        finish()
    except (AttributeError, OSError):  # not Linux, or an old kernel
        die_with_parent()
        return False

    def watch() -> None:
        select.select([fd], [], [])
        finish()

    threading.Thread(target=watch, name="batchembed-run-watch", daemon=True).start()
    return True


def die_with_parent() -> bool:
    """This process gets SIGKILL when the thread that started it ends (Linux's PR_SET_PDEATHSIG);
    False where that cannot be had."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        return False


def guard() -> None:
    mode = os.environ.get(ENV)
    if not mode:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    if mode == "die-with-parent":
        if not die_with_parent():
            return
        if os.getppid() == 1:  # the parent was gone before that took effect
            os._exit(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=guard)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def identity(pid: int) -> tuple[int, str] | None:
    """(pid, start time): a process, told apart from a later one that reuses its pid."""
    st = proc_stat(pid)
    return (pid, st[19]) if st else None


def is_alive(proc: tuple[int, str]) -> bool:
    """Running or stopped; not gone, not a zombie waiting to be reaped, not another process now."""
    st = proc_stat(proc[0])
    return st is not None and st[0] not in ("Z", "X") and st[19] == proc[1]
