"""Where workers run: this process (local.py), one process per engine (processes.py), Ray actors
(ray.py). Each runs base.Worker, the one worker body."""
