"""The running batch's bookkeeping (decode.batch): the left-padded layout, and rows that join and leave keep every
other row's caches as they were."""
import torch

from decode import SpeculativeDecoder
from decode import batch
from decode.requests import Request
from decode.sampling import SamplingParams
from tests.conftest import perturbed_copy, tiny_llama


def test_left_pad_right_aligns_each_row():
    ids, mask = batch.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_new_state_holds_all_but_the_last_prompt_token_in_the_caches():
    target = tiny_llama(seed=0, layers=1)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.3), 2, static_cache=False)
    state = dec.prefill([[4, 5, 6], [7]])
    assert state.target_cache.lens == state.draft_cache.lens == [2, 0]
    assert state.last.tolist() == [6, 7] and state.draft_pending == [1, 1]
    assert state.draft_in[:, -1].tolist() == [6, 7] and state.draft_in_mask.tolist() == [[0, 1], [0, 1]]
    assert state.committed == [[4, 5, 6], [7]] and len(state.caches()) == 2
    plain = dec.prefill([[4, 5]], use_draft=False)
    assert plain.draft_cache is None and plain.caches() == [plain.target_cache]


def test_merge_then_keep_rows_gives_back_the_rows_as_they_were():
    target = tiny_llama(seed=0, layers=1)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.3), 2, static_cache=False)
    state = dec.prefill([[4, 5, 6], [7, 8]], static=False)
    keys = state.target_cache.cache.layers[0].keys.clone()
    mask = state.target_cache.mask.clone()
    batch.merge(state, dec.prefill([[9, 10, 11, 12, 13]], static=False), room=4)
    assert state.target_cache.lens == [2, 1, 4] and state.committed[2] == [9, 10, 11, 12, 13]
    assert state.draft_in.shape[0] == state.last.shape[0] == 3 and state.draft_pending == [1, 1, 1]
    batch.keep_rows(state, [0, 1])
    assert state.target_cache.mask.tolist() == mask.tolist()  # the columns only the new row used are gone
    torch.testing.assert_close(state.target_cache.cache.layers[0].keys[mask.bool()], keys[mask.bool()])
    assert state.committed == [[4, 5, 6], [7, 8]] and state.last.tolist() == [6, 8]


def test_penalty_counts_count_new_tokens_and_mark_prompt_and_output():
    class Row:
        def __init__(self, prompt, new_tokens):
            self.prompt, self.new_tokens = prompt, new_tokens

    counts, seen = batch.penalty_counts([Row([1, 2], [3, 3]), Row([4], [])], vocab_size=6, device="cpu")
    assert counts.tolist() == [[0, 0, 0, 2, 0, 0], [0] * 6]
    assert seen.tolist() == [[False, True, True, True, False, False], [False, False, False, False, True, False]]


def test_count_tokens_adds_committed_tokens_per_row():
    counts, seen = torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.bool)
    batch.count_tokens(counts, seen, [0, 0, 1], [3, 3, 4])
    assert counts.tolist() == [[0, 0, 0, 2, 0], [0, 0, 0, 0, 1]] and seen.sum().item() == 2
    batch.count_tokens(None, None, [0], [1])  # no penalties: nothing to count


def test_running_batch_commit_trims_at_a_stop_id_and_retires_finished_rows():
    target = tiny_llama(seed=0, layers=1)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.3), 2, static_cache=False)
    params = SamplingParams(presence_penalty=0.5)
    rows = [Request(i, p, params, 5, frozenset({9}), torch.Generator()) for i, p in enumerate([[4, 5, 6], [7]])]
    running = batch.RunningBatch(dec.vocab_size)
    running.add(rows, dec.prefill([r.prompt for r in rows], static=False), room=4)
    assert running.counts is not None and running.sampling.penalized
    finished, calls = running.commit([2, 2], [1, 2], [[11, 12], [9, 13, 14]], draft_forwards=2, context_length=None)
    assert [(r.request_id, t) for r, t in calls] == [(0, [11, 12]), (1, [9])]
    assert [(o.request_id, o.new_tokens, o.finish_reason) for o in finished] == [(1, [9], "stop")]
    assert running.rows == rows[:1] and running.state.committed == [[4, 5, 6, 11, 12]]
    assert running.counts.shape[0] == 1 and running.counts[0, 11].item() == 1
    running.keep([])
    assert running.rows == [] and running.state is None and running.sampling is None


def test_roll_back_of_a_plain_step_leaves_the_token_pending_for_the_draft():
    target = tiny_llama(seed=0, layers=1)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.3), 2, static_cache=False)
    state = dec.prefill([[4, 5, 6], [7, 8]], static=False)
    dec.verify_forward(state, state.last[:, None])  # gamma = 0: the target reads only its last token
    nxt = torch.tensor([9, 10])
    batch.roll_back(state, 0, state.last.new_zeros(2, 0), torch.zeros(2, dtype=torch.long), nxt, [0, 0])
    assert state.target_cache.lens == [3, 2] and state.draft_cache.lens == [2, 1]
    assert state.last.tolist() == [9, 10] and state.draft_pending == [2, 2]
    assert state.draft_in[:, -2:].tolist() == [[6, 9], [8, 10]] and state.draft_in_mask[:, -2:].tolist() == [[1, 1]] * 2
