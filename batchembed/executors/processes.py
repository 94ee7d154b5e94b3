"""`engine.data_parallel: K`: K engine replicas, each in its own process, asking the parent for
parts one at a time over a pipe of its own.

One process per replica, not one thread: a vLLM engine's front end (request
building, output handling) is Python and needs a core of its own: several engines
in one process share one interpreter and ran slower than one. Each worker plans the job itself (footers only), runs the
same worker body as a single-engine run (base.Worker), commits its parts, and reports
progress and its WorkerReport back. The parent plans, resumes and writes the manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import threading
import time
import traceback
from multiprocessing import connection as mp_connection
from typing import TYPE_CHECKING

from .. import interrupts, procguard, scratch
from ..embed import bytecode
from ..errors import RunError
from ..logs import exit_now, json_logging, setup_logging
from ..stats import RunResult, WorkerReport, combine
from .base import ARCHITECTURES_ENV, ends_after_run
from .schedule import WAIT, Restarts

if TYPE_CHECKING:
    from ..job import Prepared
    from ..plan import Task
    from .schedule import Schedule

log = logging.getLogger(__name__)


class _Flag:
    """A stop flag shared by processes, with threading.Event's is_set/set (no semaphore to leak)."""

    def __init__(self, ctx):
        self._v = ctx.RawValue("b", 0)

    def is_set(self) -> bool:
        return bool(self._v.value)

    def set(self) -> None:
        self._v.value = 1


class _Line:
    """An engine process's own line to the parent: one duplex pipe per process, made anew for each
    start, so a process killed in the middle of a message breaks only its own line, which the parent
    drops with it. (One multiprocessing.Queue for every worker's messages, and one per replica for
    its parts, hung the run for ever where a worker was killed holding a queue's lock: the replacement
    waited on the lock its predecessor held.) Its threads (the reader asking for parts, the writer's
    progress, the end's report) send one message at a time; only the reader receives."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, message) -> None:
        with self.lock:
            self.conn.send(message)

    def recv(self):
        return self.conn.recv()


class _Tasks:
    """The pipeline's view of the parent's task list: it asks the parent for a part and gets its
    id (or None: no more) on its line, and turns it into this worker's own Task."""

    def __init__(self, replica: int, line: _Line, tasks: dict[str, Task]):
        self.replica, self.line, self.tasks = replica, line, tasks

    def get_nowait(self) -> Task:
        self.line.send(("want", self.replica))
        name = self.line.recv()
        if name is None:
            raise queue.Empty
        task = self.tasks.get(name)
        if task is None:
            raise RunError(f"{name}: not in this worker's plan; did the input change during the run?")
        return task


# Engines start at the same moment unless this is set: then one at a time (a file lock),
# which costs K times the start-up but rules start-up races out.
SERIAL_START_ENV = "BATCHEMBED_SERIAL_START"


def _isolate(replica: int, workdir: str) -> None:
    """Give this worker's engine its own socket folder and port range.

    vLLM names its ZMQ sockets with a uuid under VLLM_RPC_BASE_PATH (the temp folder) and
    picks a free TCP port for its (single-rank) torch.distributed store: two engines started
    at the same moment could race for that port. Separate folders and port ranges rule both out.
    """
    rpc = os.path.join(workdir, f"engine-{replica}")
    os.makedirs(rpc, exist_ok=True)
    os.environ["VLLM_RPC_BASE_PATH"] = rpc
    base = int(os.environ.get("VLLM_PORT") or 29600)
    os.environ["VLLM_PORT"] = str(base + 100 * replica)


def _share_cores(replicas: int) -> None:
    """Each engine process's tokenizer gets its share of the cores, not a thread for every core.

    Hugging Face tokenizers encode a batch on a Rayon pool of one thread per core. Eight engine
    processes on a 16-core GPU host would run 128 such threads beside their engines, competing
    with the engines' front ends for the cores. A RAYON_NUM_THREADS set by the user is kept."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, cores // replicas)))


def _worker(spec: dict, replica: int, replicas: int, log_level: int, as_json: bool, conn,
            start_lock: str, stop, spawned_at: float, reference, run_pid: int, restart_counts,
            run: str | None, settings: dict) -> None:
    procguard.die_with_parent()  # with the forkserver
    # its parent is the forkserver, which outlives the run while any engine process lives: a
    # process waiting for its next part from a run killed outright would wait for ever, holding
    # its GPU memory (and it may be forked after the run died, once the forkserver's import is done)
    procguard.exit_with(run_pid)
    interrupts.ignore()
    _isolate(replica, os.path.dirname(start_lock))
    _share_cores(replicas)
    setup_logging(log_level, as_json, engine=replica)
    line = _Line(conn)
    try:
        from ..config import JobSpec
        from ..embed.settings import EngineSettings
        from ..job import prepare
        from .base import Worker, process_ends_after_run

        process_ends_after_run()  # _exit_now, below
        p = prepare(JobSpec.model_validate(spec), check_output=False, warn=False)
        p.run = run
        p.settings = EngineSettings.from_dict(settings)  # the run's, as resolved once
        serial = contextlib.nullcontext()
        if os.environ.get(SERIAL_START_ENV):
            serial = _FileLock(start_lock)

        from . import preload

        log.info("engine process %d: %.1f s from its start to its plan (vLLM imported once for all engines "
                 "in %.1f s)", replica, time.time() - spawned_at, preload.IMPORT_SECONDS)
        worker = Worker(p, replica=replica, replicas=replicas, start_lock=serial, reference=reference,
                        restarts=Restarts(p.spec.engine.max_restarts, restart_counts), slot=replica + 1)
        try:
            worker.run(_Tasks(replica, line, {t.part_id: t for t in p.tasks}),
                       lambda step: line.send(("progress", replica, step)), stop)
        finally:
            t = time.perf_counter()
            worker.close()
            log.info("engine process %d: engine closed in %.1f s", replica, time.perf_counter() - t)
        line.send(("done", replica, worker.report()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        message = str(e) if isinstance(e, RunError) else f"{type(e).__name__}: {e}"
        with contextlib.suppress(OSError):  # the parent is gone
            line.send(("error", replica, message, traceback.format_exc()))
    _exit_now()


def _exit_now() -> None:
    """End the engine process without the interpreter's teardown: its engine is closed and its
    report sent (a pipe's send returns once it is written), and tearing down CUDA and vLLM's native
    threads at exit is where multi-engine runs printed "terminate called without an active
    exception" or aborted after the summary."""
    exit_now(0)


class _FileLock:
    """An exclusive lock on a file, held while in the `with` block (engines start one at a time)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        self._f = open(self.path, "rb")
        fcntl.flock(self._f, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        self._f.close()  # releases the lock


def run_in_processes(p: Prepared, schedule: Schedule, progress, replicas: int, reference=None) -> RunResult:
    """Run the schedule's parts on `replicas` engine processes, which check their engines against
    `reference` (fidelity.Reference), if given. Raises RunError if any fails."""
    result, error = _supervise(p, schedule, progress, replicas, reference)
    if result.tail_seconds is not None:
        log.info("the first engine to run out of parts waited %.1f s for the last (one window's work: %.1f s)",
                 result.tail_seconds, result.window_seconds or 0.0)
    if error:  # raised here, once the queues are gone, so none of their semaphores is reported leaked
        raise RunError(error)
    return result


def _context():
    """Engine processes are forked from one server that imported vLLM once (preload.py): the
    engines share that import and start from a process without threads or CUDA state, as a
    spawned one would."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["batchembed.executors.preload"])
    return ctx


_engines_started = False  # whether any engine process was forked in this process's life


@contextlib.contextmanager
def forkserver_ahead(wanted: bool, architectures=()):
    """Start the forkserver, and with it vLLM's import (about 20 s on a GPU machine), now, when the
    run will want engine processes: the run plans, reads what its output holds and copies what a
    previous output gives meanwhile. If the run ends before any engine process was started (a
    bad job, a complete output), the forkserver is killed, even in the middle of its import, which
    it would otherwise finish before noticing that this process is gone. So is it after the run in
    a process that ends then (the CLI): it would end 2 s after that process, when its interpreter
    had torn down vLLM's modules. Kept after runs in other processes: a later run (a library
    user's, the tests') starts its engines at once."""
    if wanted:
        from multiprocessing import forkserver

        bytecode.warn_if_compiling()
        os.environ[ARCHITECTURES_ENV] = ",".join(architectures)  # the forkserver inherits it
        _context()
        forkserver.ensure_running()
    try:
        yield
    finally:
        if wanted and (not _engines_started or ends_after_run()):
            _stop_forkserver()


def _stop_forkserver() -> None:
    """Kill the forkserver and reap it."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001 - the stdlib keeps the pid there and nowhere else
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError, ValueError):
        server._stop()  # noqa: SLF001 - reaps it and removes its socket


def _supervise(p: Prepared, schedule: Schedule, progress, replicas: int,
               reference) -> tuple[RunResult, str | None]:
    """Hand parts to the workers as they ask, until none is left. A worker process that dies
    without reporting (the OOM killer, a crash) is replaced from the run's restart budget; the
    parts it had taken and not committed go back to the list for whoever asks next."""
    ctx = _context()
    lines: dict[int, object] = {}  # replica -> the parent's end of its process's pipe (the child's is a _Line)
    stop = _Flag(ctx)  # set by any worker's failure, or by us
    # the run's restart budget: slot 0 the supervisor's, slot i + 1 engine process i's (each writes its own)
    counts = ctx.RawArray("i", replicas + 1)
    workdir = tempfile.TemporaryDirectory(prefix=scratch.prefix("engines"))
    start_lock = os.path.join(workdir.name, "start.lock")
    open(start_lock, "wb").close()
    spec = p.worker_spec()
    level = logging.getLogger("batchembed").getEffectiveLevel()
    schedule.restarts = Restarts(schedule.restarts.limit, counts)

    def start(i: int):
        global _engines_started
        _engines_started = True
        ours, theirs = ctx.Pipe(duplex=True)
        w = ctx.Process(target=_worker, name=f"batchembed-engine-{i}", daemon=False,
                        args=(spec, i, replicas, level, json_logging(), theirs, start_lock, stop,
                              time.time(), reference.file() if reference else None, os.getpid(), counts,
                              p.run, p.settings.as_dict()))
        w.start()
        theirs.close()  # the child's end lives in the child only: its death reads as EOF here
        old = lines.pop(i, None)
        if old is not None:
            old.close()
        lines[i] = ours
        return w

    def answer(i: int, part) -> None:
        with contextlib.suppress(OSError):  # a worker that died meanwhile: the check below
            lines[i].send(part)

    def give(i: int) -> bool:
        """Answer replica i's ask with a part or None; False: every part left is held by another run."""
        task = None if stop.is_set() else schedule.take(i)
        if task is WAIT:
            return False
        answer(i, None if task is None else task.part_id)
        return True

    reports = []
    t0 = time.perf_counter()
    workers = []
    done: set[int] = set()
    waiting: set[int] = set()  # replicas asking while every part left is held by another run
    error = None
    try:
        for i in range(replicas):  # the first waits for the forkserver's import
            workers.append(start(i))
        listening = set(range(replicas))  # replicas whose line may still bring a message
        while len(done) < replicas and error is None:
            if interrupts.requested() and not stop.is_set():
                stop.set()  # each worker drops its part in progress, closes its engine and reports
            if reference is not None:
                reference.watch()  # workers waiting for it learn if its process died
            messages = []
            if listening:
                by_line = {id(lines[i]): i for i in listening}
                for conn in mp_connection.wait([lines[i] for i in listening], timeout=1.0):
                    try:
                        messages.append(conn.recv())
                    except (EOFError, OSError, pickle.UnpicklingError):  # its process ended, or died mid-message
                        listening.discard(by_line[id(conn)])
            else:
                time.sleep(0.2)
            for i in sorted(waiting):
                if give(i):
                    waiting.discard(i)
            for msg in messages:
                kind, replica = msg[0], msg[1]
                if kind == "want":
                    if not give(replica):
                        waiting.add(replica)
                elif kind == "progress":
                    progress(msg[2])
                elif kind == "error":
                    log.debug("engine process %d failed:\n%s", replica, msg[3])
                    error = f"engine process {replica}: {msg[2]}"
                elif kind == "done":
                    done.add(replica)
                    schedule.finished(replica)
                    reports.append(msg[2])
            for i in [i for i, w in enumerate(workers) if i not in done and not w.is_alive()]:
                if error is not None:
                    break
                # what it committed stands (read back as a resume would); the rest goes back
                before = len(schedule.todo)
                reports.append(WorkerReport(records=schedule.lose(i)))
                waiting.discard(i)
                why = f"engine process {i} died (exit code {workers[i].exitcode}) without reporting"
                if stop.is_set():
                    error = f"{why}; committed parts are kept, a rerun resumes"
                    break
                try:
                    n = schedule.restarts.spend(why)
                except RunError as e:
                    error = str(e)
                    break
                log.warning("%s: starting another (restart %d of at most %d); its %d unfinished part(s) go "
                            "back to the list", why, n, schedule.restarts.limit, len(schedule.todo) - before)
                workers[i] = start(i)
                listening.add(i)
    finally:
        if len(done) < replicas:
            # every pipeline stops at its next step and closes its engine; a worker that does
            # not end within a minute is killed
            stop.set()
            for i in lines:  # a worker waiting for a part gets none
                if i not in done:
                    answer(i, None)
        deadline = time.monotonic() + 60
        for w in workers:
            w.join(timeout=max(0.1, deadline - time.monotonic()))
            if w.is_alive():
                w.kill()
                w.join(timeout=10)
        for conn in lines.values():
            conn.close()
        with contextlib.suppress(OSError):
            workdir.cleanup()
    return combine(reports, time.perf_counter() - t0), error
