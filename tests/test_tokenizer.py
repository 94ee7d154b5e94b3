"""Our tokenisation must be exactly what sentence-transformers feeds the model."""

from pathlib import Path

import pytest
from helpers import SENTENCES

from batchembed.embed.tokenizer import Tokenizer, cut_safe


def test_matches_sentence_transformers_including_truncation(model_info, st_model):
    for max_length in (256, 16):
        st_model.max_seq_length = max_length
        ours = Tokenizer(model_info.path, max_length)(SENTENCES)
        theirs = st_model.tokenize(SENTENCES)
        for i, ids in enumerate(ours.ids):
            n = int(theirs["attention_mask"][i].sum())
            assert ids == theirs["input_ids"][i][:n].tolist(), (max_length, SENTENCES[i])
        assert ours.lengths.max() <= max_length
    st_model.max_seq_length = model_info.max_length


def test_truncation_keeps_special_tokens_and_is_counted(model_info):
    tok = Tokenizer(model_info.path, 8)
    out = tok(["word " * 50, "short"])
    assert out.ids[0][0] == 101 and out.ids[0][-1] == 102 and len(out.ids[0]) == 8
    assert out.truncated.tolist() == [True, False]


def test_nulls_are_marked_not_tokenised_and_empty_is_counted(model_info):
    out = Tokenizer(model_info.path, 32)(["a", None, "", None])
    assert out.valid.tolist() == [True, False, True, False]
    assert len(out.ids) == 2 and out.ids[1] == [101, 102] and out.empty == 1


def test_prefix_is_prepended(model_info):
    plain = Tokenizer(model_info.path, 32)(["query: hello"]).ids
    prefixed = Tokenizer(model_info.path, 32, prefix="query: ")(["hello"]).ids
    assert plain == prefixed


# Long texts of every kind a cut can meet: runs of spaces, tabs and newlines after punctuation,
# no-break spaces, combining accents after a space, control characters, CJK with no spaces, RTL
# script, emoji, digits, a long unbroken "word", and texts just around the cut.
_PIECES = ["Plain words go here.", "  two  spaces,\tand a tab", "end.\n\n  next line", "x.\n y", "naïve café",
           "e \u0301 accent after a space", "nbsp\u00a0here\u00a0and\u2003em", "ctrl\x00\x07 chars \x1f",
           "中文没有空格的文本中文没有空格的文本", "العربية من اليمين", "emoji 🚀🚀 and 👩‍👩‍👧 family",
           "123456789 0.5 1e-9", "a" * 150, "can't won't it's", "http://example.com/a/b?c=d&e=f", "—dash— «quote»"]


def _hostile_texts(n: int = 120) -> list[str]:
    import random

    rnd = random.Random(7)
    texts = []
    for _ in range(n):
        k = rnd.randint(1, 40)
        texts.append(rnd.choice(["", " ", "  "]) + " ".join(rnd.choice(_PIECES) for _ in range(k))
                     + rnd.choice(["", " ", "\n", "  end"]))
    return texts + ["中文" * 400, "word " * 400, " " * 300 + "late start", "a" * 3000]


def _family(kind: str, texts: list[str], tmp_path) -> Path:
    """A tokenizer of one family, trained here on `texts`, saved as a model directory."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as RustTokenizer

    qwen2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")
    if kind == "unigram-metaspace":  # T5 / XLM-R shape, without their precompiled normaliser
        tok = RustTokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    else:
        tok = RustTokenizer(models.BPE(unk_token="<unk>" if kind == "bpe-nosplit" else None))
        if kind == "gpt2":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        elif kind == "qwen2":
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(qwen2), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet() if kind != "bpe-nosplit" else []
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"], initial_alphabet=alphabet)
    tok.train_from_iterator(texts, trainer)
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", eos)])
    out = tmp_path / kind
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.mark.parametrize("kind", ["bert", "gpt2", "qwen2", "unigram-metaspace"])
def test_long_texts_tokenised_up_to_a_cut_give_the_whole_texts_ids(kind, model_info, tmp_path):
    texts = _hostile_texts()
    path = model_info.path if kind == "bert" else _family(kind, texts, tmp_path)
    for max_length, prefix in ((8, ""), (33, ""), (128, ""), (33, "query: ")):
        cut, whole = Tokenizer(path, max_length, prefix), Tokenizer(path, max_length, prefix)
        whole.cutting = False
        assert cut.cutting, kind
        a, b = cut(texts + [None]), whole(texts + [None])
        assert a.ids == b.ids, (kind, max_length, prefix)
        assert a.truncated.tolist() == b.truncated.tolist() and a.lengths.tolist() == b.lengths.tolist()
        assert cut.cutting, "the check on a few whole texts disagreed"


def test_tokenizers_that_may_join_text_across_a_space_are_never_cut(tmp_path):
    from tokenizers import Regex, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    assert "no pre-tokenizer" in cut_safe(RustTokenizer.from_file(str(_family("bpe-nosplit", _hostile_texts(), tmp_path)
                                                                       / "tokenizer.json")).to_str())
    tok = RustTokenizer.from_file(str(_family("gpt2", _hostile_texts(), tmp_path) / "tokenizer.json"))
    tok.normalizer = normalizers.Replace(Regex(r" {2,}"), " ")
    assert "normalizer Replace" in cut_safe(tok.to_str())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+ ?"), behavior="isolated")
    assert "Split" in cut_safe(tok.to_str())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(split=False)
    assert "Metaspace" in cut_safe(tok.to_str())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert cut_safe(tok.to_str()) is None
    tok.add_tokens(["new york"])  # matched whole in the raw text, before any splitting
    assert "added token" in cut_safe(tok.to_str())


def test_a_cut_that_changes_the_ids_is_caught_and_texts_are_tokenised_whole_from_then_on(tmp_path, caplog):
    """A BPE with no pre-tokenizer learns merges across spaces, so a cut changes its ids: forced to
    cut anyway, the check on whole texts notices, warns once and stops cutting."""
    import random

    rnd = random.Random(3)
    words = ["the", "cat", "sat", "on", "mat", "and", "ate", "dog", "ran"]
    texts = [" ".join(rnd.choice(words) for _ in range(300)) for _ in range(50)]
    path = _family("bpe-nosplit", texts, tmp_path)
    cut, whole = Tokenizer(path, 16), Tokenizer(path, 16)
    assert not cut.cutting
    cut.cutting, cut._chars_per_token = True, 8.0  # the first cut lands inside a merge
    with caplog.at_level("WARNING"):
        assert cut(texts).ids == whole(texts).ids
    assert not cut.cutting and "tokenised whole from now on" in caplog.text
