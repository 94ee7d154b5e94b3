"""Our tokenisation must be exactly what sentence-transformers feeds the model."""

from helpers import SENTENCES

from batchembed.embed.tokenizer import Tokenizer


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
