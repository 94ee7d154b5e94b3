"""batchembed: embed large Parquet corpora in batch with vLLM's pooling engine."""

import os as _os

__version__ = "0.1.0"

if _os.environ.get("BATCHEMBED_ENGINE_PROCESS"):
    # vLLM's engine processes, spawned while embed/engine.py builds an engine, run this package's
    # import too (they import the main module of the process that spawned them). There SIGINT and
    # SIGTERM stay blocked: a terminal's Ctrl-C or a scheduler's SIGTERM to the process group is
    # batchembed's to handle, which stops the run and then its engines (interrupts.py); vLLM's
    # own shutdown then ends them with SIGKILL after its grace period.
    import signal as _signal

    _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})
