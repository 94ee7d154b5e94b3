"""Find a model folder and read what the run needs from it, without loading weights.

`model.name` is one of:
  - a local directory holding config.json;
  - `package:<python package>`: the folder inside that installed package that holds
    the model (the package itself, or its one subfolder with a config.json);
  - a Hugging Face id, taken from the local cache only (runs never download).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import JobError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str  # as the job wrote it
    path: Path  # resolved folder
    dimension: int  # size of the pooled, normalised vector
    max_length: int  # the model's own token limit (what it was trained with)
    position_limit: int  # the most tokens its position embeddings allow
    matryoshka_dimensions: tuple[int, ...] | None  # None: not declared
    is_matryoshka: bool
    kv_values_per_token: int | None = None  # K and V values a token keeps in all layers; None: unknown
    layer_flops: tuple[float, float] | None = None  # see layer_flops; None: the config does not say

    def flops_at(self, tokens_per_row: float) -> float | None:
        """Forward FLOPs a token of a row of `tokens_per_row` tokens costs; None: unknown."""
        return None if self.layer_flops is None else self.layer_flops[0] + self.layer_flops[1] * tokens_per_row
    causal: bool = False  # a decoder (Qwen3-Embedding, e5-mistral, ...); False: an encoder (BERT-like)
    architectures: tuple[str, ...] = ()  # config.json's, the names vLLM looks its model class up by
    family: str = "dense"  # one of FAMILIES: how the model's outputs are made from its token states
    outputs: tuple[str, ...] = ("dense",)  # the representations it gives (REPRESENTATIONS)
    multi_vector_dimension: int | None = None  # each token vector's size (multi_vector)
    vocab_size: int | None = None  # sparse vectors index the vocabulary


# What a row can be written as: one vector (dense), vocabulary weights (sparse), or one vector
# per token (multi_vector, late interaction).
REPRESENTATIONS = ("dense", "sparse", "multi_vector")
# How a model folder is read, by its layout: a sentence-transformers dense model (vLLM pools it);
# a sentence-transformers SparseEncoder with SpladePooling; a PyLate ColBERT; FlagEmbedding's BGE-M3
# (sparse_linear.pt and colbert_linear.pt beside an XLM-RoBERTa). For all but dense the engine gives
# each token's hidden state and embed/heads.py applies the model's own heads to them.
FAMILIES = {"dense": ("dense",), "splade": ("sparse",), "colbert": ("multi_vector",),
            "bge-m3": ("dense", "sparse", "multi_vector")}


def _family(path: Path, config: dict, st_config: dict, modules: list) -> tuple[str, int | None]:
    """(family, multi-vector dimension) of a model folder, from its layout alone."""
    kinds = [m.get("type", "") for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []
    if (path / "colbert_linear.pt").is_file() and (path / "sparse_linear.pt").is_file():
        return "bge-m3", int(config.get("hidden_size") or 0) or None
    if any(k.endswith("SpladePooling") for k in kinds):
        if not any(k.endswith("MLMTransformer") for k in kinds):
            raise JobError(f"model: {path}: a SPLADE model whose encoder is not a masked-LM transformer "
                           f"({', '.join(kinds)}); batchembed reads MLMTransformer + SpladePooling")
        return "splade", None
    if any(k.endswith("SparseStaticEmbedding") for k in kinds) or any(k.endswith("Router") for k in kinds):
        raise JobError(f"model: {path}: an inference-free or routed sparse model ({', '.join(kinds)}); batchembed "
                       "reads SPLADE models (MLMTransformer + SpladePooling) and BGE-M3")
    if st_config.get("model_type") == "ColBERT":
        dim = None
        for m in modules if isinstance(modules, list) else []:
            if m.get("type", "").endswith("Dense"):
                dim = read_model_json(path / m.get("path", "") / "config.json").get("out_features", dim)
        return "colbert", dim
    if "HF_ColBERT" in (config.get("architectures") or ()):
        raise JobError(f"model: {path}: a Stanford ColBERT checkpoint (HF_ColBERT); batchembed reads PyLate's "
                       "layout: convert it once with `pylate.models.ColBERT('<folder>').save('<new folder>')`")
    return "dense", None


DECODER_TYPES = {"qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3",
                 "gpt2", "gpt_neox", "stablelm", "olmo", "olmo2", "internlm2"}


def is_causal(config: dict) -> bool:
    """From a config.json: a decoder-only model (causal attention), as embedders built on LLMs are."""
    config = config.get("text_config", config)
    archs = config.get("architectures") or []
    return (config.get("model_type") in DECODER_TYPES or bool(config.get("is_decoder"))
            or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs))


def layer_flops(config: dict) -> tuple[float, float] | None:
    """(FLOPs a token costs in the weights it meets: 2 x those weights; FLOPs it costs per position
    of its sequence in attention), from a config.json; None when it does not say."""
    c = config.get("text_config", config)
    try:
        d, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        hd = int(c.get("head_dim") or d // heads)
        ff = int(c.get("intermediate_size") or 4 * d)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    gated = c.get("hidden_act") in ("silu", "swiglu") or "mlp_bias" in c or c.get("model_type", "").startswith("qwen")
    attention = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    mlp = (3 if gated else 2) * d * ff
    return 2.0 * layers * (attention + mlp), 4.0 * layers * heads * hd


def flops_per_token(config: dict, tokens_per_row: float) -> float | None:
    """Forward FLOPs a token costs: 2 x the weights it meets, and attention over its sequence."""
    f = layer_flops(config)
    return None if f is None else f[0] + f[1] * tokens_per_row


def kv_values_per_token(config: dict) -> int | None:
    """layers x (K, V) x kv heads x head dim, from a config.json (kv heads default to the heads,
    head dim to hidden / heads); None when it does not say. Sizes a GPU engine's KV cache."""
    config = config.get("text_config", config)
    try:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def _package_model_dir(package: str) -> Path:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise JobError(f"model.name: package:{package}: no installed Python package named {package!r} (pip install it)")
    root = Path(list(spec.submodule_search_locations)[0])
    if (root / "config.json").is_file():
        return root
    found = sorted(p.parent for p in root.glob("*/config.json"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise JobError(f"model.name: package:{package}: no folder with a config.json inside {root}")
    raise JobError(f"model.name: package:{package}: several model folders in {root}: {[p.name for p in found]}; "
                   "name one as a local directory")


def resolve_model_dir(name: str) -> Path:
    if name.startswith("package:"):
        return _package_model_dir(name[len("package:"):])
    p = Path(os.path.expanduser(name))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise JobError(f"model.name: {name}: the directory has no config.json")
        return p.resolve()
    if p.is_absolute() or name.startswith("."):
        raise JobError(f"model.name: {name}: no such directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE")))
    except Exception as e:  # noqa: BLE001 - the hub client raises many kinds; all mean "not here"
        from huggingface_hub.constants import HF_HUB_CACHE

        raise JobError(
            f"model.name: {name}: not a local directory, not package:<name>, and not in the local "
            f"Hugging Face cache ({HF_HUB_CACHE}); batchembed never downloads ({type(e).__name__})"
        ) from None


def read_model_json(path: Path) -> dict:
    """A JSON file of a model folder: {} when it is not there, a JobError when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise JobError(f"model: cannot read {path}: {e}") from None


def read_model_info(name: str) -> ModelInfo:
    path = resolve_model_dir(name)
    config = read_model_json(path / "config.json")
    st_config = read_model_json(path / "sentence_bert_config.json")
    modules = read_model_json(path / "modules.json") or []
    st_model_config = read_model_json(path / "config_sentence_transformers.json")
    family, multi_dim = _family(path, config, st_model_config, modules)

    dimension = config.get("hidden_size") or config.get("d_model")
    for module in modules if isinstance(modules, list) else []:
        kind = module.get("type", "")
        sub = path / module.get("path", "")
        if kind.endswith("Pooling"):
            dimension = read_model_json(sub / "config.json").get("word_embedding_dimension", dimension)
        elif kind.endswith("Dense"):
            dimension = read_model_json(sub / "config.json").get("out_features", dimension)
    if not dimension:
        raise JobError(f"model: {path}/config.json names no hidden_size; cannot tell the embedding dimension")

    limits = [st_config.get("max_seq_length"), config.get("max_position_embeddings")]
    tok_config = read_model_json(path / "tokenizer_config.json")
    if isinstance(tok_config.get("model_max_length"), int) and tok_config["model_max_length"] < 10**6:
        limits.append(tok_config["model_max_length"])
    limits = [x for x in limits if isinstance(x, int) and x > 0]
    # sentence-transformers' max_seq_length wins: it is what the model was trained with.
    max_length = st_config.get("max_seq_length") or (min(limits) if limits else 512)
    if family == "colbert":  # PyLate cuts documents at document_length, its marker included
        max_length = st_model_config.get("document_length") or max_length

    mdims = config.get("matryoshka_dimensions")
    return ModelInfo(
        name=name,
        path=path,
        dimension=int(dimension),
        max_length=int(max_length),
        position_limit=int(config.get("max_position_embeddings") or max_length),
        matryoshka_dimensions=tuple(mdims) if mdims else None,
        is_matryoshka=bool(config.get("is_matryoshka") or mdims),
        kv_values_per_token=kv_values_per_token(config),
        layer_flops=layer_flops(config),
        causal=is_causal(config),
        architectures=tuple(config.get("architectures") or ()),
        family=family,
        outputs=FAMILIES[family],
        multi_vector_dimension=multi_dim,
        vocab_size=config.get("vocab_size"),
    )


_HASH_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "batchembed" / "model-hashes.json"


def model_content_hash(path: Path) -> str:
    """sha256 over every file of the model folder (names and bytes), cached by size and mtime."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                   and "__pycache__" not in p.parts)
    stat_key = hashlib.sha256(
        "\n".join(f"{p.relative_to(path)}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files).encode()
    ).hexdigest()
    key = f"{path.resolve()}|{stat_key}"
    try:
        cache = json.loads(_HASH_CACHE.read_text())
    except (OSError, json.JSONDecodeError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(path)).encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    digest = "sha256:" + h.hexdigest()
    try:
        _HASH_CACHE.parent.mkdir(parents=True, exist_ok=True)
        cache[key] = digest
        tmp = _HASH_CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(_HASH_CACHE)
    except OSError:
        pass  # a read-only home only costs a re-hash next time
    return digest
