"""Drafts with their own tokenizer (decode.cross_vocab): the pairing of two vocabularies, exact greedy output and the
target's sampling distribution with a draft of another vocabulary, in batch 1 and 4."""
import inspect
import json
import textwrap

import pytest
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from decode import SpeculativeDecoder
from decode.certify import Setting, certify
from decode.cross_vocab import draft_intersection, intersect_vocabularies, token_keys
from tests.conftest import make_tokenizer, perturbed_copy, tiny_llama
from tests.decode.test_lossless import N, PROMPT, chi_square, critical, exact_joints, fits, joint_counts

CORPUS = [inspect.getsource(m) for m in (json.decoder, textwrap)]
TEXTS = ["def wrap(text, width=70):\n    return text", "class JSONDecoder(object):", "    if end is None:",
         "import re\n\n__all__ = ['wrap']"]


def byte_level_bpe(size, corpus=CORPUS):
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on ``corpus`` with ``size`` ids, specials 0-3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def metaspace_bpe(size, corpus=CORPUS):
    """A SentencePiece-style BPE (``▁`` for spaces, ``<0xNN>`` byte fallback) with ``size`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback()])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=size, special_tokens=specials,
                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def transplant(target, target_tok, draft_tok, noise=0.1, seed=0):
    """A draft of ``draft_tok``'s vocabulary that knows the target: the target's layers, and for each shared token
    the target's embedding and head rows (others random), plus noise on the head, so greedy drafts are accepted
    often but not always."""
    draft = tiny_llama(vocab_size=len(draft_tok), layers=target.config.num_hidden_layers, seed=seed + 1)
    draft.model.load_state_dict({k: v for k, v in target.model.state_dict().items() if "embed" not in k},
                                strict=False)
    x = intersect_vocabularies(target_tok, draft_tok)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            src, dst = target.get_parameter(name), draft.get_parameter(name)
            dst[x.columns] = src[x.target_ids]
        w = draft.lm_head.weight
        w.add_(noise * w.std() * torch.randn(w.shape, generator=g, dtype=w.dtype))
    return draft


@pytest.fixture(scope="module")
def bpe_pair():
    """Target and draft tokenizers trained on the same text: byte-level BPE with 700 ids and SentencePiece-style
    BPE with 600 (two BPE tokenizers of one scheme and different sizes share their first ids, so they are one
    vocabulary to the decoder), and models for them."""
    t_tok, d_tok = byte_level_bpe(700), metaspace_bpe(600)
    target = tiny_llama(vocab_size=len(t_tok), layers=2, seed=0)
    return target, t_tok, transplant(target, t_tok, d_tok), d_tok


def prompts(tok):
    return [tok(t)["input_ids"] for t in TEXTS]


def plain_greedy(target, ids, n):
    return SpeculativeDecoder(target, None, 0).generate(ids, max_new_tokens=n).new_tokens


# ------------------------------------------------------------------------------------------------ the pairing

def test_token_keys_read_byte_level_and_metaspace_tokens_as_bytes():
    bl, ms = byte_level_bpe(400), metaspace_bpe(400)
    bl_keys, ms_keys = token_keys(bl), token_keys(ms)
    assert bl_keys[bl.convert_tokens_to_ids("Ġ")] == b" " and bl_keys[bl.convert_tokens_to_ids("Ċ")] == b"\n"
    assert ms_keys[ms.convert_tokens_to_ids("▁")] == b" " and ms_keys[ms.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert bl_keys[bl.eos_token_id] == ("special", "</s>")  # specials match by text, never by bytes
    word = next(t for t in bl.get_vocab() if t.startswith("Ġ") and len(t) > 4 and t[1:].isascii() and t[1:].isalpha())
    assert bl_keys[bl.convert_tokens_to_ids(word)] == b" " + word[1:].encode()
    # the same word in a metaspace vocabulary pairs with it
    x = intersect_vocabularies(bl, ms)
    pairs = dict(zip(x.target_ids.tolist(), x.columns.tolist()))
    if "▁" + word[1:] in ms.get_vocab():
        assert pairs[bl.convert_tokens_to_ids(word)] == ms.convert_tokens_to_ids("▁" + word[1:])
    assert pairs[bl.convert_tokens_to_ids("Ċ")] == ms.convert_tokens_to_ids("<0x0A>")
    assert pairs[bl.eos_token_id] == ms.eos_token_id


def test_intersection_is_one_to_one_and_reads_every_target_id():
    t_tok, d_tok = byte_level_bpe(700), metaspace_bpe(600)
    x = intersect_vocabularies(t_tok, d_tok)
    assert 300 < x.size < 600 and x.target_size == 700 and x.draft_size == len(d_tok)
    assert bool((x.target_ids[1:] > x.target_ids[:-1]).all()) and len(set(x.columns.tolist())) == x.size
    gpt2_bytes = {c: b for b, c in bytes_to_unicode().items()}  # transformers' table of the byte-level alphabet

    def text(tok, i):
        token = tok.convert_ids_to_tokens(i)
        if tok is t_tok:
            return bytes(gpt2_bytes[c] for c in token)
        return bytes([int(token[3:5], 16)]) if token.startswith("<0x") else token.replace("▁", " ").encode()

    assert all(text(t_tok, i) == text(d_tok, j) for i, j in zip(x.target_ids.tolist(), x.columns.tolist()) if i > 3)
    assert x.draft_input.shape == (700,) and int(x.draft_input.max()) < len(d_tok)
    assert bool((x.draft_input[x.target_ids] == x.columns).all())
    # a target token the draft lacks is read as the last piece of the draft's encoding of its text
    outside = [i for i in range(260, 700) if i not in set(x.target_ids.tolist())]  # merged tokens the draft lacks
    assert outside
    for i in outside:
        assert int(x.draft_input[i]) == d_tok(t_tok.decode([i]), add_special_tokens=False)["input_ids"][-1]


def test_target_logits_put_the_shared_columns_at_their_target_ids_and_minus_inf_elsewhere():
    x = intersect_vocabularies(byte_level_bpe(700), metaspace_bpe(600))
    logits = torch.randn(2, 1, x.draft_size, dtype=torch.float64, requires_grad=True)
    row = x.target_logits(logits)
    assert row.shape == (2, 1, 700)
    assert torch.equal(row[..., x.target_ids], logits[..., x.columns])
    outside = torch.ones(700, dtype=torch.bool)
    outside[x.target_ids] = False
    assert bool(torch.isneginf(row[..., outside]).all())
    row[..., x.target_ids].sum().backward()
    shared = torch.zeros_like(logits)
    shared[..., x.columns] = 1.0
    assert torch.equal(logits.grad, shared)  # gradient reaches the shared columns, and only them


def test_a_pruned_draft_with_a_tokenizer_of_another_vocabulary_is_refused_naming_the_fix():
    from decode.compat import IncompatibleModelsError
    from decode.vocab_map import prune_draft_head

    t_tok, d_tok = byte_level_bpe(700), metaspace_bpe(600)
    target = tiny_llama(vocab_size=700)
    pruned = prune_draft_head(tiny_llama(vocab_size=700, seed=2), torch.arange(0, 700, 2))
    with pytest.raises(IncompatibleModelsError, match="vocabulary-pruned.*Drop the draft tokenizer"):
        SpeculativeDecoder(target, pruned, 2, tokenizer=t_tok, draft_tokenizer=d_tok)


def test_tokenizers_given_wrongly_are_named():
    target, draft, tok = tiny_llama(vocab_size=700), tiny_llama(vocab_size=600), byte_level_bpe(700)
    with pytest.raises(ValueError, match="draft_tokenizer= needs tokenizer="):
        SpeculativeDecoder(target, draft, 2, draft_tokenizer=metaspace_bpe(600))
    with pytest.raises(TypeError, match="draft_tokenizer must be a tokenizer object"):
        SpeculativeDecoder(target, draft, 2, tokenizer=tok, draft_tokenizer="path/to/draft")


def test_a_draft_of_the_same_vocabulary_is_not_paired():
    tok = byte_level_bpe(320)
    draft = tiny_llama(vocab_size=700)
    # trained on the same text, a larger BPE of the same scheme keeps the smaller one's ids: one vocabulary
    assert draft_intersection(draft, tok, byte_level_bpe(700)) is None
    assert draft_intersection(draft, tok, metaspace_bpe(600)) is not None


# ------------------------------------------------------------------------------------------------ decoding

@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("direction", ["larger target", "larger draft"])
def test_greedy_output_equals_plain_greedy(bpe_pair, batch, direction):
    target, t_tok, draft, d_tok = bpe_pair
    if direction == "larger draft":  # a 400-id SentencePiece-style target, a 900-id byte-level draft
        t_tok, d_tok = metaspace_bpe(400), byte_level_bpe(900)
        target = tiny_llama(vocab_size=len(t_tok), layers=2, seed=4)
        draft = transplant(target, t_tok, d_tok, seed=5)
    ids = prompts(t_tok)
    with pytest.warns(UserWarning, match="draft's tokenizer differs"):
        dec = SpeculativeDecoder(target, draft, 3, tokenizer=t_tok, draft_tokenizer=d_tok)
    expected = plain_greedy(target, ids, 24)
    got = []
    for start in range(0, len(ids), batch):
        got += dec.generate(ids[start:start + batch], max_new_tokens=24).new_tokens
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    out = dec.generate(ids, max_new_tokens=24)
    assert 0.1 < out.stats.acceptance_rate < 1.0  # the draft is used and differs from the target


def test_greedy_with_stop_ids_equals_plain_greedy(bpe_pair):
    target, t_tok, draft, d_tok = bpe_pair
    ids = prompts(t_tok)
    expected = plain_greedy(target, ids, 24)
    stop = int(expected[0][5])  # a token the first row produces: it ends there
    dec = SpeculativeDecoder(target, draft, 4, tokenizer=t_tok, draft_tokenizer=d_tok)
    out = dec.generate(ids, max_new_tokens=24, eos_token_id=stop)
    for got, full in zip(out.new_tokens, expected):
        full = full.tolist()
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got.tolist() == full[:cut]


def test_a_draft_sharing_almost_no_tokens_still_decodes_exactly(bpe_pair):
    """A word-level draft vocabulary with only the special tokens in common: nothing it proposes but eos can be
    accepted, the output is still the target's."""
    target, t_tok, _, _ = bpe_pair
    d_tok = make_tokenizer([f"zz{i}" for i in range(60)])
    draft = tiny_llama(vocab_size=len(d_tok), layers=1, seed=9)
    dec = SpeculativeDecoder(target, draft, 2, tokenizer=t_tok, draft_tokenizer=d_tok)
    assert dec.intersection.size == 4  # <pad> <s> </s> <unk>
    ids = prompts(t_tok)
    out = dec.generate(ids, max_new_tokens=16)
    assert [g.tolist() for g in out.new_tokens] == [e.tolist() for e in plain_greedy(target, ids, 16)]
    assert out.stats.acceptance_rate < 0.1


# ------------------------------------------------------------------------------------------------ sampling

WORDS_T = ["w0", "w1", "w2", "w3"]          # the target's ids 4-7
WORDS_D = ["x0", "w3", "w1", "x1", "w0"]    # the draft's: three shared words at other ids, two of its own


@pytest.fixture(scope="module")
def small_pair():
    """V = 8 target with word-level tokenizer; a 9-id draft of another vocabulary sharing 3 of its 4 words."""
    from tests.decode.test_lossless import small_vocab_llama

    t_tok, d_tok = make_tokenizer(WORDS_T), make_tokenizer(WORDS_D)
    target = small_vocab_llama(seed=0, layers=2)
    draft = tiny_llama(vocab_size=len(d_tok), seed=7, layers=1)
    with torch.no_grad():
        draft.lm_head.weight.mul_(0.15)
    return target, t_tok, draft, d_tok


@pytest.mark.parametrize("temperature,top_k,top_p,gamma", [(1.0, None, None, 2), (0.7, None, 0.8, 3),
                                                           (1.0, 5, 0.9, 4)])
def test_sampled_output_follows_the_target(small_pair, temperature, top_k, top_p, gamma):
    target, t_tok, draft, d_tok = small_pair
    dec = SpeculativeDecoder(target, draft, gamma, tokenizer=t_tok, draft_tokenizer=d_tok)
    assert dec.intersection.size == 7  # the 4 specials and w0, w1, w3
    expected = [j.double() * N for j in exact_joints(target, temperature, top_k, top_p)]
    g = torch.Generator().manual_seed(4321)
    out = dec.generate([PROMPT] * N, max_new_tokens=gamma + 2, temperature=temperature, top_k=top_k, top_p=top_p,
                       generator=g)
    for i, e in enumerate(expected):
        counts = joint_counts(out, i)
        assert counts[e == 0].sum() == 0
        stat, df = chi_square(counts, e)
        assert stat < critical(df), (i, stat, df)
    assert 0.0 < out.stats.acceptance_rate < 1.0
    # Power: a slightly different target's samples fail the same test.
    own = SpeculativeDecoder(perturbed_copy(target, 0.5, seed=3), None, 0)
    assert not fits(own.generate([PROMPT] * N, max_new_tokens=gamma + 2, temperature=temperature, top_k=top_k,
                                 top_p=top_p, generator=g), expected)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_certify_passes_a_pair_of_two_vocabularies(small_pair, batch_size):
    target, t_tok, draft, d_tok = small_pair
    prefixes = [PROMPT, [1, 6, 4]][:batch_size // 2 + 1]  # batch 1 (one call per draw) certifies one prefix
    cert = certify(target, draft, prefixes, [Setting(1.0), Setting(0.8, top_p=0.9)], samples=1200,
                   num_draft_tokens=2, seed=batch_size, tokenizer=t_tok, draft_tokenizer=d_tok,
                   batch_size=batch_size)
    assert cert["verdict"] == "PASS", cert
