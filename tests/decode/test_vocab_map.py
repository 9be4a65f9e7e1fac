"""Vocabulary-pruned drafts: id selection, the N-row head, save/reload, the pair check, and a lossless decoder
(exact greedy equality, chi-square against the target's distribution with a map that omits likely ids)."""
import pytest
import torch

from decode import SpeculativeDecoder
from decode.compat import (IncompatibleModelsError, check_compatibility, check_tokenizers, tokenizer_fingerprint,
                           vocab_fingerprint)
from decode.loading import load_causal_lm
from decode.vocab_map import (HASH_FIELD, MAP_KEY, SIZE_FIELD, draft_vocab_map, expand_draft_head, prune_draft_head,
                              scatter_to_vocab, select_kept_ids)
from tests.conftest import VOCAB, make_tokenizer, perturbed_copy, tiny_llama
from tests.decode.test_lossless import (N, PROMPT, V, chi_square, critical, exact_joints, joint_counts,
                                        reference_joints, small_vocab_llama)


# ------------------------------------------------------------------------------------------------ selection

def test_select_kept_ids_takes_the_heaviest_plus_specials_sorted():
    mass = torch.tensor([0.0, 5.0, 1.0, 9.0, 3.0, 3.0, 0.5, 7.0])
    assert select_kept_ids(mass, 3).tolist() == [1, 3, 7]
    # specials first, whatever their mass; the rest by mass; ties (ids 4 and 5) go to the lower id
    assert select_kept_ids(mass, 4, special_ids=[0, 2, None]).tolist() == [0, 2, 3, 7]
    assert select_kept_ids(mass, 6, special_ids=[0]).tolist() == [0, 1, 3, 4, 5, 7]
    assert select_kept_ids(mass, 5, special_ids=[0]).tolist() == [0, 1, 3, 4, 7]
    assert select_kept_ids(mass, 8).tolist() == list(range(8))


@pytest.mark.parametrize("keep,specials,match", [(0, [], "keep=0"), (9, [], "keep=9"), (1, [0, 2], r"\[2, 8\]"),
                                                 (2, [8], "special ids"), (True, [], "keep=True")])
def test_select_kept_ids_errors(keep, specials, match):
    with pytest.raises(ValueError, match=match):
        select_kept_ids(torch.ones(8), keep, specials)


# ------------------------------------------------------------------------------------------------ the model

@pytest.mark.parametrize("tie", [True, False])
def test_pruned_head_scores_the_kept_ids_with_the_drafts_own_rows(tie):
    draft = tiny_llama(seed=1, layers=1, tie_word_embeddings=tie)
    ids = torch.tensor([0, 2, 5, 17, 40, 95])
    x = torch.tensor([[1, 7, 60, 3]])
    full = draft(x).logits
    embed = draft.get_input_embeddings().weight.detach().clone()
    prune_draft_head(draft, ids, tokenizer_hash="abc")
    torch.testing.assert_close(draft(x).logits, full[..., ids], rtol=1e-12, atol=1e-12)  # matmul blocking differs
    assert draft.lm_head.weight.shape[0] == 6 and draft.get_input_embeddings().weight.shape[0] == VOCAB
    assert torch.equal(draft.get_input_embeddings().weight, embed)  # the input side keeps every id
    assert draft.lm_head.weight.data_ptr() != draft.get_input_embeddings().weight.data_ptr()
    assert not draft.config.tie_word_embeddings
    assert getattr(draft.config, SIZE_FIELD) == 6 and getattr(draft.config, HASH_FIELD) == "abc"
    assert torch.equal(draft_vocab_map(draft), ids)
    with pytest.raises(ValueError, match="already vocabulary-pruned"):
        prune_draft_head(draft, ids)


def test_prune_refuses_unsorted_or_out_of_range_ids():
    with pytest.raises(ValueError, match="sorted"):
        prune_draft_head(tiny_llama(layers=1), torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="outside"):
        prune_draft_head(tiny_llama(layers=1), torch.tensor([1, VOCAB]))


def test_scatter_to_vocab_places_logits_at_the_map():
    out = scatter_to_vocab(torch.tensor([[1.0, 2.0]]), torch.tensor([1, 3]), 5)
    assert out.tolist() == [[float("-inf"), 1.0, float("-inf"), 2.0, float("-inf")]]


def test_saved_pruned_draft_reloads_with_head_and_map(tmp_path):
    from transformers import AutoModelForCausalLM

    draft = prune_draft_head(tiny_llama(seed=2, layers=1, tie_word_embeddings=True), torch.arange(0, VOCAB, 3), "h")
    draft.save_pretrained(tmp_path / "d")
    back = load_causal_lm(str(tmp_path / "d"), "draft", dtype=None)
    x = torch.tensor([[1, 4, 9, 70]])
    assert torch.equal(back(x).logits, draft(x).logits)
    assert torch.equal(draft_vocab_map(back), torch.arange(0, VOCAB, 3))
    assert getattr(back.config, HASH_FIELD) == "h" and not back.config.tie_word_embeddings
    # A second save/reload round trip keeps it (the export of an exported draft).
    back.save_pretrained(tmp_path / "e")
    again = load_causal_lm(str(tmp_path / "e"), "draft", dtype=None)
    assert torch.equal(again(x).logits, draft(x).logits) and torch.equal(draft_vocab_map(again), draft_vocab_map(draft))
    # Plain from_pretrained cannot silently give a V-row random head: the size mismatch is an error.
    with pytest.raises(RuntimeError):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "d"))


@pytest.mark.parametrize("tie", [True, False])
def test_expanded_head_gives_the_kept_ids_their_logits_and_the_others_zero(tie, tmp_path):
    """For vLLM/SGLang, which build a config.vocab_size-row head and read no map: row map[i] is the pruned head's
    row i, the rest zero; the result saves and loads with plain from_pretrained as an ordinary draft."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([0, 2, 5, 17, 40, 95])
    draft = prune_draft_head(tiny_llama(seed=3, layers=1, tie_word_embeddings=tie), ids, tokenizer_hash="abc")
    x = torch.tensor([[1, 7, 60, 3, 5]])
    pruned = draft(x).logits  # (1, 5, N)
    embed = draft.get_input_embeddings().weight.detach().clone()
    assert expand_draft_head(draft, VOCAB) is draft
    full = draft(x).logits  # (1, 5, V)
    assert full.shape[-1] == VOCAB and draft.lm_head.weight.shape == (VOCAB, 32)
    torch.testing.assert_close(full[..., ids], pruned, rtol=1e-12, atol=1e-12)  # matmul blocking differs
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[ids] = False
    assert torch.equal(full[..., others], torch.zeros_like(full[..., others]))
    positive = pruned.max(-1).values > 0  # greedy drafting is unchanged where the best kept logit is positive
    assert positive.any()
    assert torch.equal(full.argmax(-1)[positive], ids[pruned.argmax(-1)][positive])
    assert draft_vocab_map(draft) is None and MAP_KEY not in dict(draft.named_buffers())
    assert not hasattr(draft.config, SIZE_FIELD) and not hasattr(draft.config, HASH_FIELD)
    assert not draft.config.tie_word_embeddings and torch.equal(draft.get_input_embeddings().weight, embed)
    draft.save_pretrained(tmp_path / "d")
    config = (tmp_path / "d" / "config.json").read_text()
    assert SIZE_FIELD not in config and HASH_FIELD not in config
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "d"), dtype=torch.float64)
    assert torch.equal(back(x).logits, full)


def test_expand_refuses_a_full_head_and_a_map_past_the_vocabulary():
    with pytest.raises(ValueError, match="already covers the full vocabulary"):
        expand_draft_head(tiny_llama(layers=1), VOCAB)
    draft = prune_draft_head(tiny_llama(layers=1), torch.tensor([1, 50, 90]))
    with pytest.raises(ValueError, match="outside"):
        expand_draft_head(draft, 60)
    assert draft_vocab_map(draft) is not None and draft.lm_head.weight.shape[0] == 3  # unchanged on refusal


def test_a_pruned_gpt_neox_draft_reloads_though_its_head_is_stored_as_embed_out(tmp_path):
    """Found by a new user's trial: transformers saves GPT-NeoX's lm_head module as `embed_out.weight`, so a pruned
    NeoX draft trained fine but every export/load failed with 'its safetensors lack ['lm_head.weight']'."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    torch.manual_seed(0)
    neox = AutoModelForCausalLM.from_config(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        tie_word_embeddings=False)).float().eval()
    draft = prune_draft_head(neox, torch.arange(0, VOCAB, 3), "h")
    draft.save_pretrained(tmp_path / "d")
    back = load_causal_lm(str(tmp_path / "d"), "draft", dtype=None)
    x = torch.tensor([[1, 4, 9, 70]])
    assert torch.equal(back(x).logits, draft(x).logits)
    assert torch.equal(draft_vocab_map(back), torch.arange(0, VOCAB, 3))


def test_reload_refuses_a_folder_without_its_map(tmp_path):
    from safetensors.torch import load_file, save_file

    draft = prune_draft_head(tiny_llama(seed=2, layers=1), torch.arange(10))
    draft.save_pretrained(tmp_path / "d")
    weights = load_file(str(tmp_path / "d" / "model.safetensors"))
    del weights[MAP_KEY]
    save_file(weights, str(tmp_path / "d" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(FileNotFoundError, match="could not load the draft") as err:
        load_causal_lm(str(tmp_path / "d"), "draft")
    assert "vocabulary-pruned draft" in str(err.value)  # the folder's own problem is in the message


def _saved_pruned(tmp_path):
    from safetensors.torch import load_file

    draft = prune_draft_head(tiny_llama(seed=2, layers=1), torch.arange(10), "h")
    draft.save_pretrained(tmp_path / "d")
    return tmp_path / "d", load_file(str(tmp_path / "d" / "model.safetensors"))


def test_reload_refuses_a_map_that_is_not_integer(tmp_path):
    """A float map (an edited or converted checkpoint) is refused, not truncated to ids by ``.long()``."""
    from safetensors.torch import save_file

    folder, weights = _saved_pruned(tmp_path)
    weights[MAP_KEY] = weights[MAP_KEY].float() + 0.7  # 0.7, 1.7, ...: .long() would silently give 0, 1, ...
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(FileNotFoundError, match=f"{MAP_KEY}.* is torch.float32; it must hold integer"):
        load_causal_lm(str(folder), "draft")


@pytest.mark.parametrize("size,match", [
    (None, f"hold a vocabulary map '{MAP_KEY}' of shape \\(10,\\) but config.json has no {SIZE_FIELD}; "
           f"add \"{SIZE_FIELD}\": 10"),
    ("ten", f"{SIZE_FIELD}='ten'; it must be a positive integer"),
    (0, f"{SIZE_FIELD}=0; it must be a positive integer"),
])
def test_reload_names_a_missing_or_bad_size_field(tmp_path, size, match):
    """An edited config.json: a clear error naming ``draft_vocab_map_size``, not transformers' size-mismatch
    RuntimeError (missing field) or a bare int() error (a string)."""
    import json

    folder, _ = _saved_pruned(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop(SIZE_FIELD) if size is None else cfg.update({SIZE_FIELD: size})
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match=match):
        load_causal_lm(str(folder), "draft")


def test_reload_names_a_head_of_another_width_or_a_tied_config(tmp_path):
    """An edited pruned draft from someone else: a head whose rows are narrower than the hidden size, or a
    config.json that says the N-row head is tied to the V-row embedding, is refused naming the problem (these
    loaded and failed mid-decode with a matmul RuntimeError, or in transformers with a meta-tensor traceback)."""
    import json

    from safetensors.torch import save_file

    folder, weights = _saved_pruned(tmp_path)
    head = next(k for k in weights if k.endswith("lm_head.weight"))
    save_file({**weights, head: weights[head][:, :16].contiguous()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(FileNotFoundError, match=r"the head \(10, 16\) \(expected \(10, 32\)"):
        load_causal_lm(str(folder), "draft")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    load_causal_lm(str(folder), "draft")  # the unedited folder loads
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(FileNotFoundError, match="tie_word_embeddings=true"):
        load_causal_lm(str(folder), "draft")


# ------------------------------------------------------------------------------------------------ the pair check

def test_pair_check_refuses_other_tokenizer_and_bad_maps():
    tok = make_tokenizer()
    target = tiny_llama(seed=0)
    draft = prune_draft_head(tiny_llama(seed=1, layers=1), torch.arange(0, 40), vocab_fingerprint(tok))
    assert check_compatibility(target, draft, tok, tok) == VOCAB
    other = make_tokenizer([f"x{i}" for i in range(VOCAB - 4)])
    with pytest.raises(IncompatibleModelsError, match="tokenizer .* but the target's tokenizer is"):
        check_compatibility(target, draft, other)
    with torch.no_grad():
        getattr(draft, MAP_KEY)[3] = 1  # not sorted/unique any more
    with pytest.raises(IncompatibleModelsError, match="sorted.*target's vocabulary has 96"):
        SpeculativeDecoder(target, draft, tokenizer=tok)
    # A map pruned for a larger vocabulary: ids beyond the target's.
    big = prune_draft_head(tiny_llama(vocab_size=200, seed=1, layers=1), torch.tensor([1, 2, 150]))
    with pytest.raises(IncompatibleModelsError, match=r"outside \[0, 96\).*96 ids"):
        check_compatibility(target, big, tok)


def test_pair_check_takes_a_pad_less_tokenizer_and_its_eos_as_pad_copy_as_one():
    """Training loads a tokenizer without pad with eos as pad and saves it beside the draft (and hashes it into the
    map); the decoder loads the target's own, without pad. Both the tokenizer pair (pad 2 vs None) and the map must
    pass, or no draft trained on such a target could be decoded."""
    no_pad, eos_pad = make_tokenizer(pad_token=None), make_tokenizer(pad_token="</s>")
    assert no_pad.pad_token_id is None and eos_pad.pad_token_id == eos_pad.eos_token_id
    target = tiny_llama(seed=0)
    for trained, decoding in ((eos_pad, no_pad), (no_pad, eos_pad)):
        check_tokenizers(decoding, trained)
        draft = prune_draft_head(tiny_llama(seed=1, layers=1), torch.arange(0, 40), vocab_fingerprint(trained))
        assert check_compatibility(target, draft, decoding, trained) == VOCAB
    # A pad of its own on one side is no disagreement either: pad only fills masked batch rows.
    unk_pad = make_tokenizer(pad_token="<unk>")
    check_tokenizers(no_pad, unk_pad)
    check_tokenizers(eos_pad, unk_pad)


def test_a_map_records_the_vocabulary_so_a_chat_template_or_another_pad_token_is_the_same_tokenizer():
    """The map recorded a hash of the vocabulary, special tokens and chat template: adding a chat template (for
    /v1/chat/completions) or another pad token refused the pruned draft, and the advice (prune again) was refused
    on an already-pruned draft. A different vocabulary is still refused."""
    tok = make_tokenizer()
    target = tiny_llama(seed=0)
    draft = prune_draft_head(tiny_llama(seed=1, layers=1), torch.arange(0, 40), vocab_fingerprint(tok))
    chat, unk_pad = make_tokenizer(), make_tokenizer(pad_token="<unk>")
    chat.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for other in (chat, unk_pad):
        assert check_compatibility(target, draft, other) == VOCAB
    with pytest.raises(IncompatibleModelsError, match=r"another vocabulary.*Prune the full-vocabulary draft"):
        check_compatibility(target, draft, make_tokenizer([f"x{i}" for i in range(VOCAB - 4)]))
    with pytest.raises(IncompatibleModelsError, match="vocabulary-pruned draft .* Give it as the draft"):
        check_compatibility(draft, target, tok)  # it said to resize the target's embeddings


def test_a_map_that_records_a_hash_of_another_form_is_refused_naming_the_fix():
    """Only a vocabulary hash ("v:" + 16 hex digits) can be checked; a map recorded with the whole tokenizer's hash
    (special tokens and chat template too) is refused even with its own tokenizer, and the message says to prune
    the draft again."""
    tok = make_tokenizer()
    target = tiny_llama(seed=0)
    other_form = prune_draft_head(tiny_llama(seed=1, layers=1), torch.arange(0, 40), tokenizer_fingerprint(tok))
    with pytest.raises(IncompatibleModelsError, match=r"not a vocabulary hash.*Prune the full-vocabulary draft "
                                                      r"again with this tokenizer \(draft.vocab.keep=N\)"):
        check_compatibility(target, other_form, tok)
    assert check_compatibility(target, other_form) == VOCAB  # without a tokenizer there is nothing to compare


# ------------------------------------------------------------------------------------------------ decoding

@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_equality_with_a_pruned_draft(gamma):
    target = tiny_llama(seed=0)
    prompts = [[1, 5, 9, 33], [1, 60, 2, 7, 8, 11], [1, 90]]
    plain = SpeculativeDecoder(target, None, 0).generate(prompts, max_new_tokens=24)
    # The map keeps every other id: the target's greedy choice is often outside it (rejected drafts).
    draft = prune_draft_head(perturbed_copy(target, 0.3, seed=5), torch.arange(0, VOCAB, 2))
    out = SpeculativeDecoder(target, draft, gamma).generate(prompts, max_new_tokens=24)
    for a, b in zip(out.sequences, plain.sequences):
        assert torch.equal(a, b)
    omitted = torch.cat(plain.new_tokens) % 2 == 1
    assert omitted.any() and (~omitted).any()  # both kinds of ids were produced
    assert 0.0 < out.stats.acceptance_rate < 1.0


@pytest.mark.parametrize("settings,gamma", [(dict(temperature=1.0), 3), (dict(temperature=1.0), 1),
                                            (dict(temperature=0.7, top_k=5), 2), (dict(presence_penalty=1.0), 2)])
def test_pruned_draft_output_follows_target(settings, gamma):
    """The map omits the target's two likeliest 2nd tokens (the first speculative step's first position; the 1st
    token comes from the target's prefill): those ids come only from the residual."""
    target = small_vocab_llama(seed=0, layers=2)
    if "presence_penalty" in settings:
        expected = reference_joints(target, presence_penalty=settings["presence_penalty"])
    else:
        expected = exact_joints(target, settings["temperature"], settings.get("top_k"), None)
    expected = [j.double() * N for j in expected]
    omit = expected[0].sum(0).topk(2).indices  # p(x2), x1 summed out
    keep = torch.tensor([i for i in range(V) if i not in omit.tolist()])
    draft = prune_draft_head(perturbed_copy(target, 1.0, seed=3), keep)
    out = SpeculativeDecoder(target, draft, gamma).generate(
        [PROMPT] * N, max_new_tokens=4, generator=torch.Generator().manual_seed(4321),
        **{"temperature": 1.0, **settings})
    for i, e in enumerate(expected):
        counts = joint_counts(out, i)
        assert counts[e == 0].sum() == 0
        stat, df = chi_square(counts, e)
        assert stat < critical(df), (i, stat, df)
    counts = joint_counts(out, 1)  # rows: x2
    assert counts[omit].sum() > 0.05 * N  # the omitted ids were really produced, through the residual
    assert 0.0 < out.stats.acceptance_rate < 1.0

    # Power: the omitted ids carry over 5% of the expected pairs, so an engine that let them through only via the
    # draft (never the residual) would fail the chi-square test above.
    assert expected[1][omit].sum() > 0.05 * N


def test_map_is_applied_a_pruned_copy_of_the_target_accepts_every_greedy_draft():
    """Losslessness holds for any q, so it cannot show that the map is read: acceptance does. A copy of the target
    pruned to ids that include every greedy choice agrees with it everywhere; reading the N logits as ids
    0..N-1 (no map) would reject most drafts."""
    target = tiny_llama(seed=0)
    prompts = [[1, 5, 9, 33], [1, 60, 2, 7, 8, 11]]
    plain = SpeculativeDecoder(target, None, 0).generate(prompts, max_new_tokens=20)
    used = set(torch.cat(plain.new_tokens).tolist())
    keep = sorted(used | set(range(VOCAB - 1, VOCAB - 1 - 30, -1)))
    assert keep[0] > 0 or len(keep) < VOCAB  # a real subset
    draft = prune_draft_head(perturbed_copy(target, 0.0), torch.tensor(keep))
    out = SpeculativeDecoder(target, draft, 4).generate(prompts, max_new_tokens=20)
    assert out.stats.acceptance_rate == 1.0
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain.sequences))
