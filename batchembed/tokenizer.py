"""Tokenise in the project, once, with the model's fast (Rust) tokenizer.

Truncation keeps the special tokens, as sentence-transformers does: a text longer
than `max_length` becomes `[CLS] first max_length-2 tokens [SEP]` (or the model's
equivalent), so no row can exceed the engine's limit and make vLLM reject the
whole call. The engine gets token ids and never tokenises again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import JobError


@dataclass
class Tokenized:
    """Token ids for the non-null rows of one window, with per-row facts."""

    ids: list[list[int]]  # one list per non-null row, in row order
    lengths: np.ndarray  # int64, tokens per non-null row
    truncated: np.ndarray  # bool, per non-null row
    valid: np.ndarray  # bool per input row: False where the text was null
    empty: int = 0  # rows whose text is "" (embedded, but worth counting)


class Tokenizer:
    def __init__(self, model_dir: Path, max_length: int, prefix: str = ""):
        from tokenizers import Tokenizer as RustTokenizer

        tokenizer_json = Path(model_dir) / "tokenizer.json"
        if tokenizer_json.is_file():
            tok = RustTokenizer.from_file(str(tokenizer_json))
        else:  # older models ship only vocab files; transformers converts them to a fast tokenizer
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(model_dir), use_fast=True).backend_tokenizer
            except Exception as e:  # noqa: BLE001
                raise JobError(f"model: no fast tokenizer could be built from {model_dir}: {e}") from None
        # tokenizer.json often carries padding/truncation presets (MiniLM: pad to 128): replace them.
        tok.no_padding()
        tok.enable_truncation(max_length)
        self._tok = tok
        self.max_length = max_length
        self.prefix = prefix

    def __call__(self, texts: list[str | None]) -> Tokenized:
        valid = np.fromiter((t is not None for t in texts), dtype=bool, count=len(texts))
        present = [self.prefix + t if self.prefix else t for t in texts if t is not None]
        encodings = self._tok.encode_batch_fast(present, add_special_tokens=True) if present else []
        ids = [e.ids for e in encodings]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        truncated = np.fromiter((bool(e.overflowing) for e in encodings), dtype=bool, count=len(ids))
        empty = sum(1 for t in texts if t == "")
        return Tokenized(ids=ids, lengths=lengths, truncated=truncated, valid=valid, empty=empty)
