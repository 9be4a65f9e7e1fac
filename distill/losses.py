"""Token-level distillation losses between a draft q and a frozen target p. Pure functions, no state.

Every divergence takes ``(draft_logits (B, T, V), target_logits (B, T, V), mask (B, T), n_tokens)`` and returns
``Σ_{masked positions} d(p_t, q_t) / n_tokens`` as a float32 scalar. The token count comes from outside so that
prompt and pad positions contribute nothing and gradient accumulation is exact: pass the number of masked
tokens of the whole accumulation window (over all processes, divided by the number of processes under DDP),
not of the micro-batch (TRL GKDTrainer does the same).

Divergences (DistillSpec, Zhou et al. ICLR 2024, Table 1; GKD, Agarwal et al. ICLR 2024):

- ``fkl``: forward KL(p‖q), mode-covering; the classic KD objective.
- ``rkl``: reverse KL(q‖p), mode-seeking.
- ``jsd``: generalized JSD(β) = β·KL(p‖m) + (1−β)·KL(q‖m) with m = β·p + (1−β)·q. Following TRL's
  ``generalized_jsd_loss``, β=0 is defined as FKL and β=1 as RKL (the limits of JSD(β)/β and JSD(β)/(1−β)).
- ``tvd``: total variation ½Σ|p−q| = 1 − Σ min(p, q). With the same sampling on both sides this is exactly the
  expected rejection probability of speculative sampling at that position (Leviathan et al. 2023, Thm 3.5), so
  minimizing it maximizes the acceptance rate α directly.
- ``acceptance``: expected rejected draft slots over windows of γ consecutive positions, built from 1 − TVD per
  position (see :func:`acceptance`); it targets the accepted length τ rather than the per-token rate.

Temperature divides both logits before the softmax (no T² gradient rescaling; the acceptance rule compares the
distributions at the sampling temperature, so that is the one to match). Numerics: computed in float32 whatever
the input dtype; masked positions are zeroed before the softmax, so rows that are all -inf or NaN there cannot
poison the result or its gradient; -inf logits at unmasked positions (vocabulary masks) give probability 0 and
log-probabilities clamped to ``LOG_FLOOR``, so 0·log 0 terms are 0 and the loss stays finite.

Each divergence's formulas live in :func:`divergence_terms`, with its gradient with respect to the draft's
log-probabilities in closed form. The reference losses differentiate its value by autograd; the fused ones
(:func:`fused_divergence`, ``distill_loss(..., fused=True)``, the recipe's default ``loss.fused=true``) apply the
closed-form gradient in a ``torch.autograd.Function`` (:class:`FusedDivergence`; :class:`FusedBucketLogProbs` for the
cached top-k losses), the same value and gradient with much less (N, V) work.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from decode.vocab_map import scatter_to_vocab

# exp(-1e4) is 0 in every float format, so clamping log-probabilities here changes no probability and keeps
# p·(log p − log q) finite when a vocabulary entry is masked with -inf on one side.
LOG_FLOOR = -1e4


def _check(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float):
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)} and target_logits {tuple(target_logits.shape)} "
                         "must have the same shape; slice both to the shared vocabulary first")
    if mask.shape != draft_logits.shape[:-1]:
        raise ValueError(f"mask {tuple(mask.shape)} must match the logits without the vocab dim "
                         f"{tuple(draft_logits.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _log_probs(logits: torch.Tensor, keep: torch.Tensor | None, temperature: float,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """log_softmax(logits / T) in ``dtype``, clamped at LOG_FLOOR; rows where ``keep`` (..., 1) is False are zeroed
    first (uniform there), so garbage (all -inf, NaN) cannot reach the value or the gradient. ``keep=None``: every
    row is kept."""
    z = logits.to(dtype) if keep is None else torch.where(keep, logits.to(dtype), 0.0)
    if temperature != 1.0:
        z = z / temperature
    return F.log_softmax(z, dim=-1).clamp(min=LOG_FLOOR)


def _prepare(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float):
    _check(draft_logits, target_logits, mask, temperature)
    keep = mask.bool().unsqueeze(-1)
    return _log_probs(draft_logits, keep, temperature), _log_probs(target_logits, keep, temperature)


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, n_tokens: int | float | torch.Tensor) -> torch.Tensor:
    """Σ over masked positions / n_tokens; n_tokens = 0 (a fully masked window) gives 0, not NaN."""
    total = torch.where(mask.bool(), per_token, 0.0).sum()
    if isinstance(n_tokens, torch.Tensor):
        n_tokens = n_tokens.to(total.device, torch.float32)
        return total / n_tokens.clamp(min=1.0)
    return total / max(float(n_tokens), 1.0)


def fkl(draft_logits, target_logits, mask, n_tokens, temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(p_target‖q_draft) summed over masked positions / n_tokens. Shapes: (B,T,V), (B,T,V), (B,T)."""
    log_q, log_p = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(divergence_terms("fkl", log_q, log_p)[0].clamp(min=0.0), mask, n_tokens)


def rkl(draft_logits, target_logits, mask, n_tokens, temperature: float = 1.0) -> torch.Tensor:
    """Reverse KL(q_draft‖p_target) summed over masked positions / n_tokens."""
    log_q, log_p = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(divergence_terms("rkl", log_q, log_p)[0].clamp(min=0.0), mask, n_tokens)


def jsd(draft_logits, target_logits, mask, n_tokens, beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Generalized JSD(β) = β·KL(p‖m) + (1−β)·KL(q‖m), m = β·p + (1−β)·q; β=0 → FKL, β=1 → RKL (TRL's convention).

    Raises ValueError if β is outside [0, 1].
    """
    _check_beta(beta)
    log_q, log_p = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(divergence_terms("jsd", log_q, log_p, beta)[0].clamp(min=0.0), mask, n_tokens)


def tvd(draft_logits, target_logits, mask, n_tokens, temperature: float = 1.0) -> torch.Tensor:
    """Total variation ½Σ|p−q| = 1 − Σmin(p, q): the expected rejection rate of speculative sampling at that
    position (DistillSpec's objective for maximizing α)."""
    log_q, log_p = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(divergence_terms("tvd", log_q, log_p)[0], mask, n_tokens)


def _check_beta(beta: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta} (0 = forward KL, 1 = reverse KL)")


def _check_beta_temperature(beta: float, temperature: float) -> None:
    _check_beta(beta)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def divergence_terms(name: str, log_q: torch.Tensor, log_p: torch.Tensor, beta: float = 0.5,
                     grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The math of the per-position divergences, written once: the value, and (``grad=True``) its gradient with
    respect to the draft's log-probabilities in closed form, for the fused loss (:class:`FusedDivergence`).

    Args:
        name: fkl | rkl | jsd | tvd (jsd with β = 0 is fkl and with β = 1 is rkl).
        log_q, log_p: (..., V) draft and target log-probabilities (:func:`_log_probs`: clamped at LOG_FLOOR).
        beta: JSD β in [0, 1].
        grad: also return ``q = exp(log_q)`` and ``g = ∂d/∂log q`` (..., V); otherwise both are None and the
            value is differentiable by autograd (the reference path).

    Returns:
        ``(d, q, g)``: d (...,) the divergence before the clamp at 0 that the losses apply. With r = log q − log p:

        - FKL Σ p (log p − log q): g = −p, zero where log q was clamped at LOG_FLOOR (as autograd's clamp gives).
        - RKL Σ q·r: g = q ⊙ (r + 1).
        - JSD(β) β·Σ p (log p − log m) + (1−β)·Σ q (log q − log m), m = β p + (1−β) q:
          ∂ log m / ∂ log q = (1−β) q / m, and β p + (1−β) q = m makes the two mixture terms cancel to −(1−β) q,
          so g = (1−β) q ⊙ (log q − log m). log m = log(m) floored at the smallest normal number (its terms
          carry a factor p or q below it); a row with log p == log q everywhere is exactly 0 (and its gradient 0 up
          to rounding).
        - TVD ½ Σ |q − p|: g = ½ q ⊙ sign(q − p) (sign 0 = 0, as autograd's abs).

        The gradient with respect to the draft's logits z (log q = log_softmax(z / T)) is then
        ``(g − q·Σg) / T``, the same as autograd's of the value.
    """
    family = {0.0: "fkl", 1.0: "rkl"}.get(beta, "jsd") if name == "jsd" else name
    q = log_q.exp() if grad or family != "fkl" else None
    g = None
    if family == "fkl":
        p = log_p.exp()
        d = (p * (log_p - log_q)).sum(-1)
        if grad:
            g = p * (LOG_FLOOR - log_q).sign()  # −p, and 0 where log q sits at the floor (cheaper than a where)
    elif family == "rkl":
        h = q * (log_q - log_p)
        d = h.sum(-1)
        if grad:
            g = h + q
    elif family == "jsd":
        p = log_p.exp()
        log_m = torch.lerp(q, p, beta).clamp(min=torch.finfo(q.dtype).tiny).log()  # m = q + β(p − q)
        h = q * (log_q - log_m)
        d = beta * (p * (log_p - log_m)).sum(-1) + (1.0 - beta) * h.sum(-1)
        # identical rows give exactly 0 (log(exp(x)) rounds, so log m is only nearly log q there)
        d = torch.where((log_p - log_q).abs().amax(-1) == 0, 0.0, d)
        if grad:
            g = (1.0 - beta) * h
    elif family == "tvd":
        diff = q - log_p.exp()
        d = 0.5 * diff.abs().sum(-1)
        if grad:
            g = (0.5 * q) * diff.sign()
    else:
        raise ValueError(f"loss {name!r} has no per-position divergence; choose fkl, rkl, jsd or tvd")
    return d, (q if grad else None), g


# Rows per block of the fused loss: on a CPU a block's float32 temporaries (256 KiB each; 8 rows of 8192, the fastest
# of 4-32 rows measured) stay in cache and their memory is reused; on an accelerator blocks only bound the
# temporaries (256 MiB each).
_BLOCK_ELEMENTS = {"cpu": 2**16}
_BLOCK_ELEMENTS_DEFAULT = 2**26


def _block_rows(n_rows: int, vocab: int, device: torch.device) -> int:
    return max(1, min(n_rows, _BLOCK_ELEMENTS.get(device.type, _BLOCK_ELEMENTS_DEFAULT) // max(vocab, 1)))


def _block_keep(keep: torch.Tensor) -> torch.Tensor | None:
    """A block's row mask, or None when every row is kept and that is free to know (on a CPU: no host sync; there
    the where it saves costs a pass)."""
    return None if keep.device.type == "cpu" and bool(keep.all()) else keep


class FusedDivergence(torch.autograd.Function):
    """Per-position divergence (N,) of the draft's logits against the target's, with the closed-form gradient of
    :func:`divergence_terms`: ``∂d/∂z = (g − q·Σg) / T`` (the softmax Jacobian applied to g = ∂d/∂log q).

    ``forward(draft_logits (N, V), target_logits (N, V), keep (N, 1) bool, name, beta, temperature)`` computes,
    block of rows by block of rows, the same log-probabilities as the reference losses (:func:`_log_probs`: rows
    with ``keep`` False are zeroed, i.e. uniform) and the same value (:func:`divergence_terms`, clamped at 0), in
    float32 (float64 for float64 inputs). It keeps q and g, two (N, V) buffers, for the backward, which returns the
    gradient for the draft's logits only (in their dtype; the target is frozen) and zero where the value was clamped
    at 0, as autograd's clamp does. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, draft_logits, target_logits, keep, name, beta, temperature):
        dtype = torch.promote_types(draft_logits.dtype, torch.float32)
        n, vocab = draft_logits.shape
        rows = _block_rows(n, vocab, draft_logits.device)
        d = torch.empty(n, dtype=dtype, device=draft_logits.device)
        saved = []
        for lo in range(0, n, rows):
            k = _block_keep(keep[lo:lo + rows])
            log_q = _log_probs(draft_logits[lo:lo + rows], k, temperature, dtype)
            log_p = _log_probs(target_logits[lo:lo + rows], k, temperature, dtype)
            d[lo:lo + rows], q, g = divergence_terms(name, log_q, log_p, beta, grad=True)
            saved += [q, g]
        ctx.save_for_backward(d, *saved)
        ctx.rows, ctx.temperature, ctx.logits_dtype, ctx.vocab = rows, temperature, draft_logits.dtype, vocab
        return d.clamp(min=0.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_d):
        d, *saved = ctx.saved_tensors
        scale = torch.where(d >= 0, grad_d, 0.0) / ctx.temperature  # the clamp at 0 passes no gradient below it
        out = torch.empty((d.shape[0], ctx.vocab), dtype=ctx.logits_dtype, device=d.device)
        for i, lo in enumerate(range(0, d.shape[0], ctx.rows)):
            q, g = saved[2 * i], saved[2 * i + 1]
            s = scale[lo:lo + ctx.rows, None]
            out[lo:lo + ctx.rows] = torch.addcmul(g, q, g.sum(-1, keepdim=True), value=-1.0).mul_(s)
        return out, None, None, None, None, None


FUSED = ("fkl", "rkl", "jsd", "tvd")


def fused_divergence(name: str, draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                     n_tokens: int | float | torch.Tensor, beta: float = 0.5, temperature: float = 1.0
                     ) -> torch.Tensor:
    """:func:`fkl`, :func:`rkl`, :func:`jsd` or :func:`tvd` with the closed-form gradient of
    :class:`FusedDivergence`: the same value and gradient (up to float32 rounding), with fewer passes over (N, V) and no
    autograd graph over it (2–4× faster than autograd on (512, 8192) on a CPU,
    docs/results/2026-11-29-distill-step-efficiency.md).

    Args and errors as the reference loss ``name`` (shapes (..., V), (..., V), (...,)); also raises ValueError
    for a name without a fused form (``acceptance``) or target logits that require a gradient (only the draft's
    gradient is computed; use the reference loss to train both sides).
    """
    if name not in FUSED:
        raise ValueError(f"loss {name!r} has no fused form; the fused losses are {list(FUSED)}")
    _check(draft_logits, target_logits, mask, temperature)
    _check_beta(beta)
    if target_logits.requires_grad:
        raise ValueError("fused losses differentiate the draft's logits only, but target_logits requires grad; "
                         "detach the target or use the reference loss (loss.fused=false)")
    vocab = draft_logits.shape[-1]
    keep = mask.bool().reshape(-1, 1)
    per = FusedDivergence.apply(draft_logits.reshape(-1, vocab), target_logits.reshape(-1, vocab), keep, name,
                                float(beta), float(temperature))
    return _reduce(per.view(mask.shape), mask, n_tokens)


def acceptance(draft_logits, target_logits, mask, n_tokens, gamma: int = 4, temperature: float = 1.0) -> torch.Tensor:
    """Expected rejected draft slots over windows of γ positions: Σ_s (L_s − E_s) / n_tokens.

    Each masked position s starts one window: the next ``L_s = min(γ, masked positions left in s's run)``
    positions (a window stops at the first unmasked position, e.g. the end of the completion). With per-position
    acceptance α_t = Σ min(p_t, q_t) = 1 − TVD_t (Leviathan et al. 2023, Thm 3.5; DistillSpec), drafting the
    window from s accepts ``E_s = Σ_{j<L_s} Π_{i≤j} α_{s+i}`` tokens in expectation: a draft counts only if every
    draft before it was accepted (Leviathan et al. 2023, Eq. 1, with a different α per position). Minimizing
    L_s − E_s maximizes the expected accepted length τ − 1 directly, so the gradient of an early position is
    weighted by the acceptance of the positions after it (per-token objectives: LK losses, arXiv 2602.23881;
    supervision up to the first failure: Spec-AUF, arXiv 2607.01893). It is ≥ 0, exactly 0 when q = p, and equals
    ``tvd`` for γ = 1. The product treats acceptances along the window as independent given the sequence, the
    standard approximation of the analyses above.

    Args:
        draft_logits, target_logits: ``(B, T, V)``; position t predicts token t + 1.
        mask: ``(B, T)``, 1 at completion positions. Keep the sequence layout: windows must not cross sequences.
        n_tokens: masked tokens of the accumulation window (one loss window starts at each).
        gamma: γ, window length (the number of draft tokens per verify step); an integer >= 1.
        temperature: applied to both logits.

    Returns:
        float32 scalar in ``[0, γ]``.

    Raises:
        ValueError: γ < 1 or not an integer, or the shape/temperature errors of the other losses.
    """
    if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 1:
        raise ValueError(f"acceptance gamma must be an integer >= 1 (the draft tokens per step), got {gamma!r}")
    log_q, log_p = _prepare(draft_logits, target_logits, mask, temperature)
    keep = mask.bool()
    # 1 − TVD rather than Σ min(p, q): exactly 1 when q == p, so equal inputs give exactly 0.
    alpha = torch.where(keep, 1.0 - 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1), 0.0)  # (B, T)
    valid = keep.float()

    def shifted(x: torch.Tensor, j: int) -> torch.Tensor:  # x[:, t + j], 0 past the end
        return F.pad(x[:, j:], (0, j))

    accepted, inside = alpha, valid  # Π_{i≤j} α_{s+i} and Π_{i≤j} mask_{s+i}, for j = 0
    per_window = inside - accepted
    for j in range(1, min(int(gamma), alpha.shape[1])):  # slots past the sequence's end are never inside
        accepted = accepted * shifted(alpha, j)
        inside = inside * shifted(valid, j)
        per_window = per_window + inside - accepted
    return _reduce(per_window, mask, n_tokens)


def cross_entropy(draft_logits, labels, mask, n_tokens) -> torch.Tensor:
    """Token-level CE of the draft on ``labels`` (B, T) (the next tokens), summed over masked positions / n_tokens.

    Labels at masked-off positions are ignored (any value, e.g. a pad id, is fine).
    """
    keep = mask.bool()
    logits = torch.where(keep.unsqueeze(-1), draft_logits.float(), 0.0)
    safe_labels = torch.where(keep, labels, 0)
    per = F.cross_entropy(logits.flatten(0, 1), safe_labels.flatten(), reduction="none").view_as(safe_labels)
    return _reduce(per, mask, n_tokens)


DIVERGENCES: dict[str, Callable[..., torch.Tensor]] = {"fkl": fkl, "rkl": rkl, "jsd": jsd, "tvd": tvd,
                                                     "acceptance": acceptance}


def check_loss_name(name: str) -> None:
    """Raise ValueError naming the valid choices if ``name`` is not a known divergence."""
    if name not in DIVERGENCES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(DIVERGENCES)} "
                         f"(override with loss={'|'.join(sorted(DIVERGENCES))})")


def distill_loss(name: str, draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                 n_tokens: int | float | torch.Tensor, labels: torch.Tensor | None = None, beta: float = 0.5,
                 temperature: float = 1.0, ce_weight: float = 0.0, gamma: int = 4, fused: bool = False
                 ) -> torch.Tensor:
    """``(1 − ce_weight)·divergence + ce_weight·CE(draft, labels)`` over masked positions / n_tokens.

    Args:
        name: one of ``fkl``, ``rkl``, ``jsd``, ``tvd``, ``acceptance``.
        draft_logits, target_logits: (B, T, V), sliced to the shared vocabulary.
        mask: (B, T), 1 where position t's next token is a completion token.
        n_tokens: masked tokens of the whole accumulation window (see module docstring).
        labels: (B, T) next tokens; required when ``ce_weight > 0``.
        beta: JSD β (only used by ``jsd``).
        gamma: window length γ (only used by ``acceptance``, which needs the (B, T) sequence layout).
        temperature: softmax temperature applied to both sides (divergence only; CE uses T=1).
        ce_weight: weight of the token-level CE term in [0, 1].
        fused: compute fkl, rkl, jsd and tvd with :func:`fused_divergence` (closed-form gradient, same value and
            gradient); ``acceptance`` always uses its reference form.

    Raises:
        ValueError: unknown name, ce_weight outside [0, 1], or ce_weight > 0 without labels.
    """
    check_loss_name(name)
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"loss.ce_weight must be in [0, 1], got {ce_weight}")
    kw = {"beta": beta} if name == "jsd" else {"gamma": gamma} if name == "acceptance" else {}
    if fused and name in FUSED:
        loss = fused_divergence(name, draft_logits, target_logits, mask, n_tokens, beta=beta, temperature=temperature)
    else:
        loss = DIVERGENCES[name](draft_logits, target_logits, mask, n_tokens, temperature=temperature, **kw)
    if ce_weight > 0:
        if labels is None:
            raise ValueError("loss.ce_weight > 0 needs labels (the next tokens)")
        loss = (1.0 - ce_weight) * loss + ce_weight * cross_entropy(draft_logits, labels, mask, n_tokens)
    return loss


# ------------------------------------------------------------------------------------------------ cached target
# A target distribution cached as its top-k ids, their log-probabilities and the log of the remaining (tail) mass
# (distill/logit_cache.py). The divergences below compare the draft and the target on the k+1 "buckets" (the k ids
# plus the tail as one outcome), which is an exact divergence between two coarse-grained distributions: ≥ 0, 0 for
# identical inputs, never larger than the full-vocabulary divergence (data-processing inequality, which holds for
# every f-divergence: KL, JSD, TV), and equal to it when k = V.

def bucket_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the k ids and of the tail (every other id) under ``softmax(logits / temperature)``.

    Args:
        logits: (..., V) any float dtype; computed in float32. -inf entries (vocabulary padding) have probability 0.
        ids: (..., k) int, distinct per position, 0 <= id < V.
        temperature: > 0.

    Returns:
        (..., k+1) float32: ``[log p(ids_0), ..., log p(ids_{k-1}), log(1 − Σ_j p(ids_j))]``, clamped at
        ``LOG_FLOOR``. The tail is a log-sum-exp over the ids outside the k (the k are replaced by a value
        ``LOG_FLOOR`` below the row's log-partition, whose exp is exactly 0 in float32), so a tail mass of 1e-30
        keeps its relative precision, unlike ``log1p(−Σ p_j)``; with k = V the tail is ``LOG_FLOOR`` (mass 0) and
        the gradient stays finite.
    """
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (..., 1)
    ids = ids.long()
    top = z.gather(-1, ids) - lse  # (..., k)
    in_top = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, ids, True)
    rest = torch.where(in_top, lse.detach() + LOG_FLOOR, z)  # no gradient reaches the k ids through the tail
    tail = torch.logsumexp(rest, dim=-1, keepdim=True) - lse
    return torch.cat([top, tail], dim=-1).clamp(min=LOG_FLOOR)


def topk_buckets(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """The cache entry of a target distribution: ``(top_log_probs (..., k) float32, ids (..., k) int64,
    log_tail (...,) float32)`` of ``softmax(logits / temperature)``, ids ordered by decreasing probability.

    Raises ValueError if k is not in [1, V].
    """
    vocab = logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"data.logit_cache_k={k} must be in [1, {vocab}] (the vocabulary size)")
    ids = torch.topk(logits, k, dim=-1).indices
    buckets = bucket_log_probs(logits, ids, temperature)
    return buckets[..., :k], ids, buckets[..., k]


def _normalize_log(x: torch.Tensor) -> torch.Tensor:
    """x − logsumexp(x) over the last dim: a stored cache entry (fp16 rounding) becomes an exact distribution."""
    return x - torch.logsumexp(x, dim=-1, keepdim=True)


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """log(β·p + (1−β)·q), exactly ``log_p`` where log_p == log_q (so JSD of identical inputs is exactly 0).

    Written around the larger of the two: log a + log1p(w·expm1(log b − log a)) with log b ≤ log a, whose expm1
    argument is ≤ 0, so nothing overflows and the log1p argument stays ≥ min(β, 1−β) − 1 > −1 for 0 < β < 1.
    """
    d = log_p - log_q
    from_p = log_p + torch.log1p((1.0 - beta) * torch.expm1(-d.clamp(min=0)))  # p ≥ q
    from_q = log_q + torch.log1p(beta * torch.expm1(d.clamp(max=0)))  # q > p
    return torch.where(d >= 0, from_p, from_q)


def bucket_divergence(name: str, log_q: torch.Tensor, log_p: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Per-position divergence of ``name`` between two normalized log-distributions (..., K) -> (...,).

    ``log_q`` is the draft, ``log_p`` the target; JSD(β) follows :func:`jsd` (β=0 FKL, β=1 RKL). Rounding below 0
    (distributions equal up to float32 error) is clamped to 0, so the result is never negative.
    """
    if name == "fkl" or (name == "jsd" and beta == 0.0):
        per = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif name == "rkl" or (name == "jsd" and beta == 1.0):
        per = (log_q.exp() * (log_q - log_p)).sum(-1)
    elif name == "jsd":
        log_m = _log_mixture(log_p, log_q, beta)
        per = beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1.0 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)
    elif name == "tvd":
        per = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    else:
        check_loss_name(name)
        raise ValueError(f"loss {name!r} has no cached (top-k + tail) form: the cached losses are fkl, rkl, jsd, "
                         "tvd (acceptance needs the full distribution at every position of its windows)")
    return per.clamp(min=0.0)


class FusedBucketLogProbs(torch.autograd.Function):
    """:func:`bucket_log_probs` of the draft's logits (the same forward) with a closed-form backward.

    ``forward(draft_logits (N, V), ids (N, k) int64, keep (N, 1) bool, temperature) -> (N, k+1)``: rows with
    ``keep`` False are zeroed first (as :func:`cached_divergence` does). With log q = log_softmax(z / T), the
    bucket log-probabilities b_j = log q_{ids_j} (j < k) and the tail b_k = log Σ_{i ∉ ids} q_i, and G = ∂L/∂b
    (zero where b sat at LOG_FLOOR, as autograd's clamp gives), the gradient is

        ∂L/∂z_i = (G_j − q_i·ΣG) / T                      for i = ids_j,
        ∂L/∂z_i = (G_k·exp(log q_i − b_k) − q_i·ΣG) / T    for every other i (q_i / Q_tail, at most 1).

    Only the logits, ids and the (N, k+1) output are kept; log q is recomputed block by block in the backward,
    so no (N, V) buffer outlives the forward. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, draft_logits, ids, keep, temperature):
        k = _block_keep(keep)
        z = draft_logits.float() if k is None else torch.where(k, draft_logits.float(), 0.0)
        b = bucket_log_probs(z, ids, temperature)
        ctx.save_for_backward(draft_logits, ids, keep, b)
        ctx.temperature = temperature
        return b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_b):
        logits, ids, keep, b = ctx.saved_tensors
        g = torch.where(b > LOG_FLOOR, grad_b, 0.0)
        g_sum, g_tail, k = g.sum(-1, keepdim=True), g[:, -1:], ids.shape[-1]
        out = torch.empty_like(logits)
        n, vocab = logits.shape
        rows = _block_rows(n, vocab, logits.device)
        for lo in range(0, n, rows):
            hi = lo + rows
            log_q = _log_probs(logits[lo:hi], _block_keep(keep[lo:hi]), ctx.temperature)
            q = log_q.exp()
            grad = (log_q - b[lo:hi, -1:]).clamp_(max=0.0).exp_().mul_(g_tail[lo:hi])  # tail entries
            grad.addcmul_(q, g_sum[lo:hi], value=-1.0)
            top = g[lo:hi, :k] - q.gather(-1, ids[lo:hi]) * g_sum[lo:hi]
            out[lo:hi] = grad.scatter_(-1, ids[lo:hi], top).div_(ctx.temperature)
        return out, None, None, None


def cached_divergence(name: str, draft_logits: torch.Tensor, target_log_probs: torch.Tensor, ids: torch.Tensor,
                      mask: torch.Tensor, n_tokens: int | float | torch.Tensor, beta: float = 0.5,
                      temperature: float = 1.0, fused: bool = False) -> torch.Tensor:
    """Divergence ``name`` between the draft and a cached top-k + tail target, Σ over masked positions / n_tokens.

    Args:
        name: fkl | rkl | jsd | tvd.
        draft_logits: (..., V) the draft's logits over the shared vocabulary (any float dtype; float32 inside).
        target_log_probs: (..., k+1) the target's cached bucket log-probabilities (:func:`topk_buckets`: the k
            top log-probs then the log tail mass; fp16 is fine: it is renormalized in float32).
        ids: (..., k) the cached ids (any int dtype).
        mask: (...,) 1 where the position enters the loss; elsewhere inputs may hold anything (NaN, -1 ids).
        n_tokens: token count of the whole accumulation window (see module docstring).
        beta: JSD β in [0, 1]; temperature: the one the cache was built at (its manifest says which).
        fused: differentiate the draft's bucket log-probabilities in closed form (:class:`FusedBucketLogProbs`;
            same value and gradient) instead of by autograd.

    Raises ValueError for mismatched shapes, an unknown name, β outside [0, 1] or temperature ≤ 0.
    Follows DistillSpec's divergences (module docstring) on the coarse-grained k+1-outcome distributions.
    """
    check_loss_name(name)
    k = ids.shape[-1]
    if target_log_probs.shape[-1] != k + 1 or target_log_probs.shape[:-1] != ids.shape[:-1]:
        raise ValueError(f"target_log_probs {tuple(target_log_probs.shape)} must be ids {tuple(ids.shape)} "
                         "with one more column (the tail bucket)")
    if draft_logits.shape[:-1] != ids.shape[:-1] or mask.shape != ids.shape[:-1]:
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)}, ids {tuple(ids.shape)} and mask "
                         f"{tuple(mask.shape)} must share the leading dims")
    _check_beta_temperature(beta, temperature)
    keep = mask.bool().unsqueeze(-1)
    # Masked positions get harmless stand-ins (zero logits, ids 0..k-1, uniform buckets) so garbage there cannot
    # reach the value or the gradient.
    safe_ids = torch.where(keep, ids.long(), torch.arange(k, device=ids.device))
    log_p = torch.where(keep, target_log_probs.float().clamp(min=LOG_FLOOR), 0.0)
    if fused:  # same forward, closed-form backward
        vocab = draft_logits.shape[-1]
        log_q = FusedBucketLogProbs.apply(draft_logits.reshape(-1, vocab), safe_ids.reshape(-1, k),
                                          keep.reshape(-1, 1), float(temperature)).view(*ids.shape[:-1], k + 1)
    else:
        log_q = bucket_log_probs(torch.where(keep, draft_logits.float(), 0.0), safe_ids, temperature)
    log_q = _normalize_log(log_q)
    log_p = _normalize_log(log_p).clamp(min=LOG_FLOOR)
    return _reduce(bucket_divergence(name, log_q, log_p, beta), mask, n_tokens)


def cached_distill_loss(name: str, draft_logits: torch.Tensor, target_log_probs: torch.Tensor, ids: torch.Tensor,
                        mask: torch.Tensor, n_tokens: int | float | torch.Tensor, labels: torch.Tensor | None = None,
                        beta: float = 0.5, temperature: float = 1.0, ce_weight: float = 0.0,
                        fused: bool = False, tail_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`distill_loss` with a cached target: ``(1 − ce_weight)·cached_divergence + ce_weight·CE``.

    Shapes as :func:`cached_divergence`; ``labels`` (...,) next tokens, required when ``ce_weight > 0``.
    ``tail_ids`` (..., s): ids sampled from the target's tail (a cache built with
    ``data.logit_cache_tail_samples=s``); the divergence is then :func:`sampled_tail_fkl` (``name`` must be fkl).
    Raises ValueError as :func:`distill_loss` does, and for ``tail_ids`` with another loss than fkl.
    """
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"loss.ce_weight must be in [0, 1], got {ce_weight}")
    if tail_ids is not None:
        if name != "fkl":
            raise ValueError(f"sampled tail ids give an unbiased gradient for loss=fkl only, not {name!r}")
        loss = sampled_tail_fkl(draft_logits, target_log_probs, ids, tail_ids, mask, n_tokens, temperature)
    else:
        loss = cached_divergence(name, draft_logits, target_log_probs, ids, mask, n_tokens, beta=beta,
                                 temperature=temperature, fused=fused)
    if ce_weight > 0:
        if labels is None:
            raise ValueError("loss.ce_weight > 0 needs labels (the next tokens)")
        if labels.shape != draft_logits.shape[:-1]:
            raise ValueError(f"labels {tuple(labels.shape)} must match draft_logits without the vocab dim")
        ce = cross_entropy(draft_logits.reshape(1, -1, draft_logits.shape[-1]), labels.reshape(1, -1),
                           mask.reshape(1, -1), n_tokens)
        loss = (1.0 - ce_weight) * loss + ce_weight * ce
    return loss


def sampled_tail_target(target_log_probs: torch.Tensor, ids: torch.Tensor,
                        tail_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse target p' from a cached top-k + tail entry and s ids sampled from the target's tail.

    p' keeps the k cached probabilities exactly and splits the tail mass P_tail over the s samples (each P_tail / s;
    an id drawn c times gets c·P_tail / s on its first occurrence and 0 on the others). p' is a distribution and
    E[p'] = p over the draws, so the forward KL's gradient against p', (q − p')/T, is unbiased for the full
    vocabulary's (q − p)/T: the tail's spread over ids is trained, not only its total (the k + 1 buckets constrain
    the total alone). This is the top-k part of Anshumann et al. (2025), "Sparse Logit Sampling: Accelerating
    Knowledge Distillation in LLMs", whose random-sampling KD samples the whole distribution the same way.

    Args:
        target_log_probs: (..., k+1) cached bucket log-probs (fp16-valued; renormalized here).
        ids: (..., k) cached ids; tail_ids: (..., s) ids drawn with replacement from the tail (outside ``ids``).

    Returns:
        ``(log_w (..., k+s) float32, support (..., k+s) int64)``: log p' (``LOG_FLOOR`` for weight 0) and its ids.
    """
    k, s = ids.shape[-1], tail_ids.shape[-1]
    if target_log_probs.shape[-1] != k + 1 or tail_ids.shape[:-1] != ids.shape[:-1] or s < 1:
        raise ValueError(f"target_log_probs {tuple(target_log_probs.shape)}, ids {tuple(ids.shape)} and tail_ids "
                         f"{tuple(tail_ids.shape)}: need k+1 bucket columns, k ids and s >= 1 tail ids per position")
    log_p = _normalize_log(target_log_probs.float().clamp(min=LOG_FLOOR))
    tail_ids = tail_ids.long()
    count, first = _draw_counts(tail_ids)
    log_tail = (log_p[..., k:] + torch.log(count / s)).masked_fill(~first, LOG_FLOOR).clamp(min=LOG_FLOOR)
    return torch.cat([log_p[..., :k], log_tail], dim=-1), torch.cat([ids.long(), tail_ids], dim=-1)


def _draw_counts(draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ids drawn with replacement, (..., s) int64: how often each draw's id was drawn in its row (float32)
    and whether the draw is its id's first occurrence (bool). O(s log s) per row by a stable sort: the first of a
    run of equal sorted ids is the earliest draw (a pairwise (..., s, s) comparison took 25x longer at s = 128)."""
    ordered, order = draws.sort(dim=-1, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    run = starts.cumsum(-1) - 1  # index of each sorted draw's run of equal ids
    per_run = torch.zeros(ordered.shape, dtype=torch.float32, device=draws.device).scatter_add_(
        -1, run, torch.ones(ordered.shape, dtype=torch.float32, device=draws.device))
    count = torch.empty_like(per_run).scatter_(-1, order, per_run.gather(-1, run))
    first = torch.empty_like(starts).scatter_(-1, order, starts)
    return count, first


def _sampled_tail_inputs(draft_logits, target_log_probs, ids, tail_ids, mask, temperature):
    """Checks shared by the sampled-tail losses; ``(keep (..., 1) bool, log p' (..., k+s), support (..., k+s))``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if draft_logits.shape[:-1] != ids.shape[:-1] or mask.shape != ids.shape[:-1]:
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)}, ids {tuple(ids.shape)} and mask "
                         f"{tuple(mask.shape)} must share the leading dims")
    keep = mask.bool().unsqueeze(-1)
    log_w, support = sampled_tail_target(torch.where(keep, target_log_probs.float(), 0.0), ids, tail_ids)
    return keep, log_w, support


def sampled_tail_fkl(draft_logits: torch.Tensor, target_log_probs: torch.Tensor, ids: torch.Tensor,
                     tail_ids: torch.Tensor, mask: torch.Tensor, n_tokens: int | float | torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(p'‖q) against :func:`sampled_tail_target`'s sparse p', Σ over masked positions / n_tokens.

    KL(p'‖q) = Σ_j p'_j (log p'_j − log q_j) over p''s support: an exact KL between two distributions (>= 0,
    0 when q = p'), whose gradient is unbiased for the full-vocabulary FKL's (not its value: E KL(p'‖q) adds the
    sampling entropy of p'). Shapes: draft_logits (..., V), target_log_probs (..., k+1), ids (..., k),
    tail_ids (..., s), mask (...,). Raises ValueError for mismatched shapes or temperature <= 0.
    """
    keep, log_w, support = _sampled_tail_inputs(draft_logits, target_log_probs, ids, tail_ids, mask, temperature)
    n = support.shape[-1]
    support = torch.where(keep, support, torch.arange(n, device=support.device) % draft_logits.shape[-1])
    log_q = _log_probs(draft_logits, keep, temperature).gather(-1, support)
    per = (log_w.exp() * (log_w - log_q)).sum(-1).clamp(min=0.0)
    return _reduce(per, mask, n_tokens)


# ------------------------------------------------------------------------------------------------ pruned drafts
# A vocabulary-pruned draft (decode/vocab_map.py) has N logits over the target ids of its map and q = 0 on every
# other id. Its divergence from the target is computed on N + 1 buckets: the N kept ids and one tail bucket with the
# rest of the target's mass, where the draft's probability is exactly 0. Because q is 0 on every tail id, the
# bucketed TVD, RKL and JSD are *exactly* the full-vocabulary divergences between p and the pruned draft's q (the
# tail ids contribute p_tail to TVD, 0 to RKL, β·p_tail·log(1/β) to JSD, whether split or pooled). FKL would be
# infinite (p > 0 where q = 0), so it is defined against the target renormalised over the kept ids (see
# :func:`support_divergence`). With N = V the tail is empty and every loss equals its full-vocabulary form.

def support_divergence(name: str, log_q: torch.Tensor, log_p: torch.Tensor, support: torch.Tensor,
                       beta: float = 0.5) -> torch.Tensor:
    """Per-position divergence ``(...,)`` between a target ``log_p`` (..., K) and a draft that puts probability only
    on the ``support`` (..., K) bool buckets (``log_q`` there; its entries elsewhere are ignored: q = 0).

    - ``tvd``: ½ Σ |p − q| with q = 0 off the support: the target's off-support mass counts in full, exactly the
      rejection probability of speculative sampling with the pruned draft (Leviathan et al. 2023, Thm 3.5). Its
      minimum over q is ½·(p_off + Σ_support |p − q|) ≥ p_off, reached at q ≥ p on the support (e.g. q = p
      renormalised).
    - ``rkl``: Σ_support q log(q/p), exact (0·log 0 = 0 off the support); its minimum −log(1 − p_off) is reached at
      q = p renormalised over the support.
    - ``jsd`` (0 < β < 1): exact, with m = β·p off the support.
    - ``fkl`` (and ``jsd`` with β = 0): KL(p̃‖q) with p̃ = p renormalised over the support. The full FKL is +∞ for
      any pruned draft (p > 0 where q = 0), so it could not rank drafts; KL(p̃‖q) is finite, 0 exactly at
      q = p̃, and has the same minimiser as RKL and the same gradient direction as the full FKL restricted to
      the kept ids (∇ = −(p̃ − q)). The alternative, an extra trained "other" logit, would put draft mass on a
      bucket the decoder cannot propose, so training and decoding would disagree.

    Rounding below 0 is clamped to 0. Off-support entries of ``log_q`` are replaced before any arithmetic, so no
    0·(−∞) reaches the value or the gradient.
    """
    support = support.bool()
    log_q = torch.where(support, log_q, 0.0)
    q = torch.where(support, log_q.exp(), 0.0)
    p = log_p.exp()
    if name == "tvd":
        per = 0.5 * (p - q).abs().sum(-1)
    elif name == "fkl" or (name == "jsd" and beta == 0.0):
        masked = torch.where(support, log_p, float("-inf"))
        log_pt = torch.where(support, log_p - torch.logsumexp(masked, dim=-1, keepdim=True), 0.0)
        per = torch.where(support, log_pt.exp() * (log_pt - log_q), 0.0).sum(-1)
    elif name == "rkl" or (name == "jsd" and beta == 1.0):
        per = torch.where(support, q * (log_q - log_p), 0.0).sum(-1)
    elif name == "jsd":
        log_m = torch.where(support, _log_mixture(log_p, log_q, beta), math.log(beta) + log_p)
        per = beta * (p * (log_p - log_m)).sum(-1) + (1.0 - beta) * torch.where(support, q * (log_q - log_m),
                                                                                  0.0).sum(-1)
    else:
        check_loss_name(name)
        raise ValueError(f"loss {name!r} has no pruned-vocabulary bucket form (acceptance uses the V-wide row)")
    return per.clamp(min=0.0)


def pruned_divergence(name: str, draft_logits: torch.Tensor, target_logits: torch.Tensor, vocab_map: torch.Tensor,
                      mask: torch.Tensor, n_tokens: int | float | torch.Tensor, beta: float = 0.5,
                      temperature: float = 1.0) -> torch.Tensor:
    """Divergence ``name`` between a pruned draft and the target, Σ over masked positions / n_tokens.

    Args:
        name: fkl | rkl | jsd | tvd (see :func:`support_divergence` for each one's definition on the pruned support).
        draft_logits: ``(..., N)`` the pruned draft's logits; column i scores target id ``vocab_map[i]``.
        target_logits: ``(..., V)`` the target's logits over the shared vocabulary.
        vocab_map: ``(N,)`` int64, sorted unique target ids.
        mask, n_tokens: as the other losses; beta: JSD β in [0, 1]; temperature: > 0, applied to both.

    Raises ValueError for mismatched shapes, β outside [0, 1] or temperature ≤ 0.
    """
    if draft_logits.shape[-1] != vocab_map.shape[0] or draft_logits.shape[:-1] != target_logits.shape[:-1] \
            or mask.shape != draft_logits.shape[:-1]:
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)} must be (..., N={vocab_map.shape[0]}) with the "
                         f"leading dims of target_logits {tuple(target_logits.shape)} and mask {tuple(mask.shape)}")
    _check_beta_temperature(beta, temperature)
    keep = mask.bool().unsqueeze(-1)
    vocab_map = vocab_map.to(target_logits.device)
    t = torch.where(keep, target_logits.float(), 0.0)
    # The draft goes through the same bucketing as the target (its row is -inf off the map), so a draft equal to
    # the target on the kept ids gives bit-identical bucket log-probs.
    d = scatter_to_vocab(torch.where(keep, draft_logits.float(), 0.0), vocab_map, t.shape[-1])
    ids = vocab_map.expand(*t.shape[:-1], -1)
    log_p = _normalize_log(bucket_log_probs(t, ids, temperature)).clamp(min=LOG_FLOOR)  # (..., N + 1)
    log_q = _normalize_log(bucket_log_probs(d, ids, temperature))
    support = torch.ones_like(log_p, dtype=torch.bool)
    support[..., -1] = False  # the tail: q = 0
    return _reduce(support_divergence(name, log_q, log_p, support, beta), mask, n_tokens)


def pruned_cross_entropy(draft_logits: torch.Tensor, labels: torch.Tensor, vocab_map: torch.Tensor,
                         mask: torch.Tensor, n_tokens: int | float | torch.Tensor) -> torch.Tensor:
    """Token-level CE of a pruned draft on target-id ``labels`` (B, T), summed / n_tokens. A label outside the map
    has no draft logit (its CE would be +∞) and contributes 0; ``n_tokens`` still counts it."""
    vocab_map = vocab_map.to(labels.device)
    pos = torch.searchsorted(vocab_map, labels).clamp(max=vocab_map.numel() - 1)
    kept = mask.bool() & (vocab_map[pos] == labels)
    return cross_entropy(draft_logits, pos, kept, n_tokens)


def pruned_distill_loss(name: str, draft_logits: torch.Tensor, target_logits: torch.Tensor, vocab_map: torch.Tensor,
                        mask: torch.Tensor, n_tokens: int | float | torch.Tensor, labels: torch.Tensor | None = None,
                        beta: float = 0.5, temperature: float = 1.0, ce_weight: float = 0.0,
                        gamma: int = 4) -> torch.Tensor:
    """:func:`distill_loss` for a pruned draft with ``(B, T, N)`` logits over ``vocab_map`` (N,) and a ``(B, T, V)``
    target: ``(1 − ce_weight)·divergence + ce_weight·CE``.

    fkl/rkl/jsd/tvd use :func:`pruned_divergence`. ``acceptance`` places the draft's logits into a V-wide row of
    −inf (q = 0 off the map, as the decoder does) and uses :func:`acceptance`, which is built from 1 − TVD and so
    is exact with q = 0. CE uses :func:`pruned_cross_entropy`.

    Raises ValueError as :func:`distill_loss` does.
    """
    check_loss_name(name)
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"loss.ce_weight must be in [0, 1], got {ce_weight}")
    vocab_map = vocab_map.to(draft_logits.device)
    if name == "acceptance":
        full = scatter_to_vocab(draft_logits.float(), vocab_map, target_logits.shape[-1])
        loss = acceptance(full, target_logits, mask, n_tokens, gamma=gamma, temperature=temperature)
    else:
        loss = pruned_divergence(name, draft_logits, target_logits, vocab_map, mask, n_tokens, beta, temperature)
    if ce_weight > 0:
        if labels is None:
            raise ValueError("loss.ce_weight > 0 needs labels (the next tokens)")
        loss = (1.0 - ce_weight) * loss + ce_weight * pruned_cross_entropy(draft_logits, labels, vocab_map, mask,
                                                                           n_tokens)
    return loss


def pruned_cached_distill_loss(name: str, draft_logits: torch.Tensor, target_log_probs: torch.Tensor,
                               ids: torch.Tensor, vocab_map: torch.Tensor, vocab_size: int, mask: torch.Tensor,
                               n_tokens: int | float | torch.Tensor, labels: torch.Tensor | None = None,
                               beta: float = 0.5, temperature: float = 1.0, ce_weight: float = 0.0,
                               tail_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`cached_distill_loss` for a pruned draft: ``draft_logits`` (..., N) over ``vocab_map``, a cached
    top-k + tail target ``target_log_probs`` (..., k+1) / ``ids`` (..., k) over ``vocab_size`` ids.

    The buckets are the cache's: the k ids and its tail. The draft's probability is exactly 0 on cached ids outside
    its map (those buckets are off its support, :func:`support_divergence`), and its tail bucket holds its mass on
    kept ids outside the top-k. With ``tail_ids`` (..., s) the divergence is :func:`pruned_sampled_tail_fkl`
    instead (``name`` must be fkl). Raises ValueError as :func:`cached_distill_loss` does.
    """
    check_loss_name(name)
    k = ids.shape[-1]
    if target_log_probs.shape[-1] != k + 1 or target_log_probs.shape[:-1] != ids.shape[:-1] \
            or draft_logits.shape[:-1] != ids.shape[:-1] or mask.shape != ids.shape[:-1]:
        raise ValueError(f"target_log_probs {tuple(target_log_probs.shape)}, ids {tuple(ids.shape)}, draft_logits "
                         f"{tuple(draft_logits.shape)} and mask {tuple(mask.shape)} must share the leading dims "
                         "(target_log_probs with one more column than ids)")
    if not 0.0 <= beta <= 1.0 or not temperature > 0 or not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"need beta in [0, 1] (got {beta}), temperature > 0 (got {temperature}), ce_weight in "
                         f"[0, 1] (got {ce_weight})")
    vocab_map = vocab_map.to(draft_logits.device)
    keep = mask.bool().unsqueeze(-1)
    d = scatter_to_vocab(torch.where(keep, draft_logits.float(), 0.0), vocab_map, vocab_size)
    if tail_ids is not None:
        if name != "fkl":
            raise ValueError(f"sampled tail ids give an unbiased gradient for loss=fkl only, not {name!r}")
        loss = pruned_sampled_tail_fkl(d, target_log_probs, ids, tail_ids, vocab_map, mask, n_tokens, temperature)
    else:
        safe_ids = torch.where(keep, ids.long(), torch.arange(k, device=ids.device))
        log_p = _normalize_log(torch.where(keep, target_log_probs.float().clamp(min=LOG_FLOOR), 0.0)).clamp(
            min=LOG_FLOOR)
        log_q = _normalize_log(bucket_log_probs(d, safe_ids, temperature))
        support = torch.cat([torch.isin(safe_ids, vocab_map), torch.ones_like(safe_ids[..., :1], dtype=torch.bool)],
                            -1)
        loss = _reduce(support_divergence(name, log_q, log_p, support, beta), mask, n_tokens)
    if ce_weight > 0:
        if labels is None:
            raise ValueError("loss.ce_weight > 0 needs labels (the next tokens)")
        ce = pruned_cross_entropy(draft_logits.reshape(1, -1, draft_logits.shape[-1]), labels.reshape(1, -1),
                                  vocab_map, mask.reshape(1, -1), n_tokens)
        loss = (1.0 - ce_weight) * loss + ce_weight * ce
    return loss


def pruned_sampled_tail_fkl(draft_logits: torch.Tensor, target_log_probs: torch.Tensor, ids: torch.Tensor,
                            tail_ids: torch.Tensor, vocab_map: torch.Tensor, mask: torch.Tensor,
                            n_tokens: int | float | torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """:func:`sampled_tail_fkl` for a pruned draft, Σ over masked positions / n_tokens.

    ``draft_logits`` (..., V) is the pruned draft's row over the target's ids (-inf off ``vocab_map``, as
    :func:`decode.vocab_map.scatter_to_vocab` makes it). The sparse target p' of :func:`sampled_tail_target` is cut
    to the kept ids, w = p'·[id ∈ map] with mass W = Σw, and the loss is W·KL(w/W ‖ q) = Σ w (log w − log q) −
    W log W: exact (>= 0, 0 at q = w/W, 0 where the map holds none of p'), with gradient W·q − w, an unbiased
    estimate of P_kept·q − p_kept = P_kept·∇KL(p̃‖q), the pruned FKL of :func:`support_divergence` (p̃ = p
    renormalized over the kept ids) weighted by the mass the map keeps at that position.
    Shapes: target_log_probs (..., k+1), ids (..., k), tail_ids (..., s), mask (...,). Raises ValueError for
    temperature <= 0 or mismatched shapes.
    """
    keep, log_w, support = _sampled_tail_inputs(draft_logits, target_log_probs, ids, tail_ids, mask, temperature)
    support = torch.where(keep, support, vocab_map[0].to(support.device))  # masked rows: any kept id
    kept = torch.isin(support, vocab_map.to(support.device)) & (log_w > LOG_FLOOR)
    w = torch.where(kept, log_w.exp(), 0.0)
    mass = w.sum(-1)
    log_q = _log_probs(draft_logits, keep, temperature).gather(-1, support)
    terms = torch.where(kept, w * (log_w - log_q), 0.0).sum(-1)
    per = (terms - torch.where(mass > 0, mass * mass.clamp(min=1e-30).log(), 0.0)).clamp(min=0.0)
    return _reduce(per, mask, n_tokens)
