"""One logits-processing path for target and draft, and sampling from explicit uniforms or a generator.

Speculative decoding is lossless only if the draft's q and the target's p come from the same processing
(penalties, temperature, top-k, top-p, min-p) applied to the same prefix (Leviathan et al. 2023, Sec. 3; Chen et
al. 2023). Both models go through :func:`probs_from_logits`; :func:`logits_to_probs` is its one-setting form.

Order of processing, as vLLM's sampler: repetition penalty (Keskar et al. 2019, Hugging Face's
``RepetitionPenaltyLogitsProcessor`` rule: positive logits divided, negative ones multiplied, over prompt and
generated ids), frequency and presence penalties (OpenAI's rule, over generated ids), then temperature, top-k,
top-p, and min-p (Nguyen et al. 2024: drop ids whose probability is below ``min_p`` × the largest one).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

MAX_SEED = 2**63 - 1
TINY = 1e-30  # smallest temperature / repetition penalty used as such (float32's normal range starts at 1.2e-38)


class NonFiniteLogitsError(RuntimeError):
    """A model's logits were not finite (NaN or inf) during decoding, so no token could be drawn from them."""


# The message of NonFiniteLogitsError: inverse-CDF sampling of NaN probabilities draws the id V, which the step
# detects (the step's requests stay in flight until aborted).
NON_FINITE = ("a model's logits were not finite (NaN or inf) during this step, so the sampled id fell outside the "
              "vocabulary: float16 overflow, NaN weights, or a model/attention implementation that returns NaN for "
              "padded rows in this dtype. Run the models in float32 or bfloat16, check the weights "
              "(torch.isfinite), or try attn_implementation='sdpa'/'eager'")


def _finite(x) -> bool:
    """A finite real number: Python and NumPy ints and floats (``numbers.Real``), not bools, strings or tensors;
    not an int beyond float's range (~1.8e308: it could not be compared as one)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def validate_sampling_args(temperature: float, top_k: int | None = None, top_p: float | None = None,
                           min_p: float | None = None, presence_penalty: float = 0.0,
                           frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                           names: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` naming the bad argument and its accepted range.

    temperature finite and >= 0 (0 means greedy); top_k None or an integer >= 1; top_p None or in (0, 1];
    min_p None or in [0, 1]; presence_penalty and frequency_penalty in [-2, 2] (OpenAI's range);
    repetition_penalty finite and > 0 (1 = none). ``names``: what the messages call an argument (a command line
    passes its flags, ``{"top_p": "--top-p"}``); the others keep their own names.
    """
    n = lambda name: (names or {}).get(name, name)  # noqa: E731
    if temperature is None or not _finite(temperature) or temperature < 0:
        raise ValueError(f"{n('temperature')} must be a finite number >= 0 (0 means greedy), got "
                         f"{temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not _finite(top_k) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"{n('top_k')} must be an integer >= 1 (None: off), got {top_k!r}")
    if top_p is not None and not (_finite(top_p) and 0.0 < float(top_p) <= 1.0):
        raise ValueError(f"{n('top_p')} must be in (0, 1] (None: off), got {top_p!r}")
    if min_p is not None and not (_finite(min_p) and 0.0 <= float(min_p) <= 1.0):
        raise ValueError(f"{n('min_p')} must be in [0, 1] (None: off), got {min_p!r}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (_finite(value) and -2.0 <= float(value) <= 2.0):
            raise ValueError(f"{n(name)} must be a number in [-2, 2] (0 = none), got {value!r}")
    if not (_finite(repetition_penalty) and float(repetition_penalty) > 0):
        raise ValueError(f"{n('repetition_penalty')} must be a finite number > 0 (1 = none), "
                         f"got {repetition_penalty!r}")


@dataclass(frozen=True)
class SamplingParams:
    """The sampling settings of one request (validated on construction; see :func:`validate_sampling_args`)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        validate_sampling_args(self.temperature, self.top_k, self.top_p, self.min_p, self.presence_penalty,
                               self.frequency_penalty, self.repetition_penalty)
        if self.top_k is not None:  # a whole-number float (2.0) is the integer it names
            object.__setattr__(self, "top_k", int(self.top_k))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:  # a NumPy scalar is kept as the Python float it equals
                object.__setattr__(self, name, float(value))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """True if the request's distribution depends on token counts (any penalty set)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class BatchSampling:
    """Per-row sampling settings of a batch as tensors shaped ``(B, 1, 1)`` (broadcast over positions and ids).

    A setting no row uses is ``None``, so its work is skipped; ``all_greedy`` lets callers take argmaxes.
    """

    def __init__(self, params: Sequence[SamplingParams], device=None, dims: int = 3):
        shape = (len(params),) + (1,) * (dims - 1)

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype).view(shape).to(device)

        self.params = list(params)
        self.all_greedy = all(p.greedy for p in params)
        self.any_greedy = any(p.greedy for p in params)
        self.greedy = col([p.greedy for p in params], torch.bool) if self.any_greedy else None
        # Extreme values saturate instead of overflowing float32 / int64: a temperature or repetition penalty
        # outside [1e-30, 1e30] acts like its bound (a tiny temperature keeps the row's top ids only, see
        # probs_from_logits), and a top_k beyond 2^31 - 1 (more than any vocabulary) keeps every id, as it would.
        self.temperature = col([min(max(p.temperature, TINY), 1 / TINY) if not p.greedy else 1.0 for p in params])
        # Rows that divide by T < 1 (their logits can overflow: see probs_from_logits); None when no row does.
        cool = [not p.greedy and p.temperature < 1 for p in params]
        self.cool = col(cool, torch.bool) if any(cool) and not all(cool) else None
        self.any_cool, self.all_cool = any(cool), all(cool)
        self.unit_temperature = all(p.greedy or p.temperature == 1 for p in params)  # dividing changes nothing
        ks = [min(p.top_k, 2**31 - 1) for p in params if p.top_k is not None]
        self.top_k_max, self.top_k_min = (max(ks), min(ks)) if ks else (None, None)
        self.top_k = col([min(p.top_k or 1, 2**31 - 1) - 1 for p in params], torch.long) if ks else None  # k-th
        self.has_top_k = col([p.top_k is not None for p in params], torch.bool) if ks else None
        use = lambda name, none: any(getattr(p, name) not in (None, none) for p in params)  # noqa: E731
        self.top_p = col([p.top_p if p.top_p is not None else 1.0 for p in params]) if use("top_p", 1.0) else None
        self.min_p = col([p.min_p or 0.0 for p in params]) if use("min_p", 0.0) else None
        self.penalized = any(p.penalized for p in params)
        if self.penalized:
            self.presence = col([p.presence_penalty for p in params])
            self.frequency = col([p.frequency_penalty for p in params])
            self.repetition = col([min(max(p.repetition_penalty, TINY), 1 / TINY) for p in params])


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, presence, frequency,
                    repetition) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM's semantics).

    Args:
        logits: ``(..., V)`` float32.
        counts: ``(..., V)`` how often each id was *generated* in the prefix (prompt excluded).
        seen: ``(..., V)`` bool, the id occurs in the prompt or was generated.
        presence, frequency, repetition: floats or tensors broadcastable to ``logits[..., :1]``.
    """
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    return logits - frequency * counts - presence * (counts > 0).float()


def _fit_vocab(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    if vocab_size is None:
        return logits
    v_model = logits.shape[-1]
    if v_model > vocab_size:
        return logits[..., :vocab_size]
    if v_model < vocab_size:
        pad = logits.new_full((*logits.shape[:-1], vocab_size - v_model), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def probs_from_logits(logits: torch.Tensor, sampling: BatchSampling, vocab_size: int | None = None,
                      counts: torch.Tensor | None = None, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The sampling distribution of every row and position, in float32: the engine's one path for p and q.

    Args:
        logits: ``(B, K, V_model)`` raw logits of K positions per row.
        sampling: the rows' settings (:class:`BatchSampling` built with ``dims=3``).
        vocab_size: the shared vocabulary size V. Columns ``>= V`` (lm_head padding rows) get probability 0; if
            ``V > V_model`` the missing ids are appended with probability 0 (a draft that covers fewer ids).
        counts, seen: ``(B, K, V)`` token counts of each position's prefix (see :func:`apply_penalties`); needed
            when ``sampling.penalized``.

    Returns:
        ``(B, K, V)`` probabilities summing to 1 over the last dim; one-hot on the (penalised) argmax for
        greedy rows.
    """
    logits = _fit_vocab(logits.float(), vocab_size)
    if sampling.penalized:
        logits = apply_penalties(logits, counts, seen, sampling.presence, sampling.frequency, sampling.repetition)
    if sampling.all_greedy:
        return _one_hot_argmax(logits)
    greedy = _one_hot_argmax(logits) if sampling.any_greedy else None
    if sampling.any_cool:
        # Rows with T < 1 are shifted by their max before dividing: softmax is unchanged, and a tiny temperature
        # sends every other id to -inf (probability 0) instead of overflowing to +inf (inf - inf = NaN); the top
        # ids keep 0. Dividing by T >= 1 cannot overflow, so those rows skip the shift (a quarter of a T = 1 draft
        # step's sampling work), in a batch as alone (a row's result never depends on its neighbours).
        top = logits.amax(-1, keepdim=True).clamp(min=torch.finfo(logits.dtype).min)
        shifted = (logits - top) / sampling.temperature
        logits = shifted if sampling.all_cool else torch.where(sampling.cool, shifted, logits / sampling.temperature)
    elif not sampling.unit_temperature:
        logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k_min < logits.shape[-1]:  # some row keeps fewer than all ids
        k = min(sampling.top_k_max, logits.shape[-1])  # a row's k >= V keeps every id: its k-th is the smallest
        kth = torch.topk(logits, k, dim=-1).values
        kth = kth.gather(-1, sampling.top_k.clamp(max=k - 1).expand(*logits.shape[:-1], 1))
        logits = logits.masked_fill((logits < kth) & sampling.has_top_k, float("-inf"))
    if sampling.top_p is not None:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop an id when the mass *before* it already reaches top_p; the top id always survives.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        drop_sorted[..., 0] = False  # also when top_p rounds to 0 in float32 (top_p=1e-46)
        # a row without top_p (1.0 here) keeps every id, also where its cumulative sum rounds to 1 before the end
        drop_sorted &= sampling.top_p < 1.0
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if sampling.min_p is not None:
        keep = probs >= sampling.min_p * probs.amax(-1, keepdim=True)
        cut = probs * keep
        # a row without min_p (0 here) keeps its probabilities bit for bit (no renormalisation round-off)
        probs = torch.where(sampling.min_p > 0, cut / cut.sum(-1, keepdim=True), probs)
    if greedy is not None:
        probs = torch.where(sampling.greedy, greedy, probs)
    return probs


def greedy_ids(logits: torch.Tensor, sampling: BatchSampling, vocab_size: int | None = None,
               counts: torch.Tensor | None = None, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The argmax of :func:`probs_from_logits`' greedy one-hot, without building it: ``(B, K, V_model)`` ->
    ``(B, K)`` int64 (same vocabulary fit and penalties, so the same id, ties included)."""
    logits = _fit_vocab(logits.float(), vocab_size)
    if sampling.penalized:
        logits = apply_penalties(logits, counts, seen, sampling.presence, sampling.frequency, sampling.repetition)
    return logits.argmax(-1)


def next_token(logits: torch.Tensor, sampling: BatchSampling, vocab_size: int | None, counts: torch.Tensor | None,
               seen: torch.Tensor | None, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row ``(B,)`` from the logits of its last position ``(B, K, V_model)``: the argmax for greedy
    rows, else an inverse-CDF draw with uniforms ``u`` ``(B,)`` (unused when every row is greedy) from the
    processed probabilities, returned too ``(B, V)`` (None when every row is greedy). ``counts``/``seen``: the
    rows' ``(B, V)`` penalty counts, or None. The draft's guesses and the first token after a prefill are drawn
    here, as a plain decoding step draws its token."""
    args = (logits[:, -1:], sampling, vocab_size, counts[:, None] if counts is not None else None,
            seen[:, None] if seen is not None else None)
    if sampling.all_greedy:
        return greedy_ids(*args)[:, 0], None
    probs = probs_from_logits(*args)[:, 0]
    return sample(probs, u=u), probs


def logits_to_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    vocab_size: int | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """:func:`probs_from_logits` with one setting for every row: ``(..., V_model)`` -> ``(..., V)`` float32.

    temperature 0 gives a one-hot distribution on the argmax (greedy); top_k keeps the k most likely ids (ties at
    the k-th value are kept); top_p keeps the smallest set of most likely ids whose mass reaches top_p (nucleus
    sampling, Holtzman et al. 2020; the most likely id always stays); min_p drops ids below min_p × the largest
    probability. Penalties need token counts, so they are only available through :func:`probs_from_logits`.
    """
    params = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=top_p, min_p=min_p)
    shape = logits.shape
    flat = logits.reshape(-1, 1, shape[-1])
    sampling = BatchSampling([params], device=logits.device)
    out = probs_from_logits(flat, sampling, vocab_size)
    return out.reshape(*shape[:-1], out.shape[-1])


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one id per row from ``probs`` ``(..., V)`` by inverting its CDF; returns ``(...)`` int64.

    Args:
        probs: rows with a positive sum (they need not be normalised).
        generator: source of the uniforms when ``u`` is not given (same seed, same draws).
        u: ``(...)`` uniforms in [0, 1) to use instead; an id with probability 0 is never returned.
    """
    if u is None:
        u = torch.rand(probs.shape[:-1], generator=generator, device=probs.device
                       if generator is None else generator.device).to(probs.device)
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    # x < total also where u * total rounds up to it, so some id's cdf exceeds x; that id's cdf rose past the one
    # before it, so its probability is positive (no argmax fallback: one op less per draw)
    x = torch.minimum(u.to(cdf.dtype).unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)  # first id whose cdf exceeds x


def draw_uniforms(rows: Sequence, gammas: Sequence[int], gamma: int,
                  device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's uniforms: each sampled row draws 2γ_r + 1 from its own generator (``row.generator``): γ_r for its
    drafts, γ_r for the acceptance tests, one for the residual/bonus token. Greedy rows draw none (their choices are
    argmaxes), so a row's draws depend only on its own γ_r.

    Returns ``(draft_u (B, γ), accept_u (B, γ), sample_u (B,))`` on ``device``."""
    buf = torch.zeros(len(gammas), 2 * gamma + 1)
    for i, (row, g) in enumerate(zip(rows, gammas)):
        if not row.params.greedy:
            u = torch.rand(2 * g + 1, generator=row.generator)
            buf[i, :g], buf[i, gamma:gamma + g], buf[i, 2 * gamma] = u[:g], u[g:2 * g], u[2 * g]
    buf = buf.to(device, non_blocking=True)
    return buf[:, :gamma], buf[:, gamma:2 * gamma], buf[:, 2 * gamma]


def window_counts(counts: torch.Tensor | None, seen: torch.Tensor | None, drafts: torch.Tensor,
                  vocab_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Penalty counts ``(B, γ+1, V)`` of a verify window's γ+1 prefixes from the rows' ``(B, V)`` counts and the
    drafts ``(B, γ)``: position j includes d_1..d_j. ``(None, None)`` when no row has penalties."""
    if counts is None:
        return None, None
    added = torch.nn.functional.one_hot(drafts, vocab_size).float().cumsum(1)  # (B, γ, V)
    added = torch.cat([torch.zeros_like(added[:, :1]) if added.shape[1] else
                       counts.new_zeros(drafts.shape[0], 1, vocab_size), added], dim=1)
    return counts[:, None] + added, seen[:, None] | (added > 0)
