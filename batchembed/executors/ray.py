"""`executor: ray`: the same tasks, commits and resume as the local executor, on a Ray cluster.

Each engine actor (`ray.engines` of them, with `num_cpus_per_engine` and
`num_gpus_per_engine` each) holds one base.Worker for its life: it plans the job itself
(footers only), starts its engine when its pipeline first wants it, and runs whole parts
through the one pipeline it keeps, so its dedup cache spans every part it runs. A part is
scheduled on whichever actor is free (Ray's ActorPool). The driver plans, resumes and
writes the manifest, as for a local run.
"""

from __future__ import annotations

import logging
import queue
import socket
import time
from typing import TYPE_CHECKING

from .. import interrupts
from ..errors import JobError, RunError
from ..stats import RunResult, WorkerReport, combine

if TYPE_CHECKING:
    from ..job import Prepared
    from ..plan import Task

log = logging.getLogger(__name__)


class EngineActor:
    """One Worker in a Ray actor."""

    def __init__(self, spec: dict):
        from ..config import JobSpec
        from ..job import prepare
        from .base import Worker

        self.p = prepare(JobSpec.model_validate(spec), check_output=False, warn=False)
        self.tasks = {t.part_id: t for t in self.p.tasks}
        self.worker = Worker(self.p)
        self.node = socket.gethostname()

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


def run_on_ray(p: Prepared, pending: list[Task], progress) -> RunResult:
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
    actor_cls = ray.remote(num_cpus=cfg.num_cpus_per_engine, num_gpus=cfg.num_gpus_per_engine)(EngineActor)
    n = min(cfg.engines, len(pending))
    spec = p.spec.model_dump(mode="json")
    actors = []
    reports: list[WorkerReport] = []
    try:
        t0 = time.perf_counter()
        actors = [actor_cls.remote(spec) for _ in range(n)]
        pool = ActorPool(actors)
        for out in pool.map_unordered(lambda a, part_id: a.run_part.remote(part_id), [t.part_id for t in pending]):
            log.info("ray: %s committed on node %s", out["part"], out["node"])
            if interrupts.requested():
                break  # the parts still running end with their actors, uncommitted
            for record in out["records"].values():
                progress({"rows": record["rows"], "tokens": record["tokens"]})
        reports = ray.get([a.finish.remote() for a in actors])
        wall = time.perf_counter() - t0
    except ray.exceptions.RayTaskError as e:
        cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
        if isinstance(cause, RunError):
            raise RunError(str(cause).splitlines()[-1]) from e
        raise RunError(f"a Ray engine actor failed: {e}") from e
    finally:
        for a in actors:
            try:
                ray.get(a.finish.remote(), timeout=60)  # closes its engine (again: idempotent)
            except Exception:  # noqa: BLE001 - the actor may be gone already
                pass
            ray.kill(a)
        if started_here:
            ray.shutdown()
    return combine(reports, wall)
