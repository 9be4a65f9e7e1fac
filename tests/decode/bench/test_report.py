"""The bench's report: the verdict on whether drafting pays off, and the α a draft needs (break-even) by the
verify-aware prediction. Built from hand-made results (exact numbers); the CLI test of tests/decode/test_bench.py
checks the verdict of a real run."""
from __future__ import annotations

import pytest

from decode.bench.report import break_even_alpha, verdict, verdict_lines
from decode.speedup import predicted_speedup


def test_break_even_alpha_at_gamma_1_is_c_plus_v_minus_1():
    alpha, gamma = break_even_alpha(0.10, {1: 1.2})
    assert gamma == 1 and alpha == pytest.approx(0.3, abs=1e-6)
    assert predicted_speedup(alpha, 1, 0.10, 1.2) == pytest.approx(1.0, abs=1e-5)


def test_break_even_alpha_takes_the_gamma_that_needs_the_least():
    costs = {1: 1.6, 2: 1.1, 4: 1.3}  # a slow γ=1 verify (an odd measurement) makes γ=2 the cheapest way to 1
    alpha, gamma = break_even_alpha(0.05, costs)
    assert gamma == 2
    for g, v in costs.items():  # every other γ needs more
        assert predicted_speedup(alpha, g, 0.05, v) <= 1 + 1e-5
    assert predicted_speedup(alpha, 2, 0.05, 1.1) == pytest.approx(1.0, abs=1e-5)


def test_break_even_alpha_is_none_when_no_draft_pays_and_zero_when_drafting_is_free():
    assert break_even_alpha(1.5, {1: 1.0, 2: 1.0}) is None  # even α = 1 gives 2 tokens for 2.5 forwards at γ=1
    assert break_even_alpha(0.0, {1: 1.0}) == (0.0, 1)
    assert break_even_alpha(0.1, {}) is None


def _results(spec_speedup: float, alpha: float = 0.05, c: float = 0.10) -> dict:
    def run(method, kind, gamma, speedup, run_alpha=None):
        return {"temperature": 0.0, "method": method, "kind": kind, "num_draft_tokens": gamma,
                "hf_num_assistant_tokens": None, "compiled": False,
                "overall": {"speedup": speedup, "alpha": run_alpha}}

    return {"cost": {"cost_ratio": c, "verify": [{"gamma": 2, "relative_cost": 1.3}],
                     "auto_costs": {"1": {"cost_ratio": c, "verify": [1.0, 1.2, 1.3, 1.5]}}},
            "summary": [{"temperature": 0.0, "alpha": alpha}],
            "runs": [run("plain", "ours", 0, 1.0), run("spec_g2", "ours", 2, spec_speedup, alpha),
                     run("spec_auto", "ours", "auto", spec_speedup - 0.1, alpha),
                     run("hf_target", "hf", None, 1.05), run("hf_assisted", "hf", None, 0.21)]}


def test_a_weak_draft_gets_a_plain_verdict_with_the_alpha_it_needs():
    v = verdict(_results(0.74))
    # hf_target (1.05) does not draft: the best speculative method is spec_g2; γ=1's v comes from the calibration
    assert {k: v[k] for k in ("drafting_wins", "best_method", "temperature", "best_speedup", "alpha",
                              "cost_ratio", "alpha_needed_gamma")} == {
        "drafting_wins": False, "best_method": "spec_g2", "temperature": 0.0, "best_speedup": 0.74, "alpha": 0.05,
        "cost_ratio": 0.10, "alpha_needed_gamma": 1}
    assert v["alpha_needed"] == pytest.approx(0.3, abs=1e-6)
    assert [e["best_method"] for e in v["by_temperature"]] == ["spec_g2"]
    (line,) = verdict_lines(v)
    assert line == ("drafting loses here (T=0, α = 0.05, c = 0.10): the best speculative method, spec_g2, runs at "
                    "0.74× plain decoding; the verify-aware prediction says a draft needs α ≥ 0.30 for a speedup "
                    "(at γ = 1) on this hardware; use γ = 0 (plain decoding: --num-draft-tokens 0) or train a better "
                    "draft (python -m distill train)")


def test_a_draft_that_accepts_enough_but_still_loses_blames_the_overhead():
    (line,) = verdict_lines(verdict(_results(0.9, alpha=0.5)))
    assert "this draft's α reaches that, so the loss is the decoder's work beyond the forwards" in line


def test_no_alpha_reaches_a_speedup_at_a_costly_draft():
    v = verdict(_results(0.5, c=1.2))
    assert (v["alpha_needed"], v["alpha_needed_gamma"]) == (None, None)
    (line,) = verdict_lines(v)
    assert "no draft at this c gives a speedup on this hardware" in line and "cheaper draft" in line


def test_a_winning_draft_is_said_in_one_line():
    v = verdict(_results(1.4, alpha=0.7))
    assert v["drafting_wins"] is True
    assert verdict_lines(v) == ["drafting wins (T=0, α = 0.70, c = 0.10): spec_g2 runs at 1.40× plain decoding"]
