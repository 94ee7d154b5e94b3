"""Tokenise in the project, once, with the model's fast (Rust) tokenizer.

Truncation keeps the special tokens, as sentence-transformers does: a text longer
than `max_length` becomes `[CLS] first max_length-2 tokens [SEP]` (or the model's
equivalent), so no row can exceed the engine's limit and make vLLM reject the
whole call. The engine gets token ids and never tokenises again.

A text far longer than the limit is tokenised only up to a cut (`cut_safe`): most of a long
text's tokenising is work thrown away by the truncation, and on a GPU host tokenising is the
largest CPU cost of a run. The ids are the same as the whole text's, by construction and
checked on a few rows of every batch.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import JobError

log = logging.getLogger(__name__)

# Normalizers that map each character on its own (or add at the very start), so the text before
# a space is normalised alike whatever follows the space.
_LOCAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip",
                      "Prepend"}
# Pre-tokenizers that never join a non-space character to a space after it: each piece of the
# text before such a space is a piece of the text cut there. (ByteLevel only with its GPT-2
# regex, Metaspace only when it splits, Split only by a pattern that passes `_splits_at_spaces`.)
_SPLITTING_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Metaspace", "ByteLevel",
                             "Split"}
_REFINING_PRE_TOKENIZERS = {"Punctuation", "Digits", "UnicodeScripts", "CharDelimiterSplit"}
# a cut goes just before a space that follows a non-space character
_CUT = re.compile(r"\S ")
# texts with which a Split pattern is tried (the Qwen2 / Llama 3 patterns keep newlines after
# punctuation with it, which is why cuts are only ever before a plain space)
_SPLIT_PROBE = ("Hello,  world! It's 12345 o'clock.\n\n  Next\tline \u00e9t\u00e9 \u4e2d\u6587 "
                "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 x.\n y ;; \U0001f600 z  ")


def _splits_at_spaces(pre_tokenizer: dict) -> bool:
    """Whether a pre-tokenizer, given as its JSON, ends a piece before every space that follows a
    non-space character in a probe text (a Split's regex cannot be read for it)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel

    try:
        spec = json.loads(RustTokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")).to_str())
        spec["pre_tokenizer"] = pre_tokenizer
        pieces = RustTokenizer.from_str(json.dumps(spec)).pre_tokenizer.pre_tokenize_str(_SPLIT_PROBE)
    except Exception:  # noqa: BLE001 - a shape this cannot build is simply not cut
        return False
    return not any(_CUT.search(text) for text, _ in pieces)


def cut_safe(tokenizer_json: str) -> str | None:
    """None when a text cut just before a space (after a non-space) tokenises, up to the cut, as
    the whole text does; else why not. The proof is by parts: the normaliser maps characters one
    at a time, the pre-tokenizer ends a piece before every such space, and the model (WordPiece,
    BPE, Unigram) tokenises each piece on its own."""
    spec = json.loads(tokenizer_json)
    spaced = [t.get("content", "") for t in spec.get("added_tokens") or [] if re.search(r"\s", t.get("content", ""))]
    if spaced:  # matched in the raw text before anything else: a cut could split one
        return f"added token {spaced[0]!r} holds a space"

    def parts(node, key):
        if not node:
            return []
        if node.get("type") == "Sequence":
            return [x for child in node.get(key, []) for x in parts(child, key)]
        return [node]

    for n in parts(spec.get("normalizer"), "normalizers"):
        kind = n.get("type")
        single = n.get("pattern", {}).get("String") if kind == "Replace" else None
        if kind not in _LOCAL_NORMALIZERS and not (isinstance(single, str) and len(single) == 1):
            return f"normalizer {kind} may change text across a space"
    splitting = False
    for n in parts(spec.get("pre_tokenizer"), "pretokenizers"):
        kind = n.get("type")
        if kind in _REFINING_PRE_TOKENIZERS:
            continue
        if kind not in _SPLITTING_PRE_TOKENIZERS:
            return f"pre-tokenizer {kind} may join text across a space"
        if kind == "ByteLevel" and not n.get("use_regex", True):
            continue  # bytes to characters only; a Split before it does the splitting
        if kind == "Metaspace" and not n.get("split", True):
            return "pre-tokenizer Metaspace without split keeps the text in one piece"
        if kind == "Split" and not _splits_at_spaces(n):
            return "pre-tokenizer Split by a pattern that keeps a space after a word in one piece"
        splitting = True
    if not splitting:
        return "no pre-tokenizer splits the text at spaces"
    model = spec.get("model", {}).get("type")
    if model not in ("WordPiece", "BPE", "Unigram", "WordLevel"):
        return f"model {model}"
    return None


class TokenIds(Sequence):
    """Token ids of many sequences in one int32 array, read back a sequence at a time as a list.

    A list of Python ints costs about 36 bytes a token, this 4: windows wait tokenised in the
    pipeline's queues (at 512 tokens a row a window of 8,192 rows would hold 150 MB as lists), and
    only the windows on the engine need lists, made as they are submitted."""

    __slots__ = ("flat", "offsets")

    def __init__(self, seqs: list[list[int]]):
        self.offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs)), out=self.offsets[1:])
        self.flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(self.offsets[-1]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.flat[self.offsets[i]:self.offsets[i + 1]].tolist()

    def lists(self, rows) -> list[list[int]]:
        """Sequences `rows` (positions, in the order wanted) as lists, at once: the lists the
        engine is handed, made in one conversion rather than one a row."""
        whole, at = self.flat.tolist(), self.offsets.tolist()
        return [whole[at[i]:at[i + 1]] for i in rows]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None


@dataclass
class Tokenized:
    """Token ids for the non-null rows of one window, with per-row facts."""

    ids: TokenIds  # one sequence per non-null row, in row order
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
                 overlap: int = 0, marker: int | None = None):
        """`marker`: a token id put after the first token of every sequence (a ColBERT model's
        document marker, heads.document_marker), inside `max_length`."""
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
        self.marker = marker
        room = max_length - (marker is not None)
        tok.enable_truncation(room)
        self._tok = tok
        self.max_length = max_length
        self.prefix = prefix
        self.chunking = long_text == "chunk"
        if self.chunking:
            self._setup_chunks(tok, overlap)
        # tokens of text a sequence holds besides its special tokens; texts are cut at about
        # `_chars_per_token` characters for each, then the cut moves further if too many fell short
        self._text_tokens = room - len(tok.encode("", add_special_tokens=True).ids)
        why = None if not self.chunking else "long_text: chunk needs every token"
        why = why or cut_safe(tok.to_str())
        self.cutting = why is None and self._text_tokens > 0
        self._chars_per_token = 5.0
        log.debug("tokenising long texts only up to a cut: %s", "yes" if self.cutting else f"no ({why})")

    def _encode(self, texts: list[str]) -> list:
        """Encodings of `texts`, each the same as the whole text's, tokenising long ones only up to
        a cut with room for more text tokens than fit."""
        encode = self._tok.encode_batch_fast
        if not self.cutting:
            return encode(texts, add_special_tokens=True)
        at = int(self._text_tokens * self._chars_per_token) + len(self.prefix)
        cut, cuts = list(texts), []
        for i, t in enumerate(texts):
            if len(t) > at and (m := _CUT.search(t, at)) is not None:
                cut[i] = t[:m.start() + 1]
                cuts.append(i)
        encodings = encode(cut, add_special_tokens=True)
        # a cut text that did not fill the sequence and overflow says nothing of the whole text
        short = [i for i in cuts if not encodings[i].overflowing]
        if short:
            for i, e in zip(short, encode([texts[i] for i in short], add_special_tokens=True)):
                encodings[i] = e
            if len(short) > 0.02 * len(cuts):
                self._chars_per_token *= 1.1
        checked = [i for i in cuts[:2] if i not in short]
        if checked and any(encodings[i].ids != e.ids
                           for i, e in zip(checked, encode([texts[i] for i in checked], add_special_tokens=True))):
            log.warning("tokenising a text cut short gave other ids than the whole text: this model's "
                        "texts are tokenised whole from now on")
            self.cutting = False
            return encode(texts, add_special_tokens=True)
        return encodings

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
        if self.marker is not None:  # each window a document of its own: [CLS] marker ... [SEP]
            self._head = self._head[:1] + [self.marker] + self._head[1:]
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
        encodings = self._encode(present) if present else []
        ids = [e.ids for e in encodings]
        if self.marker is not None:
            ids = [x[:1] + [self.marker] + x[1:] for x in ids]
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
        return Tokenized(ids=TokenIds(ids), lengths=lengths, truncated=truncated, valid=valid, empty=empty,
                         chunks=chunks)


def model_tokenizer(model_dir: Path, max_length: int, m, marker: int | None = None) -> Tokenizer:
    """The tokenizer a job's `model` section asks for: prefix/instruction and long_text handling
    (`marker`: Tokenizer's)."""
    return Tokenizer(model_dir, max_length, m.text_prefix, m.long_text, m.chunk_overlap, marker)
