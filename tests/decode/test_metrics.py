"""Metric definitions on hand-made step records: pooled over tokens, not averaged per request."""
import pytest

from decode.metrics import DecodeStats


def test_pooled_definitions():
    s = DecodeStats(num_sequences=2)
    s.record_step(4, [4, 0])   # row 0 accepts all 4, row 1 rejects the first
    s.record_step(4, [2])      # one row left
    s.record_step(2, [1])      # a shorter final step
    assert s.num_drafted == 14 and s.num_accepted == 7 and s.num_verify_steps == 4
    assert s.acceptance_rate == pytest.approx(7 / 14)
    assert s.mean_accepted_length == pytest.approx((7 + 4) / 4)
    assert s.accepted_per_position == [3, 2, 1, 1]
    assert s.drafted_per_position == [4, 4, 3, 3]
    assert s.acceptance_by_position == pytest.approx([3 / 4, 2 / 4, 1 / 3, 1 / 3])
    assert s.accepted_length_histogram == [1, 1, 1, 0, 1]
    assert s.num_rejections == 3  # only the all-accepted step had no rejection
    assert s.alpha == pytest.approx(7 / (7 + 3))
    assert s.mean_num_draft_tokens == pytest.approx(14 / 4)


def test_pooling_is_not_mean_of_ratios():
    a, b = DecodeStats(), DecodeStats()
    a.record_step(4, [4] * 10)  # α = 1 on 40 drafted
    b.record_step(4, [0])       # α = 0 on 4 drafted
    merged = DecodeStats.merge([a, b])
    assert merged.acceptance_rate == pytest.approx(40 / 44)  # a per-request mean would say 0.5
    assert merged.mean_accepted_length == pytest.approx((40 + 11) / 11)


def test_timing_metrics():
    s = DecodeStats(num_new_tokens=21, num_sequences=1, ttft_s=0.5, total_s=2.5)
    assert s.per_token_latency_s == pytest.approx(2.0 / 20)
    # a speculative first step that committed 5 tokens: the decode phase has the 16 after it
    s = DecodeStats(num_new_tokens=21, num_sequences=1, ttft_s=0.5, total_s=2.5, num_first_step_tokens=5)
    assert s.per_token_latency_s == pytest.approx(2.0 / 16)
    merged = DecodeStats.merge([s, s])
    assert merged.num_first_step_tokens == 10 and merged.per_token_latency_s == pytest.approx(4.0 / 32)
    # the draft's prefill runs after the first token: not part of the decode phase's per-token time
    late = DecodeStats(num_new_tokens=21, num_sequences=1, ttft_s=0.5, draft_prefill_s=0.4, total_s=2.9)
    assert late.per_token_latency_s == pytest.approx(2.0 / 20)
    assert DecodeStats.merge([late, late]).draft_prefill_s == pytest.approx(0.8)
    assert s.tokens_per_s == pytest.approx(21 / 2.5)
    d = s.to_dict()
    assert d["tokens_per_s"] == pytest.approx(8.4) and "acceptance_by_position" in d


def test_plain_steps_are_not_verify_steps():
    s = DecodeStats(num_target_forwards=5)
    for _ in range(5):
        s.record_step(0, [0, 0])
    assert s.num_verify_steps == 0 and s.acceptance_rate == 0.0 and s.alpha == 0.0
    assert s.mean_accepted_length == 1.0  # plain decoding: one token per target forward
    s.record_step(3, [3, 1])
    assert s.num_verify_steps == 2 and s.mean_accepted_length == pytest.approx((4 + 2) / 2)


def test_alpha_recovers_iid_per_token_acceptance():
    """Simulated i.i.d. Bernoulli(α) acceptance: α_tok recovers α at any γ, while Σaccepted/Σdrafted falls."""
    import random

    rng = random.Random(0)
    for gamma in (2, 8):
        s = DecodeStats()
        for _ in range(20_000):
            n = 0
            while n < gamma and rng.random() < 0.7:
                n += 1
            s.record_step(gamma, [n])
        assert s.alpha == pytest.approx(0.7, abs=0.01)
        assert s.acceptance_rate < 0.7 - 0.05 * (gamma > 2)


def test_empty():
    s = DecodeStats()
    assert s.acceptance_rate == 0 and s.mean_accepted_length == 0 and s.tokens_per_s == 0 and s.per_token_latency_s == 0
