"""The benchmark: formulas it reports, the JSON schema, that every method ran, the highlights, plots, CLI,
output paths, and bad input. Models go to ``DRAFTKIT_TEST_DEVICE`` (default cpu; see tests/conftest.py).

Timings are never asserted (they live in the benchmark output); only structure, counts and exact relations.
"""
from __future__ import annotations

import io
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from decode.bench import (OURS, SCHEMA_VERSION, BenchConfig, Method, OutputPaths, alpha_from_steps, build_methods,
                          highlights, parse_gammas, render_tables, run_benchmark, run_cli, validate_results,
                          write_outputs)
from decode.speedup import best_gamma, end_to_end_speedup, expected_tokens_per_step, predicted_speedup
from tests.conftest import TEST_DEVICE, perturbed_copy, tiny_llama
from tests.decode.test_prompts import char_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------ formulas
def test_predicted_speedup_matches_leviathan():
    for alpha, gamma, c in [(0.8, 4, 0.05), (0.5, 2, 0.3), (0.9, 8, 0.0)]:
        expected = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))
        assert predicted_speedup(alpha, gamma, c) == pytest.approx(expected)
    # α = 1: every draft accepted, γ+1 tokens per step.
    assert predicted_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert expected_tokens_per_step(0.0, 5) == 1.0
    # With a free draft the best γ is the largest allowed; with a draft as slow as the target, no speculation.
    assert best_gamma(0.9, 0.0, max_gamma=12) == 12
    assert best_gamma(0.5, 1.0) == 0


def test_alpha_estimator_is_the_bernoulli_mle():
    steps = [(4, [4]), (4, [1]), (4, [0]), (4, [2, 4])]  # accepted 11; rejections at n<4: 3
    assert alpha_from_steps(steps) == pytest.approx(11 / 14)
    # A step shortened to γ_s=2 at the end of the budget that accepted both is not a rejection.
    assert alpha_from_steps([(4, [1]), (2, [2])]) == pytest.approx(3 / 4)
    # Plain steps (γ_s=0) carry no information about α.
    assert alpha_from_steps([(0, [0]), (3, [3])]) == 1.0
    assert alpha_from_steps([(0, [0])]) is None


def test_prefill_seconds_are_the_time_to_the_first_token_and_the_drafts_prefill():
    """Three calls of plain decoding, each 0.3 s to the first token (the target's prefill gives it), then 10 tokens
    at 0.1 s: pooled, 0.9 s of prefill; a speculative call adds the draft's prefill after its first token."""
    from decode.bench.pool import prefill_seconds
    from decode.metrics import DecodeStats

    calls = [DecodeStats(num_new_tokens=11, num_sequences=1, num_first_step_tokens=1, ttft_s=0.3, total_s=1.3)
             for _ in range(3)]
    assert prefill_seconds(DecodeStats.merge(calls)) == pytest.approx(0.9)
    spec = DecodeStats(num_new_tokens=11, num_sequences=1, num_first_step_tokens=1, ttft_s=0.3, draft_prefill_s=0.05,
                       total_s=1.0)
    assert prefill_seconds(spec) == pytest.approx(0.35)


def test_alpha_estimator_recovers_alpha_on_simulated_steps():
    g = torch.Generator().manual_seed(0)
    alpha, steps = 0.7, []
    for gamma in [1, 3, 5] * 800:  # variable γ, as with "auto"
        u = torch.rand(gamma, generator=g)
        n = int((u < alpha).long().cumprod(0).sum())
        steps.append((gamma, [n]))
    assert alpha_from_steps(steps) == pytest.approx(alpha, abs=0.02)


# ------------------------------------------------------------------------------------------------ a real run
@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    torch.manual_seed(0)
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    draft = perturbed_copy(target)
    rng = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, 96, (n,), generator=rng).tolist() for n in (5, 9, 7)]
    cfg = BenchConfig(gammas=[1, 3], hf_gammas=[3], temperatures=[0.0, 1.0], batch_sizes=[1, 2], max_new_tokens=8,
                      cost_repeats=5)
    results = run_benchmark(target, draft, prompts, ["x", "y", "x"], cfg, pad_token_id=0, eos_token_id=None,
                            progress=False)
    out = tmp_path_factory.mktemp("bench")
    paths = write_outputs(results, out)
    return results, paths, cfg, prompts


def test_schema_and_json_round_trip(bench_run):
    results, paths, _, _ = bench_run
    loaded = json.loads(open(paths["results"]).read())
    validate_results(loaded)
    assert loaded["schema_version"] == SCHEMA_VERSION
    assert loaded["prompts"]["categories"] == {"x": 2, "y": 1}
    assert loaded["compiled_graphs_during_timing"] is None  # nothing compiled without --compile
    bad = json.loads(json.dumps(loaded))
    del bad["runs"][0]["overall"]["alpha"]
    with pytest.raises(ValueError, match=r"runs\[0\].overall: missing keys \['alpha'\]"):
        validate_results(bad)
    bad = dict(loaded, schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(ValueError, match="schema_version"):
        validate_results(bad)
    # a version-2 file (before the *_leviathan names) is named by its version, not a KeyError half-way (re-test trial)
    with pytest.raises(ValueError, match=f"schema_version 2, this code reads {SCHEMA_VERSION}"):
        render_tables(dict(loaded, schema_version=2))


def test_every_method_ran_on_every_prompt(bench_run):
    results, _, cfg, prompts = bench_run
    names = [m.name for m in build_methods(cfg)]
    assert names == ["plain", "spec_g1", "spec_g3", "spec_auto", "hf_target", "hf_assisted", "hf_assisted_g3"]
    for t in cfg.temperatures:
        for name in names:
            recs = results["records"][f"{t}/{name}"]
            assert [r["key"] for r in recs] == list(range(len(prompts)))
            assert all(len(r["new_tokens"]) == cfg.max_new_tokens for r in recs)  # no EOS given
            assert all(r["wall_s"] > 0 for r in recs)
        runs = {r["method"]: r for r in results["runs"] if r["temperature"] == t}
        assert set(runs) == set(names)
        assert runs["plain"]["overall"]["speedup"] == pytest.approx(1.0)
        for name in ("spec_g1", "spec_g3", "spec_auto"):
            m = runs[name]["overall"]
            assert m["num_verify_steps"] > 0 and m["num_drafted"] > 0 and 0 <= m["alpha"] <= 1
            assert m["ttft_s"] > 0 and m["speedup"] > 0
        assert len(runs["spec_g3"]["overall"]["acceptance_by_position"]) == 3
        assert 1 <= runs["spec_auto"]["overall"]["mean_gamma"] <= cfg.auto_max_gamma
        assert set(runs["spec_g1"]["by_category"]) == {"x", "y"}
        assert runs["spec_g1"]["by_category"]["x"]["num_prompts"] == 2


def test_runs_are_interleaved_per_prompt_with_rotated_order(bench_run):
    results, _, cfg, prompts = bench_run
    per_prompt = len(cfg.temperatures) * len(build_methods(cfg))
    firsts = []
    for i in range(len(prompts)):
        orders = sorted((r["order"], name) for name, recs in results["records"].items() for r in recs
                        if r["key"] == i)
        # Prompt i's runs (every method, every temperature) form one contiguous block, in prompt order.
        assert [o for o, _ in orders] == list(range(i * per_prompt, (i + 1) * per_prompt))
        firsts.append(orders[0][1])
    assert len(set(firsts)) == len(prompts), "the first method must rotate from prompt to prompt"


def test_greedy_outputs_equal_plain_decoding(bench_run):
    results, _, _, _ = bench_run
    for run in results["runs"]:
        m = run["overall"]
        if run["temperature"] == 0:
            # Lossless at T=0: ours exactly; HF greedy (with and without assistant) too on the same float64 models.
            assert m["matches_plain_greedy"] == 1.0, run["method"]
        else:
            assert m["matches_plain_greedy"] is None


def test_reported_predictions_follow_the_formula(bench_run):
    results, _, cfg, _ = bench_run
    c = results["cost"]["cost_ratio"]
    assert c > 0 and results["cost"]["target_forward_s"] > 0
    assert [e["gamma"] for e in results["cost"]["verify"]] == cfg.gammas
    assert results["cost"]["few_row_linear"] is False  # as resolved: the float64 test pair is not eligible
    for run in results["runs"]:
        m = run["overall"]
        if isinstance(run["num_draft_tokens"], int) and run["num_draft_tokens"] > 0:
            g = run["num_draft_tokens"]
            assert m["predicted_speedup_leviathan"] == pytest.approx(predicted_speedup(m["alpha"], g, c))
            v = {e["gamma"]: e["relative_cost"] for e in results["cost"]["verify"]}[g]
            assert v > 0
            # the draft's two-token catch-up after an all-accepted step costs α^γ (c₂ − c) more per step
            c2 = results["cost"]["catchup_cost_ratio"]
            assert c2 > 0
            assert m["predicted_speedup_verify_aware"] == pytest.approx(
                expected_tokens_per_step(m["alpha"], g) / (g * c + v + m["alpha"] ** g * max(c2 - c, 0)))
            # τ is tokens per verify step; α from the same steps predicts it under i.i.d. acceptance only
            # roughly, but it can never exceed γ + 1.
            assert 1.0 <= m["mean_accepted_length"] <= run["num_draft_tokens"] + 1
    for s in results["summary"]:
        assert s["best_gamma_leviathan"] == best_gamma(s["alpha"], c, max_gamma=16)
        assert s["best_gamma_measured"] in cfg.gammas
        curve = {p["gamma"]: p["predicted_speedup_leviathan"] for p in s["predicted_curve"]}
        assert curve[0] == 1.0 and max(curve.values()) == pytest.approx(s["predicted_speedup_leviathan_at_best"])


def test_batch_pass_has_every_size(bench_run):
    results, _, cfg, _ = bench_run
    for t in cfg.temperatures:
        rows = [b for b in results["batch"] if b["temperature"] == t]
        best = next(s["best_gamma_measured"] for s in results["summary"] if s["temperature"] == t)
        # plain, the best fixed γ and (cfg.auto) γ="auto", which re-plans from costs measured at each batch size;
        # static batches at every size, continuous batching at sizes > 1 (size 1 is the main pass either way)
        assert sorted((b["batching"], b["batch_size"], str(b["num_draft_tokens"])) for b in rows) == sorted(
            [("static", bs, str(g)) for bs in (1, 2) for g in (0, best, "auto")]
            + [("continuous", 2, str(g)) for g in (0, best, "auto")])
        assert {b["method"] for b in rows} == {"plain", f"spec_g{best}", "spec_auto"}
        assert all(b["tokens_per_s"] > 0 for b in rows)
        two = [b for b in rows if b["batch_size"] == 2 and b["batching"] == "static"]
        assert all(b["num_new_tokens"] == 2 * 2 * cfg.max_new_tokens and b["num_batches"] == 2 for b in two)
        # one stream of max(3 prompts, 2 × 2) = 4 requests, two at a time
        streams = [b for b in rows if b["batching"] == "continuous"]
        assert all(b["num_new_tokens"] == 4 * cfg.max_new_tokens and b["num_batches"] == 1 for b in streams)
        for b in rows:  # each over plain with the same batching and size
            plain = [p for p in rows if (p["method"], p["batch_size"], p["batching"]) == (
                "plain", b["batch_size"], b["batching"])][0]
            assert b["speedup"] == pytest.approx(b["tokens_per_s"] / plain["tokens_per_s"])


def test_static_speculative_batch_rows_carry_their_prediction(bench_run):
    """Every eager speculative row of a static batch gets the prediction it is read against (a decoder with no cost
    beyond its forwards, ``predicted_batch_speedup``), shown in the batch table and the highlights label; plain rows,
    streams and the reused batch-1 rows have none, and a table with none shows no such column."""
    results, _, cfg, _ = bench_run
    for b in results["batch"]:
        static_spec = b["batching"] == "static" and b["batch_size"] > 1 and b["method"] != "plain"
        if static_spec:
            assert isinstance(b["predicted_speedup"], float) and 0 < b["predicted_speedup"] < cfg.max_new_tokens
        else:
            assert b["predicted_speedup"] is None
    checks = [ck for e in highlights(results) for ck in e["checks"] if ck["name"] == "batch_speedup"]
    assert checks and all(ck["predicted"] is not None for ck in checks)
    from rich.console import Console

    out = io.StringIO()
    render_tables(results, Console(file=out, width=220))
    assert "predicted: with no cost beyond" in out.getvalue()
    assert f"(predicted {checks[0]['predicted']:.2f})" in out.getvalue()
    none = dict(results, batch=[dict(b, predicted_speedup=None) for b in results["batch"]])
    out = io.StringIO()
    render_tables(none, Console(file=out, width=220))
    assert "batch throughput" in out.getvalue() and "predicted: with no cost beyond" not in out.getvalue()


def test_predicted_batch_speedup_is_the_simulated_batch_over_the_measured_prefill():
    from decode.bench.pool import predicted_batch_speedup
    from decode.speedup import AdaptiveGamma, simulate_batch_speedup
    from tests.decode.test_speedup import _batch_costs

    costs = _batch_costs()
    rows = [[0.9, 0.5, 0.8, 1.0], [0.3, 0.7, 0.6, 0.95]]
    sims = [simulate_batch_speedup(4, r, costs, 32, runs=50) for r in rows]
    # no prefill: one batch is the simulation itself
    assert predicted_batch_speedup(4, rows[:1], [1.0], [0.0], costs, 32, 0.1, runs=50) == pytest.approx(sims[0])
    # with a prefill: the simulation extended over plain decoding's prefill share, the draft's prefill costing r
    one = predicted_batch_speedup(4, rows[:1], [2.0], [0.5], costs, 32, 0.1, runs=50)
    assert one == pytest.approx(end_to_end_speedup(sims[0], 0.25, 0.1)) and one < sims[0]
    # two batches pool as the measured speedups do: plain seconds over predicted seconds
    both = predicted_batch_speedup(4, rows, [2.0, 3.0], [0.5, 0.3], costs, 32, 0.1, runs=50)
    expected = 5.0 / (2.0 / end_to_end_speedup(sims[0], 0.25, 0.1) + 3.0 / end_to_end_speedup(sims[1], 0.1, 0.1))
    assert both == pytest.approx(expected)
    # "auto": the decoder's controller, planning the batch
    auto = predicted_batch_speedup("auto", rows[:1], [1.0], [0.0], costs, 32, 0.1, max_auto_gamma=6, runs=50)
    assert auto == pytest.approx(simulate_batch_speedup(lambda: AdaptiveGamma(6), rows[0], costs, 32, runs=50))


@pytest.mark.parametrize("kwargs,message", [
    (dict(gamma=0), "gamma"), (dict(gamma=True), "gamma"), (dict(gamma="fast"), "gamma"),
    (dict(plain_s=[1.0, 2.0]), "one entry per batch"), (dict(alphas=[]), "one entry per batch"),
    (dict(plain_prefill_s=[1.5]), "prefill"), (dict(alphas=[[1.2]]), "alphas"),
    (dict(prefill_cost_ratio=-1), "prefill_cost_ratio"),
    # found by a trial: these reached the caller as ZeroDivisionError / TypeError / NaN from deep inside
    (dict(plain_s=[0.0], plain_prefill_s=[0.0]), "plain_s"), (dict(plain_s=[float("inf")]), "plain_s"),
    (dict(plain_s=["1.0"]), "plain_s"), (dict(plain_prefill_s=[None]), "plain_prefill_s"),
    (dict(alphas=[["0.5", 0.6]]), "alphas"), (dict(alphas=[0.5]), "alphas"), (dict(alphas=None), "alphas"),
    (dict(alphas="ab"), "alphas"), (dict(max_new_tokens=2.5), "max_new_tokens"), (dict(runs=1.5), "runs"),
    (dict(max_auto_gamma="8", gamma="auto"), "max_auto_gamma"),
])
def test_predicted_batch_speedup_refuses_bad_input_naming_it(kwargs, message):
    from decode.bench.pool import predicted_batch_speedup
    from tests.decode.test_speedup import _batch_costs

    args = dict(gamma=2, alphas=[[0.5, 0.6]], plain_s=[1.0], plain_prefill_s=[0.2], auto_costs=_batch_costs(),
                max_new_tokens=16, prefill_cost_ratio=0.1, runs=2)
    with pytest.raises(ValueError, match=message):
        predicted_batch_speedup(**{**args, **kwargs})


def test_prompt_alphas_pool_each_prompts_speculative_runs_of_the_eager_engine():
    from decode.bench.pool import prompt_alphas
    from decode.metrics import DecodeStats

    def rec(accepted, rejections):
        return {"stats": DecodeStats(num_drafted=accepted + rejections, num_accepted=accepted,
                                     num_rejections=rejections)}

    methods = [Method("plain", OURS, 0), Method("spec_g2", OURS, 2), Method("spec_g4", OURS, 4),
               Method("spec_auto", OURS, "auto"), Method("spec_g4_compiled", OURS, 4, compiled=True),
               Method("hf_assisted_g4", "hf", 4)]
    records = {(0.0, "plain"): [{"stats": DecodeStats()}] * 2, (0.0, "spec_g2"): [rec(6, 2), rec(0, 0)],
               (0.0, "spec_g4"): [rec(3, 1), rec(0, 0)], (0.0, "spec_auto"): [rec(5, 2), rec(0, 0)],
               (0.0, "spec_g4_compiled"): [rec(0, 9)] * 2, (0.0, "hf_assisted_g4"): [{"stats": None}] * 2}
    assert prompt_alphas(records, 0.0, methods, 2) == [pytest.approx(14 / 19), None]  # not the compiled twin's
    assert prompt_alphas(records, 1.0, methods, 2) == [None, None]


def test_plots_are_written(bench_run):
    results, paths, _, _ = bench_run
    assert set(results["plots"]) == {"speedup_vs_gamma", "predicted_vs_measured", "acceptance_by_position",
                                     "batch_throughput"}
    for name in results["plots"]:
        with open(paths[name], "rb") as f:
            head = f.read(8)
        assert head == PNG_MAGIC, name


def test_importing_the_bench_leaves_matplotlib_unloaded():
    """``distill`` imports ``decode.bench.measure``; matplotlib (over half a second) loads only when a plot is drawn."""
    import subprocess
    import sys

    code = "import sys, decode.bench, decode.bench.measure; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.strip() == "False"


def test_records_re_pool_to_the_runs_alpha(bench_run):
    """Per-prompt records keep the DecodeStats counters; pooled, they give the run's α and acceptance rate."""
    results, _, cfg, _ = bench_run
    for t in cfg.temperatures:
        for name in ("spec_g3", "spec_auto"):
            recs = results["records"][f"{t}/{name}"]
            total = {k: sum(r["stats"][k] for r in recs) for k in recs[0]["stats"]}
            m = {r["method"]: r for r in results["runs"] if r["temperature"] == t}[name]["overall"]
            assert total["num_drafted"] == m["num_drafted"] and total["num_verify_steps"] == m["num_verify_steps"]
            assert m["alpha"] == pytest.approx(total["num_accepted"]
                                               / (total["num_accepted"] + total["num_rejections"]))
            assert m["acceptance_rate"] == pytest.approx(total["num_accepted"] / total["num_drafted"])
            assert m["mean_gamma"] == pytest.approx(total["num_drafted"] / total["num_verify_steps"])
        assert all(r["stats"] is None for r in results["records"][f"{t}/hf_assisted"])


def test_highlights_relate_the_reported_numbers(bench_run):
    results, _, cfg, _ = bench_run
    cost = results["cost"]
    assert cost["bare"]["cost_ratio"] == pytest.approx(cost["bare"]["draft_forward_s"]
                                                       / cost["bare"]["target_forward_s"])
    assert [e["temperature"] for e in results["report"]] == cfg.temperatures
    for entry, s in zip(results["report"], results["summary"]):
        t = entry["temperature"]
        runs = {r["method"]: r["overall"] for r in results["runs"] if r["temperature"] == t}
        checks = {(c["name"], c.get("batch_size"), c.get("gamma") if c["name"].startswith("batch_") else None): c
                  for c in entry["checks"]}
        g = s["best_gamma_measured"]
        assert set(checks) == {("cost_ratio_vs_bare", None, None), ("measured_vs_verify_aware", None, None),
                               ("measured_vs_end_to_end", None, None), ("decode_vs_verify_aware", None, None),
                               ("ours_vs_hf_assisted", None, None), ("batch_speedup", 2, g),
                               ("batch_speedup", 2, "auto"), ("batch_continuous_speedup", 2, g),
                               ("batch_continuous_speedup", 2, "auto"), ("auto_vs_best_fixed", None, None)}
        checks = {(name, bs): c for (name, bs, gamma), c in checks.items() if gamma != "auto"}
        for c in entry["checks"]:
            assert c["ratio"] == pytest.approx(c["ours"] / c["reference"]), c["name"]
        assert (checks[("cost_ratio_vs_bare", None)]["ours"], checks[("cost_ratio_vs_bare", None)]["reference"]) == (
            cost["cost_ratio"], cost["bare"]["cost_ratio"])
        best = checks[("measured_vs_verify_aware", None)]
        assert best["gamma"] == s["best_gamma_measured"]
        assert best["ours"] == runs[f"spec_g{best['gamma']}"]["speedup"]
        assert best["reference"] == runs[f"spec_g{best['gamma']}"]["predicted_speedup_verify_aware"]
        whole = checks[("measured_vs_end_to_end", None)]  # the same prediction with plain decoding's prefill share
        plain = runs["plain"]
        # the target's prefill gives the first token: plain decoding's prefill is its time to the first token
        assert plain["prefill_s"] == pytest.approx(plain["ttft_s"] * plain["num_prompts"])
        assert (whole["gamma"], whole["ours"]) == (best["gamma"], best["ours"])
        assert whole["reference"] == pytest.approx(end_to_end_speedup(
            best["reference"], plain["prefill_s"] / plain["total_s"], cost["bare"]["prefill_cost_ratio"]))
        decode = checks[("decode_vs_verify_aware", None)]
        assert (decode["gamma"], decode["reference"]) == (best["gamma"], best["reference"])
        assert decode["ours"] == runs[f"spec_g{best['gamma']}"]["decode_speedup"] is not None
        hf = checks[("ours_vs_hf_assisted", None)]
        assert (hf["gamma"], hf["ours"], hf["reference"]) == (3, runs["spec_g3"]["speedup"],
                                                              runs["hf_assisted_g3"]["speedup"])
        assert hf["analytic_bound"] == pytest.approx(runs["spec_g3"]["predicted_speedup_verify_aware"]
                                                     / runs["hf_assisted_g3"]["speedup"])
        for (name, batching), gamma in itertools.product((("batch_speedup", "static"),
                                                           ("batch_continuous_speedup", "continuous")), (g, "auto")):
            batch = [c for c in entry["checks"] if c["name"] == name and c["gamma"] == gamma][0]
            row = [b for b in results["batch"] if b["temperature"] == t and b["batch_size"] == 2
                   and b["num_draft_tokens"] == gamma and b["batching"] == batching][0]
            assert batch["ratio"] == pytest.approx(row["speedup"]) and "goal" not in batch and "met" not in batch
        assert checks[("auto_vs_best_fixed", None)]["ratio"] == s["auto_vs_best_fixed"]


def test_highlights_are_ratios_without_goals(bench_run):
    """The highlights relate numbers; they grade nothing (a pair on another machine has no goal to meet)."""
    results = json.loads(json.dumps(bench_run[0]))
    results["cost"]["cost_ratio"], results["cost"]["bare"]["cost_ratio"] = 0.12, 0.1
    check = highlights(results)[0]["checks"][0]
    assert check == {"name": "cost_ratio_vs_bare", "ours": 0.12, "reference": 0.1, "ratio": pytest.approx(1.2)}
    edited = json.loads(json.dumps(results))
    for run in edited["runs"]:
        run["overall"]["prefill_s"] = -1.0  # an edited file: named, not a bare error from the formula
    with pytest.raises(ValueError, match=r"runs\[plain\]\.overall\.prefill_s / total_s.*prefill_share must be"):
        highlights(edited)
    del results["cost"]["bare"]["prefill_cost_ratio"]  # a results.json from before the bare prefills (schema 3)
    whole = [c for c in highlights(results)[0]["checks"] if c["name"] == "measured_vs_end_to_end"]
    assert [(c["reference"], c["ratio"]) for c in whole] == [(None, None)]
    with pytest.raises(ValueError, match=r"cost\.bare: missing keys \['prefill_cost_ratio'\]"):
        validate_results(results)  # a schema-4 file needs it (render_tables prints it)
    for b in results["batch"]:  # a file from before continuous batching: every row static
        del b["batching"]
    assert {c["name"] for e in highlights(results) for c in e["checks"]} & {"batch_continuous_speedup"} == set()


def test_the_highlights_table_prints_the_ratio_to_three_places_and_no_goal():
    """0.9469 printed as 0.95 would read as another number."""
    from rich.console import Console

    from decode.bench.report import _render_highlights

    ck = {"name": "cost_ratio_vs_bare", "ours": 0.2, "reference": 0.2112, "ratio": 0.9469}
    console = Console(record=True, width=200)
    _render_highlights({"report": [{"temperature": 0.0, "checks": [ck]}]}, console)
    text = console.export_text()
    row = next(line for line in text.splitlines() if "engine c" in line)
    assert row.rstrip(" │").endswith("0.947") and "goal" not in text and "met" not in text


def test_bare_forwards_are_timed_on_the_same_context():
    from decode.bench.bare_forward import measure_bare_forwards

    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    ctx = torch.tensor([[1, 5, 6, 7, 8, 9]], device=TEST_DEVICE)
    bare = measure_bare_forwards(target, perturbed_copy(target), ctx, repeats=3)
    assert bare["context_tokens"] == 6 and bare["target_forward_s"] > 0 and bare["draft_forward_s"] > 0
    assert bare["cost_ratio"] == bare["draft_forward_s"] / bare["target_forward_s"]
    assert bare["target_prefill_s"] > 0 and bare["draft_prefill_s"] > 0
    assert bare["prefill_cost_ratio"] == bare["draft_prefill_s"] / bare["target_prefill_s"]
    with pytest.raises(ValueError, match="L >= 2"):
        measure_bare_forwards(target, target, ctx[:, :1])


# ------------------------------------------------------------------------------------------------ CLI and bad input
@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    perturbed_copy(target).save_pretrained(root / "draft")
    target.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    return root


def _pair_args(saved_pair) -> list[str]:
    return ["--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"), "--device",
            str(TEST_DEVICE), "--dtype", "float32"]


def test_cli_end_to_end_on_saved_checkpoints(saved_pair, tmp_path, capsys):
    from decode.__main__ import main as decode_main

    out = tmp_path / "bench.json"
    status = decode_main(["bench", *_pair_args(saved_pair), "--prompts", "mt_bench", "--limit", "2",
                          "--max-new-tokens", "4", "--gammas", "2", "--hf-gammas", "2", "--temperatures", "0",
                          "--batch-sizes", "1,2", "--cost-repeats", "3", "--out", str(out)])
    assert status == 0
    results = json.loads(out.read_text())
    validate_results(results)
    # --out FILE.json: the JSON is that file, the plots sit beside it.
    assert results["plots"]["speedup_vs_gamma"] == str(tmp_path / "bench_speedup_vs_gamma.png")
    assert all(open(p, "rb").read(8) == PNG_MAGIC for p in results["plots"].values())
    assert results["prompts"]["count"] == 2 and set(results["prompts"]["categories"]) == {"writing", "roleplay"}
    assert {r["method"] for r in results["runs"]} == {"plain", "spec_g2", "spec_auto", "hf_target", "hf_assisted",
                                                      "hf_assisted_g2"}
    assert results["config"]["target"] == str(saved_pair / "target")
    assert [c["name"] for c in results["report"][0]["checks"]] == [
        "cost_ratio_vs_bare", "measured_vs_verify_aware", "measured_vs_end_to_end", "decode_vs_verify_aware",
        "ours_vs_hf_assisted", "batch_speedup", "batch_speedup", "batch_continuous_speedup",
        "batch_continuous_speedup", "auto_vs_best_fixed"]  # batch 2: γ=2 and auto, static then continuous
    captured = capsys.readouterr()
    printed = captured.out
    assert "cost ratio c =" in printed and "hf_assisted" in printed and "bare HF forwards" in printed
    assert "bare HF prefills of" in printed
    assert "decoding: 12/12 (" in captured.err  # progress shows in a log too (stderr is not a terminal here)
    err = captured.err.splitlines()  # from the start: the plan, the loading, every phase, in this order
    said = ["plan: 18 timed generate calls of up to 4 new tokens: 12 in the main pass", "loading the target",
            "target: 0.", "loading the draft", "draft: 0.", "prompts: 2 of mt_bench, no chat template",
            "building the decoders", "measuring c and v_γ", "calibrating the auto-γ cost model", "warm-up: 6 untimed",
            "main pass: plain, spec_g2, spec_auto, hf_target, hf_assisted, hf_assisted_g2 on 2 prompt(s)",
            "decoding: 12/12 (", "batch pass: 6 timed calls and streams at batch sizes [2] (static, continuous)"]
    at = [next((i for i, line in enumerate(err) if line.startswith(s)), s) for s in said]
    assert at == sorted(at)
    assert "highlights: ours / reference" in printed and "ours / HF assisted speedup, γ=2" in printed
    (entry,) = results["verdict"]["by_temperature"]  # the verdict is recorded and printed last
    said = "drafting wins (T=0" if entry["drafting_wins"] else "drafting loses here (T=0"
    flat = " ".join(printed.split())
    assert flat.index(said) > flat.index("highlights: ours / reference")
    assert results["config"]["prompt_lookup_ngram"] == 0 and "prompt lookup" not in printed
    from decode.bench.report import render_tables

    render_tables(dict(results, config=dict(results["config"], prompt_lookup_ngram=2)))  # a trial: said nowhere
    shown = " ".join(capsys.readouterr().out.split())
    assert shown.count("ours with prompt lookup (n = 2) at T = 0, HF assisted without") == 2  # summary, highlights
    render_tables(dict(results, config=dict(results["config"], prompt_lookup_ngram=2, temperatures=[1.0])))
    assert "prompt lookup" not in capsys.readouterr().out  # no greedy run: it did nothing, so nothing is claimed
    # Bad input through the dispatcher: exit status 2 and the message, no traceback.
    assert decode_main(["bench", *_pair_args(saved_pair), "--prompts", "humaneva", "--out",
                        str(tmp_path / "other.json")]) == 2
    assert "unknown prompt set 'humaneva'" in capsys.readouterr().err


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if the CLI loads a model: output paths must be checked before that."""
    import decode.loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the output path was checked")

    monkeypatch.setattr(decode.loading, "load_causal_lm", refuse)


def test_a_limit_beyond_the_prompt_file_is_said_before_the_models_load(saved_pair, tmp_path, capsys, monkeypatch):
    import decode.loading
    from decode.__main__ import main as decode_main

    prompts = tmp_path / "two.jsonl"
    prompts.write_text('{"prompt": "w1 w2"}\n{"prompt": "w3"}\n')
    monkeypatch.setattr(decode.loading, "load_causal_lm", lambda *a, **k: (_ for _ in ()).throw(ValueError("stop")))
    assert decode_main(["bench", *_pair_args(saved_pair), "--prompts", str(prompts), "--limit", "50",
                        "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert f"note: --prompts {prompts} has 2 prompt(s), fewer than --limit 50; benchmarking 2" in err
    assert err.index("note:") < err.index("error: stop")


def test_out_refuses_an_existing_file_before_loading_models(saved_pair, tmp_path, capsys, no_model_loads):
    from decode.__main__ import main as decode_main

    out = tmp_path / "done.json"
    out.write_text("a finished run\n")
    assert decode_main(["bench", *_pair_args(saved_pair), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} already exist" in err and "--overwrite" in err
    assert out.read_text() == "a finished run\n"
    # A plot the run would write counts too; a folder --out refuses its results.json the same way.
    (tmp_path / "fresh_batch_throughput.png").write_bytes(b"x")
    assert decode_main(["bench", *_pair_args(saved_pair), "--out", str(tmp_path / "fresh.json")]) == 2
    assert "fresh_batch_throughput.png already exist" in capsys.readouterr().err
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "results.json").write_text("{}")
    assert decode_main(["bench", *_pair_args(saved_pair), "--out", str(tmp_path / "runs")]) == 2
    assert "results.json already exist" in capsys.readouterr().err


@pytest.mark.parametrize("where, message", [
    ("missing/x.json", "does not exist; create it first"),
    ("a_file/x.json", "a_file is a file, not a folder"),
    ("a_file/sub/x.json", "a_file is a file, not a folder"),
    ("a_file/sub", "a_file is a file, not a folder"),
    ("a_file", "is a file, not a folder"),
    ("a_folder.json", "a_folder.json is a folder"),
])
def test_out_refuses_a_path_it_cannot_write(saved_pair, tmp_path, capsys, no_model_loads, where, message):
    from decode.__main__ import main as decode_main

    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_folder.json").mkdir()
    assert decode_main(["bench", *_pair_args(saved_pair), "--out", str(tmp_path / where), "--overwrite"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("out", ["/proc/x.json", "/proc/bench"])
def test_out_refuses_a_folder_that_takes_no_files_even_for_root(saved_pair, capsys, no_model_loads, out):
    """/proc is a folder that os.access calls writable for root; only a real probe file tells."""
    from decode.__main__ import main as decode_main

    assert decode_main(["bench", *_pair_args(saved_pair), "--out", out]) == 2
    assert "--out" in (err := capsys.readouterr().err) and "cannot write into folder /proc" in err


def test_overwrite_replaces_and_a_file_that_appears_mid_run_is_kept(bench_run, tmp_path):
    results = bench_run[0]
    taken = tmp_path / "r.json"
    taken.write_text("old")
    with pytest.raises(ValueError, match="already exist"):
        OutputPaths.plan(taken)
    paths = write_outputs(json.loads(json.dumps(results)), OutputPaths.plan(taken, overwrite=True))
    assert paths["results"] == str(taken) and json.loads(taken.read_text())["kind"] == "draftkit.bench"
    # Planned while free, then someone else writes there before the run ends: theirs stays, ours goes beside it.
    late = tmp_path / "late.json"
    plan = OutputPaths.plan(late)
    late.write_text("theirs")
    paths = write_outputs(json.loads(json.dumps(results)), plan)
    assert late.read_text() == "theirs"
    assert paths["results"] != str(late) and json.loads(open(paths["results"]).read())["kind"] == "draftkit.bench"


def test_a_full_disk_while_writing_results_leaves_no_cut_file_and_keeps_the_earlier_one(bench_run, tmp_path,
                                                                                         monkeypatch):
    """Found by a new user on a full disk: results.json was written in place, so a cut file stayed (and a rerun
    refused it as an existing result), and with --overwrite the earlier good file was emptied first."""
    import os

    import decode.outputs as outputs

    results = bench_run[0]
    earlier = tmp_path / "earlier.json"
    earlier.write_text("earlier run")
    real_fdopen = os.fdopen

    def full_disk(fd, mode="r", *args, **kwargs):  # every write fails with ENOSPC, as on a full disk
        os.close(fd)
        return real_fdopen(os.open("/dev/full", os.O_WRONLY), mode)

    monkeypatch.setattr(outputs.os, "fdopen", full_disk)
    with pytest.raises(ValueError, match="No space left on device"):
        write_outputs(json.loads(json.dumps(results)), OutputPaths.plan(tmp_path / "new.json"))
    assert not (tmp_path / "new.json").exists()
    with pytest.raises(ValueError, match="No space left on device"):
        write_outputs(json.loads(json.dumps(results)), OutputPaths.plan(earlier, overwrite=True))
    assert earlier.read_text() == "earlier run"
    assert sorted(f.name for f in tmp_path.iterdir() if f.suffix == ".json") == ["earlier.json"]


def test_plots_that_appear_mid_run_are_kept_and_the_runs_set_goes_beside_them(bench_run, tmp_path):
    """Only the JSON was kept: a plot made at the planned path during the run (e.g. by a second run into the same
    folder) was overwritten, and the JSON kept beside it pointed at plots of the other run."""
    results = bench_run[0]
    plan = OutputPaths.plan(tmp_path / "out")
    plan.results.parent.mkdir()
    theirs = plan.plots["speedup_vs_gamma"]
    theirs.write_bytes(b"theirs")
    paths = write_outputs(json.loads(json.dumps(results)), plan)
    assert theirs.read_bytes() == b"theirs" and not plan.results.exists()
    saved = json.loads(Path(paths["results"]).read_text())
    assert saved["plots"] == {k: v for k, v in paths.items() if k != "results"}
    for name, path in saved["plots"].items():
        assert path != str(plan.plots[name]) and Path(path).read_bytes()[:8] == PNG_MAGIC
    assert Path(paths["results"]).name.startswith("results.")  # one timestamped set beside the kept file


def test_batch_gamma_not_in_gammas_is_measured_at_batch_size_1():
    """Batch size 1 reused the main pass, which has no spec_g{batch_gamma} when --batch-gamma is not in --gammas:
    the speculative row of batch 1 was silently missing."""
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[1], auto=False, hf=False, batch_gamma=2, temperatures=[0.0], batch_sizes=[1, 2],
                      max_new_tokens=4, cost_repeats=3, warmup=False)
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6], [1, 7]], [None, None], cfg, pad_token_id=0,
                            progress=False)
    rows = {(b["method"], b["batch_size"]): b for b in results["batch"]}
    assert set(rows) == {("plain", 1), ("spec_g2", 1), ("plain", 2), ("spec_g2", 2)}
    assert rows[("spec_g2", 1)]["num_new_tokens"] == 8 and not rows[("spec_g2", 1)]["reused_main_pass"]
    assert rows[("spec_g2", 1)]["speedup"] is not None


def test_continuous_batching_alone_keeps_the_batch_1_rows_of_the_main_pass():
    """--batching continuous --batch-sizes 1,2: batch size 1 is the main pass (reused, as with static batching; it
    was dropped), batch size 2 a stream; no static batches run."""
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    cfg = BenchConfig(gammas=[1], auto=False, hf=False, temperatures=[0.0], batch_sizes=[1, 2], max_new_tokens=2,
                      cost_repeats=3, warmup=False, batching=["continuous"])
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6], [1, 7]], [None, None], cfg, pad_token_id=0,
                            progress=False)
    assert sorted((b["batch_size"], b["batching"], b["method"], b["reused_main_pass"]) for b in results["batch"]) == [
        (1, "static", "plain", True), (1, "static", "spec_g1", True), (2, "continuous", "plain", False),
        (2, "continuous", "spec_g1", False)]


def test_progress_shows_in_a_log_too(capsys):
    """Progress was a rich bar only, and the CLI enabled it only on a terminal: a run redirected to a log (nohup,
    CI) showed nothing for its whole length (the CLI side: test_cli_end_to_end_on_saved_checkpoints)."""
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[1], auto=False, hf=False, temperatures=[0.0], batch_sizes=[1, 2], max_new_tokens=2,
                      cost_repeats=3, warmup=False)
    run_benchmark(target, target, [[1, 5, 6], [1, 7]], [None, None], cfg, pad_token_id=0, progress=True)
    err = capsys.readouterr().err  # not a terminal under pytest: plain lines
    assert "decoding: 4/4 (" in err and "batches: 4/4 (" in err  # 2 static batches and a stream, 2 methods


def test_out_expands_home(tmp_path, monkeypatch):
    """--out '~/bench' (quoted) planned a folder literally named '~' in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    assert OutputPaths.plan("~/bench").results == tmp_path / "home" / "bench" / "results.json"
    assert OutputPaths.plan("~/b.json").plots["speedup_vs_gamma"] == tmp_path / "home" / "b_speedup_vs_gamma.png"


def test_compile_flag_without_engine_support_is_refused(saved_pair, monkeypatch, capsys, tmp_path):
    import decode
    from decode.bench import runs
    from decode.__main__ import main as decode_main

    class NoCompile(decode.SpeculativeDecoder):
        def __init__(self, target, draft=None, num_draft_tokens=4, tokenizer=None, draft_tokenizer=None,
                     max_auto_draft_tokens=8):
            super().__init__(target, draft, num_draft_tokens=num_draft_tokens, tokenizer=tokenizer,
                             draft_tokenizer=draft_tokenizer, max_auto_draft_tokens=max_auto_draft_tokens)

    monkeypatch.setattr(runs, "SpeculativeDecoder", NoCompile)
    assert decode_main(["bench", *_pair_args(saved_pair), "--compile", "--out", str(tmp_path / "x.json")]) == 2
    assert "no compile option; drop --compile" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no compile option"):
        run_benchmark(tiny_llama(), tiny_llama(seed=1), [[1, 5]], [None], BenchConfig(compile=True), pad_token_id=0,
                      progress=False)


def test_compile_without_a_cpp_compiler_exits_2_before_loading(saved_pair, tmp_path, monkeypatch, capsys):
    """--compile on the CPU needs inductor's C++ compiler ($CXX, else g++); it died with a BackendCompilerFailed
    traceback after loading the models and writing nothing."""
    from torch._inductor import config as inductor_config

    import decode.loading
    from decode.__main__ import main as decode_main

    loads = []
    monkeypatch.setattr(decode.loading, "load_causal_lm", lambda *a, **k: loads.append(a))
    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, str(tmp_path / "no" / "g++")))
    out = tmp_path / "x.json"
    assert decode_main(["bench", *_pair_args(saved_pair), "--compile", "draft", "--device", "cpu",
                        "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--compile: torch.compile needs a working C++ compiler" in err and "InvalidCxxCompiler" in err
    assert not loads and not out.exists()


def test_the_compiled_decoder_is_warmed_up_for_the_largest_batch_before_timing(monkeypatch):
    """With --compile and the warm-up on, the compiled decoder runs decode.costs.warm_up for the largest
    --batch-sizes before the first timed run (the per-method warm-up runs alone leave shapes whose graphs would be
    built inside timed runs); without the warm-up, or without --compile, it does not. (The decoders run eager here:
    the engine's compilation and warm-up are tested with the engine.)"""
    import decode
    import decode.costs
    from decode.bench import runs

    warmed = []

    class Recording(decode.SpeculativeDecoder):
        def __init__(self, *args, compile=False, **kwargs):
            super().__init__(*args, **kwargs)
            self.compile = compile

    def warm_up(decoder, max_batch_size=16):
        warmed.append((decoder.compile, max_batch_size))
        return 0.0

    monkeypatch.setattr(runs, "SpeculativeDecoder", Recording)
    monkeypatch.setattr(decode.costs, "warm_up", warm_up)
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    for compile, warmup, expected in (("draft", True, [("draft", 4)]), ("draft", False, []), (False, True, [])):
        warmed.clear()
        cfg = BenchConfig(gammas=[2], auto=False, compile=compile, hf=False, temperatures=[0.0], batch_sizes=[1, 4],
                          max_new_tokens=4, cost_repeats=3, warmup=warmup)
        run_benchmark(target, perturbed_copy(target), [[1, 5, 6]], [None], cfg, pad_token_id=0, progress=False)
        assert warmed == expected


@pytest.mark.parametrize("compile", [True, "draft"])
def test_compiled_methods_run_on_the_compiled_decoder(monkeypatch, tmp_path, compile):
    """The bench's plumbing for --compile: compiled methods (main and batch pass) go to the decoder built with
    compile=True, the others to the eager one. The engine's compilation itself is tested with the engine."""
    import decode
    import decode.costs
    from decode.bench import runs

    built = []

    class Recording(decode.SpeculativeDecoder):
        def __init__(self, *args, compile=False, **kwargs):
            super().__init__(*args, **kwargs)
            self.compile, self.calls = compile, []
            built.append(self)

        def generate(self, *args, **kwargs):
            self.calls.append(kwargs["num_draft_tokens"])
            graphs[0] += bool(self.compile)  # as if each compiled call built a graph
            return super().generate(*args, **kwargs)

    def cost_timer(decoder, *args, _f=decode.costs.cost_timer, **kwargs):
        timer = _f(decoder, *args, **kwargs)
        if decoder.compile:
            result = timer.result
            timer.result = lambda: {**result(), "cost_ratio": 0.01}  # tells the compiled decoder's costs apart
        return timer

    graphs = [0]
    monkeypatch.setattr(runs, "SpeculativeDecoder", Recording)
    monkeypatch.setattr(decode.costs, "cost_timer", cost_timer)
    monkeypatch.setattr("decode.bench.runs._compiled_graphs", lambda: graphs[0])
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[2], auto=False, compile=compile, hf=False, temperatures=[0.0], batch_sizes=[1, 2],
                      max_new_tokens=6, cost_repeats=3, warmup=False)
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6], [1, 7]], [None, None], cfg, pad_token_id=0,
                            progress=False)
    eager, compiled = sorted(built, key=lambda d: bool(d.compile))
    assert compiled.compile == compile and not eager.compile
    # Main pass: 2 prompts x (plain, spec_g2); batch pass at size 2: one batch of (plain, spec_g2) each.
    assert sorted(compiled.calls) == sorted(eager.calls) == [0, 0, 0, 2, 2, 2]
    assert results["compiled_graphs_during_timing"] == 6  # every compiled call was timed (no warm-up here)
    runs = {r["method"]: r for r in results["runs"]}
    assert set(runs) == {"plain", "spec_g2", "plain_compiled", "spec_g2_compiled"}
    assert runs["spec_g2_compiled"]["compiled"] and runs["spec_g2_compiled"]["overall"]["matches_plain_greedy"] == 1
    # compiled methods are predicted from the compiled forwards' costs, the others from the eager ones
    cost = results["cost"]
    assert cost["compiled"]["cost_ratio"] == 0.01 and cost["cost_ratio"] != 0.01
    for name, c in (("spec_g2", cost["cost_ratio"]), ("spec_g2_compiled", 0.01)):
        m = runs[name]["overall"]
        assert m["predicted_speedup_leviathan"] == pytest.approx(predicted_speedup(m["alpha"], 2, c))
    assert {(b["method"], b["batch_size"]) for b in results["batch"]} == {
        (m, bs) for m in ("plain", "spec_g2", "plain_compiled", "spec_g2_compiled") for bs in (1, 2)}
    paths = write_outputs(results, tmp_path / "compiled.json")
    validate_results(json.loads(open(paths["results"]).read()))
    assert all(open(paths[name], "rb").read(8) == PNG_MAGIC for name in results["plots"])


def test_compiled_auto_runs_in_the_main_pass_so_batch_1_reuses_it(monkeypatch):
    """With --compile and auto, spec_auto_compiled joins the main pass (it had no main-pass row, so --gammas auto
    gave the report no compiled run), and the batch pass's batch-1 rows of every method reuse the main pass."""
    import decode
    from decode.bench import runs

    class Labelled(decode.SpeculativeDecoder):  # "compiled" in name only: the plumbing, not the compilation
        def __init__(self, *args, compile=False, **kwargs):
            super().__init__(*args, **kwargs)
            self.compile = compile

    monkeypatch.setattr(runs, "SpeculativeDecoder", Labelled)
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[2], auto=True, compile="draft", hf=False, temperatures=[0.0], batch_sizes=[1, 2],
                      max_new_tokens=6, cost_repeats=3, warmup=False)
    assert [m.name for m in build_methods(cfg)] == ["plain", "spec_g2", "spec_auto", "plain_compiled",
                                                    "spec_g2_compiled", "spec_auto_compiled"]
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6], [1, 7]], [None, None], cfg, pad_token_id=0,
                            progress=False)
    runs = {r["method"]: r for r in results["runs"]}
    assert runs["spec_auto_compiled"]["compiled"] and runs["spec_auto_compiled"]["num_draft_tokens"] == "auto"
    batch_1 = [b for b in results["batch"] if b["batch_size"] == 1]
    assert {b["method"] for b in batch_1} == {"plain", "spec_g2", "spec_auto", "plain_compiled", "spec_g2_compiled",
                                              "spec_auto_compiled"}
    assert all(b["reused_main_pass"] for b in batch_1)


@pytest.mark.parametrize("text, message", [
    ("1,x", "bad γ 'x'"), ("0,2", "every γ must be >= 1"), (" , ", "empty γ list"), ("-1", "every γ must be >= 1"),
])
def test_bad_gamma_lists(text, message):
    with pytest.raises(ValueError, match=message):
        parse_gammas(text)


def test_gamma_list_with_auto():
    assert parse_gammas("8,1,auto,4") == ([1, 4, 8], True)
    assert parse_gammas("2") == ([2], False)


def test_cli_bad_input_fails_before_loading_models(saved_pair, tmp_path):
    pair = ["--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"), "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="unknown prompt set 'humaneva'"):
        run_cli(pair + ["--prompts", "humaneva"])
    with pytest.raises(FileNotFoundError, match="--target .*missing does not exist"):
        run_cli(["--target", str(tmp_path / "missing"), "--draft", str(saved_pair / "draft"), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="bad γ"):
        run_cli(pair + ["--gammas", "1,two"])
    with pytest.raises(ValueError, match="--temperatures .* must be >= 0"):  # the flag, not only the field
        run_cli(pair + ["--temperatures", "0,-1"])
    with pytest.raises(ValueError, match="--batch-sizes .* must each be >= 1"):
        run_cli(pair + ["--batch-sizes", "0"])
    for flag, value in (("--auto-max-gamma", "0"), ("--batch-gamma", "0"), ("--cost-repeats", "2"),
                        ("--max-new-tokens", "0"), ("--repeats", "0")):
        with pytest.raises(ValueError, match=f"^{flag} "):
            run_cli(pair + [flag, value])
    assert not (tmp_path / "results.json").exists()


def _config(*argv: str) -> BenchConfig:
    """The checked BenchConfig of a bench command line (nothing loaded, no file touched)."""
    from decode.bench.cli import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(["--target", "t", "--draft", "d", "--device", "cpu", *argv]))


@pytest.mark.parametrize("few_row_linear", [True, False])
def test_bare_forwards_run_on_the_engines_matmul_kernels(monkeypatch, few_row_linear):
    """c / bare compares the engine's forwards with the bare HF calls on the same kernels: on the AVX-512 machine the
    few-row kernels made the target a third faster than its bare F.linear forward and c / bare read 1.37 with the
    engine's draft forward below its bare one."""
    from decode import kernels
    from decode.bench.bare_forward import BareTimer

    calls = []
    linear = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda *a, **kw: calls.append(1) or linear(*a, **kw))
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    timer = BareTimer(target, perturbed_copy(target), torch.tensor([[1, 5, 6, 7]]), few_row_linear=few_row_linear)
    for _ in range(3):
        timer.round()
    assert bool(calls) is few_row_linear
    assert timer.result()["few_row_linear"] is few_row_linear and timer.result()["repeats"] == 1
    cfg = BenchConfig(gammas=[1], auto=False, hf=False, temperatures=[0.0], batch_sizes=[1], max_new_tokens=2,
                      cost_repeats=3, few_row_linear=few_row_linear, warmup=False)
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6, 7]], [None], cfg, pad_token_id=0,
                            progress=False)
    assert results["cost"]["bare"]["few_row_linear"] is results["cost"]["few_row_linear"] is few_row_linear


def test_cost_rounds_are_spread_over_the_main_pass(monkeypatch):
    """c, v_γ and the bare reference are timed before each prompt's runs, not once before them all, so the
    machine's drift hits the costs as it hits the runs they predict (a cost measured at one moment moved the ratio
    of measured to predicted speedup by ±0.1 between runs)."""
    from decode.bench import bare_forward, runs
    from decode.costs import CostTimer

    events = []
    for cls, name in ((CostTimer, "cost"), (bare_forward.BareTimer, "bare")):
        monkeypatch.setattr(cls, "round", lambda self, _f=cls.round, _n=name: events.append(_n) or _f(self))
    monkeypatch.setattr(runs, "run_ours", lambda *a, _f=runs.run_ours, **kw: events.append("run") or _f(*a, **kw))
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    cfg = BenchConfig(gammas=[1], auto=False, hf=False, temperatures=[0.0], batch_sizes=[1], max_new_tokens=2,
                      cost_repeats=5, warmup=False)
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6, 7], [1, 8, 9], [1, 4]], [None] * 3, cfg,
                            pad_token_id=0, progress=False)
    assert events[:4] == ["cost", "cost", "bare", "bare"]  # the untimed rounds, before any run
    blocks = "".join("c" if e == "cost" else "b" if e == "bare" else "r" for e in events[4:])
    assert blocks == "ccbbrr" * 3  # 2 timed rounds (ceil(5 / 3)) before each prompt's 2 runs (plain, γ = 1)
    assert results["cost"]["repeats"] == results["cost"]["bare"]["repeats"] == 6
    assert len(results["cost"]["target_forward_samples_s"]) == 6


def test_median_run_keeps_the_median_call_whole():
    from decode.bench.pool import median_run

    runs = [{"wall_s": w, "stats": f"call {i}"} for i, w in enumerate((0.3, 0.1, 0.2))]
    assert median_run(runs) == {"wall_s": 0.2, "stats": "call 2", "wall_s_repeats": [0.3, 0.1, 0.2]}
    even = [{"wall_s": w, "stats": i} for i, w in enumerate((0.4, 0.1, 0.2, 0.3))]
    assert median_run(even)["stats"] == 2  # the lower median: a real call, not an average of two
    assert median_run(runs[:1])["wall_s_repeats"] == [0.3]
    with pytest.raises(ValueError, match="no timed runs"):
        median_run([])


def test_repeats_time_each_block_and_batch_several_times_and_keep_the_median(monkeypatch):
    """--repeats 3: prompt i's block holds three rounds of every method (rotation going on), and every record, in the
    main and the batch pass, is the median-wall call of its three; the pooled speedup is built from those."""
    from decode.bench import runs

    walls = iter([0.5, 0.1, 0.3, 0.9, 0.2, 0.4] * 10)  # one per call, in call order

    def scripted(*a, **kw):
        new, _, stats, peak = real(*a, **kw)
        return new, next(walls), stats, peak

    real = runs.run_ours
    monkeypatch.setattr(runs, "run_ours", scripted)
    target = tiny_llama(seed=0, layers=2, dtype=torch.float32)
    cfg = BenchConfig(gammas=[1], auto=False, hf=False, temperatures=[0.0], batch_sizes=[1, 2], max_new_tokens=3,
                      cost_repeats=3, repeats=3, warmup=False, batching=["static"])
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6, 7], [1, 8, 9]], [None] * 2, cfg,
                            pad_token_id=0, progress=False)
    plain, spec = results["records"]["0.0/plain"], results["records"]["0.0/spec_g1"]
    # prompt 0: plain opens its rounds 0 and 2, spec_g1 round 1: calls plain .5 spec .1 | spec .3 plain .9 | plain .2
    # spec .4; prompt 1 starts at round 3 (spec first): spec .5 plain .1 | plain .3 spec .9 | spec .2 plain .4
    assert [r["wall_s_repeats"] for r in plain] == [[0.5, 0.9, 0.2], [0.1, 0.3, 0.4]]
    assert [r["wall_s_repeats"] for r in spec] == [[0.1, 0.3, 0.4], [0.5, 0.9, 0.2]]
    assert [r["wall_s"] for r in plain] == [0.5, 0.3] and [r["wall_s"] for r in spec] == [0.3, 0.5]
    assert sorted(r["order"] for r in plain + spec) == [0, 2, 6, 8]  # the kept calls' own places in the run
    speedup = next(r for r in results["runs"] if r["method"] == "spec_g1")["overall"]["speedup"]
    assert speedup == pytest.approx((0.5 + 0.3) / (0.3 + 0.5))
    two = {b["method"]: b for b in results["batch"] if b["batch_size"] == 2}
    # one batch of 2, three rounds, order reversed every other round: plain .1 spec .3 | spec .4 plain .5 | ...
    assert {m: b["num_batches"] for m, b in two.items()} == {"plain": 1, "spec_g1": 1}
    assert two["plain"]["total_s"] == pytest.approx(0.5) and two["spec_g1"]["total_s"] == pytest.approx(0.3)
    assert two["spec_g1"]["num_new_tokens"] == 2 * cfg.max_new_tokens


def test_continuous_run_streams_requests_at_most_concurrency_at_a_time(monkeypatch):
    """run_ours_stream: every row's output is the target's greedy output (or, sampled, that request's output alone
    with the same seed), no step runs more than `concurrency` rows, later requests join while others still run, and
    the decoder is left idle with its own γ, also when a step fails."""
    from decode import SpeculativeDecoder
    from decode.bench.runs import run_ours_stream
    from tests.decode.test_engine import reference_greedy

    target = tiny_llama(seed=0, layers=2)
    draft = perturbed_copy(target, 0.6)
    rows = [[1, 5, 6, 7], [1, 8], [1, 9, 4, 4, 2, 3], [1, 2, 3], [1, 7, 7]]
    dec = SpeculativeDecoder(target, draft, num_draft_tokens=3)
    cfg = BenchConfig(max_new_tokens=16)  # rows of one batch finish at different steps
    widths, step = [], SpeculativeDecoder.step
    monkeypatch.setattr(SpeculativeDecoder, "step", lambda self: widths.append(self.num_active()) or step(self))
    new, wall, stats, _ = run_ours_stream(dec, Method("spec_g2", OURS, 2), rows, 2, 0.0, cfg, None, 7,
                                          torch.device("cpu"))
    assert new == [reference_greedy(target, r, 16) for r in rows] and wall > 0
    assert stats.num_sequences == 5 and stats.num_drafted <= 2 * stats.num_verify_steps
    # rows running as each step starts (a queued request joins inside it): never more than 2, and a request joined
    # a row still running (1 then 2), not only a fresh batch
    assert max(widths) == 2 and (1, 2) in set(zip(widths, widths[1:]))
    assert dec.num_draft_tokens == 3 and not dec.has_unfinished()
    sampled, _, _, _ = run_ours_stream(dec, Method("spec_g2", OURS, 2), rows, 3, 1.0, cfg, None, 7,
                                       torch.device("cpu"))
    dec.num_draft_tokens = 2  # a seeded request's draws follow its γ schedule (docs/decode.md)
    for i in (0, 4):  # request i was seeded 7 + i
        dec.add_request(rows[i], 16, 1.0, seed=7 + i, request_id="alone")
        while dec.has_unfinished():
            out = dec.step()
        assert out[0].new_tokens == sampled[i]
    dec.num_draft_tokens = 3
    for bad in (0, 1.5, True):  # 0 looped for ever: no request was ever queued
        with pytest.raises(ValueError, match="concurrency must be an integer >= 1"):
            run_ours_stream(dec, Method("plain", OURS, 0), rows, bad, 0.0, cfg, None, 7, torch.device("cpu"))
    monkeypatch.setattr(SpeculativeDecoder, "step", lambda self: (_ for _ in ()).throw(MemoryError("boom")))
    with pytest.raises(MemoryError):
        run_ours_stream(dec, Method("plain", OURS, 0), rows, 2, 0.0, cfg, None, 7, torch.device("cpu"))
    assert dec.num_draft_tokens == 3 and not dec.has_unfinished()


def test_few_row_linear_option_maps_to_the_decoder_setting():
    assert _config().few_row_linear is None  # the decoder's default
    assert _config("--few-row-linear", "on").few_row_linear is True
    assert _config("--few-row-linear", "off").few_row_linear is False
    with pytest.raises(SystemExit) as e:
        _config("--few-row-linear", "yes")
    assert e.value.code == 2


def test_compile_option_maps_to_the_decoder_setting():
    assert _config().compile is False
    assert _config("--compile").compile is True  # both models, as before the draft-only choice
    assert _config("--compile", "both").compile is True
    assert _config("--compile", "draft").compile == "draft"
    with pytest.raises(SystemExit) as e:
        _config("--compile", "target")
    assert e.value.code == 2
    for bad in ("target", 1, 0, None):  # 1 == True and 0 == False, but neither is the setting's type
        with pytest.raises(ValueError, match="compile must be False, True .* or 'draft'"):
            BenchConfig(compile=bad).validate()


@pytest.mark.parametrize("compile", ["draft", "both"])
def test_highlights_compare_a_compiled_run_with_hf_assisted_and_its_own_prediction(bench_run, compile):
    """With --compile, spec_g{γ}_compiled gets its own row against the same HF assisted run, and the compiled c and
    the compiled run at the best γ are checked against the bare ratio and their own (compiled-c) prediction, which
    is over plain_compiled when the target is compiled too (over eager plain with the draft alone compiled)."""
    results = json.loads(json.dumps(bench_run[0]))
    results["config"]["compile"] = compile
    results["cost"]["compiled"] = dict(results["cost"], cost_ratio=0.5 * results["cost"]["cost_ratio"])
    plain_factor = {"speedup": 1.3, "decode_speedup": 1.2} if compile == "both" else {"speedup": 1, "decode_speedup": 1}
    for run in [r for r in results["runs"] if r["method"] in {f"spec_g{s['best_gamma_measured']}"
                                                              for s in results["summary"]} | {"spec_g3", "plain"}]:
        twin = json.loads(json.dumps(run))
        twin["method"], twin["compiled"] = f"{run['method']}_compiled", True
        factors = ({**plain_factor, "prefill_s": 0.5} if run["method"] == "plain" else
                   {"speedup": 1.25, "decode_speedup": 1.5, "predicted_speedup_verify_aware": 1.4})
        for key, factor in factors.items():
            twin["overall"][key] = run["overall"][key] * factor
        results["runs"].append(twin)
    for entry, s in zip(highlights(results), results["summary"]):
        runs = {r["method"]: r["overall"] for r in results["runs"] if r["temperature"] == entry["temperature"]}
        checks = {c["name"]: c for c in entry["checks"] if c["name"] != "batch_speedup"}
        ck = checks["ours_compiled_vs_hf_assisted"]  # both over eager plain
        assert (ck["gamma"], ck["compile"]) == (3, compile)
        assert ck["ours"] == runs["spec_g3_compiled"]["speedup"] and ck["reference"] == runs["hf_assisted_g3"]["speedup"]
        assert ck["ratio"] == pytest.approx(1.25 * checks["ours_vs_hf_assisted"]["ratio"])
        ck = checks["cost_ratio_compiled_vs_bare"]
        assert (ck["ours"], ck["reference"], ck["compile"]) == (
            results["cost"]["compiled"]["cost_ratio"], results["cost"]["bare"]["cost_ratio"], compile)
        assert ck["ratio"] == pytest.approx(0.5 * checks["cost_ratio_vs_bare"]["ratio"])
        g = s["best_gamma_measured"]
        for name, key, factor in (("measured", "speedup", 1.25 / 1.4), ("decode", "decode_speedup", 1.5 / 1.4)):
            ck = checks[f"{name}_compiled_vs_verify_aware"]
            assert (ck["gamma"], ck["compile"]) == (g, compile)
            assert ck["ours"] == pytest.approx(runs[f"spec_g{g}_compiled"][key] / runs["plain_compiled"][key])
            assert ck["reference"] == runs[f"spec_g{g}_compiled"]["predicted_speedup_verify_aware"]
            assert ck["ratio"] == pytest.approx(factor / plain_factor[key] * checks[f"{name}_vs_verify_aware"]["ratio"])
        ck = checks["measured_compiled_vs_end_to_end"]  # the prefill share of the plain decoding it is over
        own = runs["plain" if compile == "draft" else "plain_compiled"]
        assert (ck["gamma"], ck["compile"]) == (g, compile)
        assert ck["ours"] == checks["measured_compiled_vs_verify_aware"]["ours"]
        assert ck["reference"] == pytest.approx(end_to_end_speedup(
            runs[f"spec_g{g}_compiled"]["predicted_speedup_verify_aware"], own["prefill_s"] / own["total_s"],
            results["cost"]["bare"]["prefill_cost_ratio"]))
    from rich.console import Console

    buf = io.StringIO()
    render_tables(dict(results, report=highlights(results)), Console(file=buf, width=250))
    text = buf.getvalue()
    assert "compiled c = " in text and "its verify-aware prediction" in text, text


def test_list_options_take_each_value_once():
    """Every list option drops repeats, compared as parsed values (0 and 0.0 are one temperature), keeping the
    first; run twice they were pooled together and doubled the rows of the tables and the JSON."""
    cfg = _config("--gammas", "4,2,2,4", "--hf-gammas", "2,2", "--temperatures", "0,0.0,1,1.0",
                  "--batch-sizes", "4,1,1,4")
    assert (cfg.gammas, cfg.hf_gammas, cfg.temperatures, cfg.batch_sizes) == ([2, 4], [2], [0.0, 1.0], [4, 1])
    assert [m.name for m in build_methods(cfg)].count("plain") == 1
    # A config built in Python is taken as meant: a repeated value is refused, naming the list.
    for field, values in (("gammas", [2, 2]), ("temperatures", [0, 0.0]), ("batch_sizes", [1, 1]),
                          ("hf_gammas", [3, 3])):
        with pytest.raises(ValueError, match=f"\\({field}\\) lists a value twice"):
            BenchConfig(**{field: values}).validate()


@pytest.mark.parametrize("argv, message", [
    (["--gammas", "auto", "--no-auto"], "lists 'auto' but --no-auto skips it"),
    (["--hf-gammas", "2", "--no-hf"], "asks for HF assisted runs but --no-hf skips HF"),
    (["--hf-gammas", "4,auto"], "--hf-gammas '4,auto': 'auto' is not an option there"),
    (["--hf-gammas", "0"], "bad γ 0 in --hf-gammas"),
    (["--limit", "0"], r"--limit must be >= 1 \(got 0\)"),
    (["--cost-context", "0"], r"--cost-context \(cost_context_tokens\) must be >= 2"),
    (["--cost-context", "-5"], r"--cost-context \(cost_context_tokens\) must be >= 2"),
    (["--cost-context", "1"], r"--cost-context \(cost_context_tokens\) must be >= 2"),
])
def test_contradictory_or_out_of_range_options_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        _config(*argv)


def test_cost_context_must_fit_the_models_positions_before_any_timing(monkeypatch):
    """The cost measurement prefills n - 1 tokens, then times a verify forward of γ+1 tokens: n + γ positions."""
    import decode.costs

    seen = []

    def stop(target, draft, context, *args, **kwargs):
        seen.append(context.shape[1])
        raise InterruptedError("the timed work starts here")

    monkeypatch.setattr(decode.costs, "CostTimer", stop)
    target = tiny_llama(seed=0, layers=1)  # 256 positions
    cfg = BenchConfig(gammas=[2], auto=False, hf=False, temperatures=[0.0], batch_sizes=[1], max_new_tokens=4,
                      cost_repeats=3, warmup=False, cost_context_tokens=255)
    with pytest.raises(ValueError, match=r"--cost-context 255 plus the largest γ 2 .* 257 positions, more than the "
                                         r"models' 256; give --cost-context <= 254"):
        run_benchmark(target, target, [[1, 5, 6]], [None], cfg, pad_token_id=0, progress=False)
    assert not seen
    cfg.cost_context_tokens = 254  # fits exactly, and is the context measured
    with pytest.raises(InterruptedError):
        run_benchmark(target, target, [[1, 5, 6]], [None], cfg, pad_token_id=0, progress=False)
    assert seen == [254]


def test_auto_only_runs_auto_in_the_batch_pass_and_prints_no_none(tmp_path):
    """--gammas auto: no fixed γ to rank, so the batch pass measures γ="auto" and the tables say so."""
    from rich.console import Console

    from decode.bench import render_tables

    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[], auto=True, hf=False, temperatures=[0.0], batch_sizes=[1, 2], max_new_tokens=4,
                      cost_repeats=3, warmup=False)
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6], [1, 7]], [None, None], cfg, pad_token_id=0,
                            progress=False)
    assert {(b["method"], b["batch_size"]) for b in results["batch"]} == {
        ("plain", 1), ("spec_auto", 1), ("plain", 2), ("spec_auto", 2)}
    assert sorted(results["cost"]["auto_costs"]) == ["1", "2"]  # calibrated before the timed runs
    write_outputs(results, tmp_path / "auto.json")
    console = Console(file=io.StringIO(), width=200)
    render_tables(results, console)
    printed = console.file.getvalue()
    assert "None" not in printed and "no fixed γ measured" in printed
    assert "batch 2 tok/s, γ=auto / plain" in printed


def test_auto_costs_cover_every_batch_size_a_batch_passes_through_before_timing(monkeypatch):
    """A batch of 3 runs at 3 rows (costs of 4), then 2, then 1 as rows finish: all three are calibrated up front
    (measured lazily, a batch size's costs would be paid inside a timed run), with --cost-repeats timed forwards
    each (the decoder's default of 5 leaves the verify costs too noisy for auto γ to pick well)."""
    import decode.costs

    repeats = []
    calibrate = decode.costs.calibrate
    monkeypatch.setattr(decode.costs, "calibrate",
                        lambda dec, *a, **kw: repeats.append(kw.get("repeats")) or calibrate(dec, *a, **kw))
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[2], auto=True, hf=False, temperatures=[1.0], batch_sizes=[3], max_new_tokens=4,
                      cost_repeats=3, warmup=False)
    results = run_benchmark(target, perturbed_copy(target), [[1, 5, 6], [1, 7], [2, 9, 4]], [None] * 3, cfg,
                            pad_token_id=0, progress=False)
    assert sorted(results["cost"]["auto_costs"], key=int) == ["1", "2", "4"]
    assert repeats == [3]  # one call for the three batch sizes, with the run's cost repeats
    assert all(v["target_forward_s"] > 0 for v in results["cost"]["auto_costs"].values())


def test_config_validation_messages():
    with pytest.raises(ValueError, match=r"\(max_new_tokens\) must be >= 1"):
        BenchConfig(max_new_tokens=0).validate()
    for repeats in (3.5, "5", math.nan, True, 2):  # 3.5 used to fail after the models loaded, nan in math.ceil
        with pytest.raises(ValueError, match=r"--cost-repeats \(cost_repeats\) must be an integer >= 3"):
            BenchConfig(cost_repeats=repeats).validate()
    for repeats in (0, 1.5, "3", True):
        with pytest.raises(ValueError, match=r"--repeats \(repeats\) must be an integer >= 1"):
            BenchConfig(repeats=repeats).validate()
    assert _config("--repeats", "3").repeats == 3 and _config().repeats == 1
    assert _config("--batching", "static, continuous,static").batching == ["static", "continuous"]
    with pytest.raises(ValueError, match=r"--batching continuous runs streams at batch sizes > 1"):
        _config("--batching", "continuous", "--batch-sizes", "1")  # was an empty batch pass and a blank plot
    with pytest.raises(ValueError, match=r"--batching \(batching\) takes one or both of static, continuous"):
        _config("--batching", "dynamic")
    with pytest.raises(ValueError, match="no speculative method"):
        BenchConfig(gammas=[], auto=False).validate()
    with pytest.raises(ValueError, match="temperatures"):
        BenchConfig(temperatures=[math.nan]).validate()


def test_eos_handling_is_the_same_for_every_method():
    """With an EOS every method stops where plain greedy decoding stops; with ignore_eos none stops early, even
    though the checkpoint's generation_config names that EOS (HF would otherwise fill it in)."""
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    draft = perturbed_copy(target)
    prompt = [1, 5, 6, 7]
    cfg = BenchConfig(gammas=[2], auto=False, temperatures=[0.0], batch_sizes=[1], max_new_tokens=10,
                      cost_repeats=3, warmup=False)
    free = run_benchmark(target, draft, [prompt], [None], cfg, pad_token_id=0, progress=False)
    eos = free["records"]["0.0/plain"][0]["new_tokens"][3]  # a token plain greedy emits 4th
    target.generation_config.eos_token_id = eos
    stopped = run_benchmark(target, draft, [prompt], [None], cfg, pad_token_id=0, eos_token_id=eos, progress=False)
    ignored = run_benchmark(target, draft, [prompt], [None], BenchConfig(**{**cfg.__dict__, "ignore_eos": True}),
                            pad_token_id=0, eos_token_id=eos, progress=False)
    cut = free["records"]["0.0/plain"][0]["new_tokens"].index(eos) + 1
    for name in ("plain", "spec_g2", "hf_target", "hf_assisted"):
        assert len(stopped["records"][f"0.0/{name}"][0]["new_tokens"]) == cut, name
        assert len(ignored["records"][f"0.0/{name}"][0]["new_tokens"]) == cfg.max_new_tokens, name


def test_hf_fixed_gamma_sets_the_assistants_config_for_the_call_only():
    """HF reads the assisted-generation settings from the draft's generation_config; the hf_assisted_g{γ} run must
    really draft γ tokens per step (counted target forwards) and leave the draft's config as it was."""
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    draft = perturbed_copy(target, noise=0.0)  # identical: every draft is accepted, so each step drafts γ
    cfg = BenchConfig(gammas=[3], auto=False, hf_gammas=[3], temperatures=[0.0], batch_sizes=[1], max_new_tokens=13,
                      cost_repeats=3, warmup=False, ignore_eos=True)
    before = draft.generation_config.to_dict()
    results = run_benchmark(target, draft, [[1, 5, 6, 7]], [None], cfg, pad_token_id=0, progress=False)
    assert draft.generation_config.to_dict() == before
    run = {r["method"]: r for r in results["runs"]}["hf_assisted_g3"]
    assert run["hf_num_assistant_tokens"] == 3 and run["overall"]["matches_plain_greedy"] == 1.0
    assert set(results["summary"][0]["hf_assisted_fixed_speedup"]) == {"3"}
    # Count target forwards of one call. 13 new tokens with all drafts accepted: γ+1 per verify step, so 4 target
    # forwards at γ=3 and 7 at γ=1 (prefill included).
    from decode.bench import Method, run_hf

    def target_forwards(gamma):
        calls = []
        handle = target.register_forward_hook(lambda *a: calls.append(1))
        ids = torch.tensor([[1, 5, 6, 7]], device=TEST_DEVICE)
        run_hf(target, draft, Method("hf", "hf", gamma, assisted=True), ids, torch.ones_like(ids), 0.0, cfg, None,
               0, 0, TEST_DEVICE)
        handle.remove()
        return len(calls)

    assert target_forwards(3) == 4
    assert target_forwards(1) == 7


# ------------------------------------------------------------------------------------------------ GPU benchmark
def test_synthetic_draft_is_the_targets_early_exit():
    from decode.bench.synthetic_pair import build_pair

    pair = build_pair("tiny", draft_layers=2, dtype=torch.float64, device=TEST_DEVICE)
    plain = build_pair("tiny", draft_layers=2, late_layer_scale=1.0, logit_scale=1.0, dtype=torch.float64,
                       device=TEST_DEVICE)
    t, d = pair.target.model, pair.draft.model
    assert all(a is b for a, b in zip(d.layers, t.layers)) and len(d.layers) == 2
    assert d.embed_tokens is t.embed_tokens and pair.draft.lm_head is pair.target.lm_head and d.norm is t.norm
    for i, (scaled, base) in enumerate(zip(t.layers, plain.target.model.layers)):
        factor = 1.0 if i < 2 else pair.late_layer_scale  # same seed: same weights up to the scaling
        assert torch.equal(scaled.mlp.down_proj.weight, base.mlp.down_proj.weight * factor)
        assert torch.equal(scaled.self_attn.o_proj.weight, base.self_attn.o_proj.weight * factor)
    ids = torch.tensor([[1, 9, 33, 70, 4, 200]], device=TEST_DEVICE)
    with torch.no_grad():
        hidden = pair.target(input_ids=ids, output_hidden_states=True).hidden_states[2]  # after layer 2, pre-norm
        early_exit = pair.target.lm_head(t.norm(hidden))
        assert torch.allclose(pair.draft(input_ids=ids).logits, early_exit, rtol=1e-12, atol=1e-12)


def test_full_synthetic_pair_has_the_announced_sizes():
    from decode.bench.synthetic_pair import build_pair

    pair = build_pair("full", device="meta")  # shapes only, no memory
    assert 1.0e9 < pair.target_parameters < 1.1e9 and 100e6 < pair.draft_parameters < 120e6
    with pytest.raises(ValueError, match="draft_layers must be in"):
        build_pair("tiny", draft_layers=4, device="meta")


def test_gpu_bench_script_end_to_end_on_cpu_with_tiny_sizes(tmp_path):
    """scripts/gpu_bench.sh as shipped (its tests step skipped: this is that test run), GPU_BENCH_TINY=1."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # the script's own 300 s limit is sized for the GPU run; a loaded 2-core CPU needs more for the tiny one
    env = {**os.environ, "GPU_BENCH_TINY": "1", "GPU_BENCH_SKIP_TESTS": "1", "OUT": str(tmp_path),
           "OMP_NUM_THREADS": "1", "GPU_BENCH_TIMEOUT": "540"}
    done = subprocess.run(["bash", str(root / "scripts" / "gpu_bench.sh")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_bench.json").read_text())
    validate_results(results)
    assert {r["method"] for r in results["runs"]} == {"plain", "spec_g4", "spec_auto", "hf_target", "hf_assisted",
                                                      "hf_assisted_g4"}
    assert {b["batch_size"] for b in results["batch"]} == {1, 16} and results["pair"]["size"] == "tiny"
    ours = [r for r in results["runs"] if r["method"] in ("plain", "spec_g4", "spec_auto")]
    assert ours and all(r["profile"]["steps"] > 0 and "verify_forward" in r["profile"]["parts"] for r in ours)
    assert all(r["overall"]["matches_plain_greedy"] == 1.0 for r in results["runs"] if r["temperature"] == 0)
    assert "highlights: ours / reference" in done.stdout and "compiled:" in done.stdout
    assert (tmp_path / "bench.log").read_text().count("=== gpu_bench") >= 1
    # A second run into the same OUT refuses before doing anything: the first run's files stay.
    again = subprocess.run(["bash", str(root / "scripts" / "gpu_bench.sh")], env=env, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 2 and "already holds" in again.stderr
    assert json.loads((tmp_path / "gpu_bench.json").read_text()) == results


def test_pruned_draft_with_hf_assisted_is_refused_before_loading(saved_pair, tmp_path, capsys, no_model_loads):
    """HF assisted generation cannot read a vocabulary-pruned draft's id map: the CLI says --no-hf up front."""
    from decode.__main__ import main as decode_main
    from decode.vocab_map import prune_draft_head
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(str(saved_pair / "draft"))
    prune_draft_head(draft, torch.arange(0, draft.config.vocab_size, 2)).save_pretrained(tmp_path / "pruned")
    args = ["--target", str(saved_pair / "target"), "--draft", str(tmp_path / "pruned"), "--dtype", "float32"]
    assert decode_main(["bench", *args, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "vocabulary-pruned" in err and "pass --no-hf" in err


def test_hub_ids_pass_the_path_check(saved_pair, tmp_path, monkeypatch):
    """``org/name`` (a hub id in the local cache) is not a local path: bench used to refuse it as a missing file."""
    import huggingface_hub.constants

    from tests.conftest import put_snapshot

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    put_snapshot(cache, "org/target", "a" * 40, saved_pair / "target")
    put_snapshot(cache, "org/draft", "b" * 40, saved_pair / "draft")
    with pytest.raises(ValueError, match="unknown prompt set 'humaneva'"):  # got past --target and --draft
        run_cli(["--target", "org/target", "--draft", "org/draft", "--prompts", "humaneva", "--out", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="--target ./org/target does not exist"):
        run_cli(["--target", "./org/target", "--draft", "org/draft", "--out", str(tmp_path)])
    from decode.bench.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["--target", "org/target", "--draft", "org/draft"]))
    assert (cfg.target_revision, cfg.draft_revision) == ("a" * 40, "b" * 40)  # results.json's config names them


def test_a_draft_with_a_smaller_input_embedding_is_benchmarked():
    """Found by a new user's trial: the bare-forward reference fed the draft the target's ids, and a draft whose
    embedding has fewer rows (lossless through the decoder's substitute id) ended the bench in an IndexError. Both
    cost measurements now read the ids as the decoder feeds them."""
    target = tiny_llama(seed=0, layers=2).to(TEST_DEVICE)
    draft = tiny_llama(vocab_size=48, seed=1, layers=1).to(TEST_DEVICE)
    cfg = BenchConfig(gammas=[2], auto=False, hf=False, temperatures=[0.0], batch_sizes=[1], max_new_tokens=4,
                      cost_repeats=3, warmup=False)
    prompts = [[1, 70, 90, 5], [2, 95, 60]]  # ids the draft cannot embed
    results = run_benchmark(target, draft, prompts, [None, None], cfg, pad_token_id=0, progress=False)
    assert results["cost"]["bare"]["cost_ratio"] > 0
    spec = [run for run in results["runs"] if run["method"] == "spec_g2"]
    assert len(spec) == 1 and spec[0]["overall"]["matches_plain_greedy"] == 1.0


def test_a_draft_of_another_vocabulary_size_with_hf_assisted_says_no_hf(saved_pair, tmp_path, capsys):
    """Found by a new user's trial: ours runs a draft with fewer embedding rows losslessly, but the bench's HF
    assisted run ended the whole benchmark with HF's own tokenizer message."""
    from decode.__main__ import main as decode_main

    tiny_llama(vocab_size=48, seed=1, layers=1, dtype=torch.float32).save_pretrained(tmp_path / "small")
    args = ["--target", str(saved_pair / "target"), "--draft", str(tmp_path / "small"), "--dtype", "float32",
            "--prompts", "mt_bench", "--limit", "1", "--max-new-tokens", "4", "--gammas", "2", "--temperatures", "0",
            "--batch-sizes", "1", "--cost-repeats", "3"]
    assert decode_main(["bench", *args, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "another vocabulary size than the target" in err and "pass --no-hf" in err
    assert not (tmp_path / "x.json").exists()
    assert decode_main(["bench", *args, "--no-hf", "--no-auto", "--out", str(tmp_path / "y.json")]) == 0


def test_a_hugging_face_method_that_raises_is_reported_not_run(monkeypatch, capsys, tmp_path):
    """Universal assisted decoding raises inside transformers on some pairs: the run goes on without that row, and
    says so; our methods and the other HF rows are measured as usual."""
    import decode.bench.runs as runs
    from decode.bench.report import render_tables

    real = runs.run_hf

    def flaky(target, draft, method, ids, mask, temperature, *args, **kwargs):
        if method.assisted and temperature > 0 and ids.shape[1] > 6:  # the 2nd prompt, past the warm-up's
            raise RuntimeError("shape mismatch in the assistant")
        return real(target, draft, method, ids, mask, temperature, *args, **kwargs)

    monkeypatch.setattr(runs, "run_hf", flaky)
    target = tiny_llama(seed=0, layers=2)
    prompts = [[1, 5, 6, 7], [1, 5, 6, 7, 8, 9, 10, 11], [1, 9, 8]]
    cfg = BenchConfig(gammas=[2], auto=False, temperatures=[0.0, 1.0], batch_sizes=[1], max_new_tokens=6,
                      cost_repeats=3)
    results = run_benchmark(target, perturbed_copy(target), prompts, ["x", "y", "x"], cfg, pad_token_id=0,
                            eos_token_id=None, progress=False)
    assert list(results["hf_failures"]) == ["1.0/hf_assisted"]
    assert "RuntimeError: shape mismatch in the assistant" in results["hf_failures"]["1.0/hf_assisted"]
    ran = {(r["temperature"], r["method"]) for r in results["runs"]}
    assert ran == {(t, m) for t in (0.0, 1.0) for m in ("plain", "spec_g2", "hf_target", "hf_assisted")} - {
        (1.0, "hf_assisted")}
    summary = {s["temperature"]: s for s in results["summary"]}
    assert summary[1.0]["hf_assisted_speedup"] is None and summary[0.0]["hf_assisted_speedup"] is not None
    write_outputs(results, tmp_path / "bench")
    render_tables(results)
    assert "not run: hf_assisted at T=1" in capsys.readouterr().out
