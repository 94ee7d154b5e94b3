"""`batchembed tune JOB`: measure engine settings on a sample of the job's own corpus, print each
with its share of the accelerator's FLOP ceiling, and write the best into a copy of the job.

How many engines share one GPU is what decides small models at short lengths: one engine's
Python front end stalls near 4-5 k sequences a second whatever the model, so a small encoder
needs several engines to fill a GPU, and a large decoder needs one or two. That depends on the
model, the texts and the machine, so it is measured, not guessed: each candidate runs the job
on the same sample (the first --rows rows, copied to a local folder) from a cold start, and the
rate while every engine ran decides (start-up is the same few seconds for any count, since the
engines share one vLLM import and build at once).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from . import scratch
from .config import JobSpec
from .embed.host import bf16_peak
from .errors import JobError
from .job import Prepared, prepare
from .model import ModelInfo
from .run import run_job

log = logging.getLogger(__name__)

@dataclass
class Trial:
    engines: int
    rows: int
    tokens: int
    steady_tokens_per_s: float | None  # while every engine ran; None: they never all ran at once
    running_tokens_per_s: float  # the steady rate, or else tokens over the pipeline's time (start-up left out)
    whole_tokens_per_s: float
    engine_start_s: float
    engine_idle_share: float | None
    flop_share: float | None  # of the accelerator's bf16 peak, at the steady rate


def accelerator_peak() -> tuple[str, float | None]:
    """(name, bf16 FLOP/s) of the first GPU; ('cpu', None) without one."""
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            return name, bf16_peak(name)
    except Exception:  # noqa: BLE001 - no CUDA here
        pass
    return "cpu", None


def sample_corpus(p: Prepared, rows: int, folder: Path, parts: int) -> int:
    """The first `rows` rows of the job's input (the columns it reads), as one local Parquet file
    in row groups of rows/parts, so every engine of a trial gets parts. Returns the rows taken."""
    spec = p.spec
    batches, taken = [], 0
    for task in p.tasks:
        for batch in p.iter_batches(task, 4096):
            batches.append(batch.slice(0, rows - taken))
            taken += batches[-1].num_rows
            if taken >= rows:
                break
        if taken >= rows:
            break
    if not taken:
        raise JobError(f"input.uri: {spec.input.uri}: no rows to tune on")
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_batches(batches)
    pq.write_table(table, folder / "sample.parquet", row_group_size=max(1, -(-taken // parts)))
    return taken


def tune(spec: JobSpec, engines: list[int], rows: int, workdir: str | None = None) -> tuple[list[Trial], str]:
    """Run the sample with each engine count. Returns the trials and the accelerator's name."""
    if spec.executor != "local":
        raise JobError("tune: measures engine.data_parallel on this machine; set executor: local")
    work = Path(workdir or scratch.folder("tune"))
    try:
        p = prepare(spec, check_output=False, warn=False)
        taken = sample_corpus(p, rows, work / "sample", parts=4 * max(engines))
        model = p.model
        name, peak = accelerator_peak()
        trials = []
        for k in engines:
            trial_spec = spec.model_copy(deep=True, update={"incremental": None, "shard": None})
            trial_spec.input.uri = str(work / "sample" / "sample.parquet")
            trial_spec.output.uri = str(work / f"out-{k}")
            trial_spec.output.format = "parquet"
            trial_spec.output.index = None
            trial_spec.output.rows_per_part = max(1, -(-taken // (4 * max(engines))))
            trial_spec.engine.data_parallel = k
            trial_spec.fidelity_check = "off" if trials else spec.fidelity_check  # once is enough
            log.info("tune: %d engine(s) on %d rows", k, taken)
            started = time.perf_counter()
            s = run_job(trial_spec, show_progress=False).summary()
            whole = s["tokens_run"] / (time.perf_counter() - started)
            steady = s.get("steady_tokens_per_s")
            running = steady or s["tokens_run"] / max(1e-9, s["pipeline_seconds"])
            trials.append(Trial(k, taken, s["tokens_run"], steady, round(running, 1), round(whole, 1),
                                s["engine_start_seconds"], s.get("engine_idle_share"),
                                flop_share(model, s["tokens"] / max(1, s["embedded"] or 1), running, peak)))
            shutil.rmtree(work / f"out-{k}", ignore_errors=True)
        return trials, name
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def flop_share(model: ModelInfo, tokens_per_row: float, rate: float, peak: float | None) -> float | None:
    """The share of the accelerator's bf16 peak that `rate` tokens/s of this model use."""
    fpt = model.flops_at(tokens_per_row)
    return round(rate * fpt / peak, 4) if fpt and peak else None


def best(trials: list[Trial]) -> Trial:
    """The fastest while running; of ties within 1 %, the fewest engines. The band is narrow: a
    few percent while running is a few percent over the whole job, more than one engine's start
    and memory cost."""
    top = max(t.running_tokens_per_s for t in trials)
    return min((t for t in trials if t.running_tokens_per_s >= 0.99 * top), key=lambda t: t.engines)


def render(trials: list[Trial], accelerator: str) -> str:
    lines = [f"tune on {accelerator}, {trials[0].rows:,} rows of the job's input ({trials[0].tokens:,} tokens):",
             f"{'engines':>7} {'tok/s running':>14} {'tok/s whole':>12} {'start s':>8} {'idle':>6} "
             f"{'FLOP ceiling':>13}"]
    for t in trials:
        idle = "" if t.engine_idle_share is None else f"{t.engine_idle_share:.0%}"
        share = "—" if t.flop_share is None else f"{t.flop_share:.0%}"
        mark = " " if t.steady_tokens_per_s else "*"
        lines.append(f"{t.engines:>7} {t.running_tokens_per_s:>13,.0f}{mark} {t.whole_tokens_per_s:>12,.0f} "
                     f"{t.engine_start_s:>8.1f} {idle:>6} {share:>13}")
    if any(not t.steady_tokens_per_s for t in trials):
        lines.append("* the engines never all ran at once: tokens over the pipeline's time; give --rows more")
    b = best(trials)
    lines.append(f"best: engine.data_parallel: {b.engines}")
    return "\n".join(lines)


def as_dicts(trials: list[Trial]) -> list[dict]:
    return [asdict(t) for t in trials]
