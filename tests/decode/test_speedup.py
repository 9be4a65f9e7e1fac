"""Leviathan et al. (2023) speedup formulas and the adaptive γ controller."""
import pytest

from decode.speedup import (AdaptiveGamma, AlphaEstimate, best_gamma, cost_bucket, cost_buckets, end_to_end_speedup,
                            expected_tokens_per_step, makespan_gamma, monotone_costs, predicted_speedup,
                            simulate_batch_speedup, simulate_speedup, verify_cost_at)


def test_expected_tokens_matches_series():
    for alpha in (0.0, 0.3, 0.8, 0.99):
        for gamma in range(0, 9):
            series = sum(alpha ** i for i in range(gamma + 1))  # E = Σ_{i=0..γ} α^i
            assert expected_tokens_per_step(alpha, gamma) == pytest.approx(series)
    assert expected_tokens_per_step(1.0, 4) == 5


def test_predicted_speedup_values():
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))
    assert predicted_speedup(0.5, 0, 0.1) == 1.0
    assert predicted_speedup(0.0, 3, 0.1) < 1.0  # a useless draft only costs


def test_end_to_end_speedup_adds_the_prefill_to_both_sides():
    # plain: 75 ms prefill + 1029 ms decode; ours: the prefill and the draft's (12 ms), the decode 2.385x faster
    plain, ours = 75 + 1029, 75 + 12 + 1029 / 2.385
    assert end_to_end_speedup(2.385, 75 / plain, 12 / 75) == pytest.approx(plain / ours)
    assert end_to_end_speedup(2.385, 0.0, 0.5) == pytest.approx(2.385)  # no prefill: the per-step speedup
    assert end_to_end_speedup(2.385, 1.0, 0.25) == pytest.approx(1 / 1.25)  # all prefill: the draft's only costs
    assert end_to_end_speedup(0.8, 0.3, 0.0) > 0.8  # a losing decode phase loses less with a prefill beside it
    for bad, match in (((0.0, 0.1, 0.1), "decode_speedup"), ((float("nan"), 0.1, 0.1), "decode_speedup"),
                       ((float("inf"), 0.0, 0.1), "decode_speedup"), ((True, 0.5, 0.0), "decode_speedup"),
                       (("2", 0.5, 0.0), "decode_speedup"), ((1.5, None, 0.0), "prefill_share"),
                       ((1.5, 0.2, float("inf")), "prefill_cost_ratio"),
                       ((2.0, 1.5, 0.1), "prefill_share"), ((2.0, -0.1, 0.1), "prefill_share"),
                       ((2.0, float("nan"), 0.1), "prefill_share"), ((2.0, 0.1, -1.0), "prefill_cost_ratio"),
                       ((2.0, 0.1, float("nan")), "prefill_cost_ratio")):
        with pytest.raises(ValueError, match=match):
            end_to_end_speedup(*bad)


def test_best_gamma():
    assert best_gamma(0.9, 0.01, 16) >= 8
    assert best_gamma(0.2, 0.5, 16, min_gamma=0) == 0
    assert best_gamma(0.2, 0.5, 16, min_gamma=1) == 1
    g = best_gamma(0.8, 0.05, 16)
    assert all(predicted_speedup(0.8, g, 0.05) >= predicted_speedup(0.8, k, 0.05) for k in range(17))


def test_best_gamma_with_verify_costs():
    # Verify costs that grow with γ pull the choice down: with v = 1 the best γ at α = 0.9, c = 0.1 is 10;
    # a verify that costs 1 + 0.2 γ moves it to 5.
    v = [1.0 + 0.2 * g for g in range(17)]
    free = best_gamma(0.9, 0.1, 16)
    priced = best_gamma(0.9, 0.1, 16, verify_costs=v)
    assert (free, priced) == (10, 5)
    assert all(predicted_speedup(0.9, priced, 0.1, v[priced]) >= predicted_speedup(0.9, k, 0.1, v[k])
               for k in range(17))
    # γ past the end of the list falls back to v = 1 (Leviathan et al.)
    assert best_gamma(0.9, 0.1, 16, verify_costs=[1.0]) == free
    with pytest.raises(ValueError, match="max_gamma"):
        best_gamma(0.9, 0.1, max_gamma=1, min_gamma=2)


@pytest.mark.parametrize("bad", [dict(alpha=1.5, gamma=2), dict(alpha=0.5, gamma=-1)])
def test_bad_values(bad):
    with pytest.raises(ValueError):
        expected_tokens_per_step(**bad)
    with pytest.raises(ValueError):
        predicted_speedup(0.5, 2, -1.0)


def test_adaptive_gamma_follows_acceptance():
    ctl = AdaptiveGamma(max_gamma=8)
    for _ in range(30):
        ctl.update(num_drafted=ctl.gamma, num_accepted=ctl.gamma, draft_s_per_forward=0.01, target_s_per_forward=1.0)
    assert ctl.gamma == 8 and ctl.alpha > 0.95
    for _ in range(60):
        ctl.update(num_drafted=ctl.gamma, num_accepted=0, draft_s_per_forward=0.01, target_s_per_forward=1.0)
    assert ctl.gamma == 1 and ctl.alpha < 0.05
    assert ctl.cost_ratio == pytest.approx(0.01)


def test_adaptive_gamma_estimates_per_token_alpha_not_the_acceptance_rate():
    # α = 0.8 as truncated-geometric runs at γ = 4: per step 4 drafted, on average 2.36 accepted and 0.59
    # rejections. Σaccepted / Σdrafted would give 0.59; the per-token estimate must give 0.8.
    ctl = AdaptiveGamma(max_gamma=8, decay=1.0, prior_weight=0.0)
    for n in [4, 4, 0, 4, 1, 4, 2, 4, 3, 4] * 20:  # per 10 steps: 30 accepted, 4 rejections, 40 drafted
        ctl.update(num_drafted=4, num_accepted=n, num_rejected=int(n < 4))
    assert ctl.alpha == pytest.approx(30 / 34)
    rate = AdaptiveGamma(max_gamma=8, decay=1.0, prior_weight=0.0)
    for n in [4, 4, 0, 4, 1, 4, 2, 4, 3, 4] * 20:
        rate.update(num_drafted=4, num_accepted=n)  # no rejection count: trials = drafted (old behaviour)
    assert rate.alpha == pytest.approx(30 / 40)


def test_adaptive_gamma_drafts_during_warmup_then_follows_the_cost_model():
    ctl = AdaptiveGamma(max_gamma=8, initial_gamma=4, warmup_steps=2)
    ctl.set_costs(0.9, [1.0] + [1.5] * 8)  # drafting never pays at these costs
    assert ctl.gamma == 0 and ctl.next_gamma() == 4  # but α is unknown yet: draft to learn it
    ctl.update(num_drafted=4, num_accepted=0, num_rejected=1)
    assert ctl.next_gamma() == 4
    ctl.update(num_drafted=4, num_accepted=0, num_rejected=1)
    assert ctl.next_gamma() in (0, 1)  # warm-up over: plain steps with a 1-token probe every probe_every


def test_adaptive_gamma_warmup_follows_the_model_at_the_prior_but_drafts_at_least_one():
    cheap = AdaptiveGamma(max_gamma=8)
    cheap.set_costs(0.05)  # at the prior α = 0.8 a long γ pays
    assert cheap.next_gamma() == best_gamma(0.8, 0.05, 8) > 1
    dear = AdaptiveGamma(max_gamma=8)
    dear.set_costs(0.9, [1.0] + [1.5] * 8)  # drafting never pays at these costs
    assert dear.gamma == 0 and dear.next_gamma() == 1  # but α is unknown yet: draft to learn it


def test_a_short_verify_cost_list_extends_with_its_last_value():
    v = [1.0, 1.45, 1.5, 1.55, 1.6, 1.63, 1.67, 1.7, 1.74]
    assert verify_cost_at(v, 12) == 1.74 and verify_cost_at(v, 0) == 1.0 and verify_cost_at(None, 5) == 1.0
    # γ = 9 must not look cheaper than γ = 8 because the list ends at 8 (it did: v = 1 beyond the end)
    assert best_gamma(0.8, 0.18, max_gamma=16, verify_costs=v) == best_gamma(0.8, 0.18, max_gamma=8, verify_costs=v)
    ctl = AdaptiveGamma(max_gamma=16)
    ctl.set_costs(0.18, v)
    assert ctl.gamma <= 8


def test_adaptive_gamma_prices_a_drafted_position_by_the_draft_forwards_it_ran():
    """With prompt lookup a covered position runs no draft forward: the choice counts c·f per drafted position (f =
    forwards / positions), so it drafts longer where the lookup covers; where every position is a forward (no
    lookup) f stays exactly 1 and every choice is the one made without the counts."""
    plain, counted, covered = (AdaptiveGamma(max_gamma=16) for _ in range(3))
    for ctl in (plain, counted, covered):
        ctl.set_costs(0.5, [1.0] + [1.1] * 16)
    for _ in range(20):  # the same counts for all three: γ = 4, 3 accepted, one rejection
        plain.update(4, 3, num_rejected=1)
        counted.update(4, 3, num_rejected=1, num_draft_forwards=4, step_gamma=4)
        covered.update(4, 3, num_rejected=1, num_draft_forwards=1, step_gamma=4)  # 3 of 4 positions from lookup
        assert counted.gamma == plain.gamma and counted.draft_forward_share == 1.0
    assert covered.alpha == plain.alpha and covered.draft_forward_share == pytest.approx(0.25, abs=0.05)
    assert covered.drafting_cost_ratio == pytest.approx(0.5 * covered.draft_forward_share)
    assert plain.gamma == best_gamma(plain.alpha, 0.5, 16, verify_costs=[1.0] + [1.1] * 16)
    assert covered.gamma == best_gamma(plain.alpha, covered.drafting_cost_ratio, 16, verify_costs=[1.0] + [1.1] * 16)
    assert covered.gamma > plain.gamma


@pytest.mark.parametrize("forwards,gamma", [(5, 4), (-1, 4), (1, None), (None, 4), (float("inf"), float("inf")),
                                            (1.5, 4), (True, 4), ("2", "4"), (2, 5), (0, 0)])
def test_adaptive_gamma_refuses_impossible_forward_counts(forwards, gamma):
    with pytest.raises(ValueError, match="num_draft_forwards"):
        ctl = AdaptiveGamma(max_gamma=8)  # γ 5 > num_drafted 4 and γ 0 are impossible for a step that drafted 4
        ctl.update(4, 3, num_rejected=1, num_draft_forwards=forwards, step_gamma=gamma)
    assert ctl.draft_forward_share == 1.0 and ctl.update(4, 3, num_rejected=1, num_draft_forwards=2, step_gamma=4) >= 0


@pytest.mark.parametrize("kwargs,name", [
    ({"max_gamma": 0}, "max_gamma"), ({"min_gamma": -1}, "min_gamma"), ({"min_gamma": 9}, "min_gamma"),
    ({"decay": 0.0}, "decay"), ({"decay": 1.5}, "decay"), ({"prior_alpha": 1.5}, "prior_alpha"),
    ({"prior_weight": -4}, "prior_weight"), ({"probe_every": 0}, "probe_every"), ({"warmup_steps": -1}, "warmup_steps"),
])
def test_adaptive_gamma_refuses_bad_settings_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AdaptiveGamma(**{"max_gamma": 8, **kwargs})


def test_adaptive_gamma_refuses_impossible_counts_and_costs():
    ctl = AdaptiveGamma(max_gamma=8)
    with pytest.raises(ValueError, match="num_accepted"):
        ctl.update(num_drafted=4, num_accepted=5)
    with pytest.raises(ValueError, match="num_rejected"):
        ctl.update(num_drafted=4, num_accepted=4, num_rejected=1)  # all accepted: no row was rejected
    with pytest.raises(ValueError, match="verify_costs"):
        ctl.set_costs(0.1, [1.0, 0.0])
    with pytest.raises(ValueError, match="cost_ratio"):
        ctl.set_costs(-0.1)


@pytest.mark.parametrize("args,name", [((-1, 0.8, 0.1), "gamma"), ((2.5, 0.8, 0.1), "gamma"),
                                       ((AdaptiveGamma(4), 0.8, 0.1), "gamma"), ((4, 0.8, -1.0), "cost_ratio"),
                                       ((4, 0.8, float("nan")), "cost_ratio")])
def test_simulate_speedup_refuses_bad_arguments_naming_them(args, name):
    with pytest.raises(ValueError, match=name):
        simulate_speedup(*args)


# CPU costs of the quickstart pair (c, v_γ at batch 1; docs/results/2026-11-29-bench-highlights-quickstart-pair.md)
CPU_C, CPU_V = 0.18, [1.0, 1.45, 1.5, 1.55, 1.6, 1.63, 1.67, 1.7, 1.74]


def test_simulate_speedup_agrees_with_the_closed_form_on_long_runs():
    for alpha, gamma in [(0.8, 4), (0.6, 2), (1.0, 3)]:
        sim = simulate_speedup(gamma, alpha, 0.1, max_new_tokens=4000, runs=4)
        assert sim == pytest.approx(predicted_speedup(alpha, gamma, 0.1), rel=0.02)
    assert simulate_speedup(0, 0.9, 0.1, max_new_tokens=50, runs=2) == 1.0  # plain decoding
    with pytest.raises(ValueError, match="alpha"):
        simulate_speedup(4, 1.5, 0.1)


@pytest.mark.parametrize("alpha", [0.7, 0.8, 0.9, 1.0])
def test_auto_gamma_defaults_come_near_the_best_fixed_gamma_on_short_generations(alpha):
    # a fresh controller per 64-token request, as the decoder makes; the old defaults (prior 0.5, 2 warm-up steps
    # at γ = 4) gave 0.916 of the best fixed γ at α = 1 here
    def controller():
        ctl = AdaptiveGamma(max_gamma=8)
        ctl.set_costs(CPU_C, CPU_V)
        return ctl

    best = max(simulate_speedup(g, alpha, CPU_C, CPU_V, runs=300) for g in range(9))
    assert simulate_speedup(controller, alpha, CPU_C, CPU_V, runs=300) >= 0.94 * best


@pytest.mark.parametrize("costs,expected", [
    ([1.4, 1.6, 1.4, 1.6], [1.4, 1.5, 1.5, 1.6]),
    ([1.0, 1.1, 1.2], [1.0, 1.1, 1.2]),
    ([2.0, 1.0, 1.0, 1.0], [1.25, 1.25, 1.25, 1.25]),
])
def test_monotone_costs_is_the_least_squares_non_decreasing_fit(costs, expected):
    out = monotone_costs(costs)
    assert out == pytest.approx(expected)
    assert all(a <= b for a, b in zip(out, out[1:]))
    assert sum(out) == pytest.approx(sum(costs))  # pooling keeps block means


# ---------------------------------------------------------------- static batches: the last row ends the batch
def test_makespan_gamma_equals_best_gamma_for_equal_rows_with_room():
    v = [1.0] + [1.0 + 0.1 * g for g in range(1, 9)]
    for alpha in (0.3, 0.6, 0.8, 0.95):
        assert makespan_gamma([alpha] * 4, [500] * 4, 0.2, 8, verify_costs=v) == best_gamma(alpha, 0.2, 8,
                                                                                               verify_costs=v)


def test_makespan_gamma_drafts_less_for_a_slow_row_than_pooled_alpha_would():
    v = [1.0] + [1.0 + 0.15 * g for g in range(1, 9)]
    alphas = [1.0] * 7 + [0.2]
    pooled = (7 * 4 + 0.2) / (7 * 4 + 1.2)  # accepted / (accepted + rejections) at γ = 4, ~0.96
    assert best_gamma(pooled, 0.2, 8, verify_costs=v) >= 4
    assert makespan_gamma(alphas, [60] * 8, 0.2, 8, verify_costs=v) == 0  # the α = 0.2 row gains < its cost
    # ... unless that row is nearly done and the others are not: then the fast rows set the end.
    assert makespan_gamma(alphas, [60] * 7 + [2], 0.2, 8, verify_costs=v) >= 4


def test_makespan_gamma_never_drafts_past_every_budget():
    assert makespan_gamma([1.0, 1.0], [1, 1], 0.01, 8) == 0  # one token left each: a draft cannot be kept
    assert makespan_gamma([1.0, 1.0], [3, 2], 0.01, 8) == 2  # smallest γ that finishes the longest row in a step


@pytest.mark.parametrize("args, match", [(([], []), "non-empty"), (([0.5], [1, 2]), "equal length"),
                                         (([0.5], [0]), "remaining"), (([1.5], [4]), "alpha"),
                                         (([0.5], [float("nan")]), "remaining"), (([0.5], [2.5]), "integers"),
                                         (([0.5], [True]), "integers")])
def test_makespan_gamma_refuses_bad_rows(args, match):
    with pytest.raises(ValueError, match=match):
        makespan_gamma(*args, cost_ratio=0.1)


@pytest.mark.parametrize("verify", [[], [1.0, float("nan")], [1.0, -5.0], [1.0, float("inf")]])
def test_makespan_gamma_refuses_bad_verify_costs(verify):
    with pytest.raises(ValueError, match="verify_costs"):
        makespan_gamma([0.9], [10], 0.2, 8, verify_costs=verify)


def test_alpha_estimate_refuses_bad_settings():
    for decay in (0.0, -1.0, 2.0, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            AlphaEstimate(decay)
    est = AlphaEstimate()
    for prior, weight in ((float("nan"), 8.0), (2.0, 8.0), (0.5, -8.0), (0.5, float("nan"))):
        with pytest.raises(ValueError, match="prior"):
            est.alpha(prior, weight)
    with pytest.raises(ValueError, match="num_accepted"):
        est.update(2.5, 1.5)


def test_alpha_estimate_counts_trials_like_the_pooled_controller_and_shrinks_to_the_prior():
    est = AlphaEstimate(decay=1.0)
    assert est.alpha(0.7, 8.0) == 0.7  # no trial yet: the prior
    est.update(4, 4)   # 4 accepted, no rejection
    est.update(4, 1)   # 1 accepted, then a rejection
    est.update(0, 0)   # nothing drafted: nothing learnt
    assert (est.accepted, est.trials) == (5.0, 6.0)
    assert est.alpha(0.0, 0.0) == pytest.approx(5 / 6)
    assert est.alpha(0.5, 4.0) == pytest.approx((5 + 2) / 10)
    with pytest.raises(ValueError, match="num_accepted"):
        est.update(2, 3)


def test_plan_batch_uses_each_rows_own_alpha():
    ctl = AdaptiveGamma(max_gamma=8)
    ctl.set_costs(0.3, [1.0] + [1.0 + 0.2 * g for g in range(1, 9)])
    fast, slow = AlphaEstimate(), AlphaEstimate()
    for _ in range(20):
        fast.update(4, 4)
        slow.update(4, 0)
        ctl.update(8, 4, num_rejected=1)
    assert ctl.gamma >= 2  # the pooled α (0.8) pays for drafting
    assert slow.alpha(ctl.alpha, ctl.ROW_PRIOR_WEIGHT) < 0.4  # shrunk toward 0.8, still low
    assert ctl.plan_batch([fast] * 3 + [slow], [50] * 4) == 0 and ctl.next_gamma() in (0, 1)  # γ = 0 or a probe
    assert ctl.plan_batch([fast] * 4, [50] * 4) >= 4
    ctl.update(16, 16, num_rejected=0)
    assert ctl.gamma == best_gamma(ctl.alpha, 0.3, 8, verify_costs=ctl._verify)  # back to the pooled choice


def _batch_costs(slope_per_row=0.025):
    """A synthetic per-batch-size cost model shaped like the quickstart pair's on a 2-core CPU: the target's step
    grows ~1 ms per row from 8 ms, the verify's relative cost grows with γ and with the batch."""
    return {b: {"cost_ratio": 0.25 if b <= 2 else 0.2, "target_forward_s": 0.008 + 0.001 * (b - 1),
                "verify": [1.0] + [1.0 + (0.02 + slope_per_row * b) * (g + 1) for g in range(1, 9)]}
            for b in (1, 2, 4, 8)}


def test_simulate_batch_speedup_of_one_row_is_simulate_speedup():
    costs = _batch_costs()
    one = {"1": costs[1]}  # string keys, as read from JSON
    for alpha in (0.4, 0.9):
        for g in (0, 2, 5):
            assert simulate_batch_speedup(g, [alpha], one, 40, runs=30, seed=3) == pytest.approx(
                simulate_speedup(g, alpha, costs[1]["cost_ratio"], costs[1]["verify"], 40, runs=30, seed=3))

    def factory():
        return AdaptiveGamma(8)

    assert simulate_batch_speedup(factory, [0.8], one, 40, runs=30, seed=3) == pytest.approx(
        simulate_speedup(lambda: _with_costs(costs[1]), 0.8, costs[1]["cost_ratio"], costs[1]["verify"], 40,
                         runs=30, seed=3))


def _with_costs(entry):
    ctl = AdaptiveGamma(8)
    ctl.set_costs(entry["cost_ratio"], entry["verify"])
    return ctl


def test_simulate_batch_speedup_plain_is_one_and_bad_costs_are_refused():
    assert simulate_batch_speedup(0, [0.2, 0.9, 1.0], _batch_costs(), 30, runs=5) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="batch size 4"):
        simulate_batch_speedup(2, [0.5] * 3, {1: _batch_costs()[1], 2: _batch_costs()[2]}, 30, runs=2)
    for key, value, match in (("target_forward_s", None, "lacks target_forward_s"), ("cost_ratio", -1.0, "cost_ratio"),
                              ("verify", [], "verify")):
        costs = _batch_costs()
        if value is None:
            del costs[2][key]
        else:
            costs[2][key] = value
        with pytest.raises(ValueError, match=match):
            simulate_batch_speedup(2, [0.5] * 2, costs, 30, runs=2)
    with pytest.raises(ValueError, match="alphas"):
        simulate_batch_speedup(2, [1.5], _batch_costs(), 30, runs=2)


def test_the_static_batch_planner_beats_the_pooled_choice_when_a_few_rows_accept_little():
    """The case measured on quickstart pair H (docs/results/2026-12-04-auto-gamma-static-batches.md): at batch 8 the pooled
    choice drafts for the rows that accept most while the slow rows end the batch; the planner drafts for the last
    row. With equal rows it costs little (it ignores that the batch shrinks, so it is conservative)."""
    def factory():
        return AdaptiveGamma(8)

    costs = _batch_costs()
    slow_rows = [0.3, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95, 1.0]
    pooled = simulate_batch_speedup(factory, slow_rows, costs, 64, runs=150, plan=False)
    planned = simulate_batch_speedup(factory, slow_rows, costs, 64, runs=150, plan=True)
    assert pooled < 0.92 and planned > pooled + 0.05
    for equal in ([0.64] * 8, [0.85] * 8, [0.64] * 4):
        pooled = simulate_batch_speedup(factory, equal, costs, 64, runs=150, plan=False)
        planned = simulate_batch_speedup(factory, equal, costs, 64, runs=150, plan=True)
        assert planned > 0.97 * pooled


def test_cost_buckets_are_the_powers_of_two_a_batch_passes_through():
    assert [cost_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert cost_buckets(1) == [1] and cost_buckets(4) == [1, 2, 4] and cost_buckets(6) == [1, 2, 4, 8]


def test_the_drafts_catch_up_forward_costs_its_excess_after_an_all_accepted_step():
    """After a step that accepted all γ drafts the draft reads two tokens in its next first forward: α^γ (c₂ − c)
    more per step, nothing where the two-token forward costs what a one-token one does."""
    from decode.speedup import catchup_cost

    assert catchup_cost(0.5, 2, 0.1, 0.3) == pytest.approx(0.25 * 0.2)
    assert catchup_cost(0.5, 2, 0.1, None) == catchup_cost(0.5, 0, 0.1, 0.3) == catchup_cost(0.5, 2, 0.1, 0.05) == 0
    base = predicted_speedup(0.6, 2, 0.1, 1.1)
    assert predicted_speedup(0.6, 2, 0.1, 1.1, catchup_cost_ratio=0.1) == base
    assert predicted_speedup(0.6, 2, 0.1, 1.1, catchup_cost_ratio=0.3) == pytest.approx(
        expected_tokens_per_step(0.6, 2) / (0.2 + 1.1 + 0.36 * 0.2))
    # an expensive catch-up weighs most on γ = 1 (α^γ is largest there): the choice moves off it
    v = [1.0, 1.0, 1.25, 1.4, 1.55]
    assert best_gamma(0.55, 0.1, 4, verify_costs=v) == 1
    assert best_gamma(0.55, 0.1, 4, verify_costs=v, catchup_cost_ratio=0.8) == 2
    ctl = AdaptiveGamma(4, prior_alpha=0.55, prior_weight=1e6)
    ctl.set_costs(0.1, v)
    assert ctl.gamma == 1
    ctl.set_costs(0.1, v, catchup_cost_ratio=0.8)
    assert ctl.gamma == 2
    with pytest.raises(ValueError, match="catchup_cost_ratio must be >= 0"):
        ctl.set_costs(0.1, v, catchup_cost_ratio=-1.0)


def test_a_batch_pays_the_catch_up_when_any_row_accepted_all_its_drafts():
    costs = {1: {"cost_ratio": 0.1, "verify": [1.0, 1.1], "target_forward_s": 0.05},
             2: {"cost_ratio": 0.1, "verify": [1.0, 1.1], "target_forward_s": 0.06}}
    dear = {b: {**e, "catchup_cost_ratio": 0.5} for b, e in costs.items()}
    free = {b: {**e, "catchup_cost_ratio": 0.1} for b, e in costs.items()}
    args = dict(alphas=[0.6, 0.6], max_new_tokens=32, runs=50)
    base = simulate_batch_speedup(1, auto_costs=costs, **args)
    assert simulate_batch_speedup(1, auto_costs=free, **args) == base
    assert simulate_batch_speedup(1, auto_costs=dear, **args) < 0.85 * base
    assert simulate_batch_speedup(1, alphas=[0.0, 0.0], auto_costs=dear, max_new_tokens=32, runs=5) == \
        simulate_batch_speedup(1, alphas=[0.0, 0.0], auto_costs=costs, max_new_tokens=32, runs=5)  # never all accepted
    with pytest.raises(ValueError, match="catchup_cost_ratio >= 0"):
        simulate_batch_speedup(1, auto_costs={**costs, 1: {**costs[1], "catchup_cost_ratio": -1}}, **args)
