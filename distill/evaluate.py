"""Acceptance evaluation of a draft against its target: teacher-forced (the recipe's default) or by speculative
generation with the bundled decoder.

The loss only stands in for the real objective; this measures it: α (Leviathan et al.'s per-token acceptance), the
mean accepted length τ (committed tokens per verify step), the acceptance rate (Σaccepted/Σdrafted), the
accepted-length histogram, and the speedup predicted by Leviathan et al. (2023) at the best γ from α, a measured cost
ratio c = draft / target time of a cached decode forward and the measured verify costs v_γ (a verify forward of γ+1
tokens over a one-token one).

Two ways to get α (``eval.method``):

- ``teacher_forced`` (:func:`teacher_forced_eval`): one target forward and one draft forward over held-out
  target-generated text (prompt + the target's response). At each response position the probability that
  speculative sampling accepts the draft's token is β = Σ_x min(p(x), q(x)) (Leviathan et al. 2023, §3.1), with p
  and q the target's and the draft's distributions at temperature T (a pruned draft puts q = 0 outside its kept
  ids); at T = 0 it is the indicator argmax q == argmax p. α is the mean of β over the positions; τ, the acceptance
  rate and the histogram follow from α under the i.i.d. assumption of the speedup formula. Two forwards per batch:
  cheap enough to run often during training.
- ``generate`` (:func:`acceptance_eval`): the prompts decoded speculatively, α, τ and the histograms counted
  (``decode.bench.measure``, the benchmark's measurement): the real decoder's numbers, at the cost of generating.

Both are unbiased for the same α when the text follows the target's own distribution at T: a position's β is the
probability that the draft's token is accepted given the prefix, so its mean over target-generated prefixes is the
acceptance the decoder counts (greedy text at T = 0; at T > 0 the eval's greedy text is a close stand-in).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from decode.bench.measure import acceptance, decode_stats, measure_costs, predict
from decode.cross_vocab import VocabIntersection
from decode.engine import SpeculativeDecoder
from decode.outputs import replace_text
from decode.sampling import logits_to_probs
from decode.speedup import expected_tokens_per_step
from decode.vocab_map import draft_vocab_map, scatter_to_vocab
from distill.config import SetupError
from distill.cross_vocab import shared_columns
from distill.rollout import accepts_logits_to_keep, completion_logits
from distill.target_data import target_data_settings

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
                    progress: ProgressFn | None = None, verify_costs: list[float] | None = None,
                    draft_tokenizer: Any = None) -> dict[str, Any]:
    """α, τ, accepted-length histogram and predicted speedup of ``draft`` for ``target``, per temperature.

    Args:
        target, draft: causal LMs (the draft unwrapped from DDP/peft wrappers is fine, peft models work as is).
        prompts: token-id lists (held-out prompts, chat template already applied).
        tokenizer: the shared tokenizer (eos, pad, and the decoder's compatibility check).
        draft_tokenizer: the draft's own tokenizer when it differs from the target's (the decoder then drafts
            through the tokens both share, :mod:`decode.cross_vocab`); None: the target's.
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
        dec = SpeculativeDecoder(target, draft, num_draft_tokens=num_draft_tokens, tokenizer=tokenizer,
                                 draft_tokenizer=draft_tokenizer)
        cost_ratio, verify_costs = resolve_costs(target, draft, prompts, cost_ratio, verify_costs, max_gamma,
                                                 progress, decoder=dec)
        per_t = {str(float(t)): temperature_row(dec, prompts, tokenizer, float(t), max_new_tokens, batch_size, seed,
                                                cost_ratio, verify_costs, max_gamma, progress)
                 for t in temperatures}
    finally:
        draft.train(was_training)
    mean = lambda key: sum(v[key] for v in per_t.values()) / len(per_t)  # noqa: E731
    return {"per_temperature": per_t, "cost_ratio": float(cost_ratio), "verify_costs": verify_costs,
            "num_draft_tokens": num_draft_tokens, "method": "generate",
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


# ------------------------------------------------------------------------------------------------ teacher-forced

def expected_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``(..., V), (..., V) -> (...)``: β = Σ_x min(p(x), q(x)), the probability that speculative sampling accepts
    the draft's token drawn from q when the target's distribution is p (Leviathan et al. 2023, §3.1). One-hot p and
    q (greedy) give the indicator that both pick the same id. Clamped at 1: float32 probabilities over a large
    vocabulary can sum a hair above 1."""
    return torch.minimum(target_probs, draft_probs).sum(-1).clamp(max=1.0)


def position_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float, vocab: int,
                        vocab_map: torch.Tensor | None = None) -> torch.Tensor:
    """``(N,)`` β of each of N positions from the two models' raw logits at temperature T (0: greedy).

    Args:
        target_logits: ``(N, V_target)``; columns past ``vocab`` (lm_head padding) get probability 0.
        draft_logits: ``(N, V_draft)``, or ``(N, K)`` for a pruned draft whose ``vocab_map`` ``(K,)`` names the
            target id of each column: the K logits are placed in a V-wide row of -inf, so q = 0 outside the kept
            ids, exactly as the decoder does (:func:`decode.vocab_map.scatter_to_vocab`).
        vocab: the shared vocabulary size V.

    p and q come from the decoder's own path (:func:`decode.sampling.logits_to_probs`): a one-hot argmax at T = 0,
    so β is then the indicator argmax q == argmax p.
    """
    if vocab_map is not None:
        draft_logits = scatter_to_vocab(draft_logits.float(), vocab_map.to(draft_logits.device), vocab)
    p = logits_to_probs(target_logits, temperature, vocab_size=vocab)
    q = logits_to_probs(draft_logits.to(p.device), temperature, vocab_size=vocab)
    return expected_acceptance(p, q)


@torch.no_grad()
def teacher_forced_sums(target: Any, draft: Any, examples: list[dict], temperatures: list[float], vocab: int,
                        pad_id: int = 0, batch_size: int = 8,
                        progress: Callable[[int, int], None] | None = None,
                        intersection: VocabIntersection | None = None) -> tuple[dict[float, float], int]:
    """``({T: Σβ}, positions)`` over the completion positions of ``examples`` (``{"prompt_ids", "completion_ids"}``):
    one target forward and one draft forward per batch of ``batch_size`` (only the completion positions reach the
    lm_heads, :func:`distill.rollout.completion_logits`); ``progress(done, total)`` after each batch.

    ``intersection``: for a draft with a tokenizer of its own, the pairing it drafts through
    (:mod:`decode.cross_vocab`): it reads the examples' target ids mapped into its vocabulary and its q covers
    only the shared tokens, as in the decoder."""
    vocab_map = draft_vocab_map(draft)
    d_pad = pad_id if intersection is None else int(intersection.draft_input[pad_id])
    keep_t, keep_d = accepts_logits_to_keep(target), accepts_logits_to_keep(draft)
    sums, positions = {float(t): 0.0 for t in temperatures}, 0
    for start in range(0, len(examples), batch_size):
        rows = [e for e in examples[start:start + batch_size] if e["completion_ids"]]
        if rows:
            target_logits = completion_logits(target, rows, pad_id, keep_t)  # (N, V')
            draft_logits = completion_logits(draft, draft_rows(rows, intersection), d_pad, keep_d)  # (N, V''|K)
            if intersection is not None:  # the shared columns, scoring the target ids of vocab_map
                draft_logits, vocab_map = shared_columns(draft_logits, intersection)
            for t in sums:
                sums[t] += float(position_acceptance(target_logits, draft_logits, t, vocab, vocab_map).double().sum())
            positions += target_logits.shape[0]
        if progress is not None:
            progress(min(start + batch_size, len(examples)), len(examples))
    return sums, positions


def draft_rows(rows: list[dict], intersection: VocabIntersection | None) -> list[dict]:
    """The examples as the draft reads them: target ids mapped into its vocabulary when it has its own."""
    if intersection is None:
        return rows
    table = intersection.draft_input.tolist()
    return [{**e, "prompt_ids": [table[i] for i in e["prompt_ids"]],
             "completion_ids": [table[i] for i in e["completion_ids"]]} for e in rows]


def teacher_forced_alpha(target: Any, draft: Any, sequences: list[list[int]], prompt_lens: list[int],
                         temperatures: list[float], vocab: int | None = None, pad_id: int = 0,
                         batch_size: int = 8) -> dict[float, float]:
    """``{T: α}``: the teacher-forced α of ``draft`` for ``target`` on ``sequences`` (token ids, prompt +
    target-generated response), pooled over the response positions (each sequence's tokens after its first
    ``prompt_lens[i]``). ``vocab``: the shared vocabulary V (default: the target's output width).

    Raises:
        ValueError: the lengths disagree, or no sequence has a response token to score.
    """
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
    if any(not 1 <= int(n) <= len(s) for s, n in zip(sequences, prompt_lens)):
        raise ValueError("every prompt length must be in [1, len(sequence)] (a prompt has at least one token)")
    examples = [{"prompt_ids": list(s[:int(n)]), "completion_ids": list(s[int(n):])}
                for s, n in zip(sequences, prompt_lens)]
    if vocab is None:
        vocab = int(target.get_output_embeddings().weight.shape[0])
    was_training = draft.training
    draft.eval()
    try:
        sums, positions = teacher_forced_sums(target, draft, examples, temperatures, vocab, pad_id, batch_size)
    finally:
        draft.train(was_training)
    if not positions:
        raise ValueError("no response token to score: every sequence ends at its prompt")
    return {t: s / positions for t, s in sums.items()}


def predicted_row(alpha: float, num_draft_tokens: int, cost_ratio: float, verify_costs: list[float] | None,
                  max_gamma: int) -> dict[str, Any]:
    """What follows from α alone under the i.i.d. assumption of the speedup formula, at γ = ``num_draft_tokens``:
    τ = (1 − α^(γ+1)) / (1 − α), the acceptance rate E[accepted] / γ = (τ − 1) / γ, the accepted-length
    distribution (n < γ with probability (1 − α) α^n, γ with α^γ), the chance α^(i+1) that draft position i is
    accepted, and the verify-aware speedup at the best γ (:func:`decode.bench.measure.predict`)."""
    gamma = int(num_draft_tokens)
    tau = expected_tokens_per_step(alpha, gamma)
    histogram = [(1.0 - alpha) * alpha ** n for n in range(gamma)] + [alpha ** gamma]
    g, speedup = predict(alpha, cost_ratio, verify_costs, max_gamma=max_gamma)
    return {"alpha": alpha, "mean_accepted_length": tau, "acceptance_rate": (tau - 1.0) / gamma,
            "accepted_length_histogram": histogram,
            "acceptance_by_position": [alpha ** (i + 1) for i in range(gamma)],
            "best_gamma": g, "predicted_speedup": speedup}


def teacher_forced_eval(target: Any, draft: Any, examples: list[dict], temperatures: list[float], vocab: int,
                        num_draft_tokens: int = 4, cost_ratio: float = 1.0, verify_costs: list[float] | None = None,
                        max_gamma: int = 8, batch_size: int = 8, pad_id: int = 0,
                        progress: ProgressFn | None = None,
                        intersection: VocabIntersection | None = None) -> dict[str, Any]:
    """:func:`acceptance_eval`'s result, with α teacher-forced on ``examples`` (held-out prompts with the target's
    responses) instead of counted while generating: per temperature α (:func:`teacher_forced_sums`) and what
    follows from it (:func:`predicted_row`: τ at γ = ``num_draft_tokens``, acceptance rate, histogram as
    probabilities, the speedup at the best γ with c and v_γ), ``num_positions`` (response tokens scored) and
    ``"method": "teacher_forced"``. ``progress`` is told ``("eval α teacher-forced", done, total, "sequences")``.
    ``intersection``: a draft with a tokenizer of its own (:func:`teacher_forced_sums`).

    Raises:
        ValueError: no example has a response token.
    """
    report = None if progress is None else lambda d, n: progress("eval α teacher-forced", d, n, "sequences")
    was_training = draft.training
    draft.eval()
    try:
        sums, positions = teacher_forced_sums(target, draft, examples, temperatures, vocab, pad_id, batch_size,
                                              report, intersection)
    finally:
        draft.train(was_training)
    if not positions:
        raise ValueError("teacher-forced evaluation needs held-out responses; every example's completion is empty")
    per_t = {str(float(t)): {**predicted_row(s / positions, num_draft_tokens, cost_ratio, verify_costs, max_gamma),
                             "num_positions": positions}
             for t, s in sums.items()}
    mean = lambda key: sum(v[key] for v in per_t.values()) / len(per_t)  # noqa: E731
    return {"per_temperature": per_t, "cost_ratio": float(cost_ratio), "verify_costs": verify_costs,
            "num_draft_tokens": num_draft_tokens, "method": "teacher_forced",
            "acceptance_rate": mean("acceptance_rate"), "mean_accepted_length": mean("mean_accepted_length"),
            "predicted_speedup": mean("predicted_speedup")}


# ------------------------------------------------------------------------------------------------ held-out text

HELDOUT_FILE = "eval_heldout.json"  # in the run folder: the held-out prompts' greedy target responses


@torch.no_grad()
def greedy_completions(target: Any, prompts: list[list[int]], max_new_tokens: int, eos_token_id: Any,
                       batch_size: int = 8) -> list[dict]:
    """``[{"prompt_ids", "completion_ids"}]``: the target's greedy response to each prompt (up to ``max_new_tokens``
    tokens, its end-of-sequence token included), decoded by the bundled decoder without a draft."""
    decoder = SpeculativeDecoder(target, None, num_draft_tokens=0)
    out = []
    for start in range(0, len(prompts), batch_size):
        rows = [list(p) for p in prompts[start:start + batch_size]]
        gen = decoder.generate(rows, max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=eos_token_id,
                               num_draft_tokens=0)
        out.extend({"prompt_ids": r, "completion_ids": t.tolist()} for r, t in zip(rows, gen.new_tokens))
    return out


def heldout_settings(target_name: str, target: Any, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """What the held-out responses depend on: the target (path, weights hash, dtype), the prompts (count and hash)
    and ``max_new_tokens`` (greedy, so no seed) (:func:`distill.target_data.target_data_settings`)."""
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    examples = [{"prompt_ids": list(p)} for p in prompts]
    return target_data_settings(target_name, dtype, examples, {"max_new_tokens": int(max_new_tokens),
                                                               "temperature": 0.0})


# What sets each held-out setting, named when a run folder's held-out responses were made with other ones.
HELDOUT_FIELDS = {"target": "+target.name_or_path", "target_hash": "+target.name_or_path (its weights changed)",
                  "target_dtype": "target.dtype", "num_prompts": "eval.num_prompts / data.holdout / eval.prompts",
                  "prompts_hash": "data.* / eval.prompts (the held-out prompts)",
                  "max_new_tokens": "eval.max_new_tokens", "temperature": "(greedy)"}


def heldout_examples(path: str | Path, target: Any, target_name: str, prompts: list[list[int]], max_new_tokens: int,
                     eos_token_id: Any, batch_size: int = 8, log: Any = print) -> tuple[list[dict], dict | None]:
    """The held-out evaluation text: ``prompts`` with the target's greedy responses (:func:`greedy_completions`),
    read from ``path`` when a run already made them, so that every later evaluation and a resumed run score the same
    text. Returns the examples and, when they were generated here, the record to keep with :func:`save_heldout`
    (the run writes it with its first write, so that a setup that stops leaves its folder as it was).

    Raises:
        SetupError: ``path`` holds responses made with other settings (each differing one named with the setting
            that sets it), or is not such a file.
    """
    path = Path(path)
    settings = heldout_settings(target_name, target, prompts, max_new_tokens)
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            completions, made_with = saved["completions"], saved["settings"]
            diffs = [f"{k} (file {made_with.get(k)!r}, config {v!r}; set by {HELDOUT_FIELDS.get(k, k)})"
                     for k, v in settings.items() if made_with.get(k) != v]
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise SetupError(f"{path} is not a held-out response file (JSON with settings and completions): it is "
                             "damaged; delete it to regenerate the held-out responses") from None
        if diffs or len(completions) != len(prompts):
            raise SetupError(f"{path} holds the held-out responses of other settings: {'; '.join(diffs) or 'count'}."
                             " A run keeps its evaluation text; use the settings the run was made with, or start a "
                             "new run (another train.output_dir, or train.overwrite=true)")
        return [{"prompt_ids": list(p), "completion_ids": list(c)} for p, c in zip(prompts, completions)], None
    log(f"eval: the target's greedy responses to {len(prompts)} held-out prompts (kept in {path})")
    examples = greedy_completions(target, prompts, max_new_tokens, eos_token_id, batch_size)
    return examples, {"settings": settings, "completions": [e["completion_ids"] for e in examples]}


def save_heldout(path: str | Path, record: dict) -> None:
    """Write the record of :func:`heldout_examples` to ``path`` (whole or not at all)."""
    replace_text(Path(path), json.dumps(record))
