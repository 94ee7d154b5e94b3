"""`executor: ray`: the same schedule, commits and resume as a local run, on a Ray cluster.

Each engine actor (`engine.data_parallel` of them, with `ray.num_cpus_per_engine` and
`ray.num_gpus_per_engine` each) holds one base.Worker for its life: it plans the job itself
(footers only), starts its engine when its pipeline first wants it, and runs whole parts
through the one pipeline it keeps, so its dedup cache spans every part it runs. The driver
plans, resumes, hands parts out from the run's schedule (schedule.py: largest first, to whichever
actor is free), and writes the manifest, as for a local run.

An actor that is lost (its process killed, its node gone with a spot instance) is replaced,
wherever Ray finds room for it, from the run's one budget of engine.max_restarts, and the parts it
had not committed go back to the list. Actors that cannot be placed within ray.start_timeout_s end
the run with the resources asked and those the cluster has; a local Ray that can never fit them
is refused at once.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import time
from typing import TYPE_CHECKING

from .. import interrupts
from ..errors import JobError, RunError
from ..stats import RunResult, WorkerReport, combine
from .schedule import WAIT, Restarts

if TYPE_CHECKING:
    from ..job import Prepared
    from .schedule import Schedule

log = logging.getLogger(__name__)


class RestartBudget:
    """The run's schedule.Restarts, in a Ray actor of its own that every engine actor asks."""

    def __init__(self, limit: int, slots: int):
        self.restarts = Restarts(limit, [0] * slots)

    def take(self, slot: int) -> int | None:
        return self.restarts.take(slot)

    def used(self) -> int:
        return self.restarts.used()


class _AskBudget(Restarts):
    """schedule.Restarts for a Worker in an actor: the budget lives in the RestartBudget actor."""

    def __init__(self, limit: int, handle):
        super().__init__(limit)
        self.handle = handle

    def take(self, slot: int = 0) -> int | None:
        import ray

        return ray.get(self.handle.take.remote(slot))

    def used(self) -> int:
        import ray

        return ray.get(self.handle.used.remote())


class EngineActor:
    """One Worker in a Ray actor."""

    def __init__(self, spec: dict, budget, slot: int, run: str | None, settings: dict):
        from ..config import JobSpec
        from ..embed.settings import EngineSettings
        from ..job import prepare
        from .base import Worker

        self.p = prepare(JobSpec.model_validate(spec), check_output=False, warn=False)
        self.p.run = run
        self.p.settings = EngineSettings.from_dict(settings)  # the run's, as the driver resolved them
        self.tasks = {t.part_id: t for t in self.p.tasks}
        self.worker = Worker(self.p, restarts=_AskBudget(self.p.spec.engine.max_restarts, budget), slot=slot)
        self.node = socket.gethostname()

    def ready(self) -> dict:
        return {"node": self.node, "pid": os.getpid()}

    def run_part(self, part_id: str) -> dict:
        task = self.tasks.get(part_id)
        if task is None:
            raise RunError(f"{part_id}: not in this worker's plan; did the input change during the run?")
        tasks: queue.Queue = queue.Queue()
        tasks.put(task)
        records = self.worker.run(tasks, lambda step: None)
        return {"part": part_id, "records": records, "node": self.node}

    def finish(self) -> WorkerReport:
        self.worker.close()
        return self.worker.report(self.node)


def _resources(ray, cfg, n: int) -> str | None:
    """What is short for `n` engine actors on the cluster as it is now, or None when they fit."""
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    c, g = cfg.num_cpus_per_engine, cfg.num_gpus_per_engine
    if n * c <= cpus + 1e-9 and n * g <= gpus + 1e-9:
        return None
    return (f"{n} engine actor(s) (engine.data_parallel) of {c:g} CPU(s) and {g:g} GPU(s) each "
            f"(ray.num_cpus_per_engine, ray.num_gpus_per_engine) need {n * c:g} CPUs and {n * g:g} GPUs; the Ray "
            f"cluster has {cpus:g} CPUs and {gpus:g} GPUs")


def run_on_ray(p: Prepared, schedule: Schedule, progress) -> RunResult:
    try:
        import ray
    except ImportError:
        raise JobError("executor: ray needs Ray: pip install 'batchembed[ray]' (or pip install ray)") from None
    cfg = p.spec.ray
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=cfg.address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    try:
        return _drive(ray, p, schedule, progress, started_here and cfg.address is None)
    finally:
        if started_here:
            ray.shutdown()


def _drive(ray, p: Prepared, schedule: Schedule, progress, local: bool) -> RunResult:
    cfg = p.spec.ray
    n = min(p.settings.engines, len(schedule.by_id))
    short = _resources(ray, cfg, n)
    if short and local:  # a Ray started here never grows
        raise RunError(f"executor: ray: {short}; lower engine.data_parallel or the resources per engine")
    if short:
        log.warning("executor: ray: %s; waiting up to ray.start_timeout_s (%g s) for the cluster to grow",
                    short, cfg.start_timeout_s)
    budget = ray.remote(num_cpus=0)(RestartBudget).remote(p.spec.engine.max_restarts, n + 1)
    schedule.restarts = _AskBudget(p.spec.engine.max_restarts, budget)
    # Ray's own actor restarts are off: a lost actor is replaced here, where its parts are known
    actor_cls = ray.remote(num_cpus=cfg.num_cpus_per_engine, num_gpus=cfg.num_gpus_per_engine,
                           max_restarts=0, max_task_retries=0)(EngineActor)
    spec, settings = p.worker_spec(), p.settings.as_dict()
    actors: dict[int, object] = {}
    starting: dict[object, tuple[int, float]] = {}  # ready() ref -> (slot, when asked)
    running: dict[object, tuple[int, str]] = {}  # run_part ref -> (slot, part)
    idle: set[int] = set()
    ended: set[int] = set()  # told there is nothing left
    reports: list[WorkerReport] = []
    closed: set[int] = set()

    def start(i: int) -> None:
        actors[i] = actor_cls.remote(spec, budget, i + 1, p.run, settings)
        starting[actors[i].ready.remote()] = (i, time.monotonic())

    def lost(i: int, why: str) -> None:
        """Actor i is gone: its uncommitted parts back on the list, another in its place."""
        before = len(schedule.todo)
        reports.append(WorkerReport(records=schedule.lose(i)))
        idle.discard(i)
        for ref in [r for r, (slot, _) in running.items() if slot == i]:
            running.pop(ref)
        count = schedule.restarts.spend(why)
        log.warning("%s: starting another (restart %d of at most %d); its %d unfinished part(s) go back to the "
                    "list", why, count, schedule.restarts.limit, len(schedule.todo) - before)
        ray.kill(actors[i])
        start(i)

    t0 = time.perf_counter()
    try:
        for i in range(n):
            start(i)
        while len(ended) < n:
            if interrupts.requested():
                break  # the parts still running end with their actors, uncommitted
            for i in sorted(idle):
                task = schedule.take(i)
                if task is WAIT:
                    continue
                idle.discard(i)
                if task is None:
                    ended.add(i)
                else:
                    running[actors[i].run_part.remote(task.part_id)] = (i, task.part_id)
            if not starting and not running:
                time.sleep(0.5)  # every live actor waits for parts another run holds
                continue
            done, _ = ray.wait([*starting, *running], num_returns=1, timeout=1.0)
            for ref in done:
                if ref in starting:
                    i, _ = starting.pop(ref)
                    try:
                        where = ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        lost(i, f"engine actor {i} died as it started ({type(e).__name__})")
                        continue
                    except ray.exceptions.RayTaskError as e:
                        raise _cause(e) from e
                    log.info("ray: engine actor %d up on node %s (pid %d)", i, where["node"], where["pid"])
                    idle.add(i)
                    continue
                if ref not in running:
                    continue  # its actor was replaced meanwhile
                i, part = running.pop(ref)
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    lost(i, f"engine actor {i} was lost with part {part} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200]})")
                    continue
                except ray.exceptions.RayTaskError as e:
                    raise _cause(e) from e
                log.info("ray: %s committed on node %s", out["part"], out["node"])
                for record in out["records"].values():
                    progress({"rows": record["rows"], "tokens": record["tokens"]})
                idle.add(i)
            late = [i for i, since in starting.values() if time.monotonic() - since > p.spec.ray.start_timeout_s]
            if late:
                now = _resources(ray, cfg, n) or "the cluster has room for them now, yet they did not start"
                raise RunError(f"executor: ray: {len(late)} engine actor(s) not placed within ray.start_timeout_s "
                               f"({cfg.start_timeout_s:g} s): {now}")
        for i in sorted(ended):
            schedule.finished(i)
        reports += ray.get([actors[i].finish.remote() for i in sorted(ended)])
        closed = set(ended)
        wall = time.perf_counter() - t0
    finally:
        placing = {i for i, _ in starting.values()}
        for i, a in actors.items():
            if i not in closed and i not in placing:  # a run that stops: its engines closed, as locally
                try:
                    ray.get(a.finish.remote(), timeout=60)
                except Exception:  # noqa: BLE001 - the actor may be gone already
                    pass
            ray.kill(a)
    return combine(reports, wall)


def _cause(e) -> RunError:
    """The RunError an actor's task failed with, or one naming its exception."""
    cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
    if isinstance(cause, RunError):
        return RunError(str(cause).splitlines()[-1])
    return RunError(f"a Ray engine actor failed: {e}")
