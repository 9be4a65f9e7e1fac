"""KV-cache rollback: after every step each row's cache holds exactly its committed tokens (except the pending
last one), and continuing from it gives the same logits as a fresh prefill of the committed sequence.

Both layouts: the DynamicCache path (``static_cache=False``, the fallback) and the static path (the default for
models whose layers are all full-attention ``StaticLayer``)."""
import copy

import pytest
import torch

from decode import SpeculativeDecoder
from decode import cache as kv
from tests.conftest import perturbed_copy, tiny_gpt2, tiny_llama

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
    dec = SpeculativeDecoder(target, draft, gamma, static_cache=False)
    prompts = [[4, 8, 15], [16, 23, 42, 7, 9, 11], [5]]
    for i, p in enumerate(prompts):
        dec.add_request(p, max_new_tokens=200, temperature=1.0, seed=i)
    for _ in range(12):
        assert dec.step() == []
        state = dec.state
        T = state.target_cache.mask.shape[1]
        assert kv.cache_width(state.target_cache.cache) == T
        assert T == max(len(c) for c in state.committed) - 1  # compact: no wasted column
        for b, seq in enumerate(state.committed):
            # the target cache holds every committed token but the last, which is the next input
            assert row_slots(state.target_cache.mask, b) == len(seq) - 1
            assert int(state.last[b]) == seq[-1]
            pending = int(state.draft_in_mask[b].sum())
            assert row_slots(state.draft_cache.mask, b) == len(seq) - pending
            assert state.draft_in[b, -pending:].tolist() == seq[-pending:]
            ref = fresh_logits(target, seq)
            t = state.target_cache
            got = next_logits_from_cache(target, t.cache, t.mask, state.last[:, None],
                                         torch.ones_like(state.last)[:, None], b)
            torch.testing.assert_close(got, ref, atol=1e-9, rtol=1e-9)
            got_d = next_logits_from_cache(draft, state.draft_cache.cache, state.draft_cache.mask, state.draft_in,
                                           state.draft_in_mask, b)
            torch.testing.assert_close(got_d, fresh_logits(draft, seq), atol=1e-9, rtol=1e-9)
    hist = [sum(h) for h in zip(*(r.stats.accepted_length_histogram for r in dec._batch.rows))]
    assert hist[-1] > 0 and sum(hist[:-1]) > 0  # steps with all drafts accepted and steps with a rejection


def test_rows_joining_mid_flight_keep_caches_exact():
    target = tiny_llama(seed=0, layers=2)
    draft = perturbed_copy(target, 0.4)
    dec = SpeculativeDecoder(target, draft, 3, static_cache=False)
    dec.add_request([7], max_new_tokens=100)  # a 1-token prompt: empty caches at prefill
    for step, prompt in enumerate([[4, 8, 15, 16, 23, 42, 3, 3, 9], [5], [11, 12]]):
        dec.step()
        dec.add_request(prompt, max_new_tokens=100)
        dec.step()
        state = dec.state
        assert len(state.committed) == step + 2
        for b, seq in enumerate(state.committed):
            t = state.target_cache
            got = next_logits_from_cache(target, t.cache, t.mask, state.last[:, None],
                                         torch.ones_like(state.last)[:, None], b)
            torch.testing.assert_close(got, fresh_logits(target, seq), atol=1e-9, rtol=1e-9)
            got_d = next_logits_from_cache(draft, state.draft_cache.cache, state.draft_cache.mask, state.draft_in,
                                           state.draft_in_mask, b)
            torch.testing.assert_close(got_d, fresh_logits(draft, seq), atol=1e-9, rtol=1e-9)


def test_batch1_cache_length_equals_committed_length():
    target = tiny_llama(seed=0)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.8), 4, static_cache=False)
    dec.add_request([3, 4, 5, 6], max_new_tokens=200, temperature=1.0, seed=1)
    for _ in range(6):
        dec.step()
        state = dec.state
        assert kv.cache_width(state.target_cache.cache) == len(state.committed[0]) - 1
        pending = state.draft_in.shape[1] - int((state.draft_in_mask[0] == 0).sum())
        assert kv.cache_width(state.draft_cache.cache) == len(state.committed[0]) - pending


def test_compact_right_aligns_and_keeps_order():
    cache = kv.new_cache(tiny_llama())
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


def test_dynamic_roll_back_drops_the_rejected_slots_of_the_last_columns():
    """DynamicKV.roll_back: the kept bits of the last columns written, then a crop when every row kept as many (and
    no input had holes), else a gather that right-aligns each row."""
    def filled(widths):
        cache = kv.new_cache(tiny_llama())
        keys = torch.arange(2 * 1 * 5 * 1, dtype=torch.float64).view(2, 1, 5, 1)
        cache.update(keys.clone(), keys.clone(), 0)
        return kv.DynamicKV(cache, torch.ones(2, 5, dtype=torch.long), widths)

    same = filled([2, 2])
    same.roll_back(torch.tensor([[True, False, False], [True, False, False]]), [1, 1], [3, 3])
    assert same.mask.tolist() == [[1, 1, 1]] * 2 and kv.cache_width(same.cache) == 3 and same.lens == [3, 3]
    ragged = filled([2, 2])
    ragged.roll_back(torch.tensor([[True, True, False], [False, False, False]]), [2, 0], [4, 2])
    assert ragged.mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]] and ragged.lens == [4, 2]
    assert ragged.cache.layers[0].keys[1, 0, 2:, 0].tolist() == [5, 6]
    holey = filled([2, 2])
    holey.holey = True  # a forward with holes in its input: no crop, whatever the counts
    holey.mask[1, 0] = 0
    holey.roll_back(torch.tensor([[True, False], [True, False]]), [1, 1], [4, 3])
    assert holey.mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]] and not holey.holey


@torch.no_grad()
def test_static_roll_back_moves_the_write_column_to_the_longest_kept_row():
    """StaticKV.roll_back keeps the same interface: no copy, W goes back to the end of the longest row's kept
    columns and a row that kept fewer has masked holes."""
    target = tiny_llama(seed=0, layers=1)
    dec = SpeculativeDecoder(target, None)
    state = dec.prefill([[4, 5, 6], [7, 8, 9]])
    skv = state.target_cache
    assert isinstance(skv, kv.StaticKV) and skv.W == 2
    skv.forward(target, torch.tensor([[1, 2, 3], [1, 2, 3]]), None)
    skv.roll_back(torch.tensor([[True, False], [True, True]]), [1, 2], [4, 5])
    assert skv.W == 5 and skv.lens == [4, 5] and skv.holey
    assert skv.mask[:, :5].tolist() == [[True, True, True, True, False], [True] * 5]


# ------------------------------------------------------------------------------------------------ static path
@torch.no_grad()
def next_logits_static(model, skv, pending, pending_mask, b):
    """Feed row b's pending tokens on a snapshot of a StaticKV; return the logits after the last one."""
    snap = copy.copy(skv)
    snap.cache, snap.mask, snap.lens, snap._pos = copy.deepcopy(skv.cache), skv.mask.clone(), list(skv.lens), \
        skv._pos.clone()
    holes = not bool(pending_mask.all())
    return snap.forward(model, pending, pending_mask if holes else None, holes=holes)[b, -1]


def check_static_state(dec, target, draft):
    state = dec.state
    t, d = state.target_cache, state.draft_cache
    assert isinstance(t, kv.StaticKV) and isinstance(d, kv.StaticKV)
    for b, seq in enumerate(state.committed):
        assert t.lens[b] == len(seq) - 1 == int(t.mask[b, : t.W].sum())
        pending = int(state.draft_in_mask[b].sum())
        assert d.lens[b] == len(seq) - pending == int(d.mask[b, : d.W].sum())
        got = next_logits_static(target, t, state.last[:, None], torch.ones_like(state.last)[:, None], b)
        torch.testing.assert_close(got, fresh_logits(target, seq), atol=1e-9, rtol=1e-9)
        got_d = next_logits_static(draft, d, state.draft_in, state.draft_in_mask, b)
        torch.testing.assert_close(got_d, fresh_logits(draft, seq), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_static_rollback_matches_fresh_prefill(make, gamma):
    """Ragged sampled batch on the static cache: rejected slots are only masked (or overwritten), rows keep
    holes until a compaction, and continuing from the cache equals a fresh prefill at every step; the buffers
    are written in place (no per-step allocation) except when the cache is compacted or grown."""
    target = make(seed=0, layers=2)
    draft = perturbed_copy(target, 0.4)
    dec = SpeculativeDecoder(target, draft, gamma)
    prompts = [[4, 8, 15], [16, 23, 42, 7, 9, 11], [5]]
    for i, p in enumerate(prompts):
        dec.add_request(p, max_new_tokens=200, temperature=1.0, seed=i)
    in_place = relayouts = 0
    for _ in range(24):
        before = (dec.state.target_cache.L if dec.state else None,
                  dec.state.target_cache.cache.layers[0].keys.data_ptr() if dec.state else None)
        assert dec.step() == []
        t = dec.state.target_cache
        if before[0] == t.L and before[1] == t.cache.layers[0].keys.data_ptr():
            in_place += 1
        else:
            relayouts += 1
        check_static_state(dec, target, draft)
    hist = [sum(h) for h in zip(*(r.stats.accepted_length_histogram for r in dec._batch.rows))]
    assert hist[-1] > 0 and sum(hist[:-1]) > 0  # steps with all drafts accepted and steps with a rejection
    assert dec.state.target_cache.holey  # rows accepted different lengths: holes exist and are masked
    assert in_place >= 20 and relayouts <= 4  # first step (admission) + at most a few growths


def test_static_batch1_has_no_holes_and_passes_no_mask():
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, 0.8)
    dec = SpeculativeDecoder(target, draft, 4)
    dec.add_request([3, 4, 5, 6], max_new_tokens=200, temperature=1.0, seed=1)
    for _ in range(8):
        dec.step()
        t, d = dec.state.target_cache, dec.state.draft_cache
        assert not t.holey and not d.holey  # so forwards take HF's causal path without an attention mask
        assert t.W == len(dec.state.committed[0]) - 1  # a rejection moved the write column back
        check_static_state(dec, target, draft)


def test_static_rows_joining_and_leaving_mid_flight_keep_caches_exact():
    target = tiny_llama(seed=0, layers=2)
    draft = perturbed_copy(target, 0.4)
    dec = SpeculativeDecoder(target, draft, 3)
    dec.add_request([7], max_new_tokens=100)  # a 1-token prompt: empty caches at prefill
    long_prompt = [4, 8, 15, 16, 23, 42, 3, 3, 9] * 3  # longer than the running rows: the old rows shift right
    for step, prompt in enumerate([long_prompt, [5], [11, 12]]):
        dec.step()
        dec.add_request(prompt, max_new_tokens=100)
        dec.step()
        assert len(dec.state.committed) == step + 2
        check_static_state(dec, target, draft)
    short = dec.add_request([9, 9], max_new_tokens=2)
    finished = []
    while not finished:
        finished = dec.step()
    assert [o.request_id for o in finished] == [short]  # a row leaves; the others' caches stay exact
    assert dec.num_active() == 4
    check_static_state(dec, target, draft)
    assert dec.abort(dec.active_ids[0])
    check_static_state(dec, target, draft)


def test_static_rows_leave_and_join_in_place_without_a_relayout():
    """A continuous batch at its peak: a row leaves (from the middle: the rows after it move one place down) and a
    request joins into the freed buffer row, with no new buffers (every layer still views the same storage) and
    caches that stay exact; a free row's stale values, even non-finite ones, never reach the row written there."""
    target = tiny_llama(seed=0, layers=2)
    draft = perturbed_copy(target, 0.4)
    dec = SpeculativeDecoder(target, draft, 3)
    long_prompt = [4, 8, 15, 16, 23, 42, 3, 3, 9] * 2  # wider than every later prompt: a join never widens W
    for i in range(4):
        dec.add_request(long_prompt[i:], max_new_tokens=100)
    dec.step()
    caches = (dec.state.target_cache, dec.state.draft_cache)
    storage = [[layer.keys.data_ptr() for layer in c.cache.layers] for c in caches]
    for joined, prompt in enumerate([[5], [6, 7], [9, 10, 11]]):
        assert dec.abort(dec.active_ids[1])
        for c in caches:
            assert c.capacity == 4 and c.batch_size == 3
            for k, v in zip(*c._buffers):
                k[3:], v[3:] = float("nan"), float("inf")  # what a non-finite request could leave behind
        dec.add_request(prompt, max_new_tokens=100)
        dec.step()
        check_static_state(dec, target, draft)
        assert [[layer.keys.data_ptr() for layer in c.cache.layers] for c in caches] == storage
        assert all(c.batch_size == 4 and c.cache.layers[0].keys.shape[0] == 4 for c in caches)


def test_static_rows_joining_by_a_relayout_below_the_peak_keep_caches_exact():
    """Two requests with prompts wider than the write column join a batch that shrank below its peak: the
    re-layout keeps the peak's capacity and puts the new rows right after the old ones (a trial's case: it raised
    a shape error once the buffers held more rows than the new batch)."""
    target = tiny_llama(seed=0, layers=2)
    draft = perturbed_copy(target, 0.4)
    dec = SpeculativeDecoder(target, draft, 3)
    ids = [dec.add_request([1, 2, 3, 4, 5], max_new_tokens=40) for _ in range(6)]
    dec.step()
    for rid in ids[:4]:
        dec.abort(rid)
    dec.add_request(list(range(1, 31)), max_new_tokens=40)
    dec.add_request(list(range(2, 32)), max_new_tokens=40)
    dec.step()
    assert all(c.capacity == 6 and c.batch_size == 4 for c in (dec.state.target_cache, dec.state.draft_cache))
    check_static_state(dec, target, draft)


def test_a_join_that_fails_in_the_draft_cache_leaves_both_caches_as_they_were(monkeypatch):
    """The draft's merge raising (out of memory, Ctrl-C) after the target's took the new rows: the target's gives
    them back, the requests wait again, and the next step admits them with both caches exact (the trial's case:
    the caches disagreed on their rows and every later step raised)."""
    target = tiny_llama(seed=0, layers=2)
    draft = perturbed_copy(target, 0.4)
    dec = SpeculativeDecoder(target, draft, 3)
    for i in range(3):
        dec.add_request([4, 8, 15, 16, 23][i:], max_new_tokens=40)
    dec.step()
    draft_cache, merge = dec.state.draft_cache, kv.StaticKV.merge

    def failing(self, *args, **kwargs):
        if self is draft_cache:
            raise MemoryError("out of memory (test)")
        return merge(self, *args, **kwargs)

    monkeypatch.setattr(kv.StaticKV, "merge", failing)
    late = dec.add_request([9, 10], max_new_tokens=40)
    with pytest.raises(MemoryError):
        dec.step()
    assert dec.state.target_cache.batch_size == dec.state.draft_cache.batch_size == dec.num_active() == 3
    check_static_state(dec, target, draft)
    monkeypatch.setattr(kv.StaticKV, "merge", merge)
    dec.step()
    assert late in dec.active_ids and dec.num_active() == 4
    check_static_state(dec, target, draft)


def test_unsupported_architecture_falls_back_with_a_notice():
    """A model with sliding-window layers cannot use the static path: one warning line, then the DynamicCache
    path, still exactly greedy past the window (the DynamicCache keeps every slot; the model's own mask applies
    the window)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      use_sliding_window=True, sliding_window=8, max_window_layers=0)
    target = Qwen2ForCausalLM(cfg).double().eval()
    draft = perturbed_copy(target, 0.4)
    with pytest.warns(UserWarning, match="cannot use the static KV cache") as record:
        dec = SpeculativeDecoder(target, draft, 3)
    assert all(len(str(w.message).splitlines()) == 1 for w in record)
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42, 3, 3, 9, 1, 2, 5]])
    out = dec.generate(prompt, max_new_tokens=24)
    assert dec.state is None and not dec.static_cache["target"] and not dec.static_cache["draft"]
    ref = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:]
    assert out.new_tokens[0].tolist() == ref.tolist()
