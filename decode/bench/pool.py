"""Pooling per-prompt records into the metrics of ``results.json``: throughput and speedup from wall clock,
acceptance from ``DecodeStats`` (``decode.metrics``), predictions from ``decode.speedup``.

Everything is pooled over tokens and steps (Σ over prompts), never averaged per prompt.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from decode.bench.config import HF, OURS, BenchConfig, Method
from decode.bench.measure import acceptance, alpha_of, predict
from decode.metrics import DecodeStats, chars_per_verify_step
from decode.speedup import (AdaptiveGamma, best_gamma, end_to_end_speedup, is_count, is_finite_number,
                            predicted_speedup, simulate_batch_speedup)


def alpha_from_steps(steps: Sequence[tuple[int, Sequence[int]]]) -> float | None:
    """Estimate Leviathan et al.'s α (probability that one draft token is accepted) from verify steps.

    Args:
        steps: ``(γ_s, n_accepted per row)`` of each verify step.

    Every step with γ_s > 0 is a run of Bernoulli(α) trials that stops at the first rejection or after γ_s
    acceptances, so the maximum-likelihood estimate is accepted / (accepted + rejections), with a rejection
    wherever n < γ_s: exactly what ``DecodeStats`` records per step, so this folds the steps into one. Exact also
    for γ="auto" and for steps shortened at the end of the token budget. This is not ``acceptance_rate``
    (Σaccepted / Σdrafted), which counts drafts after a rejection as failures and so falls as γ grows even when
    α does not.

    Returns None when nothing was drafted.
    """
    stats = DecodeStats()
    for gamma, n_accepted in steps:
        stats.record_step(gamma, list(n_accepted))
    return alpha_of(stats)


def stats_counts(stats: DecodeStats | None) -> dict[str, int] | None:
    """The ``DecodeStats`` counters stored per prompt in ``results.json`` (enough to re-pool α and mean γ)."""
    if stats is None:
        return None
    return {k: int(getattr(stats, k)) for k in ("num_drafted", "num_accepted", "num_verify_steps", "num_rejections")}


_EMPTY = ("decode_latency_s", "ttft_s", "prefill_s", "peak_memory_bytes", "speedup", "decode_speedup", "alpha",
          "acceptance_rate", "mean_accepted_length", "acceptance_by_position", "accepted_per_position",
          "accepted_length_histogram", "num_verify_steps", "num_drafted", "num_accepted", "mean_gamma",
          "predicted_speedup_leviathan", "predicted_speedup_verify_aware", "predicted_gamma", "matches_plain_greedy",
          "num_matching_plain_greedy")
# Every metric of a run in results.json (validated by decode.bench.report.validate_results): the counts and
# timings every method has, then those left null where they do not apply.
RUN_METRICS = ("num_prompts", "num_new_tokens", "total_s", "tokens_per_s", "per_token_latency_s") + _EMPTY


def aggregate(records: list[dict], plain_records: list[dict] | None, cost_ratio: float, gamma, temperature: float,
              auto_max_gamma: int = 8, verify_cost: dict | None = None,
              catchup_cost_ratio: float | None = None) -> dict[str, Any]:
    """Pool per-prompt records of one method (and optionally one category) into the METRICS of the JSON schema.

    Args:
        records: per prompt {"new_tokens", "wall_s", "ttft_s", "peak_memory_bytes", "key", "stats" (DecodeStats
            for our engine, else None)}.
        plain_records: the plain-decoding records of the same prompts (speedup, greedy equality), or None.
        cost_ratio: c; gamma: the method's γ (0, int, "auto" or None for HF); verify_cost: {γ: v_γ};
            catchup_cost_ratio: c₂ of the draft's two-token catch-up forward, in the verify-aware prediction
            (:func:`decode.speedup.catchup_cost`; None: left out).
    """
    n_tokens = sum(len(r["new_tokens"]) for r in records)
    wall = sum(r["wall_s"] for r in records)
    tps = n_tokens / wall if wall > 0 else None
    m: dict[str, Any] = {"num_prompts": len(records), "num_new_tokens": n_tokens, "total_s": wall,
                         "tokens_per_s": tps, "per_token_latency_s": wall / n_tokens if n_tokens else None,
                         **dict.fromkeys(_EMPTY)}
    ttfts = [r["ttft_s"] for r in records if r.get("ttft_s") is not None]
    m["ttft_s"] = statistics.mean(ttfts) if ttfts else None
    peaks = [r["peak_memory_bytes"] for r in records if r.get("peak_memory_bytes")]
    m["peak_memory_bytes"] = max(peaks) if peaks else None
    engine = [r.get("stats") for r in records]
    if engine and all(s is not None for s in engine):
        m["prefill_s"] = prefill_seconds(DecodeStats.merge(engine))
    if plain_records is not None:
        m["decode_speedup"] = decode_speedup(records, plain_records)
        p_tokens = sum(len(r["new_tokens"]) for r in plain_records)
        p_wall = sum(r["wall_s"] for r in plain_records)
        if p_wall > 0 and p_tokens and tps:
            m["speedup"] = tps / (p_tokens / p_wall)
        if temperature == 0:
            by_key = {r["key"]: r["new_tokens"] for r in plain_records}
            same = sum(by_key.get(r["key"]) == r["new_tokens"] for r in records)
            m["num_matching_plain_greedy"], m["matches_plain_greedy"] = same, same / len(records)
    m.update(text_rates(records, n_tokens))
    stats = [r["stats"] for r in records if r.get("stats") is not None]
    if stats and gamma not in (0, None):
        m.update(acceptance(DecodeStats.merge(stats)))
        if m["chars_per_token"] is not None:
            m["chars_per_verify_step"] = chars_per_verify_step(sum(r["num_chars"] for r in records), n_tokens,
                                                               m["mean_accepted_length"])
        if m["alpha"] is not None:
            # For "auto" the fair prediction is at the γ its controller should settle on (same bounds as it).
            g, m["predicted_speedup_leviathan"] = predict(m["alpha"], cost_ratio, None,
                                                          None if gamma == "auto" else gamma, auto_max_gamma)
            m["predicted_gamma"] = g
            if verify_cost and g in verify_cost:
                m["predicted_speedup_verify_aware"] = predicted_speedup(m["alpha"], g, cost_ratio,
                                                                        verify_cost=verify_cost[g],
                                                                        catchup_cost_ratio=catchup_cost_ratio)
    return m


def text_rates(records: list[dict], num_tokens: int) -> dict[str, float | None]:
    """``chars_per_token``: Σ characters of the records' decoded new text (``num_chars``, the target's tokenizer)
    / Σ new tokens; ``chars_per_verify_step`` starts as None (:func:`aggregate` sets it for a speculative method of
    our engine: :func:`decode.metrics.chars_per_verify_step`). Both None when a record has no
    ``num_chars`` (no tokenizer) or no token was generated."""
    chars = [r.get("num_chars") for r in records]
    known = bool(chars) and all(c is not None for c in chars) and num_tokens > 0
    return {"chars_per_token": sum(chars) / num_tokens if known else None, "chars_per_verify_step": None}


def median_run(repeats: Sequence[dict]) -> dict:
    """The record of one method on one prompt (or batch) from its ``--repeats`` timed runs: the run with the median
    wall time (the lower median for an even count), whole, so its stats and timings stay one call's; with
    ``wall_s_repeats``, every run's wall seconds in run order. Raises ValueError for no runs."""
    if not repeats:
        raise ValueError("median_run: no timed runs")
    walls = [r["wall_s"] for r in repeats]
    chosen = repeats[walls.index(statistics.median_low(walls))]
    return {**chosen, "wall_s_repeats": walls}


def decode_speedup(records: list[dict], plain_records: list[dict]) -> float | None:
    """Speedup of the decode phase: plain decoding's seconds per token after the first step over the method's,
    pooled (``DecodeStats.per_token_latency_s`` of the merged stats). Prefill and the first step are left out on
    both sides: they are what Leviathan et al.'s per-step model (the predictions) leaves out. None when either
    side has no engine stats (Hugging Face runs)."""
    stats = [r.get("stats") for r in records]
    plain = [r.get("stats") for r in plain_records]
    if not stats or not plain or any(s is None for s in stats + plain):
        return None
    ours, ref = DecodeStats.merge(stats).per_token_latency_s, DecodeStats.merge(plain).per_token_latency_s
    return ref / ours if ours > 0 and ref > 0 else None


def prefill_seconds(stats: DecodeStats) -> float:
    """Seconds of prefill, from pooled stats: the time to the first token (the target's prefill gives it) plus the
    draft's prefill that follows it (``draft_prefill_s``, 0 for plain decoding). The end-to-end prediction of the
    highlights takes plain decoding's share of it."""
    return stats.ttft_s + stats.draft_prefill_s


def pool(records: dict[tuple[float, str], list[dict]], methods: list[Method], cfg: BenchConfig, cost: dict,
         categories: list[str | None]) -> tuple[list[dict], list[dict]]:
    """All records -> (``runs``: one entry per temperature and method, overall and by category; ``summary``: one
    entry per temperature with the pooled α, the best γ by measurement and by prediction, auto and HF)."""
    c, c2 = cost["cost_ratio"], cost.get("catchup_cost_ratio")
    v = {e["gamma"]: e["relative_cost"] for e in cost.get("verify", [])}
    # compiled methods are predicted from the costs of the compiled forwards (measured when the run compiles)
    compiled = cost.get("compiled") or cost
    c_comp, v_comp = compiled["cost_ratio"], {e["gamma"]: e["relative_cost"] for e in compiled.get("verify", [])}
    c2_comp = compiled.get("catchup_cost_ratio")
    cats = sorted({x for x in categories if x is not None})
    runs, summary = [], []
    for t in cfg.temperatures:
        plain = records[(t, "plain")]
        for m in methods:
            if (t, m.name) not in records:  # a Hugging Face method whose generate raised (results["hf_failures"])
                continue
            rs = records[(t, m.name)]
            mc, mv, mc2 = (c_comp, v_comp, c2_comp) if m.compiled else (c, v, c2)
            run = {"temperature": t, "method": m.name, "kind": m.kind,
                   "num_draft_tokens": None if m.kind == HF else m.gamma,
                   "hf_num_assistant_tokens": m.gamma if m.kind == HF else None, "compiled": m.compiled,
                   "overall": aggregate(rs, plain, mc, m.gamma, t, cfg.auto_max_gamma, mv, mc2), "by_category": {}}
            for cat in cats:
                run["by_category"][cat] = aggregate([r for r in rs if r["category"] == cat],
                                                    [r for r in plain if r["category"] == cat], mc, m.gamma, t,
                                                    cfg.auto_max_gamma, mv, mc2)
            runs.append(run)
        summary.append(_summarise(t, runs, records, methods, cfg, c, v, c2))
    return runs, summary


def _summarise(t: float, runs: list[dict], records, methods: list[Method], cfg: BenchConfig, c: float,
               v: dict, c2: float | None = None) -> dict[str, Any]:
    here = [r for r in runs if r["temperature"] == t]
    fixed = [r for r in here if r["kind"] == OURS and not r["compiled"] and isinstance(r["num_draft_tokens"], int)
             and r["num_draft_tokens"] > 0]
    stats = [r["stats"] for m in methods if m.kind == OURS and not m.compiled and isinstance(m.gamma, int)
             and m.gamma > 0 for r in records[(t, m.name)]]
    alpha = alpha_of(DecodeStats.merge(stats)) if stats else None
    entry: dict[str, Any] = {"temperature": t, "alpha": alpha, "cost_ratio": c}
    measured = {r["num_draft_tokens"]: r["overall"]["speedup"] for r in fixed if r["overall"]["speedup"]}
    entry["best_gamma_measured"] = max(measured, key=measured.get) if measured else None
    entry["measured_speedup_at_best"] = measured.get(entry["best_gamma_measured"])
    if alpha is not None:
        top = max(16, *cfg.gammas)
        bg = int(best_gamma(alpha, c, max_gamma=top))  # 0 means: speculation cannot pay off with this c
        curve = {g: float(predicted_speedup(alpha, g, c)) for g in range(0, top + 1)}
        tested = {g: curve[g] for g in cfg.gammas}
        aware = {g: predicted_speedup(alpha, g, c, verify_cost=v[g], catchup_cost_ratio=c2)
                 for g in cfg.gammas if g in v}
        entry.update(best_gamma_leviathan=bg, predicted_speedup_leviathan_at_best=curve[bg],
                     best_gamma_leviathan_tested=max(tested, key=tested.get) if tested else None,
                     best_gamma_verify_aware_tested=max(aware, key=aware.get) if aware else None,
                     predicted_curve=[{"gamma": g, "predicted_speedup_leviathan": s} for g, s in curve.items()])
    else:
        entry.update(best_gamma_leviathan=None, predicted_speedup_leviathan_at_best=None,
                     best_gamma_leviathan_tested=None, best_gamma_verify_aware_tested=None, predicted_curve=[])
    for name in ("spec_auto", "hf_target", "hf_assisted"):
        hit = [r for r in here if r["method"] == name]
        entry[f"{name}_speedup"] = hit[0]["overall"]["speedup"] if hit else None
    entry["hf_assisted_fixed_speedup"] = {str(r["hf_num_assistant_tokens"]): r["overall"]["speedup"] for r in here
                                          if r["kind"] == HF and r["hf_num_assistant_tokens"] is not None}
    best = entry["measured_speedup_at_best"]
    # Adaptive γ against the best fixed γ chosen with hindsight: > 1 means the controller beat it.
    entry["auto_vs_best_fixed"] = entry["spec_auto_speedup"] / best if best and entry["spec_auto_speedup"] else None
    return entry


def batching_of(row: dict[str, Any]) -> str:
    """A ``batch`` row's batching: "static" or "continuous" (rows written before the key existed are static)."""
    return row.get("batching", "static")


def batch_row(t: float, m: Method, bs: int, recs: list[dict], reused: bool,
              batching: str = "static") -> dict[str, Any]:
    """One row of ``results.json["batch"]``: pooled tokens/s of one method at one batch size, batched ``"static"``
    (``recs``: one per batch) or ``"continuous"`` (one per stream); the speedup and the prediction
    (:func:`predicted_batch_speedup`) are added later."""
    n = sum(len(r["new_tokens"]) for r in recs)
    wall = sum(r["wall_s"] for r in recs)
    peaks = [r["peak_memory_bytes"] for r in recs if r.get("peak_memory_bytes")]
    return {"temperature": t, "method": m.name, "num_draft_tokens": m.gamma, "compiled": m.compiled,
            "batch_size": bs, "batching": batching, "num_batches": len(recs), "num_new_tokens": n, "total_s": wall,
            "tokens_per_s": n / wall if wall > 0 else None, "peak_memory_bytes": max(peaks) if peaks else None,
            "reused_main_pass": reused, "predicted_speedup": None}


def prompt_alphas(records: dict[tuple[float, str], list[dict]], temperature: float, methods: Sequence[Method],
                  num_prompts: int) -> list[float | None]:
    """Each prompt's α at ``temperature`` (Leviathan et al.'s per-token acceptance,
    :func:`decode.bench.measure.alpha_of`), pooled over the main pass's speculative runs of our eager engine (fixed γ
    and ``auto``: α per token does not depend on γ); None for a prompt with no trial.

    Args:
        records: the main pass's ``{(temperature, method name): [record per prompt]}`` with their ``DecodeStats``.
        methods: the bench's methods (:func:`decode.bench.config.build_methods`).
        num_prompts: the length of the returned list.
    """
    spec = [m.name for m in methods if m.kind == OURS and not m.compiled and m.gamma != 0]
    per_method = [records.get((temperature, name)) or [] for name in spec]
    out: list[float | None] = []
    for i in range(num_prompts):
        stats = [recs[i]["stats"] for recs in per_method if i < len(recs) and recs[i].get("stats") is not None]
        out.append(alpha_of(DecodeStats.merge(stats)) if stats else None)
    return out


def predicted_batch_speedup(gamma: int | str, alphas: Sequence[Sequence[float]], plain_s: Sequence[float],
                            plain_prefill_s: Sequence[float], auto_costs: dict, max_new_tokens: int,
                            prefill_cost_ratio: float, max_auto_gamma: int = 8, runs: int = 200) -> float:
    """The speedup of static batches of speculative decoding over plain decoding that a decoder with no cost beyond
    its forwards is predicted to reach: what the batch pass's measured speedup is read against.

    A prediction, not a strict bound: acceptance in real text comes in runs (i.i.d. draws spread the rows' lengths
    more, which a static batch pays for), and plain decoding's own per-step work outside the forwards is not in the
    model, so a measured speedup can exceed it by a few percent (up to ~10% in short trial runs).

    Per batch: :func:`decode.speedup.simulate_batch_speedup` (each row's own α, i.i.d. acceptance; a step over B
    rows costs ``t_B (γ c_B + v_B(γ))`` from the costs calibrated at each batch size; rows leave as they finish and
    the batch ends with its last row), extended over the prefill by :func:`decode.speedup.end_to_end_speedup` with
    plain decoding's measured prefill share of that batch and the draft's prefill at ``prefill_cost_ratio`` of the
    target's. Pooled as the measured batch speedups are: Σ plain seconds / Σ predicted seconds. Like the batch-1
    prediction it counts γ draft forwards per step (the forwards prompt lookup saves are not in it) and every row makes
    ``max_new_tokens`` tokens (the bench computes it only where no eos stops a row: ``--ignore-eos``).

    Args:
        gamma: a fixed γ >= 1, or ``"auto"``: an ``AdaptiveGamma(max_auto_gamma)`` planning each step of the batch
            as the decoder's ``generate()`` does.
        alphas: per batch, each row's α in [0, 1] (e.g. its prompt's α at batch 1, :func:`prompt_alphas`).
        plain_s, plain_prefill_s: per batch, plain decoding's seconds and its prefill seconds
            (:func:`prefill_seconds`).
        auto_costs: ``{batch_size: {"cost_ratio", "verify", "target_forward_s"}}`` for every power of two up to the
            batch size (the decoder's ``calibrate``; results.json's ``cost.auto_costs``).
        max_new_tokens: tokens per row (>= 2); prefill_cost_ratio: the draft's prefill time / the target's (>= 0).
        runs: simulated batches per batch (fixed seed: the prediction is repeatable).

    Returns:
        the predicted speedup (> 0).

    Raises:
        ValueError: lists of different lengths or no batch, a γ that is neither an integer >= 1 nor "auto", a row
            of α that is not a non-empty list of numbers, a batch's seconds that are not finite and > 0, a prefill
            outside [0, its batch's seconds], ``max_new_tokens``, ``runs`` or ``max_auto_gamma`` not an integer,
            or a value :func:`decode.speedup.simulate_batch_speedup` / :func:`decode.speedup.end_to_end_speedup`
            refuse; each naming the argument.
    """
    lists = {"alphas": alphas, "plain_s": plain_s, "plain_prefill_s": plain_prefill_s}
    if any(isinstance(v, (str, bytes)) or not isinstance(v, Sequence) for v in lists.values()) or not alphas \
            or not len(alphas) == len(plain_s) == len(plain_prefill_s):
        raise ValueError("need one entry per batch in alphas, plain_s and plain_prefill_s (lists), got "
                         + ", ".join(f"{k}={v!r:.60}" for k, v in lists.items()))
    for name, value in (("max_new_tokens", max_new_tokens), ("runs", runs), ("max_auto_gamma", max_auto_gamma)):
        if not is_count(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    for rows, wall, prefill in zip(alphas, plain_s, plain_prefill_s):
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not rows \
                or not all(is_finite_number(a) for a in rows):
            raise ValueError(f"alphas: each batch needs a non-empty list of α per row (numbers), got {rows!r:.60}")
        if not (is_finite_number(wall) and wall > 0):
            raise ValueError(f"plain_s: each batch's plain seconds must be a finite number > 0, got {wall!r}")
        if not (is_finite_number(prefill) and 0 <= prefill <= wall):
            raise ValueError(f"plain_prefill_s: a batch's prefill must be within [0, its plain seconds {wall}], got "
                             f"{prefill!r}")
    if gamma == "auto":
        schedule = lambda: AdaptiveGamma(max_auto_gamma)  # noqa: E731  (a fresh controller per simulated batch)
    elif is_count(gamma) and gamma >= 1:
        schedule = int(gamma)
    else:
        raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
    plain_total = predicted_total = 0.0
    for rows, wall, prefill in zip(alphas, plain_s, plain_prefill_s):
        decode = simulate_batch_speedup(schedule, rows, auto_costs, max_new_tokens, runs=runs)
        plain_total += wall
        predicted_total += wall / end_to_end_speedup(decode, prefill / wall, prefill_cost_ratio)
    return plain_total / predicted_total
