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

from ..errors import JobError


@dataclass
class Tokenized:
    """Token ids for the non-null rows of one window, with per-row facts."""

    ids: list[list[int]]  # one list per non-null row, in row order
    lengths: np.ndarray  # int64, tokens per non-null row
    truncated: np.ndarray  # bool, per non-null row
    valid: np.ndarray  # bool per input row: False where the text was null
    empty: int = 0  # rows whose text is "" (embedded, but worth counting)
    # long_text: chunk: for each row (index into ids) longer than max_length, all its windows;
    # ids[i] is then its first window and lengths[i] the tokens of all of them
    chunks: dict[int, list[list[int]]] | None = None


class Tokenizer:
    """`long_text`: "truncate" cuts a long text at max_length; "chunk" cuts it into windows of
    max_length tokens (special tokens and prefix in each) that overlap by `overlap` tokens."""

    def __init__(self, model_dir: Path, max_length: int, prefix: str = "", long_text: str = "truncate",
                 overlap: int = 0):
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
        self.chunking = long_text == "chunk"
        if self.chunking:
            self._setup_chunks(tok, overlap)

    def _setup_chunks(self, tok, overlap: int) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        plain = RustTokenizer.from_str(tok.to_str())
        plain.no_truncation()
        self._plain = plain
        # the model's special tokens around one text, e.g. [CLS] ... [SEP], or ... <|endoftext|>
        bare = plain.encode("hello", add_special_tokens=False).ids
        full = plain.encode("hello", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
        if at is None:
            raise JobError("model.long_text: chunk: cannot tell this tokenizer's special tokens apart")
        self._head, self._tail = full[:at], full[at + len(bare):]
        self._prefix_ids = plain.encode(self.prefix, add_special_tokens=False).ids if self.prefix else []
        self.window = self.max_length - len(self._head) - len(self._tail) - len(self._prefix_ids)
        if self.window - overlap < 1:
            raise JobError(f"model.chunk_overlap: {overlap} leaves no room in windows of {self.window} text tokens "
                           f"(max_length {self.max_length}); make it smaller")
        self.step = self.window - overlap

    def _windows(self, body: list[int]) -> list[list[int]]:
        w, step = self.window, self.step
        starts = list(range(0, max(len(body) - w, 0) + 1, step))
        if starts[-1] + w < len(body):
            starts.append(len(body) - w)
        return [self._head + self._prefix_ids + body[s:s + w] + self._tail for s in starts]

    def __call__(self, texts: list[str | None]) -> Tokenized:
        valid = np.fromiter((t is not None for t in texts), dtype=bool, count=len(texts))
        present = [self.prefix + t if self.prefix else t for t in texts if t is not None]
        encodings = self._tok.encode_batch_fast(present, add_special_tokens=True) if present else []
        ids = [e.ids for e in encodings]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        truncated = np.fromiter((bool(e.overflowing) for e in encodings), dtype=bool, count=len(ids))
        empty = sum(1 for t in texts if t == "")
        chunks = None
        if self.chunking and truncated.any():
            long_rows = np.flatnonzero(truncated)
            present_texts = [t for t in texts if t is not None]
            bodies = self._plain.encode_batch_fast([present_texts[i] for i in long_rows], add_special_tokens=False)
            chunks = {}
            for i, body in zip(long_rows.tolist(), bodies):
                windows = self._windows(body.ids)
                chunks[i] = windows
                ids[i] = windows[0]
                lengths[i] = sum(len(c) for c in windows)
            truncated[:] = False
        return Tokenized(ids=ids, lengths=lengths, truncated=truncated, valid=valid, empty=empty, chunks=chunks)


def model_tokenizer(model_dir: Path, max_length: int, m) -> Tokenizer:
    """The tokenizer a job's `model` section asks for: prefix/instruction and long_text handling."""
    return Tokenizer(model_dir, max_length, m.text_prefix, m.long_text, m.chunk_overlap)
