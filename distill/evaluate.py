"""Acceptance evaluation of a draft against its target with the bundled speculative decoder.

The loss only stands in for the real objective; this measures it: the acceptance rate (Σaccepted/Σdrafted), α
(Leviathan et al.'s per-token acceptance), the mean accepted length τ (committed tokens per verify step), the
accepted-length histogram, and the speedup predicted by Leviathan et al. (2023) at the best γ from α, a measured cost ratio
c = draft / target time of a cached decode forward and the measured verify costs v_γ (a verify forward of γ+1
tokens over a one-token one).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from distill.data import collate_prompts

# progress(what, done, total, unit): e.g. ("eval α/τ T=0", 5, 16, "prompts"); distill.logging.Progress.reporting
ProgressFn = Callable[[str, int, int, str], None]
COST_RATIO_PROGRESS = "measuring cost ratio c"


def measure_costs(target: Any, draft: Any, prompts: list[list[int]], max_gamma: int = 0, context_tokens: int = 128,
                  repeats: int = 7, progress: ProgressFn | None = None) -> tuple[float, list[float] | None]:
    """The cost model on this hardware: c = draft / target time of one single-token decode forward with a KV
    cache, and the verify costs v_γ = t(target forward over γ+1 tokens) / t(one token), at a context built from
    the held-out prompts (:func:`decode.costs.measure_cost_ratio`, the benchmark's measurement).

    Args:
        max_gamma: v_γ is measured for γ = 1..max_gamma (0: not measured, None returned for it).
        context_tokens: context length of the timed forwards (cut to both models' context).
        repeats: timed forwards per measurement (median).
        progress: told ``("measuring cost ratio c", done, repeats + 2, "rounds")`` after each round of forwards.

    Returns:
        ``(c, [v_0 = 1, v_1, .., v_max_gamma])``, smoothed as the decoder's own ``calibrate`` does
        (:func:`decode.speedup.smooth_verify_costs`).
    """
    from decode.compat import draft_input_substitute, output_vocab_size, substitute_draft_inputs
    from decode.cache import context_length
    from decode.costs import measure_cost_ratio as measure
    from decode.speedup import smooth_verify_costs

    device = next(target.parameters()).device
    ids = [t for p in prompts for t in p] or [0, 0]
    # room for the longest timed verify (max_gamma + 1 tokens) inside both models' context
    limit = min(x for x in (context_length(target), context_length(draft), context_tokens) if x) - max_gamma - 1
    ids = (ids * (max(2, limit) // len(ids) + 1))[: max(2, limit)]
    report = None if progress is None else lambda done, total: progress(COST_RATIO_PROGRESS, done, total, "rounds")
    # ids the draft cannot embed go to both models as its substitute id, as in the decoder's own measure_costs
    context = substitute_draft_inputs(torch.tensor([ids], device=device),
                                      draft_input_substitute(draft, output_vocab_size(target)))
    m = measure(target, draft, context, repeats=repeats,
                verify_gammas=range(1, max_gamma + 1), progress=report)
    verify = smooth_verify_costs([v["relative_cost"] for v in m["verify"]]) if max_gamma > 0 else None
    return float(m["cost_ratio"]), verify


def measure_cost_ratio(target: Any, draft: Any, prompts: list[list[int]], context_tokens: int = 128,
                       repeats: int = 7, progress: ProgressFn | None = None) -> float:
    """c alone (:func:`measure_costs` with no verify costs). Pass ``eval.cost_ratio`` in the config to fix c
    instead (e.g. the ratio measured on the serving hardware)."""
    return measure_costs(target, draft, prompts, 0, context_tokens, repeats, progress)[0]


def resolve_costs(target: Any, draft: Any, prompts: list[list[int]], cost_ratio: float | None,
                  verify_costs: list[float] | None, max_gamma: int,
                  progress: ProgressFn | None = None) -> tuple[float, list[float] | None]:
    """The (c, v_γ) an evaluation predicts with: ``eval.cost_ratio`` / ``eval.verify_costs`` where given; with c
    unset, both are measured here (one hardware for both); with c given and no v_γ, Leviathan et al.'s v = 1 (the
    memory-bound verify of a GPU at batch 1), so a c measured on the serving hardware is used as before."""
    if cost_ratio is None:
        c, measured = measure_costs(target, draft, prompts, 0 if verify_costs is not None else max_gamma,
                                    progress=progress)
        return c, list(verify_costs) if verify_costs is not None else measured
    return float(cost_ratio), None if verify_costs is None else list(verify_costs)


@torch.no_grad()
def acceptance_eval(target: Any, draft: Any, prompts: list[list[int]], tokenizer: Any, temperatures: list[float],
                    num_draft_tokens: int = 4, max_new_tokens: int = 32, batch_size: int = 8, seed: int = 0,
                    cost_ratio: float | None = None, max_gamma: int = 8,
                    progress: ProgressFn | None = None, verify_costs: list[float] | None = None) -> dict[str, Any]:
    """α, τ, accepted-length histogram and predicted speedup of ``draft`` for ``target``, per temperature.

    Args:
        target, draft: causal LMs (the draft unwrapped from DDP/peft wrappers is fine, peft models work as is).
        prompts: token-id lists (held-out prompts, chat template already applied).
        tokenizer: the shared tokenizer (eos, pad, and the decoder's compatibility check).
        temperatures: sampling temperatures; 0 is greedy.
        num_draft_tokens: γ used for the measurement.
        seed: seeds the decoder's generator for each temperature, so evaluations are repeatable.
        cost_ratio: c; measured with :func:`measure_costs` on the prompts when None, together with the verify
            costs unless ``verify_costs`` is given (:func:`resolve_costs`).
        verify_costs: v_γ indexed by γ (``[1.0, v_1, ..]``) for the verify-aware prediction
            ``(1 − α^(γ+1)) / ((1 − α)(γc + v_γ))``; None with a given c: Leviathan et al.'s v = 1.
        max_gamma: largest γ considered for the best-γ prediction. The best γ is searched in [1, max_gamma]: a
            predicted speedup below 1 then says plainly that this draft does not pay off (γ = 0 would hide it
            behind a flat 1.0). α is measured at ``num_draft_tokens`` and assumed i.i.d. across positions.
        progress: told ``("eval α/τ T=<t>", prompts done, len(prompts), "prompts")`` after each batch, and the
            cost measurement's rounds (:func:`measure_costs`) when c is measured.

    Returns:
        ``{"per_temperature": {"0.0": {acceptance_rate, alpha, mean_accepted_length, accepted_length_histogram,
        acceptance_by_position, best_gamma, predicted_speedup, num_new_tokens}, ...}, "cost_ratio": c,
        "verify_costs": the v_γ used (None: v = 1),
        "acceptance_rate": mean acceptance rate over temperatures, "mean_accepted_length": mean τ,
        "predicted_speedup": mean predicted speedup}``.
    """
    from decode import DecodeStats, SpeculativeDecoder
    from decode.speedup import best_gamma, predicted_speedup, verify_cost_at

    if not prompts:
        raise ValueError("acceptance_eval needs at least one prompt")
    device = next(target.parameters()).device
    was_training = draft.training
    draft.eval()
    try:
        cost_ratio, verify_costs = resolve_costs(target, draft, prompts, cost_ratio, verify_costs, max_gamma,
                                                 progress)
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
            rate = float(s.acceptance_rate)
            # The speedup formula's α is the per-token acceptance probability, not Σaccepted/Σdrafted.
            alpha = float(s.alpha)
            g = best_gamma(alpha, cost_ratio, max_gamma=max_gamma, min_gamma=1, verify_costs=verify_costs)
            per_t[str(float(temperature))] = {
                "acceptance_rate": rate,
                "alpha": alpha,
                "mean_accepted_length": float(s.mean_accepted_length),
                "accepted_length_histogram": list(s.accepted_length_histogram),
                "acceptance_by_position": list(s.acceptance_by_position),
                "best_gamma": g,
                "predicted_speedup": predicted_speedup(alpha, g, cost_ratio, verify_cost_at(verify_costs, g)),
                "num_new_tokens": int(s.num_new_tokens),
            }
    finally:
        draft.train(was_training)
    mean = lambda key: sum(v[key] for v in per_t.values()) / len(per_t)  # noqa: E731
    return {"per_temperature": per_t, "cost_ratio": float(cost_ratio), "verify_costs": verify_costs,
            "num_draft_tokens": num_draft_tokens,
            "acceptance_rate": mean("acceptance_rate"), "mean_accepted_length": mean("mean_accepted_length"),
            "predicted_speedup": mean("predicted_speedup")}
