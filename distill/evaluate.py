"""Acceptance evaluation of a draft against its target with the bundled speculative decoder.

The loss only stands in for the real objective; this measures it: the acceptance rate (Σaccepted/Σdrafted), α
(Leviathan et al.'s per-token acceptance), the mean accepted length τ (committed tokens per verify step), the
accepted-length histogram, and the speedup predicted by Leviathan et al. (2023) at the best γ from α, a measured cost
ratio c = draft / target time of a cached decode forward and the measured verify costs v_γ (a verify forward of γ+1
tokens over a one-token one). Each is measured by ``decode.bench.measure``, the benchmark's measurement.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from decode.bench.measure import acceptance, decode_stats, measure_costs, predict
from decode.engine import SpeculativeDecoder

# progress(what, done, total, unit): e.g. ("eval α/τ T=0", 5, 16, "prompts"); distill.logging.Progress.reporting
ProgressFn = Callable[[str, int, int, str], None]
COST_RATIO_PROGRESS = "measuring cost ratio c"


def resolve_costs(target: Any, draft: Any, prompts: list[list[int]], cost_ratio: float | None,
                  verify_costs: list[float] | None, max_gamma: int, progress: ProgressFn | None = None,
                  decoder: SpeculativeDecoder | None = None) -> tuple[float, list[float] | None]:
    """The (c, v_γ) an evaluation predicts with: ``eval.cost_ratio`` / ``eval.verify_costs`` where given; with c
    unset, both are measured here (one hardware for both) by the benchmark's measurement on the decoder's forward
    path (:func:`decode.bench.measure.measure_costs`; ``decoder``, else one built for the pair), its rounds told to
    ``progress`` as ``("measuring cost ratio c", done, total, "rounds")``; with c given (e.g. measured on the
    serving GPU) and no v_γ, Leviathan et al.'s v = 1 (the memory-bound verify of a GPU at batch 1)."""
    if cost_ratio is not None:
        return float(cost_ratio), None if verify_costs is None else list(verify_costs)
    if decoder is None:
        decoder = SpeculativeDecoder(target, draft)
    report = None if progress is None else lambda done, total: progress(COST_RATIO_PROGRESS, done, total, "rounds")
    c, measured = measure_costs(decoder, prompts, 0 if verify_costs is not None else max_gamma, progress=report)
    return c, list(verify_costs) if verify_costs is not None else measured


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
        cost_ratio: c; measured on the prompts when None, together with the verify costs unless ``verify_costs``
            is given (:func:`resolve_costs`).
        verify_costs: v_γ indexed by γ (``[1.0, v_1, ..]``) for the verify-aware prediction
            ``(1 − α^(γ+1)) / ((1 − α)(γc + v_γ))``; None with a given c: Leviathan et al.'s v = 1.
        max_gamma: largest γ considered for the best-γ prediction. The best γ is searched in [1, max_gamma]: a
            predicted speedup below 1 then says plainly that this draft does not pay off (γ = 0 would hide it
            behind a flat 1.0). α is measured at ``num_draft_tokens`` and assumed i.i.d. across positions.
        progress: told ``("eval α/τ T=<t>", prompts done, len(prompts), "prompts")`` after each batch, and the
            cost measurement's rounds (:func:`resolve_costs`) when c is measured.

    Returns:
        ``{"per_temperature": {"0.0": {acceptance_rate, alpha, mean_accepted_length, accepted_length_histogram,
        acceptance_by_position, best_gamma, predicted_speedup, num_new_tokens}, ...}, "cost_ratio": c,
        "verify_costs": the v_γ used (None: v = 1),
        "acceptance_rate": mean acceptance rate over temperatures, "mean_accepted_length": mean τ,
        "predicted_speedup": mean predicted speedup}``.
    """
    if not prompts:
        raise ValueError("acceptance_eval needs at least one prompt")
    was_training = draft.training
    draft.eval()
    try:
        dec = SpeculativeDecoder(target, draft, num_draft_tokens=num_draft_tokens, tokenizer=tokenizer)
        cost_ratio, verify_costs = resolve_costs(target, draft, prompts, cost_ratio, verify_costs, max_gamma,
                                                 progress, decoder=dec)
        per_t = {str(float(t)): temperature_row(dec, prompts, tokenizer, float(t), max_new_tokens, batch_size, seed,
                                                cost_ratio, verify_costs, max_gamma, progress)
                 for t in temperatures}
    finally:
        draft.train(was_training)
    mean = lambda key: sum(v[key] for v in per_t.values()) / len(per_t)  # noqa: E731
    return {"per_temperature": per_t, "cost_ratio": float(cost_ratio), "verify_costs": verify_costs,
            "num_draft_tokens": num_draft_tokens,
            "acceptance_rate": mean("acceptance_rate"), "mean_accepted_length": mean("mean_accepted_length"),
            "predicted_speedup": mean("predicted_speedup")}


def temperature_row(decoder: SpeculativeDecoder, prompts: list[list[int]], tokenizer: Any, temperature: float,
                    max_new_tokens: int, batch_size: int, seed: int, cost_ratio: float,
                    verify_costs: list[float] | None, max_gamma: int,
                    progress: ProgressFn | None = None) -> dict[str, Any]:
    """One temperature of :func:`acceptance_eval`: the prompts decoded in batches with one generator seeded
    ``seed`` (:func:`decode.bench.measure.decode_stats`), the pooled α, τ and histograms, and the prediction at the
    verify-aware best γ (:func:`decode.bench.measure.predict`)."""
    what = f"eval α/τ T={temperature:g}"
    report = None if progress is None else lambda done, total: progress(what, done, total, "prompts")
    s = decode_stats(decoder, prompts, temperature, max_new_tokens, seed=seed, batch_size=batch_size,
                     eos_token_id=tokenizer.eos_token_id, progress=report)
    # The speedup formula's α is the per-token acceptance probability, not Σaccepted/Σdrafted.
    m = acceptance(s, none_if_unmeasured=False)
    g, predicted = predict(m["alpha"], cost_ratio, verify_costs, max_gamma=max_gamma)
    return {"acceptance_rate": m["acceptance_rate"], "alpha": m["alpha"],
            "mean_accepted_length": m["mean_accepted_length"],
            "accepted_length_histogram": m["accepted_length_histogram"],
            "acceptance_by_position": m["acceptance_by_position"], "best_gamma": g, "predicted_speedup": predicted,
            "num_new_tokens": int(s.num_new_tokens)}
