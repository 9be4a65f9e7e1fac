"""Architectures other than Llama/GPT-2: exact greedy equality with Hugging Face's own greedy decoding (sliding
window shorter than the sequence, logit softcapping, ALiBi, ALiBi by slot index, a pair of different
architectures), which ones take the static cache path, and a clear error for models whose state cannot be rolled
back (Mamba, RWKV, xLSTM)."""
import copy
import warnings

import pytest
import torch

from decode import SpeculativeDecoder
from decode.compat import IncompatibleModelsError

V = 96


def _tiny(cfg_cls, seed=0, **kw):
    from transformers import AutoModelForCausalLM

    sharpen = kw.pop("_sharpen", 20.0)
    torch.manual_seed(seed)
    # untied: a tied input embedding sharpened below would dominate the residual (the model repeats its input)
    model = AutoModelForCausalLM.from_config(cfg_cls(vocab_size=V, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                     tie_word_embeddings=False, **kw)).float().eval()
    with torch.no_grad():  # sharpen near-uniform random logits so greedy ties are rare
        model.get_output_embeddings().weight.mul_(sharpen)
    return model


def _llama_kw(**kw):
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, **kw)


def _draft_of(model, noise=0.3, seed=1):
    """A copy with noise on its lm_head: it agrees with ``model`` often but not always (ragged acceptance)."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = draft.get_output_embeddings().weight
        w.add_(noise * w.std() * torch.randn(w.shape, generator=g))
    return draft


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def _no_cache_greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt):]


def _check(target, draft, static_expected, n=24, lengths=(3, 11, 20), draft_is_close=True):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, V, (L,), generator=g).tolist() for L in lengths]
    refs = [_hf_greedy(target, p, n) for p in prompts]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dec = SpeculativeDecoder(target, draft, num_draft_tokens=3)
    notices = [str(w.message) for w in caught if str(w.message).startswith("decode:")]
    assert dec.static_cache["target"] is static_expected
    assert len(notices) == (0 if static_expected else 2) and all("\n" not in m for m in notices)
    for gamma in (1, 3, 8):
        out = dec.generate(prompts, max_new_tokens=n, temperature=0, num_draft_tokens=gamma)
        assert [t.tolist() for t in out.new_tokens] == refs, f"gamma={gamma}"
        if gamma == 3 and draft_is_close:  # rows accept different counts: rollback and holes are exercised
            assert 0.1 < out.stats.acceptance_rate < 0.95
    # a request joining mid-flight
    dec2 = SpeculativeDecoder(target, draft, num_draft_tokens=3, static_cache=False if not static_expected else None)
    first, outs = dec2.add_request(prompts[0], max_new_tokens=n), {}
    for _ in range(2):
        outs.update({o.request_id: o.new_tokens for o in dec2.step()})
    second = dec2.add_request(prompts[2], max_new_tokens=n)
    while dec2.has_unfinished():
        outs.update({o.request_id: o.new_tokens for o in dec2.step()})
    assert list(outs[first]) == refs[0] and list(outs[second]) == refs[2]


def test_mistral_sliding_window_shorter_than_sequence_falls_back_exactly():
    from transformers import MistralConfig

    target = _tiny(MistralConfig, **_llama_kw(sliding_window=8))
    _check(target, _draft_of(target), static_expected=False)


def test_gemma2_softcapping_alternating_sliding_layers():
    from transformers import Gemma2Config

    target = _tiny(Gemma2Config, _sharpen=1.0, **_llama_kw(head_dim=8, sliding_window=8,
                                                           final_logit_softcapping=5.0, attn_logit_softcapping=20.0))
    _check(target, _draft_of(target), static_expected=False)


def test_bloom_alibi_static_path():
    from transformers import BloomConfig

    target = _tiny(BloomConfig, hidden_size=32, n_layer=2, n_head=4)
    _check(target, _draft_of(target), static_expected=True)


def test_mpt_alibi_by_slot_falls_back_exactly():
    """MPT slices its ALiBi bias by key length, so the static cache's masked holes would move every bias: the slot
    probe (decode.cache.slot_probe) sends it to the DynamicCache path, where greedy output is exact."""
    from transformers import MptConfig

    from decode.cache import slot_probe

    target = _tiny(MptConfig, d_model=32, n_layers=2, n_heads=4, max_seq_len=256)
    assert slot_probe(target)[:2] == (False, True)  # relative ALiBi: left padding is fine, holes are not
    assert slot_probe(target.to(torch.bfloat16))[:2] == (False, True)
    target.float()
    _check(target, _draft_of(target), static_expected=False)


def test_slot_probe_passes_models_that_read_positions_and_mask():
    from transformers import BloomConfig, GPT2Config, LlamaConfig

    from decode.cache import slot_probe

    for model in (_tiny(LlamaConfig, **_llama_kw()), _tiny(BloomConfig, hidden_size=32, n_layer=2, n_head=4),
                  _tiny(GPT2Config, n_embd=32, n_layer=2, n_head=4)):
        model.train()  # the probe runs in eval mode and gives the mode back
        assert slot_probe(model)[:2] == (True, True) and model.training
        assert slot_probe(model.eval().to(torch.bfloat16))[:2] == (True, True)


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
def test_chunk_dependent_rope_is_named_and_exact_before_its_switch(rope):
    """Phi-3's longrope and dynamic NTK choose their frequencies from the largest position in each forward: past
    the switch the logits depend on the forward's length (no multi-token verify can match one-token decoding), so
    the engine names it once; before the switch the output is exactly Hugging Face's greedy decoding."""
    from transformers import LlamaConfig, Phi3Config

    if rope == "longrope":
        target = _tiny(Phi3Config, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=40,
                       rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4})
    else:
        target = _tiny(LlamaConfig, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=40,
                       rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    switch = 40
    with pytest.warns(UserWarning, match=f"rope_type '{rope}' picks .* past position {switch} "):
        dec = SpeculativeDecoder(target, _draft_of(target), num_draft_tokens=3)
    prompt = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    n = switch - len(prompt)  # the last token generated sits at position switch - 1
    for gamma in (1, 3, 8):
        out = dec.generate([prompt], max_new_tokens=n, temperature=0, num_draft_tokens=gamma)
        assert out.new_tokens[0].tolist() == _hf_greedy(target, prompt, n), f"gamma={gamma}"


def test_slot_probe_tolerates_bf16_rounding_of_a_deep_model():
    """A re-test found a 32-layer bf16 Llama judged slot-dependent (masked slots between tokens move bf16 attention
    by ~2% of the largest logit at that depth), so it lost the static cache."""
    from transformers import LlamaConfig

    from decode.cache import slot_probe

    for seed in (0, 1):
        torch.manual_seed(seed)
        model = _built(LlamaConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=32,
                                                      num_attention_heads=8, num_key_value_heads=2,
                                                      intermediate_size=512, max_position_embeddings=512))
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(3.0)
        assert slot_probe(model.to(torch.bfloat16)) == (True, True, False), f"seed {seed}"


def test_nan_for_left_padded_rows_runs_one_request_at_a_time_and_says_why():
    """transformers' eager attention in float64 returns NaN for left-padded rows (its own batched generate decodes
    them as garbage): the engine decodes one request at a time, with a warning naming NaN and sdpa, not "numbers
    positions by cache slot" (a re-test's finding)."""
    from transformers import LlamaConfig

    target = _built(LlamaConfig(**_llama_kw(vocab_size=V)), attn_implementation="eager").double()
    with pytest.warns(UserWarning, match=r"returns NaN for left-padded rows in torch.float64 .*sdpa"):
        dec = SpeculativeDecoder(target, None, num_draft_tokens=0)
    prompts = [[5, 6, 7], list(range(10, 21))]
    out = dec.generate(prompts, max_new_tokens=6)
    assert [t.tolist() for t in out.new_tokens] == [_no_cache_greedy(target, p, 6) for p in prompts]


def _built(config, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, **kw).eval()


def test_different_architectures_share_a_vocabulary():
    from transformers import GPTNeoXConfig, LlamaConfig

    target = _tiny(LlamaConfig, **_llama_kw())
    draft = _tiny(GPTNeoXConfig, seed=3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256)
    _check(target, draft, static_expected=True, draft_is_close=False)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_recurrent_model_is_rejected_with_a_clear_error(role):
    from transformers import LlamaConfig, MambaConfig

    mamba = _tiny(MambaConfig, hidden_size=32, num_hidden_layers=2, state_size=4)
    llama = _tiny(LlamaConfig, **_llama_kw())
    target, draft = (mamba, llama) if role == "target" else (llama, mamba)
    with pytest.raises(IncompatibleModelsError, match=f"the {role} \\(MambaForCausalLM\\).*cannot roll back"):
        SpeculativeDecoder(target, draft, num_draft_tokens=3)


@pytest.mark.parametrize("kind", ["rwkv", "xlstm", "openai-gpt"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_model_without_a_per_token_kv_cache_is_rejected(kind, role):
    """RWKV and xLSTM keep a recurrent state in a cache class of their own, OpenAI GPT keeps no cache: before the
    check, RWKV decoded garbage silently (its forward ignored the KV cache), xLSTM raised an AttributeError and OpenAI
    GPT a shape error inside their forwards."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    size = dict(n_embd=64, n_layer=2, n_head=4) if kind == "openai-gpt" else dict(hidden_size=64, num_hidden_layers=2)
    other = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=V, **size)).eval()
    llama = _tiny(LlamaConfig, **_llama_kw())
    target, draft = (other, llama) if role == "target" else (llama, other)
    reason = "takes no key/value cache" if kind == "openai-gpt" else "keeps its state in a cache of its own"
    with pytest.raises(IncompatibleModelsError, match=f"the {role} \\({type(other).__name__}\\) {reason}"):
        SpeculativeDecoder(target, draft, num_draft_tokens=3)


def test_a_subclass_with_a_generic_forward_signature_is_accepted():
    """forward(*args, **kwargs) hides the cache argument from the signature: a re-test found such a Llama subclass
    refused as 'takes no key/value cache'. A one-forward probe checks that it fills the cache it is given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class Wrapped(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    def wrap(model):
        out = Wrapped(model.config).eval()
        out.load_state_dict(model.state_dict())
        return out

    plain = _tiny(LlamaConfig, **_llama_kw())
    # (the static path reads the cache argument's name from the signature: these take the dynamic path, a notice each)
    _check(wrap(plain), wrap(_draft_of(plain)), static_expected=False)


def test_decoder_that_numbers_positions_by_slot_runs_one_request_at_a_time():
    """BART's decoder as a causal LM takes no position ids: left padding in a shared batch shifted its positions
    (padded rows decoded wrongly, plain decoding too). The padding probe (decode.cache.slot_probe) finds it and the
    engine admits one request at a time, so every row equals its own greedy decoding."""
    from transformers import BartConfig

    target = _tiny(BartConfig, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256)
    with pytest.warns(UserWarning, match=r"the target \(BartForCausalLM\) numbers positions by cache slot"):
        dec = SpeculativeDecoder(target, _draft_of(target), num_draft_tokens=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 11, 8)]
    refs = [_no_cache_greedy(target, p, 12) for p in prompts]  # (HF's generate adds BART's forced eos)
    for gamma in (0, 3):
        out = dec.generate(prompts, max_new_tokens=12, num_draft_tokens=gamma)
        assert [t.tolist() for t in out.new_tokens] == refs, f"gamma={gamma}"
    first = dec.add_request(prompts[0], max_new_tokens=12)
    second = dec.add_request(prompts[1], max_new_tokens=12)
    dec.step()
    assert len(dec._batch.rows) == 1 and len(dec._waiting) == 1
    outs = {}
    while dec.has_unfinished():
        outs.update({o.request_id: o.new_tokens for o in dec.step()})
    assert [outs[first], outs[second]] == refs[:2]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_masked_lm_is_refused_by_the_causal_probe(role, tmp_path):
    """BERT loaded through AutoModelForCausalLM without is_decoder=True attends to later tokens; it decoded and
    trained with only transformers' own warning. With is_decoder=True (a BERT-style decoder) it is causal and passes."""
    from transformers import AutoModelForCausalLM, BertConfig, LlamaConfig

    from decode.compat import NotCausalError, check_causal
    from decode.loading import load_causal_lm

    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    bert = AutoModelForCausalLM.from_config(BertConfig(**kw)).eval()
    llama = _tiny(LlamaConfig, **_llama_kw())
    target, draft = (bert, llama) if role == "target" else (llama, bert)
    with pytest.raises(NotCausalError, match=f"the {role} \\(BertLMHeadModel\\) is not a causal language model"):
        SpeculativeDecoder(target, draft, num_draft_tokens=3)
    bert.save_pretrained(str(tmp_path / "bert"))
    with pytest.raises(NotCausalError, match="the draft \\(BertLMHeadModel\\) is not a causal"):
        load_causal_lm(str(tmp_path / "bert"), "draft")
    check_causal(AutoModelForCausalLM.from_config(BertConfig(is_decoder=True, **kw)), "draft")  # passes
    check_causal(llama, "target")


def test_moe_with_router_logits_in_its_config_decodes_a_padded_batch():
    """Mixtral with output_router_logits=True in its config computed the load-balancing loss in every forward, which
    failed on a padded batch's mask (a shape error; Hugging Face's own batched generate too): the decoder now asks
    for no router logits, and greedy output is exact."""
    from transformers import MixtralConfig

    target = _tiny(MixtralConfig, **_llama_kw(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True))
    _check(target, _draft_of(target), static_expected=True)


def test_draft_context_read_from_mpt_max_seq_len():
    """MPT states its context as ``max_seq_len``: a draft of 48 positions under a target of 256 raised a shape error
    in MPT's ALiBi once a prompt and its drafts passed 48; now the draft stops drafting there, output exact."""
    from transformers import MptConfig

    target = _tiny(MptConfig, d_model=32, n_layers=2, n_heads=4, max_seq_len=256)
    draft = _tiny(MptConfig, seed=1, d_model=32, n_layers=2, n_heads=4, max_seq_len=48)
    dec = SpeculativeDecoder(target, draft, num_draft_tokens=4)
    assert (dec.context_length, dec.draft_context_length) == (256, 48)
    prompt = list(range(3, 43))
    assert dec.generate([prompt], max_new_tokens=30).new_tokens[0].tolist() == _hf_greedy(target, prompt, 30)
