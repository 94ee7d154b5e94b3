"""batchembed: embed large Parquet corpora in batch with vLLM's pooling engine."""

import os as _os

__version__ = "0.1.0"

if _os.environ.get("BATCHEMBED_ENGINE_PROCESS"):
    # vLLM's engine processes, spawned while embed/engine.py builds an engine, run this package's
    # import too (they import the main module of the process that spawned them). There:
    # - SIGINT and SIGTERM stay blocked: a terminal's Ctrl-C or a scheduler's SIGTERM to the
    #   process group is batchembed's to handle, which stops the run and then its engines
    #   (interrupts.py); vLLM's own shutdown ends them with SIGKILL after its grace period;
    # - the process gets SIGKILL when the thread that started it ends (Linux), so an engine never
    #   outlives a run killed outright; only where that thread lives as long as the engine.
    import signal as _signal

    _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})
    if _os.environ.get("BATCHEMBED_ENGINE_PROCESS") == "die-with-parent":
        try:
            import ctypes as _ctypes

            _ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, _signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if _os.getppid() == 1:  # the parent was gone before that took effect
            _os._exit(1)
