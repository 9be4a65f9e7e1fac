"""The one measurement the benchmark, the recipe's evaluation and the quickstart share (``decode.bench.measure``):
interleaving, pooled acceptance, the cost measurement and the prediction. Timings are never asserted."""
from __future__ import annotations

import pytest

from decode.bench.measure import acceptance, cost_context_ids, decode_stats, measure_costs, predict, run_interleaved
from decode.engine import SpeculativeDecoder
from decode.metrics import DecodeStats
from decode.speedup import best_gamma, predicted_speedup
from tests.conftest import perturbed_copy, tiny_llama


def test_interleaving_runs_every_mode_on_a_prompt_before_the_next_and_rotates_the_first():
    calls = []
    out = run_interleaved(lambda m, i, t: calls.append((i, t, m)) or f"{m}{i}", ["a", "b", "c"], 3, [0.0, 1.0],
                          before_prompt=lambda i: calls.append(("before", i)))
    assert [calls[k] for k in (0, 7, 14)] == [("before", 0), ("before", 1), ("before", 2)]  # 6 runs a block
    assert [calls[k][2] for k in (1, 8, 15)] == ["a", "b", "c"]  # the first run of each prompt's block
    assert [c[:2] for c in calls if c[0] != "before"][:6] == [(0, 0.0)] * 3 + [(0, 1.0)] * 3
    assert out[(1.0, "b")] == [["b0"], ["b1"], ["b2"]]
    repeated = []
    run_interleaved(lambda m, i, t: repeated.append(m), ["a", "b"], 1, [0.0], repeats=3)
    assert repeated == ["a", "b", "b", "a", "a", "b"]  # the opener rotates from round to round


def test_acceptance_is_none_where_nothing_was_measured_unless_asked_for_the_stats_own_values():
    s = DecodeStats()
    assert acceptance(s)["alpha"] is None and acceptance(s)["mean_accepted_length"] is None
    zero = acceptance(s, none_if_unmeasured=False)
    assert (zero["alpha"], zero["acceptance_rate"], zero["mean_accepted_length"]) == (0.0, 0.0, 0.0)
    s.record_step(4, [2, 4])
    m = acceptance(s)
    assert m["alpha"] == pytest.approx(6 / 7) and m["acceptance_rate"] == pytest.approx(6 / 8)
    assert m["mean_accepted_length"] == pytest.approx((6 + 2) / 2) and m["num_verify_steps"] == 2


def test_predict_is_the_verify_aware_formula_at_the_best_gamma_from_one():
    steep = [1.0] + [1.0 + 0.5 * g for g in range(1, 9)]
    g, s = predict(0.8, 0.05, steep, max_gamma=8)
    assert g == best_gamma(0.8, 0.05, 8, 1, verify_costs=steep)
    assert s == pytest.approx(predicted_speedup(0.8, g, 0.05, steep[g]))
    assert predict(0.0, 0.5, None)[0] == 1  # a draft that never helps is still priced at γ = 1, below 1.0
    assert predict(0.8, 0.05, steep, gamma=3) == (3, pytest.approx(predicted_speedup(0.8, 3, 0.05, steep[3])))


def test_decode_stats_pools_every_batch():
    target = tiny_llama(seed=0, layers=1)
    dec = SpeculativeDecoder(target, perturbed_copy(target), num_draft_tokens=2)
    prompts = [[1, 5 + i, 6] for i in range(5)]
    done = []
    s = decode_stats(dec, prompts, 1.0, 4, seed=3, batch_size=2, progress=lambda *a: done.append(a))
    assert done == [(2, 5), (4, 5), (5, 5)] and s.num_sequences == 5 and s.num_new_tokens == 5 * 4
    again = decode_stats(dec, prompts, 1.0, 4, seed=[3, 4, 5], batch_size=2)  # a generator per batch
    assert again.num_sequences == 5


def test_cost_context_repeats_the_prompts_tokens():
    assert cost_context_ids([[1, 2], [3]], 7) == [1, 2, 3, 1, 2, 3, 1]
    assert cost_context_ids([], 1) == [0, 0]


def test_measure_costs_reports_rounds():
    target = tiny_llama(seed=0, layers=1)
    calls = []
    c, verify = measure_costs(SpeculativeDecoder(target, perturbed_copy(target)), [[1, 2, 3]], repeats=3,
                              progress=lambda *a: calls.append(a))
    assert calls == [(i, 5) for i in range(1, 6)] and c > 0 and verify is None


def test_the_cost_measurement_reads_the_ids_as_the_decoder_feeds_the_draft():
    """Found by a new user's trial: `distill eval` of a draft with a smaller input embedding than the target's
    vocabulary (lossless in the decoder, which feeds it a substitute id) failed in the cost measurement."""
    target, draft = tiny_llama(seed=0), tiny_llama(vocab_size=48, seed=1, layers=1)
    c, verify = measure_costs(SpeculativeDecoder(target, draft), [[1, 70, 90, 5], [2, 95, 60]], max_gamma=2,
                              context_tokens=16, repeats=1)
    assert c > 0 and len(verify) == 3 and verify[0] == 1.0
