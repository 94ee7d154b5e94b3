"""Where one engine's start-up goes: vLLM's import, then the build of one batchembed Engine, timed
and (with --profile) under cProfile, the engine core in this process so that the profile sees it.

    python3 scripts/build_profile.py --model ~/models/qwen3-0.6b --max-length 512 [--profile OUT.prof]
        [--set engine.max_batch_rows=256 ...]

Prints one line, "RESULT " and JSON (import and build seconds, the settings; vLLM logs to stdout
too), and, with --profile, the functions with the most cumulative time. Run it after a run of the
same model and settings on the machine, so that vLLM's compile cache is warm (as a nightly job
finds it); the first build compiles.
cProfile slows Python-bound phases more than GPU-bound ones: compare the timed runs (no --profile)
for figures, and read the profile for where the time goes."""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--max-length", type=int, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--set", action="append", default=[], metavar="engine.KEY=VALUE")
    p.add_argument("--profile", help="write the cProfile stats here and print the top entries")
    p.add_argument("--top", type=int, default=45)
    a = p.parse_args()
    # batchembed's lines (the engine's "up: import, build", the heap frozen) with milliseconds
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("batchembed").setLevel(logging.DEBUG)

    from batchembed.config import EngineSpec
    from batchembed.model import read_model_info

    settings = {"in_process": True}
    for s in a.set:
        key, _, value = s.partition("=")
        try:
            settings[key.removeprefix("engine.")] = json.loads(value)  # numbers, true/false, {...}
        except ValueError:
            settings[key.removeprefix("engine.")] = value
    spec = EngineSpec(**settings)
    model = read_model_info(a.model)
    prof = cProfile.Profile() if a.profile else None
    if prof:
        prof.enable()
    from batchembed.embed.engine import Engine
    from batchembed.embed.vllm_import import UNUSED_BY_ENGINES, imports_frozen, unused_packages_hidden

    t0 = time.perf_counter()
    # as the forkserver imports it (BATCHEMBED_GC_FREEZE=0, BATCHEMBED_LEAN_IMPORT=0: as Python does)
    with imports_frozen(), unused_packages_hidden():
        from vllm import LLM, PoolingParams  # noqa: F401 - the import is timed apart from the build
    t1 = time.perf_counter()

    engine = Engine(model, a.dtype, a.max_length, spec)
    t2 = time.perf_counter()
    if prof:
        prof.disable()
    result = {"model": a.model, "max_length": a.max_length, "settings": settings,
              "import_s": round(t1 - t0, 2), "build_s": round(t2 - t1, 2), "profiled": bool(prof),
              # whether the build imported what the import left out (then it only moved the cost)
              "imported_after_build": sorted(name for name in UNUSED_BY_ENGINES if sys.modules.get(name))}
    print("RESULT " + json.dumps(result), flush=True)
    if prof:
        prof.dump_stats(a.profile)
        st = pstats.Stats(prof, stream=sys.stdout)
        st.sort_stats("cumulative").print_stats(a.top)
        st.sort_stats("tottime").print_stats(25)
    sys.stdout.flush()
    engine.leave()
    os._exit(0)


if __name__ == "__main__":
    main()
