"""The one worker body every executor runs: a prepared job, an engine started when a window
first needs it (and checked by the fidelity guard before its first vector), and one
pipeline over whatever tasks it is handed, for its whole life. Executors (local.py,
processes.py, ray.py) only say where workers run and how tasks reach them; each hands
back the workers' reports, which stats.combine adds up."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import fidelity, interrupts
from ..errors import EngineFailure, RunError
from ..pipeline import Pipeline
from ..stats import WorkerReport
from .schedule import Restarts

if TYPE_CHECKING:
    from ..embed.engine import Engine, EngineKey
    from ..job import Prepared

log = logging.getLogger(__name__)

# the model's architectures (config.json), for the forkserver of engine processes to have vLLM
# inspect the model's class once (preload.py)
ARCHITECTURES_ENV = "BATCHEMBED_MODEL_ARCHITECTURES"


def start_engine(p: Prepared, replica: int = 0, replicas: int = 1, lock=None,
                 reference: fidelity.ReferenceFile | None = None) -> Engine:
    """A new engine for the job, checked by the fidelity guard (unless off or done): the one way
    every executor, and the int8 calibration, gets an engine. `lock` serialises the build.
    `reference`: the run's fidelity reference; without one, one is computed while this builds."""
    from ..embed.engine import Engine

    own = fidelity.start_reference(p) if reference is None else None
    reference = reference or own
    try:
        with lock if lock is not None else contextlib.nullcontext():
            engine = Engine(p.model, p.spec.model.dtype, p.max_length, p.spec.engine, replica, replicas,
                            cpu_wait=reference.result if reference is not None else None, outputs=p.outputs,
                            settings=p.settings)
        try:
            fidelity.ensure(p, engine, reference)
        except BaseException:
            engine.close()
            raise
    finally:
        if own is not None:
            own.close()
    return engine


_process_ends_after_run = False


def process_ends_after_run() -> None:
    """Say that this process ends once its run returns (the CLI, an engine process): engines in
    it are then left to the exit rather than torn down (Engine.leave), and the forkserver of its
    engine processes is stopped with the run (processes.forkserver_ahead)."""
    global _process_ends_after_run
    _process_ends_after_run = True


def ends_after_run() -> bool:
    """Whether process_ends_after_run() was said in this process."""
    return _process_ends_after_run


def release(engine, run_over: bool = True) -> None:
    """Close an engine this run started; after SIGINT / SIGTERM, end its processes at once (their
    step in flight would be cut short by a graceful shutdown, and complain at length). Once the
    run is over in a process that then ends, leave it to the exit (process_ends_after_run)."""
    if interrupts.requested():
        engine.kill()
    elif run_over and ends_after_run():
        engine.leave()
    else:
        engine.close()


def engine_key(p: Prepared) -> EngineKey:
    from ..embed.engine import EngineKey

    return EngineKey(str(p.model.path), p.spec.model.dtype, p.max_length)


class Worker:
    """One engine's worth of work. `engine`: a loaded engine to use (checked, not closed);
    otherwise one is started when the pipeline first wants it (`replica` of `replicas`
    places it) and closed by close()."""

    def __init__(self, p: Prepared, engine=None, replica: int = 0, replicas: int = 1, start_lock=None,
                 reference: fidelity.ReferenceFile | None = None, restarts: Restarts | None = None, slot: int = 0):
        """`restarts`: the run's budget of engine restarts (schedule.Restarts), this worker's `slot` in it."""
        self.p, self.given, self.replica, self.replicas = p, engine, replica, replicas
        self.start_lock, self.reference = start_lock, reference
        self.restarts, self.slot = restarts or Restarts(p.spec.engine.max_restarts), slot
        self.own = None
        self.start_seconds: float | None = None
        self.pipeline = Pipeline(p, self._engine, self._replace)

    def _engine(self):
        t0 = time.perf_counter()
        if self.given is not None:
            fidelity.ensure(self.p, self.given)  # a given engine is checked before its first vector too
            engine = self.given
        else:
            engine = self.own = start_engine(self.p, self.replica, self.replicas, self.start_lock, self.reference)
        self.start_seconds = time.perf_counter() - t0
        return engine

    def _replace(self, old, failure: EngineFailure):
        """A new engine for one that died or hung, from the run's budget of engine.max_restarts."""
        if self.given is not None or interrupts.requested():
            raise failure  # an engine we were handed is not ours to replace; a stopping run stops
        old.kill()
        self.own = None
        n = self.restarts.spend(str(failure), self.slot)
        log.warning("engine failed (%s): starting a new one, restart %d of at most %d", failure, n,
                    self.restarts.limit)
        t0 = time.perf_counter()
        try:
            self.own = start_engine(self.p, self.replica, self.replicas, self.start_lock, self.reference)
        except RunError as e:  # the first failure is the cause; say it, not only the new one's
            raise RunError(f"{e}; it was to replace an engine that failed: {failure}") from e
        log.warning("engine restarted in %.1f s; the windows it had not finished go to the new one",
                    time.perf_counter() - t0)
        return self.own

    def run(self, tasks, progress: Callable[[dict], None], stop=None) -> dict[str, dict]:
        """Run what `tasks` gives (get_nowait until queue.Empty); returns the parts committed."""
        return self.pipeline.run(tasks, progress, stop)

    def report(self, node: str | None = None) -> WorkerReport:
        e = self.pipeline.embedder
        return WorkerReport(records=dict(self.pipeline.records), failed=list(self.pipeline.failed),
                            engine_start_seconds=self.start_seconds, engine_seconds=e.engine_seconds,
                            calls=list(e.calls), node=node)

    def close(self) -> None:
        if self.own is not None:
            release(self.own)
            self.own = None
