"""Speedup-calibrated benchmark: plain decoding, our speculative decoder at each γ and γ="auto", and Hugging Face
assisted generation, side by side on one target/draft pair and one prompt set, in one run.

    python -m decode bench --target PATH --draft PATH --prompts humaneval --limit 20 --max-new-tokens 64 \
        --gammas 1,2,4,8 --temperatures 0,1 --batch-sizes 1,4,8 --out checkpoints/bench

Method (see docs/bench.md):
- Interleaved: for each prompt, every temperature and every method runs before the next prompt (method order rotated
  per prompt), so machine drift and thermal state hit all methods alike.
- Throughput is wall-clock around each generate call (device synchronised), identical for our engine and for HF.
- α is the per-token acceptance probability of Leviathan et al. (2023), estimated from accept/reject trials
  (``alpha_from_steps``), under the exact sampler and temperature being benchmarked.
- c = draft / target time of one single-token decode forward with a KV cache at a realistic context length (median).
- Predicted speedup (Leviathan et al., 2023, Sec. 3): (1 − α^(γ+1)) / ((1 − α)(γc + 1)), from ``decode.speedup``.

Outputs under ``--out``: ``results.json`` (schema ``SCHEMA_VERSION``, checked by ``validate_results``), PNG plots,
and a rich table on the terminal.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from decode.engine import context_length, left_pad
from decode.speedup import measure_cost_ratio  # noqa: F401  (re-exported: part of the bench API)

SCHEMA_VERSION = 1
OURS, HF = "ours", "hf"


# --------------------------------------------------------------------------------------------------- configuration
@dataclass
class BenchConfig:
    """Everything a run depends on; stored verbatim in ``results.json["config"]``."""

    gammas: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    auto: bool = True  # also run num_draft_tokens="auto"
    auto_max_gamma: int = 8  # upper bound of the adaptive γ controller
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8])
    max_new_tokens: int = 64
    hf: bool = True  # run HF generate (target alone, and with assistant_model=draft)
    # Extra HF assisted runs at fixed γ (constant schedule, no confidence stop), next to HF's defaults.
    hf_gammas: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # always generate max_new_tokens (comparable token counts across methods)
    batch_gamma: int | None = None  # γ for the batch pass; None: best measured fixed γ at that temperature
    cost_context_tokens: int | None = None  # None: mean prompt length + max_new_tokens // 2
    cost_repeats: int = 21
    warmup: bool = True
    seed: int = 0
    # Descriptive, filled by the CLI.
    target: str | None = None
    draft: str | None = None
    prompts: str | None = None
    limit: int | None = None
    max_prompt_tokens: int | None = None  # prompts were cut to their last this-many tokens
    device: str | None = None
    dtype: str | None = None

    def validate(self) -> None:
        """Raise ValueError naming the bad setting and the fix; called before any model work starts."""
        if not self.gammas and not self.auto:
            raise ValueError("no speculative method to run: give --gammas with at least one γ >= 1, or 'auto'")
        if any((not isinstance(g, int)) or g < 1 for g in self.gammas):
            raise ValueError(f"every γ must be an integer >= 1 (got {self.gammas}); γ=0 (plain decoding) always runs")
        if any((not math.isfinite(t)) or t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError(f"temperatures must be >= 0 and finite, at least one (got {self.temperatures})")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1 (got {self.batch_sizes})")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if self.cost_repeats < 3:
            raise ValueError(f"cost_repeats must be >= 3 for a meaningful median (got {self.cost_repeats})")
        if self.auto and self.auto_max_gamma < 1:
            raise ValueError(f"auto_max_gamma must be >= 1 (got {self.auto_max_gamma})")
        if any(g < 1 for g in self.hf_gammas):
            raise ValueError(f"HF assisted γ values must be >= 1 (got {self.hf_gammas})")
        if self.batch_gamma is not None and self.batch_gamma < 1:
            raise ValueError(f"batch_gamma must be >= 1 (got {self.batch_gamma})")


def parse_gammas(text: str) -> tuple[list[int], bool]:
    """Parse ``"1,2,4,8,auto"`` -> ([1, 2, 4, 8], True). Raises ValueError naming the bad item."""
    gammas, auto = [], False
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        if item.lower() == "auto":
            auto = True
            continue
        try:
            g = int(item)
        except ValueError:
            raise ValueError(f"bad γ {item!r} in {text!r}: use comma-separated integers >= 1 and/or 'auto', "
                             "e.g. --gammas 1,2,4,8") from None
        if g < 1:
            raise ValueError(f"bad γ {g} in {text!r}: every γ must be >= 1 (plain decoding, γ=0, always runs)")
        gammas.append(g)
    if not gammas and not auto:
        raise ValueError(f"empty γ list {text!r}: e.g. --gammas 1,2,4,8")
    return sorted(set(gammas)), auto


def _parse_list(text: str, kind: type, what: str) -> list:
    try:
        out = [kind(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"bad {what} list {text!r}: use comma-separated numbers, e.g. 0,1") from None
    if not out:
        raise ValueError(f"empty {what} list {text!r}")
    return out


# --------------------------------------------------------------------------------------------------- measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_bytes(device: torch.device) -> int:
    """Same definition for every method (``decode.metrics.peak_memory_bytes``): the CUDA allocator's peak since the
    reset before the call; on CPU the process's RSS high-water mark, which only ever grows (a coarse upper bound)."""
    from decode.metrics import peak_memory_bytes

    return peak_memory_bytes(device)


def predicted_speedup_verify_aware(alpha: float, gamma: int, cost_ratio: float, verify_cost: float) -> float:
    """Leviathan et al.'s prediction with the measured verify cost: E[tokens per step] / (γc + v_γ), where v_γ is
    the time of a (γ+1)-token target forward over a 1-token one (``measure_cost_ratio``); v_γ = 1 gives the
    paper's formula. Still ignores sampling, cache bookkeeping and host syncs."""
    from decode.speedup import expected_tokens_per_step

    return expected_tokens_per_step(alpha, gamma) / (gamma * cost_ratio + verify_cost)


def alpha_from_steps(steps: Sequence[tuple[int, Sequence[int]]]) -> float | None:
    """Estimate Leviathan et al.'s α (probability that one draft token is accepted) from verify steps.

    Args:
        steps: ``(γ_s, n_accepted per row)`` of each verify step, as returned by ``SpeculativeDecoder.step``.

    Every step with γ_s > 0 is a run of Bernoulli(α) trials that stops at the first rejection or after γ_s
    acceptances, so the maximum-likelihood estimate is accepted / (accepted + rejections), with a rejection
    wherever n < γ_s. Exact also for γ="auto" and for steps shortened at the end of the token budget. This is not
    ``DecodeStats.acceptance_rate`` (accepted / drafted), which counts drafts after a rejection as failures and so
    falls as γ grows even when α does not.

    Returns None when nothing was drafted.
    """
    return _alpha(_step_counts(steps))


def _step_counts(steps) -> dict[str, int]:
    """Pooled counts of a step log: what ``alpha_from_steps`` and the mean γ need, small enough to store."""
    out = {"accepted": 0, "rejections": 0, "drafting_steps": 0, "gamma_sum": 0}
    for gamma, n_acc in steps:
        if gamma > 0:
            out["accepted"] += sum(n_acc)
            out["rejections"] += sum(n < gamma for n in n_acc)
            out["drafting_steps"] += len(n_acc)
            out["gamma_sum"] += gamma * len(n_acc)
    return out


def step_counts_from_stats(stats) -> dict[str, int]:
    """The counts of :func:`_step_counts`, read off ``DecodeStats`` (which records rejections per verify step)."""
    return {"accepted": int(stats.num_accepted), "rejections": int(stats.num_rejections),
            "drafting_steps": int(stats.num_verify_steps), "gamma_sum": int(stats.num_drafted)}


def _alpha(counts: dict[str, int]) -> float | None:
    n = counts["accepted"] + counts["rejections"]
    return counts["accepted"] / n if n else None


# --------------------------------------------------------------------------------------------------- running
@dataclass(frozen=True)
class Method:
    """One way to decode: ``kind`` is OURS or HF; ``gamma`` is 0 (plain), an int or "auto" for ours; for HF None
    (its own assistant settings) or the fixed num_assistant_tokens of an assisted run."""

    name: str
    kind: str
    gamma: int | str | None
    assisted: bool = False  # HF only: generate(..., assistant_model=draft)


def build_methods(cfg: BenchConfig) -> list[Method]:
    """plain, spec_g{γ} for each γ, spec_auto, hf_target, hf_assisted (as configured)."""
    methods = [Method("plain", OURS, 0)] + [Method(f"spec_g{g}", OURS, g) for g in cfg.gammas]
    if cfg.auto:
        methods.append(Method("spec_auto", OURS, "auto"))
    if cfg.hf:
        methods += [Method("hf_target", HF, None), Method("hf_assisted", HF, None, assisted=True)]
        methods += [Method(f"hf_assisted_g{g}", HF, g, assisted=True) for g in cfg.hf_gammas]
    return methods


def _seed_for(cfg: BenchConfig, prompt_index: int, batch: int = 0) -> int:
    # Same seed for every method on a prompt: common random numbers make method differences less noisy.
    return cfg.seed * 1_000_003 + prompt_index * 101 + batch


def _run_ours(decoder, method: Method, ids, mask, temperature: float, cfg: BenchConfig, eos,
              seed: int, device):
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device).manual_seed(seed)
    _reset_peak(device)
    _sync(device)
    t0 = time.perf_counter()
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens, temperature=temperature,
                           eos_token_id=eos, generator=generator, num_draft_tokens=method.gamma)
    _sync(device)
    wall = time.perf_counter() - t0
    out.stats.step_counts = step_counts_from_stats(out.stats)
    return [t.tolist() for t in out.new_tokens], wall, out.stats, _peak_bytes(device)


def _run_hf(target, draft, method: Method, ids, mask, temperature: float, cfg: BenchConfig, eos, pad_id: int,
            seed: int, device):
    """HF ``generate``; batch 1 only for assisted generation (an HF limitation). Token ids go in directly, so no
    tokenizer is needed (both models share the vocabulary, checked before the run)."""
    generation_config = hf_generation_config(target, cfg, temperature, eos, pad_id)
    ttft = _FirstTokenTimer() if ids.shape[0] == 1 else None  # HF streamers take batch size 1 only
    kwargs: dict[str, Any] = {"streamer": ttft} if ttft is not None else {}
    if method.assisted:
        kwargs["assistant_model"] = draft
    if temperature > 0:
        torch.manual_seed(seed)  # HF draws from the global generator
    _reset_peak(device)
    _sync(device)
    t0 = time.perf_counter()
    if ttft is not None:
        ttft.start = t0
    with _AssistantSettings(draft, method.gamma if method.assisted else None):
        seqs = target.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config, **kwargs)
    _sync(device)
    wall = time.perf_counter() - t0
    eos_set = set() if eos is None else set(eos) if isinstance(eos, (list, tuple)) else {eos}
    rows = []
    for row in seqs[:, ids.shape[1]:].tolist():
        # Finished rows are padded after EOS; cut at the first EOS like our engine does.
        hit = next((j for j, t in enumerate(row) if t in eos_set), None)
        rows.append(row if hit is None else row[: hit + 1])
    return rows, wall, ttft, _peak_bytes(device)


class _FirstTokenTimer:
    """An HF streamer that only notes when the first new token arrives (HF ``put``s the prompt first)."""

    def __init__(self):
        self.start, self.ttft_s, self._puts = 0.0, None, 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2 and self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def hf_generation_config(target, cfg: BenchConfig, temperature: float, eos, pad_id: int):
    """The ``GenerationConfig`` of the HF baseline, set to sample exactly what our decoder samples.

    HF fills every unset (None) field from the checkpoint's ``generation_config`` (which may carry e.g.
    temperature 0.6, top_p 0.9 or a repetition penalty) and then from its global defaults (top_k=50). So every
    logits processor that would change the distribution is set explicitly to neutral: full softmax at
    ``temperature``, greedy at 0. ``eos`` None means never stop early; it becomes ``[]``, since None would be
    filled with the checkpoint's EOS.
    """
    from transformers import GenerationConfig

    gc = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens, min_new_tokens=0, pad_token_id=pad_id,
        eos_token_id=[] if eos is None else eos, do_sample=temperature > 0,
        repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
    )
    if temperature > 0:
        gc.temperature, gc.top_k, gc.top_p, gc.min_p = float(temperature), 0, 1.0, 0.0
    return gc


class _AssistantSettings:
    """Temporarily give the draft fixed-γ assisted-generation settings. HF reads ``num_assistant_tokens``, its
    schedule and ``assistant_confidence_threshold`` from the *assistant's* generation_config (defaults: 20 tokens,
    a dynamic confidence threshold of 0.4 that often stops drafting after one token); setting them on the
    target's config has no effect."""

    KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")

    def __init__(self, draft, gamma: int | None):
        self.config, self.gamma, self.saved = draft.generation_config, gamma, None

    def __enter__(self):
        if self.gamma is not None:
            self.saved = {k: getattr(self.config, k, None) for k in self.KEYS}
            self.config.num_assistant_tokens = self.gamma
            self.config.num_assistant_tokens_schedule = "constant"
            self.config.assistant_confidence_threshold = 0.0

    def __exit__(self, *exc):
        if self.saved is not None:
            for k, v in self.saved.items():
                setattr(self.config, k, v)


# --------------------------------------------------------------------------------------------------- aggregation
def _merge_stats(stats_list):
    from decode import DecodeStats

    merged = DecodeStats.merge(list(stats_list))
    merged.step_counts = step_counts_from_stats(merged)
    return merged


def _aggregate(records: list[dict], plain_records: list[dict] | None, cost_ratio: float, gamma,
               temperature: float, auto_max_gamma: int = 8, verify_cost: dict | None = None) -> dict[str, Any]:
    """Pool per-prompt records of one method (and optionally one category) into the metrics of the JSON schema."""
    from decode.speedup import best_gamma, predicted_speedup

    n_tokens = sum(len(r["new_tokens"]) for r in records)
    wall = sum(r["wall_s"] for r in records)
    tps = n_tokens / wall if wall > 0 else None
    m: dict[str, Any] = {
        "num_prompts": len(records), "num_new_tokens": n_tokens, "total_s": wall, "tokens_per_s": tps,
        "per_token_latency_s": wall / n_tokens if n_tokens else None, "decode_latency_s": None,
        "ttft_s": None, "peak_memory_bytes": None, "speedup": None,
        "alpha": None, "acceptance_rate": None, "mean_accepted_length": None, "acceptance_by_position": None,
        "accepted_per_position": None, "accepted_length_histogram": None, "num_verify_steps": None,
        "num_drafted": None, "num_accepted": None, "mean_gamma": None, "predicted_speedup": None,
        "predicted_speedup_verify_aware": None, "predicted_gamma": None, "matches_plain_greedy": None,
        "num_matching_plain_greedy": None,
    }
    ttfts = [r["ttft_s"] for r in records if r.get("ttft_s") is not None]
    m["ttft_s"] = statistics.mean(ttfts) if ttfts else None
    peaks = [r["peak_memory_bytes"] for r in records if r.get("peak_memory_bytes")]
    m["peak_memory_bytes"] = max(peaks) if peaks else None
    if plain_records is not None:
        p_tokens = sum(len(r["new_tokens"]) for r in plain_records)
        p_wall = sum(r["wall_s"] for r in plain_records)
        if p_wall > 0 and p_tokens and tps:
            m["speedup"] = tps / (p_tokens / p_wall)
        if temperature == 0:
            by_key = {r["key"]: r["new_tokens"] for r in plain_records}
            same = sum(by_key.get(r["key"]) == r["new_tokens"] for r in records)
            m["num_matching_plain_greedy"], m["matches_plain_greedy"] = same, same / len(records)
    stats = [r["stats"] for r in records if r.get("stats") is not None]
    if stats and gamma not in (0, None):
        s = _merge_stats(stats)
        alpha = _alpha(s.step_counts)
        steps = int(s.num_verify_steps)
        m.update(
            alpha=alpha, acceptance_rate=s.acceptance_rate if s.num_drafted else None,
            mean_accepted_length=s.mean_accepted_length if steps else None,
            accepted_per_position=[int(x) for x in s.accepted_per_position],
            acceptance_by_position=[float(x) for x in s.acceptance_by_position],
            accepted_length_histogram=[int(x) for x in s.accepted_length_histogram],
            num_verify_steps=steps, num_drafted=int(s.num_drafted), num_accepted=int(s.num_accepted),
            decode_latency_s=s.per_token_latency_s or None,
            mean_gamma=(s.step_counts["gamma_sum"] / s.step_counts["drafting_steps"]
                        if s.step_counts["drafting_steps"] else None),
        )
        if alpha is not None:
            # For "auto" the fair prediction is at the γ its controller should settle on (same bounds as it).
            g = best_gamma(alpha, cost_ratio, max_gamma=auto_max_gamma, min_gamma=1) if gamma == "auto" else int(gamma)
            m["predicted_gamma"] = int(g)
            m["predicted_speedup"] = float(predicted_speedup(alpha, g, cost_ratio))
            if verify_cost and g in verify_cost:
                m["predicted_speedup_verify_aware"] = predicted_speedup_verify_aware(alpha, g, cost_ratio,
                                                                                     verify_cost[g])
    return m


def _strip(records: list[dict]) -> list[dict]:
    """Per-prompt records for the JSON: DecodeStats objects become their step counts."""
    out = []
    for r in records:
        row = {k: v for k, v in r.items() if k != "stats"}
        row["step_counts"] = r["stats"].step_counts if r.get("stats") is not None else None
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------------- the benchmark
def run_benchmark(target, draft, prompt_ids: list[list[int]], categories: list[str | None], cfg: BenchConfig,
                  pad_token_id: int, eos_token_id=None, prompt_names: list[str] | None = None,
                  progress: bool = True, tokenizer=None, draft_tokenizer=None) -> dict[str, Any]:
    """Run every method on every prompt (interleaved), measure c, and pool into the results dict.

    Args:
        target, draft: causal LMs sharing a vocabulary, on one device, in eval mode.
        prompt_ids: token ids per prompt (unpadded, already fitting the models' positions).
        categories: one category (or None) per prompt.
        cfg: the run's settings (validated here first).
        pad_token_id: used to left-pad batches and given to HF generate.
        eos_token_id: int, list of ints, or None; generation stops there unless ``cfg.ignore_eos``.
        prompt_names: ids of the prompts, stored with the per-prompt records.
        progress: show a rich progress bar.
        tokenizer, draft_tokenizer: optional; passed to the decoder, which then checks them and limits sampling
            to the tokenizer's vocabulary (lm_head padding rows never sampled).

    Returns:
        the results dict described in docs/bench.md (without ``plots``; ``write_outputs`` adds them).

    Raises:
        ValueError: bad config or empty prompt list (before any model work).
    """
    from decode import SpeculativeDecoder

    cfg.validate()
    if not prompt_ids:
        raise ValueError("no prompts to benchmark")
    if len(categories) != len(prompt_ids):
        raise ValueError(f"{len(categories)} categories for {len(prompt_ids)} prompts")
    device = next(target.parameters()).device
    eos = None if cfg.ignore_eos else eos_token_id
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=max(cfg.gammas or [1]), tokenizer=tokenizer,
                                 draft_tokenizer=draft_tokenizer, max_auto_draft_tokens=cfg.auto_max_gamma)
    methods = build_methods(cfg)
    cost = measure_cost_ratio(target, draft, _cost_context(prompt_ids, cfg, device), cfg.cost_repeats,
                              verify_gammas=cfg.gammas)

    def run(method, rows, temperature, seed):
        ids, mask = left_pad(rows, pad_token_id, device)
        if method.kind == OURS:
            return _run_ours(decoder, method, ids, mask, temperature, cfg, eos, seed, device)
        return _run_hf(target, draft, method, ids, mask, temperature, cfg, eos, pad_token_id, seed, device)

    if cfg.warmup:  # first calls pay for allocator growth and lazy init; keep them out of the timings
        short = BenchConfig(**{**asdict(cfg), "max_new_tokens": min(4, cfg.max_new_tokens)})
        for method in methods:
            for t in cfg.temperatures:
                ids, mask = left_pad(prompt_ids[:1], pad_token_id, device)
                if method.kind == OURS:
                    _run_ours(decoder, method, ids, mask, t, short, eos, 0, device)
                else:
                    _run_hf(target, draft, method, ids, mask, t, short, eos, pad_token_id, 0, device)

    records: dict[tuple[float, str], list[dict]] = {(t, m.name): [] for t in cfg.temperatures for m in methods}
    names = prompt_names or [str(i) for i in range(len(prompt_ids))]
    with _progress(progress, len(prompt_ids) * len(cfg.temperatures) * len(methods), "decoding") as tick:
        order = 0
        for i, row in enumerate(prompt_ids):
            for t in cfg.temperatures:
                k = i % len(methods)  # rotate so no method is always first after a prompt switch
                for method in methods[k:] + methods[:k]:
                    new, wall, stats, peak = run(method, [row], t, _seed_for(cfg, i))
                    records[(t, method.name)].append({
                        "key": i, "order": order, "prompt": names[i], "category": categories[i],
                        "prompt_tokens": len(row),
                        "new_tokens": new[0], "wall_s": wall, "peak_memory_bytes": peak,
                        "stats": stats if method.kind == OURS else None,
                        "ttft_s": getattr(stats, "ttft_s", None),
                    })
                    order += 1
                    tick()
    runs, summary = _pool(records, methods, cfg, cost, categories)
    batch = _batch_pass(run, records, methods, summary, prompt_ids, cfg, progress)
    return {
        "schema_version": SCHEMA_VERSION, "kind": "draftkit.bench",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(cfg), "environment": _environment(device),
        "prompts": {"source": cfg.prompts, "count": len(prompt_ids),
                    "categories": _count(c for c in categories if c is not None),
                    "mean_prompt_tokens": statistics.mean(len(r) for r in prompt_ids)},
        "cost": cost, "runs": runs, "summary": summary, "batch": batch,
        "records": {f"{t}/{name}": _strip(rs) for (t, name), rs in records.items()},
    }


def _cost_context(prompt_ids, cfg: BenchConfig, device) -> torch.Tensor:
    n = cfg.cost_context_tokens or int(statistics.mean(len(r) for r in prompt_ids)) + cfg.max_new_tokens // 2
    flat = [t for r in prompt_ids for t in r]
    ids = (flat * (n // len(flat) + 1))[:n]  # real tokens, repeated when the prompts are shorter than n
    return torch.tensor([ids], dtype=torch.long, device=device)


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _pool(records, methods, cfg: BenchConfig, cost: dict, categories) -> tuple[list[dict], list[dict]]:
    from decode.speedup import best_gamma, predicted_speedup

    c = cost["cost_ratio"]
    v = {e["gamma"]: e["relative_cost"] for e in cost.get("verify", [])}

    cats = sorted({x for x in categories if x is not None})
    runs, summary = [], []
    for t in cfg.temperatures:
        plain = records[(t, "plain")]
        for m in methods:
            rs = records[(t, m.name)]
            run = {"temperature": t, "method": m.name, "kind": m.kind,
                   "num_draft_tokens": None if m.kind == HF else m.gamma,
                   "hf_num_assistant_tokens": m.gamma if m.kind == HF else None,
                   "overall": _aggregate(rs, plain, c, m.gamma, t, cfg.auto_max_gamma, v), "by_category": {}}
            for cat in cats:
                sub = [r for r in rs if r["category"] == cat]
                run["by_category"][cat] = _aggregate(sub, [r for r in plain if r["category"] == cat], c, m.gamma, t,
                                                     cfg.auto_max_gamma, v)
            runs.append(run)
        fixed = [r for r in runs if r["temperature"] == t and isinstance(r["num_draft_tokens"], int)
                 and r["num_draft_tokens"] > 0]
        pooled = _merge_stats([r["stats"] for m in methods if m.kind == OURS and isinstance(m.gamma, int)
                               and m.gamma > 0 for r in records[(t, m.name)]]) if fixed else None
        alpha = _alpha(pooled.step_counts) if pooled is not None else None
        entry: dict[str, Any] = {"temperature": t, "alpha": alpha, "cost_ratio": c}
        measured = {r["num_draft_tokens"]: r["overall"]["speedup"] for r in fixed if r["overall"]["speedup"]}
        entry["best_gamma_measured"] = max(measured, key=measured.get) if measured else None
        entry["measured_speedup_at_best"] = measured.get(entry["best_gamma_measured"])
        if alpha is not None:
            top = max(16, *cfg.gammas)
            bg = int(best_gamma(alpha, c, max_gamma=top))  # 0 means: speculation cannot pay off with this c
            curve = {g: float(predicted_speedup(alpha, g, c)) for g in range(0, top + 1)}
            tested = {g: curve[g] for g in cfg.gammas}
            aware = {g: predicted_speedup_verify_aware(alpha, g, c, v[g]) for g in cfg.gammas if g in v}
            entry.update(best_gamma_predicted=bg, predicted_speedup_at_best=curve[bg],
                         best_gamma_predicted_tested=max(tested, key=tested.get) if tested else None,
                         best_gamma_verify_aware_tested=max(aware, key=aware.get) if aware else None,
                         predicted_curve=[{"gamma": g, "predicted_speedup": s} for g, s in curve.items()])
        else:
            entry.update(best_gamma_predicted=None, predicted_speedup_at_best=None, best_gamma_predicted_tested=None,
                         best_gamma_verify_aware_tested=None, predicted_curve=[])
        for name in ("spec_auto", "hf_target", "hf_assisted"):
            hit = [r for r in runs if r["temperature"] == t and r["method"] == name]
            entry[f"{name}_speedup"] = hit[0]["overall"]["speedup"] if hit else None
        entry["hf_assisted_fixed_speedup"] = {
            str(r["hf_num_assistant_tokens"]): r["overall"]["speedup"] for r in runs
            if r["temperature"] == t and r["kind"] == HF and r["hf_num_assistant_tokens"] is not None}
        best = entry["measured_speedup_at_best"]
        # Adaptive γ against the best fixed γ chosen with hindsight: > 1 means the controller beat it.
        entry["auto_vs_best_fixed"] = entry["spec_auto_speedup"] / best if best and entry["spec_auto_speedup"] else None
        summary.append(entry)
    return runs, summary


def _batch_pass(run, records, methods, summary, prompt_ids, cfg: BenchConfig, progress: bool) -> list[dict]:
    """Tokens/s of plain and speculative decoding (our engine) at each batch size, interleaved per batch.

    Batch size 1 reuses the main pass (same prompts, same measurement). Larger batches cycle through the prompts
    so every batch is full, with ceil(n / batch_size) batches: roughly the same number of prompts per size.
    """
    out = []
    jobs = []
    for entry in summary:
        t = entry["temperature"]
        g = cfg.batch_gamma or entry["best_gamma_measured"] or (cfg.gammas[0] if cfg.gammas else None)
        pair = [Method("plain", OURS, 0)] + ([Method(f"spec_g{g}", OURS, g)] if g else [])
        for bs in cfg.batch_sizes:
            if bs == 1:
                for m in pair:
                    rs = records.get((t, m.name))
                    if rs:
                        out.append(_batch_row(t, m, 1, rs, reused=True))
            else:
                jobs.append((t, pair, bs))
    total = sum(math.ceil(len(prompt_ids) / bs) * len(pair) for _, pair, bs in jobs)
    with _progress(progress, total, "batches") as tick:
        for t, pair, bs in jobs:
            n_batches = math.ceil(len(prompt_ids) / bs)
            rows = [prompt_ids[i % len(prompt_ids)] for i in range(n_batches * bs)]
            if cfg.warmup:
                for m in pair:
                    run(m, rows[:bs], t, 0)
            recs: dict[str, list[dict]] = {m.name: [] for m in pair}
            for b in range(n_batches):
                chunk = rows[b * bs:(b + 1) * bs]
                for m in (pair if b % 2 == 0 else pair[::-1]):
                    new, wall, _, peak = run(m, chunk, t, _seed_for(cfg, b, batch=bs))
                    recs[m.name].append({"new_tokens": [x for r in new for x in r], "wall_s": wall,
                                         "peak_memory_bytes": peak})
                    tick()
            for m in pair:
                out.append(_batch_row(t, m, bs, recs[m.name], reused=False))
    for row in out:  # speedup of speculative over plain at the same temperature and batch size
        plain = [r for r in out if r["temperature"] == row["temperature"] and r["batch_size"] == row["batch_size"]
                 and r["num_draft_tokens"] == 0]
        row["speedup"] = (row["tokens_per_s"] / plain[0]["tokens_per_s"]
                          if plain and plain[0]["tokens_per_s"] and row["tokens_per_s"] else None)
    return out


def _batch_row(t, m: Method, bs: int, recs: list[dict], reused: bool) -> dict[str, Any]:
    n = sum(len(r["new_tokens"]) for r in recs)
    wall = sum(r["wall_s"] for r in recs)
    peaks = [r["peak_memory_bytes"] for r in recs if r.get("peak_memory_bytes")]
    return {"temperature": t, "method": m.name, "num_draft_tokens": m.gamma, "batch_size": bs,
            "num_batches": len(recs), "num_new_tokens": n, "total_s": wall,
            "tokens_per_s": n / wall if wall > 0 else None, "peak_memory_bytes": max(peaks) if peaks else None,
            "reused_main_pass": reused}


class _progress:
    """A rich progress bar, or nothing (tests, non-terminals)."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled and total > 0, total, label

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.progress import Progress

        self._p = Progress(transient=True)
        self._p.start()
        task = self._p.add_task(self.label, total=self.total)
        return lambda: self._p.advance(task)

    def __exit__(self, *exc):
        if self.enabled:
            self._p.stop()


def _environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "device": str(device), "torch_threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


# --------------------------------------------------------------------------------------------------- schema
_RUN_METRICS = ("num_prompts", "num_new_tokens", "total_s", "tokens_per_s", "per_token_latency_s",
                "decode_latency_s", "ttft_s",
                "peak_memory_bytes", "speedup", "alpha", "acceptance_rate", "mean_accepted_length",
                "acceptance_by_position", "accepted_per_position", "accepted_length_histogram", "num_verify_steps",
                "num_drafted", "num_accepted", "mean_gamma", "predicted_speedup", "predicted_speedup_verify_aware",
                "predicted_gamma",
                "matches_plain_greedy",
                "num_matching_plain_greedy")
_SUMMARY_KEYS = ("temperature", "alpha", "cost_ratio", "best_gamma_measured", "measured_speedup_at_best",
                 "best_gamma_predicted", "predicted_speedup_at_best", "best_gamma_predicted_tested",
                 "best_gamma_verify_aware_tested",
                 "predicted_curve", "spec_auto_speedup", "hf_target_speedup", "hf_assisted_speedup",
                 "auto_vs_best_fixed", "hf_assisted_fixed_speedup")
_BATCH_KEYS = ("temperature", "method", "num_draft_tokens", "batch_size", "num_batches", "num_new_tokens", "total_s",
               "tokens_per_s", "peak_memory_bytes", "reused_main_pass", "speedup")
_TOP_KEYS = ("schema_version", "kind", "created", "config", "environment", "prompts", "cost", "runs", "summary",
             "batch", "records")


def validate_results(results: dict[str, Any]) -> None:
    """Check a results dict (or loaded results.json) against schema version ``SCHEMA_VERSION``.

    Raises:
        ValueError: naming the first missing key, wrong version or wrong type.
    """
    def need(obj, keys, where):
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
        missing = [k for k in keys if k not in obj]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")

    need(results, _TOP_KEYS, "results")
    if results["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"results: schema_version {results['schema_version']!r}, this code reads {SCHEMA_VERSION}")
    need(results["cost"], ("context_tokens", "target_forward_s", "draft_forward_s", "cost_ratio", "verify"), "cost")
    if not isinstance(results["runs"], list) or not results["runs"]:
        raise ValueError("results.runs: expected a non-empty list")
    for i, run in enumerate(results["runs"]):
        need(run, ("temperature", "method", "kind", "num_draft_tokens", "hf_num_assistant_tokens", "overall",
                   "by_category"), f"runs[{i}]")
        need(run["overall"], _RUN_METRICS, f"runs[{i}].overall")
        for cat, m in run["by_category"].items():
            need(m, _RUN_METRICS, f"runs[{i}].by_category[{cat}]")
    for i, s in enumerate(results["summary"]):
        need(s, _SUMMARY_KEYS, f"summary[{i}]")
    for i, b in enumerate(results["batch"]):
        need(b, _BATCH_KEYS, f"batch[{i}]")


# --------------------------------------------------------------------------------------------------- output
def write_outputs(results: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """Write ``results.json`` and the PNG plots into ``out_dir``; return {name: path} (also stored in results)."""
    from decode.plots import write_plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = write_plots(results, out)
    validate_results(results)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    return {"results": str(path), **results["plots"]}


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _fmt(x, spec=".2f", scale=1.0, none="-"):
    return none if x is None else format(x * scale, spec)


def render_tables(results: dict[str, Any], console=None) -> None:
    """Print the per-temperature method table, the category table, and the batch table with rich."""
    from rich.console import Console
    from rich.table import Table

    # Not a terminal (logs, CI): wide enough that no column is cut.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    c = results["cost"]
    console.print(f"cost ratio c = {c['cost_ratio']:.3f}  (draft {c['draft_forward_s'] * 1e3:.2f} ms / target "
                  f"{c['target_forward_s'] * 1e3:.2f} ms per decode forward at {c['context_tokens']} tokens)")
    if c.get("verify"):
        console.print("verify cost v_γ = t(γ+1 tokens) / t(1 token): "
                      + ", ".join(f"γ={e['gamma']}: {e['relative_cost']:.2f}" for e in c["verify"]))
    for s in results["summary"]:
        t = s["temperature"]
        table = Table(title=f"T={t:g}  α={_fmt(s['alpha'], '.3f')}  best γ: measured {s['best_gamma_measured']}, "
                            f"predicted {s['best_gamma_predicted']} (among tested {s['best_gamma_predicted_tested']}, "
                            f"verify-aware {s['best_gamma_verify_aware_tested']})")
        for col in ("method", "γ", "α", "τ", "TTFT ms", "ms/token", "tok/s", "speedup", "predicted", "pred. v-aware",
                    "=greedy", "peak MiB"):
            table.add_column(col, justify="left" if col == "method" else "right")
        for run in (r for r in results["runs"] if r["temperature"] == t):
            m = run["overall"]
            g = run["num_draft_tokens"] if run["kind"] == OURS else run["hf_num_assistant_tokens"]
            if g == "auto" and m["mean_gamma"] is not None:
                g = f"auto ({m['mean_gamma']:.1f})"  # the mean γ the controller actually used
            table.add_row(run["method"], "-" if g is None else str(g), _fmt(m["alpha"], ".3f"),
                          _fmt(m["mean_accepted_length"]), _fmt(m["ttft_s"], ".1f", 1e3),
                          _fmt(m["per_token_latency_s"], ".2f", 1e3), _fmt(m["tokens_per_s"], ".1f"),
                          _fmt(m["speedup"], ".2f") + ("x" if m["speedup"] is not None else ""),
                          _fmt(m["predicted_speedup"], ".2f") + ("x" if m["predicted_speedup"] is not None else ""),
                          _fmt(m["predicted_speedup_verify_aware"], ".2f")
                          + ("x" if m["predicted_speedup_verify_aware"] is not None else ""),
                          _fmt(m["matches_plain_greedy"], ".0%"), _fmt(m["peak_memory_bytes"], ".0f", 2 ** -20))
        console.print(table)
    _render_summary(results, console)
    _render_categories(results, console)
    if results["batch"]:
        table = Table(title="batch throughput (our engine)")
        for col in ("T", "method", "batch", "tok/s", "speedup"):
            table.add_column(col, justify="right")
        for b in sorted(results["batch"], key=lambda b: (b["temperature"], b["batch_size"], b["method"] != "plain")):
            table.add_row(f"{b['temperature']:g}", b["method"], str(b["batch_size"]), _fmt(b["tokens_per_s"], ".1f"),
                          _fmt(b["speedup"]))
        console.print(table)


def _render_summary(results, console) -> None:
    """One row per temperature: ours (best fixed γ, auto) vs HF assisted, measured vs predicted."""
    from rich.table import Table

    table = Table(title=f"summary: speedup over plain decoding (c = {results['cost']['cost_ratio']:.3f})")
    for col in ("T", "α", "best γ meas.", "speedup", "best γ pred.", "predicted", "auto", "auto/best",
                "HF assisted", "HF target"):
        table.add_column(col, justify="right")
    for s in results["summary"]:
        x = lambda v: _fmt(v) + ("x" if v is not None else "")  # noqa: E731
        hf = x(s["hf_assisted_speedup"]) + "".join(f", γ={g}: {x(v)}" for g, v in s["hf_assisted_fixed_speedup"].items())
        table.add_row(f"{s['temperature']:g}", _fmt(s["alpha"], ".3f"), str(s["best_gamma_measured"]),
                      x(s["measured_speedup_at_best"]), str(s["best_gamma_predicted"]),
                      x(s["predicted_speedup_at_best"]), x(s["spec_auto_speedup"]), _fmt(s["auto_vs_best_fixed"]),
                      hf, x(s["hf_target_speedup"]))
    console.print(table)


def _render_categories(results, console) -> None:
    from rich.table import Table

    cats = sorted(results["prompts"]["categories"])
    if not cats:
        return
    for s in results["summary"]:
        t, best = s["temperature"], s["best_gamma_measured"]
        shown = [f"spec_g{best}"] if best else []
        shown += ["spec_auto", "hf_assisted"]
        runs = {r["method"]: r for r in results["runs"] if r["temperature"] == t and r["method"] in shown}
        table = Table(title=f"T={t:g} by category: α / speedup")
        table.add_column("category")
        table.add_column("n", justify="right")
        for name in shown:
            if name in runs:
                table.add_column(name, justify="right")
        for cat in cats:
            cells = []
            for name in shown:
                if name in runs:
                    m = runs[name]["by_category"].get(cat, {})
                    cells.append(f"{_fmt(m.get('alpha'), '.2f')} / {_fmt(m.get('speedup'))}x")
            table.add_row(cat, str(results["prompts"]["categories"][cat]), *cells)
        console.print(table)


# --------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint: local path or HF id (loaded offline)")
    p.add_argument("--draft", required=True, help="draft checkpoint: local path or HF id")
    p.add_argument("--tokenizer", help="tokenizer path (default: the target's, else the draft's)")
    p.add_argument("--prompts", default="humaneval",
                   help="humaneval | mbpp | spec_bench | mt_bench | gsm8k | path/to/file.jsonl[.gz]")
    p.add_argument("--prompt-field", help="text field of a local jsonl (default: prompt, text, question or turns)")
    p.add_argument("--limit", type=int, default=20, help="number of prompts (category-balanced for Spec-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gammas", default="1,2,4,8", help="comma-separated γ list; add 'auto' or use --no-auto")
    p.add_argument("--no-auto", action="store_true", help="skip num_draft_tokens='auto'")
    p.add_argument("--auto-max-gamma", type=int, default=8, help="largest γ the adaptive controller may pick")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--batch-sizes", default="1,4,8")
    p.add_argument("--batch-gamma", type=int, help="γ for the batch pass (default: best measured γ)")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate (plain and assisted)")
    p.add_argument("--hf-gammas", default="",
                   help="extra HF assisted runs with num_assistant_tokens=γ, constant schedule, no confidence stop "
                        "(e.g. 4); hf_assisted always runs with HF's own defaults")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_new_tokens")
    p.add_argument("--no-chat-template", action="store_true", help="tokenize raw text even if a template exists")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="keep each prompt's last N tokens (default: what the models' positions allow); use the "
                        "training window minus --max-new-tokens for models trained on short windows")
    p.add_argument("--cost-context", type=int, help="context length for measuring c (default: mean prompt + N/2)")
    p.add_argument("--cost-repeats", type=int, default=21)
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow checkpoints to run their own Python modeling/tokenizer code (off by default)")
    p.add_argument("--out", default="checkpoints/bench", help="output folder for results.json and plots")
    return p


def _load_tokenizer(paths: list[str], trust_remote_code: bool = False):
    from decode.loading import load_tokenizer

    for i, path in enumerate(paths):
        try:
            return load_tokenizer(path, trust_remote_code=trust_remote_code)
        except FileNotFoundError:
            if i == len(paths) - 1:
                raise


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``python -m decode bench ...``); returns the exit status."""
    run_cli(argv)
    return 0


def run_cli(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, validate everything before loading models, run the benchmark, write outputs, print tables.

    Returns:
        the results dict (also written to ``--out``/results.json).

    Raises:
        ValueError: bad γ list, temperatures, batch sizes, prompt set, or a prompt budget that cannot fit.
        FileNotFoundError: missing target/draft/tokenizer/prompt file.
        decode.compat.IncompatibleModelsError: the pair cannot share a vocabulary.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # HF's assisted generate warns about its own internal generation_config use
    gammas, auto = parse_gammas(args.gammas)
    cfg = BenchConfig(
        gammas=gammas, auto=auto or not args.no_auto, auto_max_gamma=args.auto_max_gamma,
        temperatures=_parse_list(args.temperatures, float, "temperature"),
        batch_sizes=_parse_list(args.batch_sizes, int, "batch size"), max_new_tokens=args.max_new_tokens,
        hf=not args.no_hf, hf_gammas=parse_gammas(args.hf_gammas)[0] if args.hf_gammas.strip() else [],
        ignore_eos=args.ignore_eos,
        batch_gamma=args.batch_gamma, cost_context_tokens=args.cost_context, cost_repeats=args.cost_repeats,
        warmup=not args.no_warmup, seed=args.seed, target=args.target, draft=args.draft, prompts=args.prompts,
        limit=args.limit)
    cfg.validate()
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens must be >= 1 (got {args.max_prompt_tokens})")
    for name in ("target", "draft"):
        path = getattr(args, name)
        if (os.path.sep in path or path.startswith(".")) and not Path(path).exists():
            raise FileNotFoundError(f"--{name} {path} does not exist")
    from decode.prompts import encode_prompts, load_prompts

    prompts = load_prompts(args.prompts, limit=args.limit, field=args.prompt_field)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    cfg.device, cfg.dtype = str(device), str(dtype).replace("torch.", "")
    tokenizer = _load_tokenizer([args.tokenizer] if args.tokenizer else [args.target, args.draft],
                                args.trust_remote_code)
    draft_tokenizer = None
    if not args.tokenizer and Path(args.draft).is_dir() and (Path(args.draft) / "tokenizer_config.json").exists():
        draft_tokenizer = _load_tokenizer([args.draft], args.trust_remote_code)
    from decode.loading import load_causal_lm

    target = load_causal_lm(args.target, "target", dtype, str(device), args.trust_remote_code)
    draft = load_causal_lm(args.draft, "draft", dtype, str(device), args.trust_remote_code)
    from decode.compat import check_compatibility

    # Before any timing: a pair that cannot share a vocabulary fails here with the difference named.
    check_compatibility(target, draft, target_tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)
    positions = [p for p in (context_length(target), context_length(draft)) if p]
    max_prompt = None
    if positions:
        max_prompt = min(positions) - cfg.max_new_tokens - max(cfg.gammas or [1]) - 2
        if max_prompt < 1:
            raise ValueError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt within the models' "
                             f"{min(positions)} positions; lower it")
    if args.max_prompt_tokens is not None:
        max_prompt = args.max_prompt_tokens if max_prompt is None else min(max_prompt, args.max_prompt_tokens)
    prompt_ids = encode_prompts(prompts, tokenizer, chat_template=not args.no_chat_template,
                                max_prompt_tokens=max_prompt)
    cfg.max_prompt_tokens = max_prompt
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    results = run_benchmark(target, draft, prompt_ids, [p.category for p in prompts], cfg, pad_token_id=pad,
                            eos_token_id=eos, prompt_names=[p.id for p in prompts], progress=sys.stderr.isatty(),
                            tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)
    paths = write_outputs(results, args.out)
    render_tables(results)
    from rich.console import Console

    Console().print("wrote " + ", ".join(paths.values()))
    return results


if __name__ == "__main__":
    sys.exit(main())
