"""Acceptance evaluation of a draft against its target with the bundled speculative decoder.

The loss only stands in for the real objective; this measures it: the acceptance rate α (Σaccepted/Σdrafted),
the mean accepted length τ (committed tokens per verify step), the accepted-length histogram, and the speedup
predicted by Leviathan et al. (2023) at the best γ from the per-token acceptance α_tok and a measured cost
ratio c = draft / target time of a cached decode forward.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from distill.data import collate_prompts

SELECT_KEYS = ("acceptance_rate", "predicted_speedup")
# progress(what, done, total, unit): e.g. ("eval α/τ T=0", 5, 16, "prompts"); distill.logging.Progress.reporting
ProgressFn = Callable[[str, int, int, str], None]
COST_RATIO_PROGRESS = "measuring cost ratio c"


def measure_cost_ratio(target: Any, draft: Any, prompts: list[list[int]], context_tokens: int = 128,
                       repeats: int = 7, progress: ProgressFn | None = None) -> float:
    """c = draft / target time of one single-token decode forward with a KV cache, at a context built from the
    held-out prompts (:func:`decode.speedup.measure_cost_ratio`, the benchmark's measurement).

    Pass ``eval.cost_ratio`` in the config to fix c instead (e.g. the ratio measured on the serving hardware).
    ``progress`` is told ``("measuring cost ratio c", done, repeats + 2, "rounds")`` after each round of forwards.
    """
    from decode.engine import context_length
    from decode.speedup import measure_cost_ratio as measure

    device = next(target.parameters()).device
    ids = [t for p in prompts for t in p] or [0, 0]
    limit = min(x for x in (context_length(target), context_length(draft), context_tokens) if x)
    ids = (ids * (limit // len(ids) + 1))[: max(2, limit)]
    report = None if progress is None else lambda done, total: progress(COST_RATIO_PROGRESS, done, total, "rounds")
    return float(measure(target, draft, torch.tensor([ids], device=device), repeats=repeats,
                         progress=report)["cost_ratio"])


@torch.no_grad()
def acceptance_eval(target: Any, draft: Any, prompts: list[list[int]], tokenizer: Any, temperatures: list[float],
                    num_draft_tokens: int = 4, max_new_tokens: int = 32, batch_size: int = 8, seed: int = 0,
                    cost_ratio: float | None = None, max_gamma: int = 8,
                    progress: ProgressFn | None = None) -> dict[str, Any]:
    """α, τ, accepted-length histogram and predicted speedup of ``draft`` for ``target``, per temperature.

    Args:
        target, draft: causal LMs (the draft unwrapped from DDP/peft wrappers is fine, peft models work as is).
        prompts: token-id lists (held-out prompts, chat template already applied).
        tokenizer: the shared tokenizer (eos, pad, and the decoder's compatibility check).
        temperatures: sampling temperatures; 0 is greedy.
        num_draft_tokens: γ used for the measurement.
        seed: seeds the decoder's generator for each temperature, so evaluations are repeatable.
        cost_ratio: c; measured with :func:`measure_cost_ratio` on the prompts when None.
        max_gamma: largest γ considered for the best-γ prediction. The best γ is searched in [1, max_gamma]: a
            predicted speedup below 1 then says plainly that this draft does not pay off (γ = 0 would hide it
            behind a flat 1.0). α is measured at ``num_draft_tokens`` and assumed i.i.d. across positions.
        progress: told ``("eval α/τ T=<t>", prompts done, len(prompts), "prompts")`` after each batch, and the
            cost-ratio measurement's rounds (:func:`measure_cost_ratio`) when c is measured.

    Returns:
        ``{"per_temperature": {"0.0": {acceptance_rate, mean_accepted_length, accepted_length_histogram,
        acceptance_by_position, best_gamma, predicted_speedup, num_new_tokens}, ...}, "cost_ratio": c,
        "acceptance_rate": mean α over temperatures, "mean_accepted_length": mean τ,
        "predicted_speedup": mean predicted speedup}``.
    """
    from decode import DecodeStats, SpeculativeDecoder
    from decode.speedup import best_gamma, predicted_speedup

    if not prompts:
        raise ValueError("acceptance_eval needs at least one prompt")
    device = next(target.parameters()).device
    was_training = draft.training
    draft.eval()
    try:
        if cost_ratio is None:
            cost_ratio = measure_cost_ratio(target, draft, prompts, progress=progress)
        dec = SpeculativeDecoder(target, draft, num_draft_tokens=num_draft_tokens, tokenizer=tokenizer)
        per_t = {}
        for temperature in temperatures:
            gen = torch.Generator(device=device).manual_seed(seed)
            stats = []
            for b in range(0, len(prompts), batch_size):
                ids, att = collate_prompts(prompts[b:b + batch_size], tokenizer.pad_token_id)
                out = dec.generate(ids.to(device), attention_mask=att.to(device), max_new_tokens=max_new_tokens,
                                   temperature=float(temperature), eos_token_id=tokenizer.eos_token_id,
                                   generator=gen)
                stats.append(out.stats)
                if progress is not None:
                    progress(f"eval α/τ T={float(temperature):g}", min(b + batch_size, len(prompts)), len(prompts),
                             "prompts")
            s = DecodeStats.merge(stats)
            alpha = float(s.acceptance_rate)
            # The speedup formula's α is the per-token acceptance probability, not Σaccepted/Σdrafted.
            alpha_tok = float(s.per_token_acceptance)
            g = best_gamma(alpha_tok, cost_ratio, max_gamma=max_gamma, min_gamma=1)
            per_t[str(float(temperature))] = {
                "acceptance_rate": alpha,
                "per_token_acceptance": alpha_tok,
                "mean_accepted_length": float(s.mean_accepted_length),
                "accepted_length_histogram": list(s.accepted_length_histogram),
                "acceptance_by_position": list(s.acceptance_by_position),
                "best_gamma": g,
                "predicted_speedup": predicted_speedup(alpha_tok, g, cost_ratio),
                "num_new_tokens": int(s.num_new_tokens),
            }
    finally:
        draft.train(was_training)
    mean = lambda key: sum(v[key] for v in per_t.values()) / len(per_t)  # noqa: E731
    return {"per_temperature": per_t, "cost_ratio": float(cost_ratio), "num_draft_tokens": num_draft_tokens,
            "acceptance_rate": mean("acceptance_rate"), "mean_accepted_length": mean("mean_accepted_length"),
            "predicted_speedup": mean("predicted_speedup")}
