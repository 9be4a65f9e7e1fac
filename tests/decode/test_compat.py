"""Vocabulary/tokenizer compatibility: padding rows never sampled, a smaller draft stays lossless, and
disagreeing tokenizers raise errors naming the difference."""
import pytest
import torch

from decode import SpeculativeDecoder
from decode.compat import IncompatibleModelsError, check_compatibility
from tests.conftest import VOCAB, make_tokenizer, perturbed_copy, tiny_llama


def test_shared_vocab_is_the_tokenizers():
    tok = make_tokenizer()
    assert len(tok) == VOCAB
    target = tiny_llama(vocab_size=VOCAB + 32)  # lm_head padded to a multiple of 64
    assert check_compatibility(target, tiny_llama(vocab_size=VOCAB + 8), tok, tok) == VOCAB


def test_padding_rows_never_sampled():
    tok = make_tokenizer()
    target = tiny_llama(vocab_size=VOCAB + 32, seed=0)
    draft = tiny_llama(vocab_size=VOCAB + 8, seed=1)
    with torch.no_grad():  # make the padding rows the most likely ids for both models
        target.lm_head.weight[VOCAB:] = 5.0
        draft.lm_head.weight[VOCAB:] = 5.0
    dec = SpeculativeDecoder(target, draft, 3, tokenizer=tok)
    for temperature in (0.0, 1.0):
        out = dec.generate([[1, 5, 9]] * 16, max_new_tokens=12, temperature=temperature,
                           generator=torch.Generator().manual_seed(0))
        assert max(int(t.max()) for t in out.new_tokens) < VOCAB


def test_draft_with_fewer_ids_stays_lossless():
    """The target can emit ids the draft cannot propose; they come from the residual max(p - q, 0)."""
    V, small = 8, 6
    target = tiny_llama(vocab_size=V, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)
    draft = tiny_llama(vocab_size=small, seed=2)
    words = [f"w{i}" for i in range(V - 4)]
    dec = SpeculativeDecoder(target, draft, 2, tokenizer=make_tokenizer(words))
    N = 20_000
    out = dec.generate([[1, 4, 5]] * N, max_new_tokens=1, temperature=1.0, generator=torch.Generator().manual_seed(0))
    first = torch.stack([t[0] for t in out.new_tokens])
    emp = torch.bincount(first, minlength=V).double() / N
    with torch.no_grad():
        p = target(torch.tensor([[1, 4, 5]])).logits[0, -1].softmax(-1)
    assert p[small:].sum() > 0.1  # the ids the draft lacks carry real mass
    assert 0.5 * (emp - p).abs().sum() < 0.02


def test_target_smaller_than_tokenizer_is_an_error():
    with pytest.raises(IncompatibleModelsError, match="target's lm_head has 64 rows but the tokenizer has 96"):
        check_compatibility(tiny_llama(vocab_size=64), tiny_llama(), make_tokenizer())


def test_different_special_ids():
    a = make_tokenizer()
    b = make_tokenizer(eos_token="w0")
    with pytest.raises(IncompatibleModelsError, match="eos token id: target 2, draft 4"):
        check_compatibility(tiny_llama(), tiny_llama(), a, b)


def test_shared_id_decoding_to_different_text():
    a = make_tokenizer()
    words = [f"w{i}" for i in range(VOCAB - 4)]
    words[10] = "other"
    with pytest.raises(IncompatibleModelsError, match="id 14: target 'w10' vs draft 'other'"):
        SpeculativeDecoder(tiny_llama(), tiny_llama(), 2, tokenizer=a, draft_tokenizer=make_tokenizer(words))


def test_draft_lm_head_larger_than_target_without_tokenizer():
    with pytest.raises(IncompatibleModelsError, match="pass the tokenizer"):
        check_compatibility(tiny_llama(vocab_size=64), tiny_llama(vocab_size=96))


def test_same_tokenizer_objects_pass():
    tok = make_tokenizer()
    target = tiny_llama()
    assert check_compatibility(target, perturbed_copy(target), tok, make_tokenizer()) == VOCAB
