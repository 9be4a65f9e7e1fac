"""What a run records about itself: only the batchings that ran, and the category tables only where each category
has prompts enough to mean something (the JSON keeps every category with its count either way)."""
from __future__ import annotations

import json

from rich.console import Console

from decode.bench import BenchConfig, render_tables, run_benchmark
from decode.bench.report import highlights, verdict
from tests.conftest import TEST_DEVICE, perturbed_copy, tiny_llama


def _run(categories, batch_sizes=(1,)):
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[1], auto=False, hf=False, temperatures=[0.0], batch_sizes=list(batch_sizes),
                      max_new_tokens=2, cost_repeats=3, warmup=False)
    prompts = [[1, 5, 6], [1, 7], [1, 9, 9, 4]][:len(categories)]
    results = run_benchmark(target, perturbed_copy(target), prompts, categories, cfg, pad_token_id=0, progress=False)
    return dict(results, report=highlights(results), verdict=verdict(results), plots={})


def _printed(results) -> str:
    console = Console(record=True, width=250)
    render_tables(json.loads(json.dumps(results)), console)
    return " ".join(console.export_text().split())


def test_batch_size_1_alone_records_static_batching_only():
    results = _run(["a", "b"])
    assert BenchConfig().batching == ["static", "continuous"]  # asked for both (the default) ...
    assert results["config"]["batching"] == ["static"]  # ... but a stream needs a batch size > 1
    assert {b["batching"] for b in results["batch"]} == {"static"}


def test_category_tables_need_two_prompts_in_every_category():
    results = _run(["a", "b", "a"])
    shown = _printed(results)
    assert "by category" not in shown
    assert ("per-category tables left out: 1 of 2 categories have one prompt (b); runs[].by_category in the JSON "
            "keeps each category's numbers with its num_prompts") in shown
    spec = next(r for r in results["runs"] if r["method"] == "spec_g1")
    assert {c: m["num_prompts"] for c, m in spec["by_category"].items()} == {"a": 2, "b": 1}
    results = _run(["a", "a"])
    shown = _printed(results)
    assert "T=0 by category: α / speedup" in shown and "left out" not in shown


def test_the_planned_calls_are_the_calls_made(monkeypatch):
    import decode.bench.runs as runs

    made = {True: 0, False: 0}
    call = runs._Runner.__call__

    def counted(self, *args, timed=True, **kwargs):
        made[timed] += 1
        return call(self, *args, timed=timed, **kwargs)

    monkeypatch.setattr(runs._Runner, "__call__", counted)
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[1, 2], auto=True, hf=False, temperatures=[0.0], batch_sizes=[1, 2], max_new_tokens=2,
                      cost_repeats=3)
    run_benchmark(target, perturbed_copy(target), [[1, 5, 6], [1, 7], [1, 8]], [None] * 3, cfg, pad_token_id=0,
                  progress=False)
    plan = runs.planned_calls(cfg, 3)
    # main: 3 prompts × 4 methods; batch: plain, γ, auto × (2 static batches of 2 + 1 stream); warm-up: 4 + 3 × 2
    assert plan == {"main": 12, "batch": 9, "warmup": 10}
    assert (made[True], made[False]) == (plan["main"] + plan["batch"], plan["warmup"])
    assert runs.plan_line(cfg, 3).startswith("plan: 21 timed generate calls of up to 2 new tokens: 12 in the main "
                                             "pass (3 prompt(s) × 1 temperature(s) × 4 methods × 1 repeat(s)), 9 "
                                             "in the batch pass")
