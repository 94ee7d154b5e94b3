"""Logging for the command line and its engine processes: text or one JSON object per line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import NoReturn


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers (Airflow, Loki, CloudWatch)."""

    def __init__(self, **extra):
        super().__init__()
        self.extra = extra  # e.g. {"engine": 2} in an engine process

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
                 "level": record.levelname, "logger": record.name, **self.extra, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _OthersAtWarning(logging.Filter):
    """Other libraries' records only from WARNING up (unless DEBUG is asked for), whatever level
    they set their own loggers to: at INFO, object-store clients log every request (azure-core:
    every HTTP header) and Ray its start-up."""

    def __init__(self, level: int):
        super().__init__()
        self.others = max(level, logging.WARNING)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".", 1)[0] == "batchembed" or record.levelno >= self.others


def setup_logging(level: str | int, as_json: bool = False, engine: int | None = None) -> None:
    """Log to stderr at `level`; `engine` tags the lines of an engine process."""
    level = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(JsonFormatter(**({} if engine is None else {"engine": engine})))
    else:
        tag = "%(name)s" if engine is None else f"engine-{engine}"
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag}: %(message)s"))
    if level > logging.DEBUG:
        handler.addFilter(_OthersAtWarning(level))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # vLLM logs to stdout unless told; stdout is the run's JSON summary, one line (docs/reference/cli.md)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # vLLM logs per weight and per process at INFO and WARNING; its errors still show.
    # Set through the environment so the engine's child processes obey it too; a
    # VLLM_LOGGING_LEVEL the user set is kept (e.g. INFO, for vLLM's start-up timings).
    if level > logging.DEBUG:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        # the resource tracker cleans up after os._exit (below) on its own; its note about it is noise
        os.environ.setdefault("PYTHONWARNINGS",
                              "ignore::FutureWarning,ignore::UserWarning:multiprocessing.resource_tracker")
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())


def json_logging() -> bool:
    """Whether this process logs JSON (an engine process then does too)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def exit_now(code: int) -> NoReturn:
    """End this process at once with `code`, once the logs and standard streams are flushed, without
    the interpreter's teardown: vLLM's engines leave C++ threads that can abort it ("terminate
    called without an active exception"), which would turn a finished run into a failed one.
    Multiprocessing's resource tracker, if this process started one, is ended first, and its
    temp folder removed."""
    _stop_resource_tracker()
    _remove_multiprocessing_temp_dir()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _stop_resource_tracker() -> None:
    """End multiprocessing's resource tracker, if this process started one (the engine processes'
    forkserver and queues start it), and wait for it: left alone, it ends only once this process's
    exit has closed its pipe, a moment after, and so outlived the run (seen under load). Only in a
    process that ends right after: the tracker removes whatever is still registered with it."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # noqa: SLF001 - the stdlib's one instance
    if getattr(tracker, "_pid", None) is None or not hasattr(tracker, "_stop"):
        return
    lock = getattr(tracker, "_lock", None)
    if lock is not None:  # held by a thread that hangs (exit_now from the watchdog): leave it to the exit
        if not lock.acquire(timeout=1.0):
            return
        lock.release()
    with contextlib.suppress(Exception):  # e.g. ChildProcessError: inherited, not this process's child
        tracker._stop()  # noqa: SLF001 - closes its pipe and waits for it to end


def _remove_multiprocessing_temp_dir() -> None:
    """Remove the folder multiprocessing made in the temp folder for this process (pymp-*: the
    forkserver's socket), which its exit handler would have, had the process not ended at once:
    one more left in /tmp by every run with engine processes. Only in the process that made it: a
    process multiprocessing started has its parent's (in the config it inherits), still in use there."""
    import multiprocessing
    import shutil

    if multiprocessing.parent_process() is not None:
        return
    tempdir = multiprocessing.current_process()._config.get("tempdir")  # noqa: SLF001 - where the stdlib keeps it
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)
