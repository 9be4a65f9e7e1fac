"""The stop set and stop strings on detokenized text (decode.stops)."""
import pytest

from decode.stops import StopStringFilter, stop_token_ids
from tests.conftest import make_tokenizer, tiny_llama


def test_stop_set_is_tokenizer_eos_union_generation_config_union_request():
    tok = make_tokenizer()
    target = tiny_llama()
    target.generation_config.eos_token_id = [2, 40, 41]
    assert stop_token_ids(tok, target) == [2, 40, 41]
    assert stop_token_ids(tok, target, [7, 40]) == [2, 7, 40, 41]
    target.generation_config.eos_token_id = 9
    assert stop_token_ids(tok, target) == [2, 9]
    assert stop_token_ids(tok, None) == [2]


def stream(filt, ids, step):
    out = [filt.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return out + [filt.flush()]


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_string_spanning_tokens_is_cut_where_it_starts(step):
    tok = make_tokenizer()
    ids = tok("w10 w11 w12 w13 w14 w15")["input_ids"]
    filt = StopStringFilter(tok, ["1 w12"])
    deltas = stream(filt, ids, step)
    assert "".join(deltas) == "w10 w1"
    assert filt.stopped
    # the completion's ids end with the one that completed the stop string, however many a push ran past it
    assert filt.num_tokens == ids.index(tok.convert_tokens_to_ids("w12")) + 1


@pytest.mark.parametrize("step", [1, 3])
def test_held_back_prefix_is_released_when_no_stop_follows(step):
    tok = make_tokenizer()
    ids = tok("w10 w11 w12 w13")["input_ids"]
    filt = StopStringFilter(tok, ["w13 w99"])
    deltas = stream(filt, ids, step)
    assert "".join(deltas) == "w10 w11 w12 w13" and not filt.stopped
    # The prefix "w13" of the stop string was never shown before the end (it could have become the stop).
    assert not any("w13" in d for d in deltas[:-1])


def test_stop_ids_are_not_text_and_no_stop_means_everything_streams():
    tok = make_tokenizer()
    filt = StopStringFilter(tok, [], stop_ids=[40])
    assert filt.push([10, 11]) == "w6 w7"
    assert filt.push([40]) == ""
    assert filt.flush() == ""


def test_incomplete_utf8_is_held_back(tmp_path):
    from tests.distill.distill_helpers import make_tokenizer as make_bpe

    tok = make_bpe(tmp_path)
    ids = tok("é ok")["input_ids"]
    # Byte-level BPE: 'é' is two bytes; the first one alone decodes to U+FFFD.
    assert len(ids) >= 2
    filt = StopStringFilter(tok)
    shown = [filt.push([i]) for i in ids] + [filt.flush()]
    assert "".join(shown) == "é ok" and all("\ufffd" not in s for s in shown)


def test_empty_stop_string_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringFilter(make_tokenizer(), [""])


@pytest.mark.parametrize("step", [1, 2])
def test_streamed_text_is_the_decode_even_with_tokenization_space_cleanup(step):
    """With clean_up_tokenization_spaces (true in many saved tokenizers, e.g. GPT-2's), decoding more ids can
    change text already shown: "it '" becomes "it's" once "s" arrives, and the stream lost the "s". The filter
    decodes without the cleanup, so every push only appends."""
    tok = make_tokenizer(["it", "'", "s", "fine", ".", "w5"], clean_up_tokenization_spaces=True)
    ids = tok("it ' s fine . w5 ' s")["input_ids"]
    assert tok.decode(ids) != tok.decode(ids, clean_up_tokenization_spaces=False)  # the cleanup is active
    deltas = stream(StopStringFilter(tok), ids, step)
    assert "".join(deltas) == tok.decode(ids, clean_up_tokenization_spaces=False) == "it ' s fine . w5 ' s"
    deltas = stream(StopStringFilter(tok, ["fine ."]), ids, step)  # stop strings are found in the same text
    assert "".join(deltas) == "it ' s "
