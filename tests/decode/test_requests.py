"""The request API: requests join and leave a running batch, each with its own settings and seed."""
import json

import pytest
import torch

from decode import SpeculativeDecoder
from decode.requests import Request, RequestIds, check_num_draft_tokens, row_gammas
from decode.sampling import SamplingParams
from tests.conftest import perturbed_copy, tiny_llama
from tests.decode.test_engine import prompts_of, reference_greedy


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0, layers=2)
    return target, perturbed_copy(target, 0.6)


def run_all(dec):
    """Step until idle; returns {request_id: RequestOutput}."""
    out = {}
    while dec.has_unfinished():
        out.update((o.request_id, o) for o in dec.step())
    return out


@pytest.mark.parametrize("gamma", [1, 4, "no draft"])
def test_request_added_mid_flight_equals_alone(pair, gamma):
    """"no draft": a request joins a running batch of a target-only decoder (the server without --draft), where
    the batch has no draft cache whose rows could go out of step with the target's."""
    target, draft = pair
    prompts = prompts_of([5, 2, 9, 3], seed=21)
    refs = [reference_greedy(target, p, 20) for p in prompts]
    dec = SpeculativeDecoder(target, None, 0) if gamma == "no draft" else SpeculativeDecoder(target, draft, gamma)
    dec.add_request(prompts[0], max_new_tokens=20, request_id="a")
    dec.add_request(prompts[1], max_new_tokens=20, request_id="b")
    out = {}
    for step in range(100):
        if step == 2:
            dec.add_request(prompts[2], max_new_tokens=20, request_id="c")
        if step == 3:
            assert dec.num_active() == 3
            dec.add_request(prompts[3], max_new_tokens=20, request_id="d")
        out.update((o.request_id, o) for o in dec.step())
        if not dec.has_unfinished():
            break
    assert [out[k].new_tokens for k in "abcd"] == refs
    assert all(out[k].finish_reason == "length" and out[k].prompt_ids == p for k, p in zip("abcd", prompts))


@pytest.mark.parametrize("gamma", [2, 4])
def test_seeded_request_alone_equals_among_seven_others(pair, gamma):
    target, draft = pair
    prompt = prompts_of([6], seed=3)[0]
    settings = dict(max_new_tokens=24, temperature=1.0, top_k=30, seed=123)
    alone = SpeculativeDecoder(target, draft, gamma)
    alone.add_request(prompt, **settings, request_id="x")
    ref = run_all(alone)["x"].new_tokens
    others = prompts_of([3, 8, 1, 5, 12, 4, 7], seed=9)
    dec = SpeculativeDecoder(target, draft, gamma)
    for i, p in enumerate(others[:4]):  # different settings, budgets, seeds; one greedy
        dec.add_request(p, max_new_tokens=5 + 3 * i, temperature=0.7 if i else 0.0, top_p=0.9, seed=i)
    dec.step()
    dec.add_request(prompt, **settings, request_id="x")
    for i, p in enumerate(others[4:]):  # one keeps the whole vocabulary with a top_k beyond it
        dec.add_request(p, max_new_tokens=30, temperature=1.3, min_p=0.05, repetition_penalty=1.2, seed=50 + i,
                        top_k=10**6 if i == 0 else None)
    assert run_all(dec)["x"].new_tokens == ref
    other_seed = SpeculativeDecoder(target, draft, gamma)
    other_seed.add_request(prompt, **{**settings, "seed": 124}, request_id="x")
    assert run_all(other_seed)["x"].new_tokens != ref  # the seed matters


def test_on_tokens_streams_exactly_the_output_and_finish_reasons(pair):
    target, draft = pair
    prompt = prompts_of([6], seed=11)[0]
    ref = reference_greedy(target, prompt, 24)
    eos = ref[5]
    got: dict = {"s": [], "l": []}
    dec = SpeculativeDecoder(target, draft, 3)
    dec.add_request(prompt, max_new_tokens=24, eos_token_id=[eos, 95], request_id="s",
                    on_tokens=lambda rid, toks: got[rid].extend(toks))
    dec.add_request(prompt, max_new_tokens=4, request_id="l", on_tokens=lambda rid, toks: got[rid].extend(toks))
    out = run_all(dec)
    assert out["s"].new_tokens == ref[: ref.index(eos) + 1] == got["s"] and out["s"].finish_reason == "stop"
    assert out["l"].new_tokens == ref[:4] == got["l"] and out["l"].finish_reason == "length"
    assert out["l"].stats.num_new_tokens == 4 and out["l"].stats.num_sequences == 1


def test_abort_removes_the_row_and_others_continue(pair):
    target, draft = pair
    prompts = prompts_of([4, 7, 2], seed=5)
    dec = SpeculativeDecoder(target, draft, 3)
    ids = [dec.add_request(p, max_new_tokens=16) for p in prompts]
    assert len(set(ids)) == 3
    waiting = dec.add_request([5, 6], max_new_tokens=16)
    assert dec.abort(waiting) and not dec.abort(waiting)
    dec.step()
    assert dec.num_active() == 3
    assert dec.abort(ids[1]) and dec.num_active() == 2 and not dec.abort("nope")
    out = run_all(dec)
    assert set(out) == {ids[0], ids[2]}
    assert out[ids[2]].new_tokens == reference_greedy(target, prompts[2], 16)
    assert dec.step() == [] and not dec.has_unfinished()


def test_duplicate_request_id_is_rejected(pair):
    dec = SpeculativeDecoder(*pair, 2)
    dec.add_request([4, 5], request_id=7)
    with pytest.raises(ValueError, match="request_id"):
        dec.add_request([4, 5], request_id=7)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"),
    (dict(seed=1.5), "seed"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(prompt_ids=[]), "prompt_ids"),
    (dict(prompt_ids=[5, 500]), "prompt_ids"), (dict(prompt_ids=list(range(3, 259))), "prompt_ids"),
    (dict(eos_token_id="x"), "eos_token_id"), (dict(request_id=1.5), "request_id"), (dict(on_tokens=3), "on_tokens"),
    (dict(eos_token_id=[2.0]), "eos_token_id"), (dict(eos_token_id=torch.tensor(2.0)), "eos_token_id"),
    # a string was read digit by digit ("57" -> [5, 7]) and floats were truncated (5.5 -> 5)
    (dict(prompt_ids="57"), "prompt_ids"), (dict(prompt_ids=[5.5, 6]), "prompt_ids"),
    (dict(prompt_ids=torch.tensor([5.5, 6.0])), "prompt_ids"),
])
def test_bad_arguments_name_the_argument(pair, kwargs, match):
    dec = SpeculativeDecoder(*pair, 2)
    kwargs = {"prompt_ids": [4, 5], **kwargs}
    with pytest.raises(ValueError, match=match):
        dec.add_request(**kwargs)
    assert not dec.has_unfinished()


def test_numpy_scalars_are_numbers_as_python_ones_are(pair):
    """np.float32 temperature / np.int64 top_k and max_new_tokens (what a sweep over np.linspace or a config read
    with numpy gives) were refused as 'must be a finite number' / 'an integer'; np.float64 passed only by being a
    float subclass."""
    import numpy as np

    prompt = prompts_of([5], seed=3)[0]
    runs = []
    for t, k, n in ((0.5, 4, 12), (np.float32(0.5), np.int64(4), np.int64(12))):
        dec = SpeculativeDecoder(*pair, 2)
        dec.add_request(prompt, max_new_tokens=n, temperature=t, top_k=k, seed=1)
        runs.append([list(o.new_tokens) for o in run_all(dec).values()])
    assert runs[0] == runs[1] and len(runs[0][0]) == 12


def test_stats_count_only_kept_tokens(pair):
    """Copy draft, γ = 4, eos = the 3rd greedy token: the prefill gives the 1st, the first step keeps 2 tokens (one
    accepted draft + the eos)."""
    target, _ = pair
    prompt = prompts_of([6], seed=11)[0]
    ref = reference_greedy(target, prompt, 8)
    assert ref[2] not in ref[:2]
    dec = SpeculativeDecoder(target, target, 4)
    out = dec.generate([prompt], max_new_tokens=20, eos_token_id=ref[2])
    s = out.stats
    assert out.new_tokens[0].tolist() == ref[:3]
    assert (s.num_drafted, s.num_accepted, s.num_verify_steps, s.num_rejections) == (1, 1, 1, 0)
    assert s.mean_accepted_length == 2.0 and s.acceptance_rate == 1.0
    assert s.accepted_length_histogram == [0, 1] and s.accepted_per_position == [1]
    assert s.num_first_step_tokens == 1 and s.num_target_forwards == 1


# ---------------------------------------------------------------- "auto" γ
def test_auto_gamma_same_seed_same_output(pair):
    target, draft = pair
    prompts = prompts_of([5, 9, 3], seed=2)
    dec = SpeculativeDecoder(target, draft, "auto", max_auto_draft_tokens=6)
    run = lambda d: [t.tolist() for t in d.generate(prompts, max_new_tokens=30, temperature=1.0,  # noqa: E731
                                                    generator=torch.Generator().manual_seed(4)).new_tokens]
    first = run(dec)
    assert 4 in dec.auto_costs and set(dec.auto_costs) <= {1, 2, 4}  # measured once per power-of-two batch size
    assert run(dec) == first
    assert run(SpeculativeDecoder(target, draft, "auto", max_auto_draft_tokens=6, auto_costs=dec.auto_costs)) == first
    saved = json.loads(json.dumps(dec.auto_costs))  # as kept in a file: batch sizes become string keys
    again = SpeculativeDecoder(target, draft, "auto", max_auto_draft_tokens=6, auto_costs=saved)
    assert run(again) == first and again.auto_costs == dec.auto_costs  # nothing re-measured


def test_bad_auto_settings_are_refused_at_construction(pair):
    for name in ("static_cache", "few_row_linear"):  # 'yes' was taken as True, 0.5 too
        for bad in ("yes", 0.5, 1):
            with pytest.raises(ValueError, match=f"{name} must be None .*True or False, got {bad!r}"):
                SpeculativeDecoder(*pair, 2, **{name: bad})
    with pytest.raises(ValueError, match="max_auto_draft_tokens"):
        SpeculativeDecoder(*pair, "auto", max_auto_draft_tokens=0)
    with pytest.raises(ValueError, match=r"auto_costs\[1\]"):
        SpeculativeDecoder(*pair, "auto", auto_costs={1: {"cost_ratio": 0.1}})
    with pytest.raises(ValueError, match="auto_costs"):
        SpeculativeDecoder(*pair, "auto", auto_costs={"1": {"cost_ratio": -1.0, "verify": [1.0]}})
    for bad in ({"cost_ratio": float("inf"), "verify": [1.0]}, {"cost_ratio": 0.1, "verify": [1.0, float("nan")]}):
        with pytest.raises(ValueError, match="auto_costs"):
            SpeculativeDecoder(*pair, "auto", auto_costs={1: bad})


def test_auto_gamma_goes_to_zero_when_drafting_does_not_pay(pair):
    target, _ = pair
    useless = tiny_llama(seed=1, layers=1)
    expensive = {1: {"cost_ratio": 0.9, "verify": [1.0] + [1.5] * 8}}
    prompt = prompts_of([6], seed=4)[0]
    out = SpeculativeDecoder(target, useless, "auto", auto_costs=expensive).generate([prompt], max_new_tokens=40)
    assert out.new_tokens[0].tolist() == reference_greedy(target, prompt, 40)
    s = out.stats
    assert s.num_target_forwards >= 38 and s.num_drafted <= 2 + 40 // 8  # 2 warm-up steps at γ=1, then probes only
    cheap = {1: {"cost_ratio": 0.01, "verify": [1.0] * 9}}
    out = SpeculativeDecoder(target, target, "auto", auto_costs=cheap).generate([prompt], max_new_tokens=40)
    assert len(out.stats.accepted_per_position) == 8  # a perfect draft at no cost: γ reaches max_auto_draft_tokens


def test_auto_gamma_plans_static_batches_from_each_rows_acceptance(pair, monkeypatch):
    """generate() waits for its last row: auto γ plans from the rows' own acceptance and remaining budgets
    (AdaptiveGamma.plan_batch); requests of the step API (a server's continuous batch) keep the pooled choice."""
    from decode.speedup import AdaptiveGamma

    target, draft = pair
    calls = []
    real = AdaptiveGamma.plan_batch

    def spy(self, rows, remaining):
        calls.append(([(r.accepted, r.trials) for r in rows], list(remaining)))
        return real(self, rows, remaining)

    monkeypatch.setattr(AdaptiveGamma, "plan_batch", spy)
    prompts = prompts_of([5, 9, 3], seed=6)
    costs = {b: {"cost_ratio": 0.1, "verify": [1.0] * 7} for b in (1, 2, 4)}
    dec = SpeculativeDecoder(target, draft, "auto", max_auto_draft_tokens=6, auto_costs=costs)
    out = dec.generate(prompts, max_new_tokens=12)
    assert [t.tolist() for t in out.new_tokens] == [reference_greedy(target, p, 12) for p in prompts]
    assert calls and all(len(rows) == len(left) >= 2 for rows, left in calls)
    assert calls[0] == ([(0.0, 0.0)] * 3, [11] * 3)  # nothing learnt yet; the prefill gave each row a token
    assert any(trials > 0 for rows, _ in calls[1:] for _, trials in rows)  # each row's own counts
    calls.clear()
    for p in prompts:
        dec.add_request(p, max_new_tokens=12)
    while dec.has_unfinished():
        dec.step()
    assert calls == []


def test_a_raising_on_tokens_loses_no_finished_request(pair):
    """An on_tokens exception loses no request that finished in the same step: the next step() returns them, and
    has_unfinished() stays True until it has."""
    target, draft = pair
    dec = SpeculativeDecoder(target, draft, 2)
    calls = []

    def boom(rid, tokens):
        calls.append(tokens)
        if len(calls) <= 2:  # two steps in a row fail: the first one's finished request must survive both
            raise RuntimeError("callback failed")

    dec.add_request([5, 6, 7], max_new_tokens=1, request_id="short")
    dec.add_request([5, 6, 7], max_new_tokens=6, request_id="cb", on_tokens=boom)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="callback failed"):
            dec.step()
    assert dec.has_unfinished()
    out = run_all(dec)
    assert set(out) == {"short", "cb"}
    assert len(out["short"].new_tokens) == 1 and len(out["cb"].new_tokens) == 6
    assert sum(calls, []) == out["cb"].new_tokens
    assert not dec.has_unfinished()


@pytest.mark.parametrize("eos", [torch.tensor(2), torch.tensor([2, 99]), [torch.tensor(2)]])
def test_eos_token_id_may_be_a_tensor(pair, eos):
    """A tensor eos_token_id (0-d or 1-D, e.g. from a batch) is taken as its ids."""
    import numpy as np

    dec = SpeculativeDecoder(*pair, 2)
    dec.add_request([4, 5], max_new_tokens=12, eos_token_id=2, request_id="int")
    ref = run_all(dec)["int"].new_tokens
    for e in (eos, np.int64(2)):
        dec.add_request([4, 5], max_new_tokens=12, eos_token_id=e, request_id="t")
        assert run_all(dec)["t"].new_tokens == ref


def test_request_aborted_by_another_callback_gets_no_more_tokens(pair):
    """Aborting b from a's on_tokens returned True, yet b's on_tokens was still called for that step."""
    dec = SpeculativeDecoder(*pair, 2)
    got = {"a": [], "b": []}

    def on_a(rid, tokens):
        got["a"].append(tokens)
        if len(got["a"]) == 1:
            assert dec.abort("b")

    dec.add_request([5, 6, 7], max_new_tokens=6, request_id="a", on_tokens=on_a)
    dec.add_request([5, 6, 7], max_new_tokens=6, request_id="b", on_tokens=lambda r, t: got["b"].append(t))
    out = run_all(dec)
    assert set(out) == {"a"} and got["b"] == [] and sum(got["a"], []) == out["a"].new_tokens


def test_a_callback_that_steps_is_refused_and_streams_stay_in_order(pair):
    """A step() from inside an on_tokens callback is refused (a nested step would stream another request's tokens
    out of order and return the requests finishing in it only to the callback)."""
    dec = SpeculativeDecoder(*pair, 2)
    got = {"a": [], "b": []}
    refused = []

    def on_a(rid, tokens):
        got["a"].extend(tokens)
        try:
            dec.step()
        except RuntimeError as err:
            refused.append(str(err))

    dec.add_request([5, 6, 7], max_new_tokens=8, request_id="a", on_tokens=on_a)
    dec.add_request([4, 5], max_new_tokens=8, request_id="b", on_tokens=lambda r, t: got["b"].extend(t))
    out = run_all(dec)
    assert refused and "while a step is running" in refused[0]
    assert set(out) == {"a", "b"} and got == {"a": out["a"].new_tokens, "b": out["b"].new_tokens}
    dec.add_request([5, 6, 7], max_new_tokens=2, request_id="after")
    assert run_all(dec)["after"].new_tokens  # the guard is released after a step


def test_ids_that_are_bools_and_masks_other_than_0_1_are_refused(pair):
    """A bool tensor (a mask passed as ids) ran as ids 1 and 0; a mask value such as 0.5 counted as 1."""
    dec = SpeculativeDecoder(*pair, 2)
    for ids in (torch.tensor([True, False, True]), [True, 5]):
        with pytest.raises(ValueError, match="integer token ids"):
            dec.add_request(ids)
        with pytest.raises(ValueError, match="integer token ids"):
            dec.generate(ids, max_new_tokens=2)
    with pytest.raises(ValueError, match="only 0 .padding. and 1"):
        dec.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[0.5, 1.0, 1.0]]), max_new_tokens=2)


def test_num_draft_tokens_can_change_between_requests_only(pair):
    """The bench's continuous-batching runs set γ on one decoder between streams: the next requests draft that many
    tokens; a bad γ is refused as by the constructor, and a change while requests are in flight is refused."""
    target, draft = pair
    prompt = prompts_of([6], seed=3)[0]
    dec = SpeculativeDecoder(target, draft, 4)
    for gamma, drafted_per_step in ((2, 2), (0, 0), ("auto", None)):
        dec.num_draft_tokens = gamma
        assert dec.num_draft_tokens == gamma
        dec.add_request(prompt, max_new_tokens=9, request_id="r")
        out = run_all(dec)["r"]
        assert out.new_tokens == reference_greedy(target, prompt, 9)
        if drafted_per_step is not None:  # the last step may draft fewer (the budget's end)
            assert out.stats.num_drafted <= drafted_per_step * out.stats.num_verify_steps
            assert out.stats.num_drafted >= drafted_per_step * (out.stats.num_verify_steps - 1)
    for bad in (-1, 1.5, "best", True):
        with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 0 or 'auto'"):
            dec.num_draft_tokens = bad
    dec.add_request(prompt, max_new_tokens=9)
    with pytest.raises(RuntimeError, match="only between requests"):
        dec.num_draft_tokens = 2
    assert dec.num_draft_tokens == "auto"
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeDecoder(target, None, 0).num_draft_tokens = 2


def test_request_ids_default_to_the_next_free_req_n_and_refuse_one_in_use():
    ids = RequestIds()
    assert ids.claim("req-0") == "req-0" and ids.claim(None) == "req-1" and ids.claim(7) == 7
    with pytest.raises(ValueError, match="already queued or active"):
        ids.claim(7)
    with pytest.raises(ValueError, match="must be a str, an int or None"):
        ids.claim(True)
    ids.discard(7)
    assert ids.claim(7) == 7


def test_row_gammas_cut_gamma_to_each_rows_budget_and_both_contexts():
    def row(max_new, done):
        r = Request("r", [1], SamplingParams(), max_new, frozenset(), torch.Generator())
        r.new_tokens = [2] * done
        return r

    rows = [row(10, 0), row(3, 0), row(10, 9), row(10, 0)]
    committed = [[1] * 5, [1] * 5, [1] * 14, [1] * 18]
    # budget 10 -> 4; budget 3 -> 2; one token left -> 0; context 20 - 18 = 2 left -> min(4, 1, draft ctx 19 - 18)
    assert row_gammas(4, rows, committed, context_length=20, draft_context_length=19) == [4, 2, 0, 1]
    assert rows[3].remaining(18, 20) == 2 and rows[3].remaining(18, None) == 10


@pytest.mark.parametrize("gamma, has_draft, error", [(3, True, None), ("auto", True, None), (0, False, None),
                                                     ("auto", False, "needs a draft"), (2, False, "needs a draft"),
                                                     (-1, True, "integer >= 0"), (True, True, "integer >= 0")])
def test_check_num_draft_tokens(gamma, has_draft, error):
    if error is None:
        assert check_num_draft_tokens(gamma, has_draft) == gamma
    else:
        with pytest.raises(ValueError, match=error):
            check_num_draft_tokens(gamma, has_draft)
