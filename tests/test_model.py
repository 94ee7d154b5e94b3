"""Where a model comes from: a package, a local directory, or the local Hugging Face cache."""

import shutil

import pytest

from batchembed.errors import JobError
from batchembed.model import model_content_hash, read_model_info, resolve_model_dir


def test_package_model_facts(model_info):
    assert model_info.path.name == "model" and (model_info.path / "config.json").is_file()
    assert (model_info.dimension, model_info.max_length, model_info.is_matryoshka) == (384, 256, False)


def test_local_directory_and_hub_cache_resolve_to_the_same_files(tmp_path, model_info, monkeypatch):
    local = tmp_path / "my-model"
    shutil.copytree(model_info.path, local)
    assert resolve_model_dir(str(local)) == local.resolve()
    assert read_model_info(str(local)).dimension == 384
    # a hub id, from a cache laid out as huggingface_hub lays it out
    cache = tmp_path / "hub"
    snap = cache / "models--sentence-transformers--all-MiniLM-L6-v2" / "snapshots" / "abc123"
    shutil.copytree(model_info.path, snap)
    (cache / "models--sentence-transformers--all-MiniLM-L6-v2" / "refs").mkdir()
    (cache / "models--sentence-transformers--all-MiniLM-L6-v2" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model_dir("sentence-transformers/all-MiniLM-L6-v2") == snap
    with pytest.raises(JobError, match="not in the local Hugging Face cache"):
        resolve_model_dir("sentence-transformers/not-there")


def test_content_hash_changes_with_the_weights(tmp_path, model_info):
    local = tmp_path / "m"
    shutil.copytree(model_info.path, local)
    before = model_content_hash(local)
    assert before == model_content_hash(local) and before.startswith("sha256:")
    with open(local / "config.json", "a") as f:
        f.write(" ")
    assert model_content_hash(local) != before


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(JobError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def test_kv_cache_size_for_gpu_engines_from_the_model_config(tmp_path, model_info):
    """The KV cache a GPU engine is given (embed.settings.kv_cache_bytes): layers x K and V x kv heads x
    head dim x element size, per token. Its sizes come from config.json, with the defaults
    that config leaves out (kv heads = heads, head dim = hidden / heads)."""
    import json

    from batchembed.embed.settings import kv_cache_bytes

    # MiniLM: 6 layers, 12 heads of 32 (hidden 384), bf16
    assert kv_cache_bytes(model_info, "bfloat16", 1000) == 6 * 2 * 12 * 32 * 2 * 1000
    assert kv_cache_bytes(model_info, "float32", 1000) == 6 * 2 * 12 * 32 * 4 * 1000
    # Qwen3-0.6B: grouped-query attention (8 kv heads of 128), two steps of 65,536 tokens: 14 GiB
    qwen = tmp_path / "qwen3"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 1024}))
    assert kv_cache_bytes(read_model_info(str(qwen)), "auto", 2 * 65536) == 14 * 2**30
    (qwen / "config.json").write_text(json.dumps({"hidden_size": 1024}))
    assert kv_cache_bytes(read_model_info(str(qwen)), "auto", 10) is None  # unknown: vLLM sizes the cache itself
    (tmp_path / "missing").mkdir()
    with pytest.raises(JobError, match="no config.json"):  # without a config there is no engine at all
        read_model_info(str(tmp_path / "missing"))
