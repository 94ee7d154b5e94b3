"""The kinds of failure a user sees, each with its documented exit code."""


class BatchembedError(Exception):
    exit_code = 1


class JobError(BatchembedError):
    """The job file, the command line or the input's shape is wrong: nothing was started."""

    exit_code = 2


class RunError(BatchembedError):
    """The run started and failed; the message says what and where."""

    exit_code = 1


class EngineFailure(RunError):
    """The engine died or stopped answering (embed/watchdog.py); a new one may take over."""


class RequestFailure(RunError):
    """The engine failed some of the sequences it was given (or the step that held them), and
    is still alive: the rows that fail alone are found by bisection (pipeline/embed.py)."""


class Interrupted(BatchembedError):
    """SIGINT or SIGTERM stopped the run; committed parts are kept. Exit 128 + the signal."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum
