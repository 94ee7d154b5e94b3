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
import signal
import subprocess
import sys
import threading

ENV = "BATCHEMBED_ENGINE_PROCESS"


@contextlib.contextmanager
def starting(extra: dict[str, str] | None = None):
    """Set, while processes are started in the block, what makes them run guard(), with `extra`
    environment beside it; restored after. Also for other processes of a run (fidelity.py)."""
    main = threading.current_thread() is threading.main_thread()
    env = {**(extra or {}), ENV: "die-with-parent" if main else "1"}
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
    start its job twice). Ctrl-C is the run's to handle; it dies with the starting thread."""
    module, name = function.split(":")
    with starting():
        return subprocess.Popen([sys.executable, "-c", f"import sys; from {module} import {name}; {name}(sys.argv[1])",
                                 folder], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def end(process: subprocess.Popen) -> None:
    """Kill a helper if it still runs, and reap it."""
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


def guard() -> None:
    mode = os.environ.get(ENV)
    if not mode:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    if mode == "die-with-parent":
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() == 1:  # the parent was gone before that took effect
            os._exit(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=guard)
