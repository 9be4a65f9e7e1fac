"""Prompt lookup: the n-gram index against a brute-force scan, and the decoder with it: greedy equality, the exact
acceptance its proposals give, sampled rows untouched, bad settings."""
import random

import pytest
import torch

import decode.engine
from decode import SpeculativeDecoder, costs
from decode.lookup import NgramLookup, check_prompt_lookup
from tests.conftest import tiny_llama
from tests.decode.test_engine import reference_greedy


def scan_next(seq, n):
    """The token after the most recent earlier occurrence of seq's last n tokens, by a full scan; None if none."""
    for s in range(len(seq) - n - 1, -1, -1):
        if seq[s:s + n] == seq[len(seq) - n:]:
            return seq[s + n]
    return None


def scan_chain(seq, n, k):
    chain = []
    while len(chain) < k and len(seq) >= n:
        nxt = scan_next(list(seq) + chain, n)
        if nxt is None:
            break
        chain.append(nxt)
    return chain


@pytest.mark.parametrize("n", [1, 2, 3])
def test_proposals_equal_a_brute_force_scan_as_the_sequence_grows(n):
    rng = random.Random(n)
    for trial in range(30):
        seq, lookup = [], NgramLookup(n)
        vocab = rng.choice([2, 3, 5, 12])  # small vocabularies: many matches, chains that run into their own output
        for _ in range(rng.randint(1, 12)):
            seq.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 9)))
            k = rng.randint(1, 9)
            assert lookup.propose(seq, k) == scan_chain(seq, n, k), (seq, k)


def test_a_loop_is_continued_and_an_unseen_ngram_proposes_nothing():
    lookup = NgramLookup(2)
    assert lookup.propose([7, 8, 9, 7, 8], 4) == [9, 7, 8, 9]
    assert lookup.propose([7, 8, 9, 7, 8, 5], 4) == []  # (8, 5) never occurred before
    assert NgramLookup(3).propose([1, 2], 3) == []     # shorter than n
    # the most recent occurrence wins: (1, 2) was followed by 3, then by 4
    assert NgramLookup(2).propose([1, 2, 3, 1, 2, 4, 1, 2], 1) == [4]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_bad_ngram_lengths_are_named(bad):
    with pytest.raises(ValueError, match="prompt_lookup_ngram"):
        check_prompt_lookup(bad)
    with pytest.raises(ValueError, match="prompt_lookup_ngram"):
        SpeculativeDecoder(tiny_llama(), tiny_llama(seed=1, layers=1), prompt_lookup_ngram=bad)
    with pytest.raises(ValueError, match="prompt_lookup_ngram must be an integer >= 1"):
        NgramLookup(0)


def test_without_a_draft_gamma_needs_prompt_lookup_and_auto_needs_a_draft():
    with pytest.raises(ValueError, match="needs a draft model"):
        check_prompt_lookup(3, has_draft=False, name="--prompt-lookup-ngram")  # the CLIs' rule
    with pytest.raises(ValueError, match="num_draft_tokens=2 needs a draft model"):
        SpeculativeDecoder(tiny_llama(), None, num_draft_tokens=2)
    with pytest.raises(ValueError, match="'auto' needs a draft model"):
        SpeculativeDecoder(tiny_llama(), None, num_draft_tokens="auto", prompt_lookup_ngram=2)
    assert SpeculativeDecoder(tiny_llama(), None, prompt_lookup_ngram=0).num_draft_tokens == 0
    assert SpeculativeDecoder(tiny_llama(), None, prompt_lookup_ngram=3).num_draft_tokens == 4


@torch.no_grad()
def replay_lookup_alone(prompt, new_tokens, gamma, n):
    """(accepted-length histogram, drafted, accepted) that prompt lookup alone must give on the target's greedy
    text: a step drafts the lookup chain of the committed text (nothing when it has none) and keeps the prefix that
    equals the text."""
    seq = prompt + new_tokens
    hist, t, drafted, accepted_total = [0] * (gamma + 1), len(prompt), 0, 0
    while t < len(seq):
        chain = scan_chain(seq[:t], n, min(gamma, len(seq) - t - 1))
        accepted = 0
        while accepted < len(chain) and chain[accepted] == seq[t + accepted]:
            accepted += 1
        if chain:
            hist[accepted] += 1
        drafted, accepted_total, t = drafted + len(chain), accepted_total + accepted, t + accepted + 1
    return hist, drafted, accepted_total


@pytest.mark.parametrize("static_cache", [None, False])
@pytest.mark.parametrize("gamma,n", [(4, 2), (6, 3), (3, 1)])
def test_lookup_alone_greedy_output_is_plain_greedy_output(looping_pair, gamma, n, static_cache):
    """No draft model: a row with a match drafts the chain, one without takes a plain step; the output equals
    plain greedy decoding, alone and in a batch whose rows match at different steps."""
    target, _ = looping_pair
    prompts = [[5, 17, 33, 5, 17, 40, 8], [60, 3, 91, 12], [44]]
    dec = SpeculativeDecoder(target, None, num_draft_tokens=gamma, prompt_lookup_ngram=n, static_cache=static_cache)
    refs = [reference_greedy(target, p, 40) for p in prompts]
    drafted = 0
    for prompt, ref in zip(prompts, refs):
        out = dec.generate([prompt], max_new_tokens=40)
        assert out.new_tokens[0].tolist() == ref
        hist, n_drafted, n_accepted = replay_lookup_alone(prompt, ref, gamma, n)
        assert out.stats.accepted_length_histogram[:gamma + 1] == hist
        assert (out.stats.num_drafted, out.stats.num_accepted) == (n_drafted, n_accepted)
        assert out.stats.num_draft_forwards == 0
        drafted += n_drafted
    assert drafted > 0  # the lookup really proposed: the target's text loops
    batched = dec.generate(prompts, max_new_tokens=40)
    assert [t.tolist() for t in batched.new_tokens] == refs
    plain = SpeculativeDecoder(target, None).generate(prompts, max_new_tokens=40, eos_token_id=7)
    stopped = dec.generate(prompts, max_new_tokens=40, eos_token_id=7)
    assert [t.tolist() for t in stopped.new_tokens] == [t.tolist() for t in plain.new_tokens]


def test_lookup_alone_at_a_temperature_is_plain_decoding_with_the_same_seed(looping_pair):
    """Lookup drafts only for greedy rows: a sampled row takes plain steps, drawing what plain decoding draws from
    its generator, so the same seed gives the same tokens (exactly, not only in distribution), also beside a greedy
    row that drafts."""
    target, _ = looping_pair
    prompts = [[5, 17, 33, 5, 17, 40, 8], [60, 3, 91, 12]]
    lookup = SpeculativeDecoder(target, None, num_draft_tokens=4, prompt_lookup_ngram=2)
    plain = SpeculativeDecoder(target, None)
    for seed in range(3):
        a = lookup.generate(prompts, max_new_tokens=30, temperature=1.0, generator=torch.Generator().manual_seed(seed))
        b = plain.generate(prompts, max_new_tokens=30, temperature=1.0, generator=torch.Generator().manual_seed(seed))
        assert [t.tolist() for t in a.new_tokens] == [t.tolist() for t in b.new_tokens]
        assert a.stats.num_drafted == 0
    ids = [lookup.add_request(prompts[0], 30, temperature=0.0), lookup.add_request(prompts[1], 30, temperature=1.0,
                                                                                 seed=11)]
    outs = {}
    while lookup.has_unfinished():
        outs.update((o.request_id, o) for o in lookup.step())
    plain.add_request(prompts[1], 30, temperature=1.0, seed=11, request_id="s")
    ref = {}
    while plain.has_unfinished():
        ref.update((o.request_id, o) for o in plain.step())
    assert outs[ids[0]].new_tokens == reference_greedy(target, prompts[0], 30)
    assert outs[ids[1]].new_tokens == ref["s"].new_tokens


@torch.no_grad()
def replay_histogram(target, draft, prompt, new_tokens, gamma, n):
    """The accepted-length histogram greedy speculative decoding with prompt lookup must give, from the target's
    greedy text and the draft's teacher-forced argmaxes: a step's drafts are the lookup chain while it lasts, then
    the draft's argmaxes; it keeps the prefix equal to the target's text. The first new token comes from the
    target's prefill, before any step."""
    seq = prompt + new_tokens
    draft_next = draft(torch.tensor([seq])).logits[0].argmax(-1).tolist()  # draft_next[j]: its guess for seq[j+1]
    hist, t, total = [0] * (gamma + 1), len(prompt) + 1, len(seq)  # the target's prefill gives the first token
    while t < total:
        g = min(gamma, total - t - 1)  # the decoder never drafts past the length budget
        chain = scan_chain(seq[:t], n, g)
        accepted = 0
        while accepted < g:
            j = t + accepted
            guess = chain[accepted] if accepted < len(chain) else draft_next[j - 1]
            if guess != seq[j]:
                break
            accepted += 1
        if g > 0:
            hist[accepted] += 1
        t += accepted + 1
    return hist


@pytest.fixture(scope="module")
def looping_pair():
    """A target whose greedy text repeats itself after a few tokens (random tiny models fall into loops), and a
    draft that rarely agrees with it."""
    return tiny_llama(seed=0, layers=2), tiny_llama(seed=1, layers=1)


@pytest.mark.parametrize("gamma,n", [(4, 2), (6, 3), (3, 1)])
def test_greedy_output_is_the_targets_and_lookup_proposals_are_kept_exactly_when_they_match(looping_pair, gamma, n):
    target, draft = looping_pair
    prompts = [[5, 17, 33, 5, 17, 40, 8], [60, 3, 91, 12], [44]]
    helped = 0
    for prompt in prompts:
        ref = reference_greedy(target, prompt, 40)
        out = SpeculativeDecoder(target, draft, num_draft_tokens=gamma, prompt_lookup_ngram=n).generate(
            [prompt], max_new_tokens=40)
        assert out.new_tokens[0].tolist() == ref
        expected = replay_histogram(target, draft, prompt, ref, gamma, n)
        assert out.stats.accepted_length_histogram == expected
        without = SpeculativeDecoder(target, draft, num_draft_tokens=gamma).generate([prompt], max_new_tokens=40)
        helped += out.stats.num_accepted > without.stats.num_accepted
    assert helped >= 2  # the lookup really proposed here: its text loops, the draft does not copy it


def test_sampled_rows_are_untouched_and_greedy_rows_stay_exact_in_a_mixed_batch(looping_pair, monkeypatch):
    """A greedy row drafts by lookup beside sampled rows (whose q must stay the draft's): the sampled rows' output is
    the same with lookup on or off, the greedy row's is the target's greedy text."""
    target, draft = looping_pair
    prompts = [[5, 17, 33, 5, 17, 40, 8], [60, 3, 91, 12], [44, 9], [70, 71, 72, 70]]
    temps = [0.0, 1.0, 0.0, 0.7]
    outs, checked = {}, []
    real_verify = decode.engine.verify

    def verify(q, p, drafts, **kw):  # q must be what each draft was drawn from: one-hot on a greedy row's drafts
        gammas = kw["num_draft"].tolist() if kw.get("num_draft") is not None else [drafts.shape[1]] * len(drafts)
        hot = torch.nn.functional.one_hot(drafts, q.shape[-1]).to(q.dtype)
        for r, g in enumerate(gammas):
            if dec._batch.rows[r].params.greedy:
                checked.append(torch.equal(q[r, :g], hot[r, :g]))
        return real_verify(q, p, drafts, **kw)

    monkeypatch.setattr(decode.engine, "verify", verify)
    for n in (0, 2):
        dec = SpeculativeDecoder(target, draft, num_draft_tokens=4, prompt_lookup_ngram=n)
        for i, (p, t) in enumerate(zip(prompts, temps)):
            dec.add_request(p, max_new_tokens=32, temperature=t, seed=100 + i, request_id=i)
        done = {}
        while dec.has_unfinished():
            done.update({o.request_id: o for o in dec.step()})
        outs[n] = done
    for i, (p, t) in enumerate(zip(prompts, temps)):
        if t == 0.0:  # its drafts are what they would be alone: the replay's acceptance, step by step
            ref = reference_greedy(target, p, 32)
            assert outs[2][i].new_tokens == ref
            assert outs[2][i].stats.accepted_length_histogram == replay_histogram(target, draft, p, ref, 4, 2)
        assert outs[2][i].new_tokens == outs[0][i].new_tokens
    assert sum(outs[2][i].stats.num_accepted for i in (0, 2)) > sum(outs[0][i].stats.num_accepted for i in (0, 2))
    assert checked and all(checked)


@pytest.mark.parametrize("static_cache", [None, False])
def test_positions_every_row_takes_from_lookup_run_no_draft_forward(looping_pair, static_cache):
    """Where the lookup covers a step's leading drafts the draft's forwards are skipped (their tokens join the next
    forward): fewer forwards than drafts, and the same output and acceptance as the replay, on both cache paths and
    in a ragged batch of greedy rows."""
    target, draft = looping_pair
    prompts = [[5, 17, 33, 5, 17, 40, 8], [60, 3, 91, 12], [44]]
    dec = SpeculativeDecoder(target, draft, num_draft_tokens=5, prompt_lookup_ngram=2, static_cache=static_cache)
    calls = []
    forward = dec.draft_forward
    dec.draft_forward = lambda state, inp, *a: calls.append(inp.shape[1]) or forward(state, inp, *a)
    for prompt in prompts:
        calls.clear()
        out = dec.generate([prompt], max_new_tokens=40)
        ref = reference_greedy(target, prompt, 40)
        assert out.new_tokens[0].tolist() == ref
        assert out.stats.accepted_length_histogram == replay_histogram(target, draft, prompt, ref, 5, 2)
        assert len(calls) < out.stats.num_drafted and max(calls) > 2  # skipped, and fed several tokens at once
        assert out.stats.num_draft_forwards == len(calls)
    out = dec.generate(prompts, max_new_tokens=40)  # ragged rows: a position is skipped only if every row is covered
    assert [t.tolist() for t in out.new_tokens] == [reference_greedy(target, p, 40) for p in prompts]


def test_auto_gamma_is_told_the_draft_forwards_each_step_ran(looping_pair, monkeypatch):
    """γ = "auto" with prompt lookup: the controller gets each step's draft forwards and γ (so it prices the
    positions the lookup covers at no forward, :attr:`AdaptiveGamma.draft_forward_share`), and they add up to the
    forwards the stats count; the output stays the target's greedy text."""
    from decode.speedup import AdaptiveGamma

    target, draft = looping_pair
    seen = []
    real = AdaptiveGamma.update

    def update(self, *args, **kw):
        seen.append((kw.get("num_draft_forwards"), kw.get("step_gamma")))
        return real(self, *args, **kw)

    monkeypatch.setattr(AdaptiveGamma, "update", update)
    prompt = [5, 17, 33, 5, 17, 40, 8]
    dec = SpeculativeDecoder(target, draft, num_draft_tokens="auto", prompt_lookup_ngram=2)
    costs.calibrate(dec, prompt, batch_sizes=[1], repeats=1)
    # fixed costs (the catch-up forward too): the test's schedule, not this machine's timings under load
    dec.auto_costs[1] = {**dec.auto_costs[1], "cost_ratio": 0.2, "catchup_cost_ratio": 0.2, "verify": [1.0] * 9}
    out = dec.generate([prompt], max_new_tokens=48)
    assert out.new_tokens[0].tolist() == reference_greedy(target, prompt, 48)
    assert seen and all(f is not None and 0 <= f <= g for f, g in seen)
    assert sum(f for f, _ in seen) == out.stats.num_draft_forwards
    assert any(f < g for f, g in seen)  # the lookup covered positions
    assert dec._adaptive.draft_forward_share < 1.0
