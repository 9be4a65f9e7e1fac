"""The speculative acceptance rule, as a pure function over batched tensors (no model, no cache).

Leviathan, Kalman, Matias (2023), "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
Chen et al. (2023), "Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2.
"""
from __future__ import annotations

import torch

from decode.sampling import sample


def verify(
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    accept_u: torch.Tensor | None = None,
    sample_u: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of the drafted tokens and draw the token that follows it.

    Draft token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``. At the first rejection
    (position n) the next token is drawn from ``normalize(max(p_n - q_n, 0))``; if all γ are accepted a bonus
    token is drawn from ``p_γ``. The committed tokens are then distributed exactly as sampling from p.

    Args:
        draft_probs: ``(B, γ, V)`` q, the distribution each draft token was drawn from (one-hot if greedy).
        target_probs: ``(B, γ + 1, V)`` p on the same prefixes; row γ is the bonus distribution.
        draft_tokens: ``(B, γ)`` int64 drafted ids.
        generator: source of the random draws not given below.
        accept_u: ``(B, γ)`` uniforms in [0, 1) for the acceptance tests.
        sample_u: ``(B,)`` uniforms in [0, 1) for the residual/bonus draw (inverse CDF, :func:`decode.sampling.sample`).
        num_draft: ``(B,)`` int64, each row's own γ_r <= γ: drafts at positions >= γ_r are not verified (the row
            behaves as if it had drafted γ_r tokens; its bonus distribution is ``p_{γ_r}``).

    Returns:
        ``(n_accepted, next_token)``: ``(B,)`` int64 in ``[0, γ_r]`` and ``(B,)`` int64.
        With one-hot p and q (temperature 0) this reduces to: accept while the draft equals the target's
        argmax, then emit the target's argmax, so output equals plain greedy decoding.
    """
    B, gamma, V = draft_probs.shape
    if target_probs.shape != (B, gamma + 1, V):
        raise ValueError(f"target_probs must be (B, γ+1, V) = {(B, gamma + 1, V)}, got {tuple(target_probs.shape)}")
    if draft_tokens.shape != (B, gamma):
        raise ValueError(f"draft_tokens must be (B, γ) = {(B, gamma)}, got {tuple(draft_tokens.shape)}")
    device = draft_probs.device
    idx = draft_tokens.unsqueeze(-1)
    p_x = target_probs[:, :gamma].gather(-1, idx).squeeze(-1)  # (B, γ)
    q_x = draft_probs.gather(-1, idx).squeeze(-1)  # (B, γ)
    if accept_u is None:
        accept_u = torch.rand((B, gamma), generator=generator, device=device, dtype=torch.float32)
    # u < p/q without dividing; q_x > 0 because x was drawn from q.
    accepted = accept_u * q_x < p_x
    if num_draft is not None:
        accepted &= torch.arange(gamma, device=device) < num_draft[:, None]
    n_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # (B,)

    # q is taken as 0 past the last verified draft, so the bonus case is the same formula: max(p - 0, 0) = p.
    rows = torch.arange(B, device=device)
    p_n = target_probs[rows, n_accepted]  # (B, V)
    limit = num_draft if num_draft is not None else gamma
    q_n = draft_probs[rows, n_accepted.clamp_max(max(gamma - 1, 0))] if gamma > 0 else torch.zeros_like(p_n)
    q_n = torch.where((n_accepted < limit)[:, None], q_n, 0.0)
    residual = (p_n - q_n).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # A rejection at p == q has probability 0; guard float round-off by falling back to p.
    residual = torch.where(mass > 0, residual, p_n)
    next_token = sample(residual, generator, sample_u)
    return n_accepted, next_token


def verify_greedy(target_ids: torch.Tensor, draft_tokens: torch.Tensor,
                  num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify` for greedy rows from ids alone (p and q one-hot): accept while the draft equals the target's
    argmax, then emit the target's argmax at the first mismatch (or the bonus position).

    Args:
        target_ids: ``(B, γ + 1)`` int64, the target's (penalised) argmax at each window position.
        draft_tokens: ``(B, γ)`` int64; num_draft: ``(B,)`` each row's own γ_r (see :func:`verify`).

    Returns:
        ``(n_accepted (B,), next_token (B,))``, equal to :func:`verify` on the one-hot distributions.
    """
    gamma = draft_tokens.shape[1]
    accepted = draft_tokens == target_ids[:, :gamma]
    if num_draft is not None:
        accepted &= torch.arange(gamma, device=draft_tokens.device) < num_draft[:, None]
    n_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    return n_accepted, target_ids.gather(1, n_accepted[:, None])[:, 0]
