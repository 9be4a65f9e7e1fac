"""Vocabulary/tokenizer compatibility: padding rows never sampled, a smaller draft stays lossless, and
disagreeing tokenizers raise errors naming the difference."""
import pytest
import torch

from decode import SpeculativeDecoder
from decode.compat import IncompatibleModelsError, check_compatibility, check_tokenizers, vocab_fingerprint
from decode.vocab_map import prune_draft_head
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


def test_a_draft_tokenizer_with_tokens_the_target_cannot_score_is_accepted():
    """Found by a new user: special tokens added to the draft's tokenizer (not the target's) were refused with
    "the target's lm_head has 96 rows but the tokenizer has 98 tokens ... use its own tokenizer", though the target's
    own tokenizer was in use and the extra ids have no target probability."""
    tok, dtok = make_tokenizer(), make_tokenizer()
    dtok.add_special_tokens({"additional_special_tokens": ["<|a|>", "<|b|>"]})
    assert len(dtok) == VOCAB + 2
    target = tiny_llama(seed=0)
    for draft in (perturbed_copy(target, 0.5), tiny_llama(vocab_size=VOCAB + 2, seed=1)):  # a head that has them too
        assert check_compatibility(target, draft, tok, dtok) == VOCAB
        dec = SpeculativeDecoder(target, draft, 3, tokenizer=tok, draft_tokenizer=dtok)
        out = dec.generate([[1, 5, 9]], max_new_tokens=12, temperature=0.0)
        ids = torch.tensor([[1, 5, 9]])
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              min_new_tokens=12, pad_token_id=0, eos_token_id=None)[0, 3:]
        assert torch.equal(out.new_tokens[0], ref)
    # a target whose head has rows for them: the shared vocabulary grows to include them
    assert check_compatibility(tiny_llama(vocab_size=VOCAB + 32), tiny_llama(seed=1), tok, dtok) == VOCAB + 2


def test_different_special_ids():
    a = make_tokenizer()
    b = make_tokenizer(eos_token="w0")
    with pytest.raises(IncompatibleModelsError, match=r"both 96 ids\) disagree on the eos token id \(the target's "
                       r"tokenizer 2, the draft's tokenizer 4\): a draft of another vocabulary drafts through"):
        check_compatibility(tiny_llama(), tiny_llama(), a, b)


def test_shared_id_decoding_to_different_text():
    a = make_tokenizer()
    words = [f"w{i}" for i in range(VOCAB - 4)]
    words[10] = "other"
    b = make_tokenizer(words)
    with pytest.raises(IncompatibleModelsError, match="the target's tokenizer vs the draft's tokenizer: id 14 'w10' "
                       "vs 'other'"):
        check_tokenizers(a, b)
    # to the decoder such a draft has a vocabulary of its own: it drafts through the tokens both share
    assert SpeculativeDecoder(tiny_llama(), tiny_llama(), 2, tokenizer=a, draft_tokenizer=b).intersection.size == VOCAB - 1


def test_a_draft_tokenizer_of_another_vocabulary_is_named_by_its_size_before_its_special_tokens():
    """Found by a new user: a draft with its own 8,192-id tokenizer against a 49,152-id target was refused with
    "tokenizers disagree on the unk token id", which hid the real difference (another vocabulary)."""
    tok, small = make_tokenizer(), make_tokenizer([f"x{i}" for i in range(40)], unk_token="x0")
    assert small.unk_token_id != tok.unk_token_id and len(small) == 44
    with pytest.raises(IncompatibleModelsError) as err:
        check_tokenizers(tok, small)
    message = str(err.value)
    assert message.startswith("the draft's tokenizer has 44 ids and the target's tokenizer 96, and they map 40 "
                              "shared ids to different tokens (the target's tokenizer vs the draft's tokenizer: id 4 "
                              "'w0' vs 'x0'") and "drafts through the tokens both share" in message
    assert "unk" not in message
    # A draft whose model head is pruned to fewer ids keeps the target's tokenizer: it decodes.
    target = tiny_llama(seed=0)
    draft = prune_draft_head(tiny_llama(seed=1, layers=1), torch.arange(0, 40), vocab_fingerprint(tok))
    dec = SpeculativeDecoder(target, draft, 2, tokenizer=tok, draft_tokenizer=make_tokenizer())
    out = dec.generate([[5, 6, 7]], max_new_tokens=6, eos_token_id=None)
    plain = SpeculativeDecoder(target, None, 0).generate([[5, 6, 7]], max_new_tokens=6, eos_token_id=None)
    assert out.new_tokens[0].tolist() == plain.new_tokens[0].tolist()


def test_draft_lm_head_larger_than_target_without_tokenizer():
    with pytest.raises(IncompatibleModelsError, match="pass the tokenizer"):
        check_compatibility(tiny_llama(vocab_size=64), tiny_llama(vocab_size=96))


def test_same_tokenizer_objects_pass():
    tok = make_tokenizer()
    target = tiny_llama()
    assert check_compatibility(target, perturbed_copy(target), tok, make_tokenizer()) == VOCAB


# ---------------------------------------------------------------- a draft smaller than its target (#8 point 7)
def gpt2(vocab_size, positions, seed, layers=1):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=layers, n_head=4, n_positions=positions,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = GPT2LMHeadModel(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


@torch.no_grad()
def greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_with_a_smaller_input_vocabulary_runs_losslessly(temperature):
    """Target vocab 64, draft vocab 32 (embedding and lm_head), no tokenizer: ids >= 32 reach the draft's input."""
    target, draft = tiny_llama(vocab_size=64, seed=0), tiny_llama(vocab_size=32, seed=1, layers=1)
    dec = SpeculativeDecoder(target, draft, 3)
    prompts = [[1, 40, 5, 63], [7, 3]]
    out = dec.generate(prompts, max_new_tokens=30, temperature=temperature, generator=torch.Generator().manual_seed(0))
    new = [t.tolist() for t in out.new_tokens]
    assert max(max(n) for n in new) >= 32  # the target produced ids the draft cannot read, and decoding went on
    if temperature == 0:
        assert new == [greedy(target, p, 30) for p in prompts]
    assert out.stats.num_drafted > 0


@pytest.mark.parametrize("prompt_len", [5, 20])
def test_draft_with_a_shorter_context_stops_drafting_past_it(prompt_len):
    """GPT-2 draft with 16 learned positions, target with 256: rows past 16 tokens decode plainly, exactly."""
    target, draft = gpt2(VOCAB, 256, seed=0, layers=2), gpt2(VOCAB, 16, seed=0, layers=1)
    prompts = [list(range(3, 3 + prompt_len)), [4, 9]]
    out = SpeculativeDecoder(target, draft, 4).generate(prompts, max_new_tokens=30)
    assert [t.tolist() for t in out.new_tokens] == [greedy(target, p, 30) for p in prompts]
    assert 0 < out.stats.num_drafted < 2 * 30


def test_target_with_a_smaller_input_embedding_is_an_error_naming_both_sizes():
    target = tiny_llama(vocab_size=VOCAB)
    target.set_input_embeddings(torch.nn.Embedding(64, 32).to(torch.float64))
    with pytest.raises(IncompatibleModelsError, match=f"64 rows.*{VOCAB} ids"):
        SpeculativeDecoder(target, tiny_llama(seed=1), 2)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(tokenizer="/some/tokenizer/folder"), r"tokenizer must be a tokenizer object .*load_tokenizer"),
    (dict(tokenizer=[0] * 50), "tokenizer must be a tokenizer object"),
    (dict(tokenizer=100), "tokenizer must be a tokenizer object"),
    (dict(draft_tokenizer="tok"), "draft_tokenizer must be a tokenizer object"),
])
def test_a_tokenizer_of_the_wrong_kind_is_refused_by_name(kwargs, needle):
    """A path string has a len() too: taken as a tokenizer it made its length the vocabulary and the decoder sampled
    from the first few ids only."""
    with pytest.raises(TypeError, match=needle):
        SpeculativeDecoder(tiny_llama(seed=0), tiny_llama(seed=1), 2, **kwargs)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_path_where_a_model_belongs_is_refused_by_name(role):
    models = {"target": tiny_llama(seed=0), "draft": tiny_llama(seed=1), role: "/models/some-model"}
    with pytest.raises(TypeError, match=rf"^{role} must be a loaded Hugging Face causal LM .*load_causal_lm"):
        SpeculativeDecoder(models["target"], models["draft"], 2)


def test_a_streamer_without_put_and_end_is_refused():
    dec = SpeculativeDecoder(tiny_llama(seed=0), tiny_llama(seed=1), 2)
    with pytest.raises(ValueError, match=r"streamer must have put\(LongTensor\) and end\(\)"):
        dec.generate([5, 6], max_new_tokens=4, streamer=5)
    assert len(dec.generate([5, 6], max_new_tokens=4).new_tokens[0]) == 4  # still usable
