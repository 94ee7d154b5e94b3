"""Sparse and multi-vector representations from one pass: the engine gives each token's last
hidden state (vLLM's `token_embed` task, no activation), and the model's own heads run here,
once per engine step over every token the step finished, so one forward pass per row gives
every representation the job asks for.

Each family computes exactly what its library does:
  - BGE-M3 (FlagEmbedding's BGEM3FlagModel): dense = the first token's state, normalised;
    sparse = relu(sparse_linear(state)) per token, the largest per token id, the tokenizer's
    cls / eos / pad / unk tokens left out, zeros dropped; multi-vector = colbert_linear over the
    tokens after the first, each normalised.
  - SPLADE (sentence-transformers' SparseEncoder): the masked-LM head's logits per token,
    log(1 + relu), pooled over the tokens by max (or sum, as its SpladePooling says).
  - ColBERT (PyLate): the Dense projections over every token, then the tokens whose id is in the
    model's skiplist (punctuation) dropped, each vector normalised. The document marker is put
    after the first token by the tokenizer (tokenizer.py), as PyLate does.

The heads' weights are a few matrices read from the model folder; they run on the engine's
device when the engine is in this process's view (a GPU), else on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import JobError
from ..model import ModelInfo, read_model_json
from .vectors import max_per_id

log = logging.getLogger(__name__)


@dataclass
class Reps:
    """One row's representations: each None where the job does not write it."""

    dense: np.ndarray | None = None  # float32 (dimension,), normalised
    sparse: tuple[np.ndarray, np.ndarray] | None = None  # (int32 token ids ascending, float32 weights > 0)
    multi_vector: np.ndarray | None = None  # float32 (vectors, d), each normalised

    @classmethod
    def empty(cls, outputs, dimension: int, multi_dimension: int | None) -> "Reps":
        """What a row the engine failed holds (it is written as nulls)."""
        return cls(np.zeros(dimension, np.float32) if "dense" in outputs else None,
                   (np.zeros(0, np.int32), np.zeros(0, np.float32)) if "sparse" in outputs else None,
                   np.zeros((0, multi_dimension or 0), np.float32) if "multi_vector" in outputs else None)


def _load_weights(folder: Path) -> dict:
    """A module folder's weights (safetensors, else a torch file), as CPU tensors."""
    import torch

    st = folder / "model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    for name in ("pytorch_model.bin",):
        if (folder / name).is_file():
            return torch.load(folder / name, map_location="cpu", weights_only=True)
    raise JobError(f"model: no weights (model.safetensors or pytorch_model.bin) in {folder}")


def _token_id(tokenizer, token) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    return tokenizer.token_to_id(token)


def _rust_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def _activation(name: str):
    """A Dense module's activation, by the class name its config gives."""
    import torch

    short = (name or "torch.nn.modules.linear.Identity").rsplit(".", 1)[-1]
    known = {"Identity": torch.nn.Identity(), "Tanh": torch.nn.Tanh(), "ReLU": torch.nn.ReLU(),
             "Sigmoid": torch.nn.Sigmoid(), "GELU": torch.nn.GELU()}
    if short not in known:
        raise JobError(f"model: a Dense layer with activation {name}; batchembed applies "
                       f"{', '.join(sorted(known))}")
    return known[short]


def document_marker(model: ModelInfo) -> int | None:
    """The token id a ColBERT model puts after the first token of every document, or None."""
    if model.family != "colbert":
        return None
    prefix = read_model_json(model.path / "config_sentence_transformers.json").get("document_prefix", "[D] ")
    if not prefix:
        return None
    tok = _rust_tokenizer(model.path)
    marker = tok.token_to_id(prefix)
    if marker is None:
        marker = tok.token_to_id(prefix.strip())
    if marker is None:
        raise JobError(f"model: {model.path}: the document prefix {prefix!r} is not a token of its tokenizer")
    return marker


class Heads:
    """The family's heads, for the representations `outputs`."""

    def __init__(self, model: ModelInfo, outputs: tuple[str, ...], device: str = "cpu"):
        import torch

        self.model, self.outputs, self.device = model, tuple(outputs), torch.device(device)
        self.family = model.family
        self.dimension = model.dimension
        self.multi_dimension = model.multi_vector_dimension
        path = model.path
        self.hidden = int(read_model_json(path / "config.json").get("hidden_size") or 0)  # a token state's size
        with torch.no_grad():
            if self.family == "bge-m3":
                self._colbert = self._linear(torch.load(path / "colbert_linear.pt", map_location="cpu",
                                                        weights_only=True))
                self._sparse = self._linear(torch.load(path / "sparse_linear.pt", map_location="cpu",
                                                       weights_only=True))
                tok = _rust_tokenizer(path)
                specials = read_model_json(path / "special_tokens_map.json")
                self._unused = {i for k in ("cls_token", "eos_token", "pad_token", "unk_token")
                                if k in specials and (i := _token_id(tok, specials[k])) is not None}
            elif self.family == "splade":
                self._mlm_head(path)
                pooling = next((m for m in read_model_json(path / "modules.json")
                                if m.get("type", "").endswith("SpladePooling")), {})
                cfg = read_model_json(path / pooling.get("path", "") / "config.json")
                self._pool = cfg.get("pooling_strategy", "max")
                if self._pool not in ("max", "sum") or cfg.get("activation_function", "relu") != "relu":
                    raise JobError(f"model: {path}: SpladePooling {cfg}; batchembed applies max or sum "
                                   "pooling of log(1 + relu)")
            elif self.family == "colbert":
                self._dense_chain(path)
                words = read_model_json(path / "config_sentence_transformers.json").get("skiplist_words")
                if words is None:
                    import string

                    words = list(string.punctuation)
                tok = _rust_tokenizer(path)
                self._skip = torch.tensor(sorted({i for w in words if (i := tok.token_to_id(w)) is not None}),
                                          dtype=torch.int64, device=self.device)
            else:
                raise JobError(f"model: {path}: no heads for the {self.family} family")

    def _linear(self, state: dict):
        import torch

        w = state["weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias="bias" in state)
        lin.load_state_dict(state)
        return lin.to(self.device, torch.float32).eval()

    def _mlm_head(self, path: Path) -> None:
        """BERT's masked-LM head: dense, activation, LayerNorm, then the decoder onto the vocabulary
        (the word embeddings, where the checkpoint ties them)."""
        import torch
        from transformers.activations import ACT2FN

        config = read_model_json(path / "config.json")
        w = _load_weights(path)
        p = "cls.predictions."
        hidden = int(config["hidden_size"])
        self._transform = self._linear({"weight": w[p + "transform.dense.weight"],
                                        "bias": w[p + "transform.dense.bias"]})
        self._act = ACT2FN[config.get("hidden_act", "gelu")]
        norm = torch.nn.LayerNorm(hidden, eps=float(config.get("layer_norm_eps", 1e-12)))
        norm.load_state_dict({"weight": w[p + "transform.LayerNorm.weight"],
                              "bias": w[p + "transform.LayerNorm.bias"]})
        self._norm = norm.to(self.device, torch.float32).eval()
        decoder = w.get(p + "decoder.weight")
        if decoder is None:  # tied to the input embeddings
            decoder = w.get("bert.embeddings.word_embeddings.weight", w.get("embeddings.word_embeddings.weight"))
        bias = w.get(p + "bias", w.get(p + "decoder.bias"))
        if decoder is None or bias is None:
            raise JobError(f"model: {path}: no masked-LM decoder weights (cls.predictions.*)")
        self._decoder = self._linear({"weight": decoder, "bias": bias})

    def _dense_chain(self, path: Path) -> None:
        """PyLate's Dense modules, in order."""
        import torch

        self._chain = []
        for m in read_model_json(path / "modules.json"):
            if not m.get("type", "").endswith("Dense"):
                continue
            folder = path / m.get("path", "")
            cfg = read_model_json(folder / "config.json")
            w = _load_weights(folder)
            linear = self._linear({k[len("linear."):]: v for k, v in w.items() if k.startswith("linear.")})
            residual = None
            if cfg.get("use_residual"):
                residual = (self._linear({"weight": w["residual.weight"]}) if "residual.weight" in w
                            else torch.nn.Identity())
            self._chain.append((linear, _activation(cfg.get("activation_function")), residual))
        if not self._chain:
            raise JobError(f"model: {path}: a ColBERT model without a Dense projection in modules.json")

    def __call__(self, states: list, ids: list[list[int]]) -> list[Reps]:
        """Each row's representations from its token states ((tokens, hidden) tensors) and ids."""
        import torch

        if not states:
            return []
        with torch.no_grad():
            lengths = [len(x) for x in ids]
            h = torch.cat([s.reshape(len(s), -1) for s in states]).to(self.device, torch.float32)
            if self.family == "bge-m3":
                return self._bge_m3(h, ids, lengths)
            if self.family == "splade":
                return self._splade(h, lengths)
            return self._colbert_rows(h, ids, lengths)

    def _bge_m3(self, h, ids, lengths) -> list[Reps]:
        import torch
        import torch.nn.functional as F

        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        dense = multi = weights = None
        if "dense" in self.outputs:
            dense = F.normalize(h[torch.as_tensor(starts)], dim=-1).cpu().numpy()
        if "multi_vector" in self.outputs:
            multi = F.normalize(self._colbert(h), dim=-1).cpu().numpy()
        if "sparse" in self.outputs:
            weights = torch.relu(self._sparse(h)).squeeze(-1).cpu().numpy()
        rows = []
        for r, (s, n) in enumerate(zip(starts.tolist(), lengths)):
            sparse = max_per_id(np.asarray(ids[r], np.int64), weights[s:s + n], self._unused) \
                if weights is not None else None
            rows.append(Reps(dense[r] if dense is not None else None, sparse,
                             multi[s + 1:s + n] if multi is not None else None))
        return rows

    def _splade(self, h, lengths) -> list[Reps]:
        import torch

        rows, at = [], 0
        # a token's vocabulary logits are the large tensor: a few thousand tokens at a time
        for n in lengths:
            x = h[at:at + n]
            at += n
            scores = torch.log1p(torch.relu(self._decoder(self._norm(self._act(self._transform(x))))))
            pooled = scores.max(dim=0).values if self._pool == "max" else scores.sum(dim=0)
            idx = torch.nonzero(pooled > 0).squeeze(-1)
            rows.append(Reps(sparse=(idx.cpu().numpy().astype(np.int32), pooled[idx].cpu().numpy()
                                     .astype(np.float32))))
        return rows

    def _colbert_rows(self, h, ids, lengths) -> list[Reps]:
        import torch
        import torch.nn.functional as F

        x = h
        for linear, act, residual in self._chain:
            y = act(linear(x))
            x = y + residual(x) if residual is not None else y
        all_ids = torch.as_tensor(np.concatenate([np.asarray(i, np.int64) for i in ids]), device=self.device)
        keep = ~torch.isin(all_ids, self._skip)
        x = F.normalize(x, p=2, dim=-1)
        rows, at = [], 0
        keep_np, x_np = keep.cpu().numpy(), x.cpu().numpy()
        for n in lengths:
            rows.append(Reps(multi_vector=x_np[at:at + n][keep_np[at:at + n]]))
            at += n
        return rows


# --- the folder vLLM loads -------------------------------------------------------------------

_ENCODERS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "batchembed" / "encoders"


def encoder_folder(model: ModelInfo, content_hash: str) -> Path:
    """The folder the engine loads for a model whose heads run here: a view of the model folder as
    a plain encoder, made once per model content in the cache. Without modules.json, so vLLM adds
    no sentence-transformers layer of its own to the token states (it would apply PyLate's Dense);
    for a SPLADE model (a BertForMaskedLM checkpoint, whose `bert.` weights vLLM's BERT does not
    read and whose tied decoder vLLM's SPLADE model cannot load) with its encoder weights renamed.
    Everything else is linked."""
    # per folder and content: the view links to the folder's files
    key = hashlib.sha256(f"{model.path.resolve()}|{content_hash}".encode()).hexdigest()[:32]
    folder = _ENCODERS / key
    if (folder / "config.json").is_file() and all(f.exists() for f in folder.iterdir()):
        return folder
    shutil.rmtree(folder, ignore_errors=True)  # a link to a file since removed
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config = read_model_json(model.path / "config.json")
        skip = {"config.json", "modules.json"}
        if model.family == "splade":
            from safetensors.torch import save_file

            weights = _load_weights(model.path)
            encoder = {k[len("bert."):]: v.contiguous() for k, v in weights.items() if k.startswith("bert.")} or \
                {k: v.contiguous() for k, v in weights.items() if not k.startswith("cls.")}
            save_file(encoder, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config["architectures"] = ["BertModel"]
            skip |= {"model.safetensors", "pytorch_model.bin"}
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        for f in model.path.iterdir():
            if f.is_file() and f.name not in skip:
                os.symlink(f.resolve(), tmp / f.name)
        try:
            tmp.rename(folder)
        except OSError:  # another process made it meanwhile
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.debug("the engine loads %s's encoder from %s", model.path, folder)
    return folder
