"""The one measurement of a draft against its target: α, τ, c, v_γ, the predicted speedup and the γ to run.

The benchmark (``python -m decode bench``), the recipe's evaluation (``distill.evaluate``) and the quickstart's
evaluation all measure through these functions, so a metric is defined once:

- :func:`run_interleaved`: every mode on each prompt before the next prompt, the mode that runs first rotating;
- :func:`decode_stats`: a decoder run over prompts, its ``DecodeStats`` pooled over tokens and steps;
- :func:`acceptance`: pooled stats -> α (Leviathan et al.'s per-token acceptance), the acceptance rate
  (Σaccepted / Σdrafted), τ (tokens committed per verify step), the accepted-length histogram;
- :func:`measure_costs`: c (draft / target time of a one-token decode forward) and the verify costs v_γ (a target
  forward over γ+1 tokens / over one) on the decoder's own forward path;
- :func:`predict`: the verify-aware prediction ``(1 − α^(γ+1)) / ((1 − α)(γc + v_γ))`` at a γ, or at the γ in
  ``[1, max_gamma]`` that maximises it.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import torch

from decode import costs
from decode.metrics import DecodeStats
from decode.speedup import best_gamma, predicted_speedup, smooth_verify_costs, verify_cost_at


def run_interleaved(run: Callable[[Hashable, int, float], Any], modes: Sequence[Hashable], num_prompts: int,
                    temperatures: Sequence[float], repeats: int = 1,
                    before_prompt: Callable[[int], None] | None = None) -> dict[tuple[float, Hashable], list[list]]:
    """Run every mode on every prompt, interleaved, so machine drift and thermal state hit all modes alike.

    Prompt i's runs (each temperature, each mode, ``repeats`` times) form one block before prompt i + 1's; the mode
    that opens each round of a block rotates from round to round, so no mode always runs first.

    Args:
        run: ``run(mode, prompt index, temperature)`` -> one run's result (any object).
        modes: what to run on each prompt (e.g. plain decoding and each draft), in their unrotated order.
        before_prompt: called with the prompt index before its block (e.g. a round of cost timing).

    Returns:
        ``{(temperature, mode): [[result of each repeat] per prompt]}``.
    """
    out: dict[tuple[float, Hashable], list[list]] = {(t, m): [] for t in temperatures for m in modes}
    for i in range(num_prompts):
        if before_prompt is not None:
            before_prompt(i)
        block: dict[tuple[float, Hashable], list] = {key: [] for key in out}
        for rep in range(repeats):
            for t in temperatures:
                k = (i * repeats + rep) % len(modes)
                for mode in list(modes[k:]) + list(modes[:k]):
                    block[(t, mode)].append(run(mode, i, t))
        for key, results in block.items():
            out[key].append(results)
    return out


def decode_stats(decoder: Any, prompts: Sequence[Sequence[int]], temperature: float, max_new_tokens: int,
                 seed: int | Sequence[int] = 0, batch_size: int = 1, eos_token_id: Any = None,
                 num_draft_tokens: int | str | None = None,
                 progress: Callable[[int, int], None] | None = None) -> DecodeStats:
    """Decode ``prompts`` with ``decoder.generate`` in batches of ``batch_size`` and pool the stats.

    Args:
        seed: an int seeds one generator for the whole pass; a list seeds each batch's own generator.
        num_draft_tokens: γ of the calls (None: the decoder's own).
        progress: told ``(prompts done, len(prompts))`` after each batch.
    """
    device = decoder.target.device
    generator = torch.Generator(device=device).manual_seed(seed) if isinstance(seed, int) else None
    stats = []
    for n, b in enumerate(range(0, len(prompts), batch_size)):
        gen = generator if generator is not None else torch.Generator(device=device).manual_seed(seed[n])
        rows = [list(p) for p in prompts[b:b + batch_size]]  # generate() pads them itself
        out = decoder.generate(rows, max_new_tokens=max_new_tokens, temperature=float(temperature),
                               eos_token_id=eos_token_id, generator=gen, num_draft_tokens=num_draft_tokens)
        stats.append(out.stats)
        if progress is not None:
            progress(min(b + batch_size, len(prompts)), len(prompts))
    return DecodeStats.merge(stats)


def alpha_of(stats: DecodeStats) -> float | None:
    """α, Leviathan et al.'s per-token acceptance (``DecodeStats.alpha``); None with no trial."""
    return stats.alpha if stats.num_accepted + stats.num_rejections else None


def acceptance(s: DecodeStats, none_if_unmeasured: bool = True) -> dict[str, Any]:
    """The draft statistics of pooled ``DecodeStats``, under their one name each. A metric with nothing to measure
    (no draft, no verify step) is None, or with ``none_if_unmeasured=False`` the value ``DecodeStats`` gives it
    (0.0 for α and the acceptance rate)."""
    steps = int(s.num_verify_steps)

    def measured(value, ok: bool):
        return float(value) if ok or not none_if_unmeasured else None

    return dict(
        alpha=measured(s.alpha, alpha_of(s) is not None),
        acceptance_rate=measured(s.acceptance_rate, s.num_drafted > 0),
        mean_accepted_length=measured(s.mean_accepted_length, steps > 0),
        accepted_per_position=[int(x) for x in s.accepted_per_position],
        acceptance_by_position=[float(x) for x in s.acceptance_by_position],
        accepted_length_histogram=[int(x) for x in s.accepted_length_histogram],
        num_verify_steps=steps, num_drafted=int(s.num_drafted), num_accepted=int(s.num_accepted),
        decode_latency_s=s.per_token_latency_s or None, mean_gamma=measured(s.mean_num_draft_tokens, steps > 0),
    )


def cost_context_ids(prompts: Sequence[Sequence[int]], length: int) -> list[int]:
    """``length`` (>= 2) real prompt tokens, the prompts' tokens repeated as needed, as the context of the timed
    forwards (only its length matters to the timing; real ids keep the draft's input embedding honest)."""
    ids = [t for p in prompts for t in p] or [0, 0]
    length = max(2, length)
    return (ids * (length // len(ids) + 1))[:length]


def measure_costs(decoder: Any, prompts: Sequence[Sequence[int]], max_gamma: int = 0, context_tokens: int = 128,
                  repeats: int = 7, progress: Callable[[int, int], None] | None = None
                  ) -> tuple[float, list[float] | None]:
    """c and the verify costs v_γ on ``decoder``'s own forward path (its kernels, cache kinds and compiled forwards:
    :func:`decode.costs.measure_costs`), at a context of the prompts' tokens.

    Args:
        max_gamma: v_γ is measured for γ = 1..max_gamma (0: not measured, None returned for it).
        context_tokens: context length of the timed forwards (cut so a verify of max_gamma + 1 tokens fits both
            models' positions).
        repeats: timed forwards per measurement (median).
        progress: told ``(done, repeats + 2)`` after each round of forwards.

    Returns:
        ``(c, [v_0 = 1, v_1, .., v_max_gamma])``, v_γ smoothed as the decoder's own ``calibrate`` does
        (:func:`decode.speedup.smooth_verify_costs`).
    """
    ids = cost_context_ids(prompts, min(costs.shared_context(decoder), context_tokens or 1 << 30) - max_gamma - 1)
    m = costs.measure_costs(decoder, torch.tensor([ids], device=decoder.target.device), repeats=repeats,
                            verify_gammas=range(1, max_gamma + 1), progress=progress)
    verify = smooth_verify_costs([v["relative_cost"] for v in m["verify"]]) if max_gamma > 0 else None
    return float(m["cost_ratio"]), verify


def predict(alpha: float, cost_ratio: float, verify_costs: Sequence[float] | None = None,
            gamma: int | None = None, max_gamma: int = 8) -> tuple[int, float]:
    """``(γ, predicted speedup)``: the verify-aware prediction at ``gamma``, or (None) at the γ in
    ``[1, max_gamma]`` that maximises it (γ = 0 would hide a draft that does not pay off behind a flat 1.0).

    Args:
        alpha: Leviathan et al.'s per-token acceptance α in [0, 1], assumed i.i.d. across positions.
        verify_costs: v_γ indexed by γ (``[1.0, v_1, ..]``); None is Leviathan et al.'s v = 1.
    """
    g = (best_gamma(alpha, cost_ratio, max_gamma=max_gamma, min_gamma=1, verify_costs=verify_costs)
         if gamma is None else int(gamma))
    return g, float(predicted_speedup(alpha, g, cost_ratio, verify_cost_at(verify_costs, g)))
