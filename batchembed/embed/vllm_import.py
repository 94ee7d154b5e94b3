"""vLLM's import, paid once per process and made cheaper: the collector paused and the heap frozen
over it, optional packages an engine never uses hidden from it, and the model's class inspected in
this process (not in a new interpreter that imports vLLM again). The forkserver of engine processes
(executors/preload.py) and each Engine build use these."""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import sys
import types

log = logging.getLogger(__name__)

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
    all, and a full collection before the freeze costs more than the few unreachable objects of the
    import that now stay (frozen, never walked) are worth.
    Whether the heap is frozen already is this module's to know, not `gc.get_freeze_count()`'s: the
    Python 3.12 can start with a few hundred objects frozen already, which would read as done."""
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
# goes without), and sentence-transformers installs both: about a sixth of vLLM's import.
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
    a multi-engine run at once, most of a fresh machine's first build. Registering the class object
    (vLLM's public `ModelRegistry.register_model`)
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
