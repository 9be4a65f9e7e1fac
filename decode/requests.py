"""Requests of the engine's step API: what a caller adds (:class:`Request`) and what a finished one returns
(:class:`RequestOutput`)."""
from __future__ import annotations

import numbers
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from decode.metrics import DecodeStats
from decode.sampling import MAX_SEED, SamplingParams
from decode.speedup import AlphaEstimate


@dataclass
class RequestOutput:
    """A finished request.

    ``prompt_ids`` and ``new_tokens`` are token-id lists; ``finish_reason`` is ``"stop"`` (an eos id was produced;
    it is the last of ``new_tokens``) or ``"length"`` (``max_new_tokens`` or the target's context was reached);
    ``stats`` are this request's alone.
    """

    request_id: Any
    prompt_ids: list[int]
    new_tokens: list[int]
    finish_reason: str
    stats: DecodeStats


@dataclass(eq=False)
class Request:
    """Engine-side state of one request (internal; created by ``SpeculativeDecoder.add_request``).

    ``generator`` is a CPU ``torch.Generator`` seeded from ``seed``: it supplies every uniform this request uses
    (draft draws, acceptance tests, residual draws), so its output does not depend on the other rows.
    """

    request_id: Any
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    eos: frozenset
    generator: torch.Generator
    on_tokens: Callable[[Any, list[int]], Any] | None = None
    new_tokens: list[int] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=lambda: DecodeStats(num_sequences=1))
    added_at: float = field(default_factory=time.perf_counter)
    aborted: bool = False  # set by SpeculativeDecoder.abort (its on_tokens is not called after that)
    acceptance: AlphaEstimate = field(default_factory=AlphaEstimate)  # this row's acceptance counts (auto γ, static batch)
    lookup: Any = None  # decode.lookup.NgramLookup of prompt + committed tokens (prompt lookup), made at first use

    def output(self, finish_reason: str) -> RequestOutput:
        self.stats.num_new_tokens = len(self.new_tokens)
        self.stats.total_s = time.perf_counter() - self.added_at
        return RequestOutput(self.request_id, list(self.prompt), list(self.new_tokens), finish_reason, self.stats)


def check_seed(seed: Any, name: str = "seed", none_ok: bool = True) -> int:
    """Validate a seed; ``None`` (when ``none_ok``) draws one from torch's global generator (so
    ``torch.manual_seed`` fixes it). Raises ``ValueError`` naming ``name`` (the argument, or a CLI's ``--seed``)
    unless it is an int in [0, 2**63 - 1]."""
    if seed is None and none_ok:
        return int(torch.randint(0, MAX_SEED, (1,)).item())
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be in [0, 2**63 - 1] (an integer{' or None' if none_ok else ''}), "
                         f"got {seed!r}")
    return seed


def check_max_new_tokens(max_new_tokens: Any) -> int:
    """An integer >= 1 (a NumPy integer too) as an ``int``; ``ValueError`` naming ``max_new_tokens`` otherwise."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return int(max_new_tokens)


def check_eos(eos_token_id: Any) -> frozenset:
    """``int | list[int] | None`` (numpy ints and 0-d/1-D integer tensors too) -> a set of stop ids; ``ValueError``
    naming ``eos_token_id`` otherwise (floats, strings, bools)."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):  # a 0-d or 1-D tensor of ids
        eos_token_id = eos_token_id.tolist() if eos_token_id.dim() <= 1 else eos_token_id
    ids = [eos_token_id] if isinstance(eos_token_id, int) or not hasattr(eos_token_id, "__iter__") else eos_token_id
    try:
        if isinstance(ids, (str, bytes)) or any(isinstance(i, bool) for i in ids):
            raise TypeError
        return frozenset(operator.index(i) for i in ids)  # ints (numpy ints too), not floats or strings
    except TypeError:
        raise ValueError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}") from None
