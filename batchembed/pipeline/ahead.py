"""Tokenising ahead while the engine processes start (executors/processes.py).

Each engine process's reader tokenises its windows while its engine runs, and on a GPU host
eight engines' readers and engines compete for the cores: `batchembed tune` measured 2.0 M tok/s
while eight bge-base engines ran on a 200,000-row sample, whose windows were all tokenised while
the engines were being built, against 1.58 M over the whole 2 M-row job on the same machine, with
no engine ever waiting for a window (notes/performance.md). Meanwhile, while vLLM imports and the
engines build (about 30 s on an H200 host), most cores are idle.

So a helper process, at the lowest CPU priority (SCHED_IDLE: it gets only cores nothing else
wants), reads and tokenises the run's parts in the order the engines will take them and leaves
each window's token ids in a folder; an engine process's reader takes a window from there
instead of tokenising it, and tokenises itself what is not there (yet). A part an engine process
has begun is skipped. The ids are checked against the window's own texts (their hashes) before
use, so a window from the folder is always the one the reader would have made. Only for runs
with no previous output (whose windows do not depend on what it reuses) and whole-text
truncation (long_text: chunk keeps every token, and its windows are left to the readers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from typing import TYPE_CHECKING

import numpy as np

from .. import procguard, scratch
from ..embed.tokenizer import Tokenized
from ..inputs.rows import select_rows
from .read import ReadStage

if TYPE_CHECKING:
    from ..job import Prepared
    from ..plan import Task
    from .base import Window

log = logging.getLogger(__name__)

# BATCHEMBED_TOKENIZE_AHEAD=0 turns it off (benchmarks compare the two)
SWITCH_ENV = "BATCHEMBED_TOKENIZE_AHEAD"
# the most the folder holds: 2 GiB is 6.7 M rows of 80 tokens, 1 M of 512
MAX_BYTES = 2 << 30


class AheadFolder:
    """The folder the helper fills: `<part>.<k>.npz` for window k of a part, `<part>.taken` once
    an engine process's reader has begun the part. Picklable: engine processes get one."""

    def __init__(self, folder: str):
        self.folder = folder

    def _path(self, part_id: str, suffix: str) -> str:
        return os.path.join(self.folder, f"{part_id}.{suffix}")

    def take(self, part_id: str) -> None:
        """An engine process's reader begins the part: the helper leaves it alone from now on."""
        open(self._path(part_id, "taken"), "wb").close()

    def taken(self, part_id: str) -> bool:
        return os.path.exists(self._path(part_id, "taken"))

    def load(self, part_id: str, k: int, uniq: np.ndarray) -> Tokenized | None:
        """Window k's token ids, if the helper left them and they are of these texts (`uniq`: the
        hashes of the window's unique texts, in order); the file is removed either way."""
        path = self._path(part_id, f"{k}.npz")
        try:
            with np.load(path) as z:
                arrays = {name: z[name] for name in z.files}
        except (OSError, ValueError):  # not there (yet), or not whole
            return None
        os.remove(path)
        if not np.array_equal(arrays["uniq"], uniq):
            return None
        flat, lengths = arrays["ids"].tolist(), arrays["lengths"]
        ends = np.cumsum(lengths).tolist()
        starts = [0] + ends[:-1]
        return Tokenized(ids=[flat[a:b] for a, b in zip(starts, ends)], lengths=lengths,
                         truncated=arrays["truncated"], valid=arrays["valid"], empty=int(arrays["empty"]))

    def save(self, part_id: str, k: int, window: Window) -> int:
        """Leave window k's token ids (renamed into place whole); returns the bytes written."""
        tok = window.tok
        ids = np.fromiter((i for row in tok.ids for i in row), dtype=np.int32, count=int(tok.lengths.sum()))
        path = self._path(part_id, f"{k}.npz")
        with open(path + ".tmp", "wb") as f:
            np.savez(f, uniq=window.uniq, ids=ids, lengths=tok.lengths, truncated=tok.truncated, valid=tok.valid,
                     empty=np.int64(tok.empty))
            size = f.tell()
        os.replace(path + ".tmp", path)
        return size


class TokenizeAhead:
    """The helper process and its folder, owned by the run's process: close() ends both."""

    def __init__(self, p: Prepared, tasks: list[Task]):
        self.folder = AheadFolder(scratch.folder("ahead"))
        try:
            with open(os.path.join(self.folder.folder, "job.json"), "w", encoding="utf-8") as f:
                json.dump({"spec": p.spec.model_dump(mode="json"), "parts": [t.part_id for t in tasks]}, f)
            self.process = procguard.helper("batchembed.pipeline.ahead:_ahead_process", self.folder.folder)
            # idle from its first instruction (its imports too); it sets it again for itself
            with contextlib.suppress(OSError):  # gone already: its error.txt says why
                os.sched_setscheduler(self.process.pid, os.SCHED_IDLE, os.sched_param(0))
        except BaseException:
            shutil.rmtree(self.folder.folder, ignore_errors=True)
            raise

    def close(self) -> None:
        procguard.end(self.process)
        error = os.path.join(self.folder.folder, "error.txt")
        if os.path.exists(error):
            with open(error, encoding="utf-8") as f:
                log.debug("tokenising ahead stopped early: %s", f.read())
        shutil.rmtree(self.folder.folder, ignore_errors=True)


def start_ahead(p: Prepared, tasks: list[Task]) -> TokenizeAhead | None:
    """Start tokenising `tasks` (in the order engine processes will take them) ahead, where it
    can help: no previous output, truncated texts, a Linux host (SCHED_IDLE), not switched off."""
    if (os.environ.get(SWITCH_ENV) == "0" or p.previous is not None or p.spec.model.long_text != "truncate"
            or not hasattr(os, "SCHED_IDLE")):
        return None
    return TokenizeAhead(p, tasks)


def _ahead_process(folder: str) -> None:
    """The helper: tokenise the parts of folder/job.json, in its order, into the folder, until
    done or the budget is spent (then `done`); a failure stops it quietly (error.txt) and the
    readers tokenise the rest."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # threads started from here inherit it
    logging.disable(logging.WARNING)
    ahead = AheadFolder(folder)
    try:
        from ..config import JobSpec
        from ..job import prepare

        with open(os.path.join(folder, "job.json"), encoding="utf-8") as f:
            job = json.load(f)
        p = prepare(JobSpec.model_validate(job["spec"]), check_output=False, warn=False)
        tasks = {t.part_id: t for t in p.tasks}
        reader = ReadStage(p)
        budget = min(MAX_BYTES, shutil.disk_usage(folder).free // 4)
        for part_id in job["parts"]:
            task = tasks.get(part_id)
            if task is None or ahead.taken(part_id):
                continue
            for k, batch in enumerate(p.iter_batches(task, p.spec.engine.sort_window_rows)):
                if ahead.taken(part_id):
                    break
                batch, texts, _ = select_rows(p.spec.input, batch)
                budget -= ahead.save(part_id, k, reader.plan(batch, texts, None))
                if budget <= 0:
                    raise RuntimeError("its folder reached its size limit")
    except BaseException as e:  # noqa: BLE001 - the readers tokenise what is not here
        with open(os.path.join(folder, "error.txt"), "w", encoding="utf-8") as f:
            f.write(f"{type(e).__name__}: {e}")
    open(os.path.join(folder, "done"), "wb").close()  # then it waits for the run to end it (procguard)
