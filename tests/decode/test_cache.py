"""KV-cache rollback: after every step each row's cache holds exactly its committed tokens (except the pending
last one), and continuing from it gives the same logits as a fresh prefill of the committed sequence."""
import copy

import pytest
import torch

from decode import SpeculativeDecoder
from decode import cache as kv
from tests.conftest import perturbed_copy, tiny_gpt2, tiny_llama

SAMPLING = {"temperature": 1.0, "top_k": None, "top_p": None}


def row_slots(mask, b):
    return int(mask[b].sum())


@torch.no_grad()
def next_logits_from_cache(model, cache, mask, pending, pending_mask, b):
    """Feed row b's pending tokens on a copy of the cache; return the logits after the last one."""
    cache, mask = copy.deepcopy(cache), mask.clone()
    logits, _ = kv.forward(model, cache, mask, pending, pending_mask)
    return logits[b, -1]


@torch.no_grad()
def fresh_logits(model, seq):
    return model(torch.tensor([seq])).logits[0, -1]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_rollback_matches_fresh_prefill(make, gamma):
    target = make(seed=0, layers=2)
    draft = perturbed_copy(target, 0.4)
    dec = SpeculativeDecoder(target, draft, gamma)
    prompts = [[4, 8, 15], [16, 23, 42, 7, 9, 11], [5]]
    state = dec.prefill(prompts)
    g = torch.Generator().manual_seed(0)
    seen_rejection = seen_all_accepted = False
    for _ in range(12):
        n_acc, new = dec.step(state, gamma, SAMPLING, g)
        seen_rejection |= min(n_acc) < gamma
        seen_all_accepted |= max(n_acc) == gamma
        for b, tokens in enumerate(new):
            state.committed[b].extend(tokens)
        T = state.target_mask.shape[1]
        assert kv.cache_width(state.target_cache) == T
        assert T == max(len(c) for c in state.committed) - 1  # compact: no wasted column
        for b, seq in enumerate(state.committed):
            # the target cache holds every committed token but the last, which is the next input
            assert row_slots(state.target_mask, b) == len(seq) - 1
            assert int(state.last[b]) == seq[-1]
            pending = int(state.draft_in_mask[b].sum())
            assert row_slots(state.draft_mask, b) == len(seq) - pending
            assert state.draft_in[b, -pending:].tolist() == seq[-pending:]
            ref = fresh_logits(target, seq)
            got = next_logits_from_cache(target, state.target_cache, state.target_mask, state.last[:, None],
                                         torch.ones_like(state.last)[:, None], b)
            torch.testing.assert_close(got, ref, atol=1e-9, rtol=1e-9)
            got_d = next_logits_from_cache(draft, state.draft_cache, state.draft_mask, state.draft_in,
                                           state.draft_in_mask, b)
            torch.testing.assert_close(got_d, fresh_logits(draft, seq), atol=1e-9, rtol=1e-9)
    assert seen_rejection and seen_all_accepted


def test_batch1_cache_length_equals_committed_length():
    target = tiny_llama(seed=0)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.8), 4)
    state = dec.prefill([[3, 4, 5, 6]])
    for _ in range(6):
        _, new = dec.step(state, 4, SAMPLING, torch.Generator().manual_seed(1))
        state.committed[0].extend(new[0])
        assert kv.cache_width(state.target_cache) == len(state.committed[0]) - 1
        pending = state.draft_in.shape[1] - int((state.draft_in_mask[0] == 0).sum())
        assert kv.cache_width(state.draft_cache) == len(state.committed[0]) - pending


def test_compact_right_aligns_and_keeps_order():
    cache = kv.new_cache(tiny_llama())
    from transformers import DynamicCache  # noqa: F401  (the real cache class is what compact edits)

    keys = torch.arange(2 * 1 * 5 * 1, dtype=torch.float64).view(2, 1, 5, 1)
    cache.update(keys.clone(), keys.clone() + 100, 0)
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 0]])
    new_mask = kv.compact(cache, mask, counts=[3, 2])
    assert new_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    layer = cache.layers[0]
    assert layer.keys[0, 0, :, 0].tolist() == [0, 2, 3]
    assert layer.keys[1, 0, 1:, 0].tolist() == [6, 7]
    assert layer.values[1, 0, 1:, 0].tolist() == [106, 107]


def test_compact_crop_path_for_uniform_trailing_holes():
    cache = kv.new_cache(tiny_llama())
    keys = torch.arange(2 * 1 * 5 * 1, dtype=torch.float64).view(2, 1, 5, 1)
    cache.update(keys.clone(), keys.clone(), 0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 0, 0]])
    new_mask = kv.compact(cache, mask, counts=[3, 2], trailing_holes=2)
    assert new_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert kv.cache_width(cache) == 3 and cache.layers[0].keys[1, 0, :, 0].tolist() == [5, 6, 7]
