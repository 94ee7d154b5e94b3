"""`executor: ray`: the same tasks, commits and resume as the local executor, on a Ray cluster.

The driver plans and resumes exactly as a local run does and writes the
manifest; each engine actor (`ray.engines` of them, with `num_cpus_per_engine`
and `num_gpus_per_engine` each) loads one engine and runs whole parts through
the same pipeline, committing each part itself. A part is scheduled on
whichever actor is free (Ray's ActorPool).
"""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING

from .errors import JobError, RunError

if TYPE_CHECKING:
    from .plan import Task
    from .runner import Prepared, RunResult

log = logging.getLogger(__name__)


class EngineWorker:
    """One engine in a Ray actor; plans the job itself (a footer read per file) to find its parts."""

    def __init__(self, spec: dict):
        from .config import JobSpec
        from .runner import make_engine, prepare

        t0 = time.perf_counter()
        self.p = prepare(JobSpec.model_validate(spec))
        self.tasks = {t.part_name: t for t in self.p.tasks}
        self.engine = make_engine(self.p)
        self.start_seconds = time.perf_counter() - t0

    def started(self) -> float:
        return self.start_seconds

    def run_part(self, part_name: str) -> dict:
        from .pipeline import Pipeline

        task = self.tasks.get(part_name)
        if task is None:
            raise RunError(f"{part_name}: not in this worker's plan; did the input change during the run?")
        tasks: queue.Queue = queue.Queue()
        tasks.put(task)
        steps: list[dict] = []
        pipeline = Pipeline(self.p, lambda: self.engine, tasks, steps.append)
        pipeline.run()
        return {"records": list(pipeline.records.values()), "failed": pipeline.failed,
                "engine_seconds": pipeline.engine_seconds}

    def close(self) -> None:
        self.engine.close()


def run_on_ray(p: Prepared, pending: list[Task], progress) -> RunResult:
    from .runner import RunResult

    try:
        import ray
        from ray.util import ActorPool
    except ImportError:
        raise JobError("executor: ray needs Ray: pip install 'batchembed[ray]' (or pip install ray)") from None
    cfg = p.spec.ray
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=cfg.address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    actor_cls = ray.remote(num_cpus=cfg.num_cpus_per_engine, num_gpus=cfg.num_gpus_per_engine)(EngineWorker)
    n = min(cfg.engines, len(pending))
    spec = p.spec.model_dump(mode="json")
    result = RunResult(engines=n)
    actors = []
    try:
        t0 = time.perf_counter()
        actors = [actor_cls.remote(spec) for _ in range(n)]
        result.engine_start_seconds = max(ray.get([a.started.remote() for a in actors]))
        log.info("ray: %d engine actors up in %.1f s", n, time.perf_counter() - t0)
        by_name = {t.part_name: t for t in pending}
        busy = 0.0
        t0 = time.perf_counter()
        pool = ActorPool(actors)
        for out in pool.map_unordered(lambda a, name: a.run_part.remote(name), list(by_name)):
            for record in out["records"]:
                result.records[by_name[record["part"]].index] = record
                progress({"rows": record["rows"], "tokens": record["tokens"]})
            result.failed += out["failed"]
            busy += out["engine_seconds"]
        result.pipeline_seconds = time.perf_counter() - t0
        result.engine_seconds = busy / max(1, n)
    except ray.exceptions.RayTaskError as e:
        cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
        if isinstance(cause, RunError):
            raise RunError(str(cause).splitlines()[-1]) from e
        raise RunError(f"a Ray engine actor failed: {e}") from e
    finally:
        for a in actors:
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - the actor may be gone already
                pass
            ray.kill(a)
        if started_here:
            ray.shutdown()
    return result
