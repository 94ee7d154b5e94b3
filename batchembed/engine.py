"""The embedding engine: vLLM's offline pooling runner, fed token ids, read as arrays.

Three things are done on purpose here:
  - `PoolingParams(task="embed")`: without a task, recent vLLM returns per-token
    hidden states (tokens x hidden) instead of one pooled vector.
  - `LLM.encode(..., pooling_task="embed")` rather than `LLM.embed`: the latter
    turns every vector into a Python list of floats; we keep the tensors.
  - every result is checked to be exactly one vector of the model's dimension.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from .config import EngineSpec
from .errors import RunError
from .model import ModelInfo

log = logging.getLogger(__name__)

# On the CPU backend `gpu_memory_utilization` is the share of *host* memory vLLM
# reserves; encoders keep no KV cache worth the name, so a small share is plenty
# and vLLM's default (0.92) fails to start beside anything else.
_CPU_MEMORY_SHARE = 0.1


def default_step_limits(spec: EngineSpec, on_cpu: bool, max_length: int) -> tuple[int, int]:
    # CPU: 4096-8192-token steps ran at 11.8k tok/s, 16384 at 9.7k (MiniLM, 2 cores; notes/performance.md).
    budget = spec.token_budget or (8192 if on_cpu else 65536)
    rows = spec.max_batch_rows or (512 if on_cpu else 4096)
    return max(budget, max_length), rows


@dataclass(frozen=True)
class EngineKey:
    """What must match for an engine to serve a job."""

    model_path: str
    dtype: str
    max_length: int


def _cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (avx512_bf16 or AMX); unknown counts as yes."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return True
    return not flags or any(x in flags.split() for x in ("avx512_bf16", "amx_bf16"))


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


def kv_cache_bytes(model: ModelInfo, dtype: str, tokens: int) -> int | None:
    """KV cache for `tokens` tokens of a decoder model; None if its config does not say.

    On a GPU we give vLLM this size (kv_cache_memory_bytes) rather than let it size the cache
    by profiling: the profile reads the device's free memory, so an engine starting beside
    another one on the same GPU counts the other's allocations as its own and fails with
    "No available memory for the cache blocks" (seen with two compiled Qwen3 engines on an
    H200, notes/performance.md). A pooling step's requests finish within the step, so a
    cache of two steps' tokens is all a batch job uses; vLLM's default takes 90 % of the GPU.
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


def _shutdown_grace(shutdown) -> dict:
    """Keyword arguments for vLLM's engine shutdown: a 1 s grace instead of its default 5 s.

    The engine core stops at once, but vLLM then waits for its worker process, which on CPU
    never leaves on its own and is killed when the wait ends: closing took 5.5 s, all of it
    waiting, and 1.5 s with this (scripts/engine_settings.py prints it). Everything is on
    disk by then. Versions whose shutdown takes no timeout keep their own.
    """
    import inspect

    try:
        takes_timeout = "timeout" in inspect.signature(shutdown).parameters
    except (TypeError, ValueError):
        takes_timeout = False
    return {"timeout": 1.0} if takes_timeout else {}


class Engine:
    """One vLLM engine. Use as a context manager, or call close().

    `replica`/`replicas` place one of several engines of a process (engine.data_parallel):
    its own GPU (or share of one), or its own CPU cores.
    """

    def __init__(self, model: ModelInfo, dtype: str, max_length: int, spec: EngineSpec,
                 replica: int = 0, replicas: int = 1):
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # vLLM-cpu keeps one core back for its front end by default; our front end is a
        # few light threads, and on a 2-core machine that reserve halves throughput
        # (6.5k -> 11.5k tok/s measured, notes/performance.md). Ignored by GPU builds.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM, PoolingParams
        from vllm.platforms import current_platform

        _copy_engine_output_frames()

        self.key = EngineKey(str(model.path), dtype, max_length)
        self.dimension = model.dimension
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu and dtype in ("bfloat16", "bf16") and not _cpu_has_bf16():
            log.warning("model.dtype %s on a CPU without avx512_bf16 or AMX: bf16 is emulated there, "
                        "over 100x slower than float32 in a matmul on an AVX2-only EPYC; set "
                        "model.dtype: float32", dtype)
        env, sharing = _placement(replica, replicas, self.on_cpu)
        memory_share = spec.gpu_memory_utilization or (_CPU_MEMORY_SHARE if self.on_cpu else 0.9 / sharing)
        # Per-step limits. On a GPU, small encoder steps are bound by per-step overhead, not
        # FLOPs (one engine stalls near 4-5k sequences/s at 80 tokens), so steps are larger.
        self.token_budget, self.max_batch_rows = default_step_limits(spec, self.on_cpu, max_length)
        args = dict(
            model=str(model.path),
            tokenizer=str(model.path),
            runner="pooling",
            dtype=dtype,
            max_model_len=max_length,
            # The scheduler cuts each call into steps of this budget, in the (length-sorted)
            # order the rows were submitted: our token-budget batches.
            max_num_batched_tokens=self.token_budget,
            max_num_seqs=self.max_batch_rows,
            # Compiled on a GPU: +15 % for Qwen3-0.6B shape @ 512 (notes/performance.md), its
            # ~20 s compile cached by vLLM for the next run; eager on CPU, where compiling is slow.
            enforce_eager=self.on_cpu if spec.enforce_eager is None else spec.enforce_eager,
            gpu_memory_utilization=memory_share,
            seed=0,
            disable_log_stats=True,
            # vLLM turns prefix caching on for causal, last-token-pooling embedders (Qwen3-
            # Embedding). A batch corpus gains little from it, and with it on, runs with
            # repeated prefixes stalled here (Qwen3-0.6B shape on an H200, notes/performance.md)
            # and others report wrong vectors from partly cached prompts (vllm-ascend #6988).
            enable_prefix_caching=False,
        )
        if not self.on_cpu:
            kv_bytes = kv_cache_bytes(model, dtype, 2 * self.token_budget)
            if kv_bytes:
                args["kv_cache_memory_bytes"] = max(kv_bytes, 256 * 2**20)
        args.update(spec.vllm_args)
        log.info("starting vLLM engine %d/%d %s: %s", replica + 1, replicas, env,
                 {k: v for k, v in args.items() if k != "tokenizer"})
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # read by the engine's processes as they start, in LLM()
        try:
            self.llm = LLM(**args)
        except Exception as e:  # noqa: BLE001 - vLLM raises many kinds at start
            raise RunError(f"the vLLM engine failed to start for {model.path}: {type(e).__name__}: {e}") from e
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._params = PoolingParams(task="embed")
        self.calls = 0  # engine calls made: a run that only reuses vectors makes none

    def embed(self, token_ids: list[list[int]]) -> np.ndarray:
        """One engine call. Returns float32 (rows, dimension), each row L2-normalised by the model's pooler."""
        import torch
        from vllm.inputs import TokensPrompt

        if not token_ids:
            return np.zeros((0, self.dimension), dtype=np.float32)
        self.calls += 1
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
        outputs = self.llm.encode(prompts, pooling_params=self._params, pooling_task="embed", use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RunError(f"engine returned {len(outputs)} results for {len(prompts)} inputs")
        tensors = []
        for out in outputs:
            if getattr(out, "error", None) is not None:
                raise RunError(f"engine failed a request ({len(out.prompt_token_ids)} tokens): {out.error}")
            tensors.append(out.outputs.data)
        matrix = torch.stack(tensors).to(torch.float32).cpu().numpy()
        # The per-token bug: a missing pooling task yields (tokens, hidden) per row.
        if matrix.shape != (len(prompts), self.dimension):
            raise RunError(
                f"engine returned shape {tuple(tensors[0].shape)} per row, expected one vector of "
                f"{self.dimension}: the model's pooling does not produce sentence embeddings"
            )
        return matrix

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown(**_shutdown_grace(core.shutdown))
            except Exception as e:  # noqa: BLE001 - shutting down must not turn success into failure
                log.warning("engine shutdown: %s", e)
        del llm
        import gc

        gc.collect()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
