"""``--profile``: our methods' main-pass steps timed by part (decode.profile), recorded per run and rendered as the
per-step table; without it no profile is attached."""
from __future__ import annotations

import json

import pytest
from rich.console import Console

import decode.bench.runs as runs
from decode.bench import BenchConfig, render_tables, run_benchmark
from decode.bench.report import highlights, profile_rows, verdict
from decode.profile import PARTS
from tests.conftest import TEST_DEVICE, perturbed_copy, tiny_llama


def _run(profile: bool, monkeypatch=None):
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[2], auto=True, hf=True, temperatures=[0.0, 1.0], batch_sizes=[1], max_new_tokens=6,
                      cost_repeats=3, profile=profile)
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6], [1, 7, 8, 9]], ["a", "b"], cfg,
                            pad_token_id=0, eos_token_id=None, progress=False)
    return dict(results, report=highlights(results), verdict=verdict(results), plots={})


@pytest.fixture(scope="module")
def profiled():
    return _run(True)


def test_each_of_our_methods_carries_its_profile_and_the_parts_add_up_to_the_steps(profiled):
    for run in profiled["runs"]:
        if run["kind"] != "ours":  # HF's generate has no parts to time
            assert "profile" not in run
            continue
        prof, m = run["profile"], run["overall"]
        parts = prof["parts"]
        assert set(parts) <= set(PARTS) and {"prefill_target", "verify_forward"} <= set(parts), run["method"]
        assert sum(p["total_s"] for p in parts.values()) == pytest.approx(prof["steps"] * prof["step_ms"] / 1e3)
        assert sum(p["share"] for p in parts.values()) == pytest.approx(1.0)
        assert parts["prefill_target"]["calls"] == m["num_prompts"]  # every timed call profiled, no warm-up call
        assert prof["step_ms"] * prof["steps"] / 1e3 <= m["total_s"]  # inside the timed calls
        if run["num_draft_tokens"] == 0:
            assert "draft_forward" not in parts and "prefill_draft" not in parts
        else:
            assert parts["prefill_draft"]["calls"] == m["num_prompts"] and parts["draft_forward"]["calls"] > 0
        if run["num_draft_tokens"] == 2:  # a target forward per step (a step cut to γ = 0 at the budget's end is
            # no verify step), at most γ draft forwards per step
            assert parts["verify_forward"]["calls"] >= m["num_verify_steps"] > 0
            assert parts["draft_forward"]["calls"] <= 2 * parts["verify_forward"]["calls"]
    json.loads(json.dumps(profiled))  # JSON-able as written


def test_the_per_step_table_has_a_column_per_profiled_method_and_the_bare_forwards(profiled):
    names, rows = profile_rows(profiled, 0.0)
    assert names == ["plain", "spec_g2", "spec_auto"]
    labels = [label for label, _ in rows]
    assert labels[:-8] == [p for p in PARTS if any(p in r["profile"]["parts"] for r in profiled["runs"]
                                                    if r["temperature"] == 0.0 and "profile" in r)]
    assert labels[-8:] == ["step (all parts)", "steps", "bare HF target forward (1 token)",
                           "bare HF draft forward (1 token)", "engine target forward (1 token)",
                           "engine draft forward (1 token)", "c (engine)", "c (bare HF)"]
    step = dict(rows)["step (all parts)"]
    assert step == [f"{r['profile']['step_ms']:.2f}" for r in profiled["runs"][:3]]
    assert dict(rows)["c (engine)"] == [f"{profiled['cost']['cost_ratio']:.3f}"] * 3
    console = Console(record=True, width=250)
    render_tables(json.loads(json.dumps(profiled)), console)
    shown = console.export_text()
    assert shown.count("per-step breakdown (ms per step)") == 2  # T=0 and T=1
    assert "verify_forward" in shown and "bare HF draft forward (1 token)" in shown


def test_without_profile_no_profile_is_attached(monkeypatch):
    seen = []
    run_ours = runs.run_ours

    def spy(decoder, *args, **kwargs):
        seen.append(kwargs.get("profile", args[8] if len(args) > 8 else None))
        return run_ours(decoder, *args, **kwargs)

    monkeypatch.setattr(runs, "run_ours", spy)
    results = _run(False)
    assert seen and all(p is None for p in seen)
    assert all("profile" not in r for r in results["runs"])
    console = Console(record=True, width=250)
    render_tables(json.loads(json.dumps(results)), console)
    assert "per-step breakdown" not in console.export_text()
