"""Shared fixtures: one real vLLM engine for the whole session, real Parquet files."""

from __future__ import annotations

import os
import shutil
import tempfile
from multiprocessing.util import Finalize

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from helpers import MODEL

# The tiers (pyproject.toml's markers): a test that takes the session's real engine or its S3 server
# is marked so by the fixture it asks for; modules of whole-process runs mark themselves `slow`.
_MARK_BY_FIXTURE = {"engine": "engine", "st_model": "engine", "s3": "s3", "s3_env": "s3"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture in set(item.fixturenames) & set(_MARK_BY_FIXTURE):
            item.add_marker(_MARK_BY_FIXTURE[fixture])


@pytest.fixture(scope="session")
def model_info():
    from batchembed.model import read_model_info

    return read_model_info(MODEL)


@pytest.fixture(scope="session")
def engine(model_info):
    """The one engine of the test session: float32, so vectors can be compared tightly."""
    from batchembed.config import EngineSpec
    from batchembed.embed.engine import Engine

    # in processes of its own: an engine in this process would share vLLM's per-process state with
    # the engines that runs started by tests build and close in it (engine.py); those run in it
    eng = Engine(model_info, "float32", model_info.max_length, EngineSpec(in_process=False))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def st_model(model_info):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_info.path), device="cpu")


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 server (SeaweedFS) on a free loopback port, for the whole session."""
    from s3server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweed") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    """The S3 server's endpoint (TEST_S3_ENDPOINT) and credentials in the environment."""
    monkeypatch.setenv("TEST_S3_ENDPOINT", s3.endpoint)
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    return s3


# the machine's temp folder, before the session's own (below) takes TMPDIR's place
MACHINE_TEMP = tempfile.gettempdir()


@pytest.fixture(scope="session", autouse=True)
def session_temp(tmp_path_factory):
    """The test session's temp folder (TMPDIR for it and every process it starts), removed at its exit.
    The runs that tests kill outright leave their scratch as a killed nightly run would, for a later
    run's sweep an hour on; a test session's end is that later run. pytest's own folders (tmp_path)
    stay where pytest keeps them, for a failure to be read."""
    tmp_path_factory.getbasetemp()  # settled before TMPDIR moves
    temp = tempfile.mkdtemp(prefix="be-", dir=MACHINE_TEMP)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = temp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR afresh
    yield temp
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    # removed at this process's exit, after what multiprocessing keeps there: its own temp folder
    # (pymp-*, the forkserver's socket of tune's in-process trials), which its exit finalizer
    # removes at priority -100 and would find gone (a traceback after the session's summary)
    Finalize(None, shutil.rmtree, args=(temp,), kwargs={"ignore_errors": True}, exitpriority=-101)


@pytest.fixture
def run_temp():
    """A temp folder (TMPDIR) for the run under test, short enough for vLLM's and Ray's socket paths
    (so in the machine's temp folder, not the session's); removed after."""
    temp = tempfile.mkdtemp(prefix="be-", dir=MACHINE_TEMP)
    yield temp
    shutil.rmtree(temp)
