"""Drafting from two sources (decode.drafting): positions every row takes from prompt lookup run no draft forward,
and q is the distribution each draft was drawn from."""
import torch

from decode import SpeculativeDecoder
from decode.drafting import draft_logits, draft_tokens
from decode.lookup import LookupDrafts
from decode.sampling import BatchSampling, SamplingParams
from tests.conftest import perturbed_copy, tiny_llama


def _setup(temperature=0.0):
    target = tiny_llama(seed=0, layers=1)
    dec = SpeculativeDecoder(target, perturbed_copy(target, 0.3), 3, static_cache=False)
    state = dec.prefill([[4, 5, 6], [7, 8, 9]])
    sampling = BatchSampling([SamplingParams(temperature)] * 2, "cpu")
    return dec, state, sampling


def _recording(dec, fed):
    def forward(state, inp, inp_mask, holes):
        fed.append(inp.tolist())
        return dec.draft_forward(state, inp, inp_mask, holes)
    return forward


def test_fully_covered_positions_feed_the_draft_once_with_all_but_the_last_proposal():
    dec, state, sampling = _setup()
    lookup = LookupDrafts(torch.tensor([[11, 12, 13], [21, 22, 23]]), torch.ones(2, 3, dtype=torch.bool), covered=3)
    fed = []
    tokens, q, forwards = draft_tokens(state, 3, lookup, _recording(dec, fed), sampling, dec.vocab_size, None, None,
                                       None, torch.zeros(2, 3))
    assert tokens.tolist() == [[11, 12, 13], [21, 22, 23]] and q is None and forwards == 1
    assert fed == [[[6, 11, 12], [9, 21, 22]]]  # the pending token, then the proposals but the γ-th
    assert state.draft_cache.mask.shape[1] == 2 + 3


def test_uncovered_positions_run_one_draft_forward_each_and_sampled_q_is_a_distribution():
    dec, state, sampling = _setup(temperature=1.0)
    fed = []
    tokens, q, forwards = draft_tokens(state, 3, None, _recording(dec, fed), sampling, dec.vocab_size, None, None,
                                       None, torch.full((2, 3), 0.5))
    assert forwards == 3 and len(fed) == 3 and tokens.shape == (2, 3) and q.shape == (2, 3, dec.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
    assert fed[1] == tokens[:, :1].tolist() and fed[2] == tokens[:, 1:2].tolist()


def test_a_proposal_overlays_the_draft_models_guess_with_a_one_hot_q():
    dec, state, sampling = _setup(temperature=1.0)
    use = torch.tensor([[False, True, False], [False, False, False]])
    lookup = LookupDrafts(torch.tensor([[0, 42, 0], [0, 0, 0]]), use, covered=0)
    tokens, q, forwards = draft_tokens(state, 3, lookup, dec.draft_forward, sampling, dec.vocab_size, None, None,
                                       None, torch.full((2, 3), 0.5))
    assert forwards == 3 and int(tokens[0, 1]) == 42
    assert q[0, 1].tolist() == torch.nn.functional.one_hot(torch.tensor(42), dec.vocab_size).float().tolist()


def test_a_pruned_drafts_logits_go_to_the_ids_of_its_map():
    logits = torch.tensor([[[1.0, 2.0, 3.0]]])
    full = draft_logits(logits, torch.tensor([4, 0, 2]), vocab_size=5)
    assert full[0, 0].tolist() == [2.0, float("-inf"), 3.0, float("-inf"), 1.0]
    assert draft_logits(logits, None, 3) is logits
