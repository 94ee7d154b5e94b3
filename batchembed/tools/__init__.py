"""Tools that read a finished (or unfinished) output: verify, inspect, report."""
