"""Shared fixtures: one real vLLM engine for the whole session, real Parquet files."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from helpers import MODEL


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


@pytest.fixture
def run_temp():
    """A temp folder (TMPDIR) for the run under test, short enough for vLLM's and Ray's socket paths; removed after."""
    temp = tempfile.mkdtemp(prefix="be-")
    yield temp
    shutil.rmtree(temp)
