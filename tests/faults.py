"""Fault injection, on the test side: an engine wrapper that implements the engine interface
(submit / step / abort, the rest passed through to the real engine) and fails as a real one can, on
a row holding a marker token id; and a launcher that runs batchembed with every engine it starts so
wrapped:

    python tests/faults.py run job.yaml --no-progress

The launcher reads the markers from the environment (each a token id; unset: no such fault):

    FAULT_REJECT_TOKEN   a step holding such a row fails, as a step fails on a row the model cannot take
    FAULT_HANG_TOKEN     a submission holding such a row never returns, as a hung kernel's step
    FAULT_FAIL_TOKEN     the first step in the process holding such a row fails as a crashed engine's does

Engines started in processes forked from the run's (engine.data_parallel) are not wrapped: the
launcher patches this process only.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from batchembed.errors import EngineFailure, RequestFailure

log = logging.getLogger("batchembed.tests.faults")

REJECT, HANG, FAIL = "FAULT_REJECT_TOKEN", "FAULT_HANG_TOKEN", "FAULT_FAIL_TOKEN"
_failed: list[int] = []  # FAIL's failure happens once per process: the replacement engine works


class Faulty:
    """`engine` (embed.engine.Engine), failing on rows that hold a marker token id."""

    def __init__(self, engine, reject: int | None = None, hang: int | None = None, fail: int | None = None):
        self._engine, self._reject, self._hang, self._fail = engine, reject, hang, fail
        self._rejected = self._failing = False  # a submission in flight holds the marker

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, token_ids: list[list[int]]):
        pending = self._engine.submit(token_ids)

        def holds(marker):
            return marker is not None and any(marker in seq for seq in token_ids)

        self._rejected |= holds(self._reject)
        self._failing |= holds(self._fail) and not _failed
        if holds(self._hang):
            log.warning("%s: this step will never return (a test's fault injection)", HANG)
            threading.Event().wait()
        return pending

    def step(self) -> None:
        if self._rejected:
            self.abort()
            raise RequestFailure(f"the step failed on a sequence carrying token {self._reject} "
                                 f"({REJECT}, a test's fault injection)")
        if self._failing:
            _failed.append(1)
            self._failing = False
            raise EngineFailure(f"the step failed on a sequence carrying token {self._fail} "
                                f"({FAIL}, a test's fault injection)")
        self._engine.step()

    def abort(self) -> None:
        self._rejected = self._failing = False
        self._engine.abort()


def _marker(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def main() -> None:
    """batchembed's command line, with each engine it starts wrapped in Faulty."""
    from batchembed import cli
    from batchembed.embed import engine

    real = engine.Engine
    markers = {"reject": _marker(REJECT), "hang": _marker(HANG), "fail": _marker(FAIL)}

    def wrapped(*args, **kwargs):
        return Faulty(real(*args, **kwargs), **markers)

    engine.Engine = wrapped
    cli.main()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
