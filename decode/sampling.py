"""One logits-processing path for target and draft, and sampling through an explicit generator.

Speculative decoding is lossless only if the draft's q and the target's p come from the same processing
(temperature, top-k, top-p) applied to the same prefix (Leviathan et al. 2023, Sec. 3; Chen et al. 2023).
Both models go through :func:`logits_to_probs`.
"""
from __future__ import annotations

import torch


def validate_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ``ValueError`` naming the bad value and the accepted range.

    temperature finite and >= 0 (0 means greedy), top_k None or >= 1, top_p None or in (0, 1].
    """
    if temperature is None or not (0.0 <= float(temperature) < float("inf")):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Turn logits into the sampling distribution, in float32.

    Args:
        logits: ``(..., V_model)`` raw logits.
        temperature: 0 gives a one-hot distribution on the argmax (greedy); otherwise logits are divided by it.
        top_k: keep the k most likely ids (ties at the k-th value are kept).
        top_p: keep the smallest set of most likely ids whose mass reaches top_p (nucleus sampling,
            Holtzman et al. 2020); the most likely id is always kept.
        vocab_size: the shared vocabulary size V. Columns ``>= V`` (lm_head padding rows) get probability 0;
            if ``V > V_model`` the missing ids are appended with probability 0 (a draft that covers fewer ids).

    Returns:
        ``(..., V)`` float32 probabilities summing to 1 over the last dim.
    """
    logits = logits.float()
    if vocab_size is not None:
        v_model = logits.shape[-1]
        if v_model > vocab_size:
            logits = logits[..., :vocab_size]
        elif v_model < vocab_size:
            pad = logits.new_full((*logits.shape[:-1], vocab_size - v_model), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)
    if temperature == 0:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop an id when the mass *before* it already reaches top_p; the top id always survives.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one id per row from ``probs`` ``(..., V)``; returns ``(...)`` int64.

    Uses ``torch.multinomial`` with the given generator, so the same seed gives the same draw.
    Rows must sum to a positive value.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
