"""batchembed's benchmarks: one entry point, cases on one harness.

    python -m benchmarks --help            # the cases
    python -m benchmarks CASE --help       # a case's options
    python -m benchmarks throughput --rows 30000 --repeat 2

Every case writes out/bench/CASE/results.json (one schema: the command, the environment, every run,
the medians) and prints a Markdown table. docs/benchmarks.md publishes the current figures, each
with the command that produced it; the results behind them are in benchmarks/results/.
"""
