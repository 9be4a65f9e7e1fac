"""Requests of the engine's step API: what a caller adds (:class:`Request`), what a finished one returns
(:class:`RequestOutput`) and what ``generate()`` returns (:class:`GenerationOutput`)."""
from __future__ import annotations

import numbers
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from decode.metrics import DecodeStats
from decode.sampling import MAX_SEED, SamplingParams
from decode.speedup import AlphaEstimate


# generate()'s sampling keyword arguments beyond temperature, top_k and top_p
PENALTY_ARGS = frozenset({"min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"})


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


@dataclass
class GenerationOutput:
    """Result of :meth:`decode.engine.SpeculativeDecoder.generate`.

    ``sequences`` and ``new_tokens`` are lists (one per input row, in input order) of 1-D int64 CPU tensors:
    the prompt without padding followed by the new tokens, and the new tokens alone.
    """

    sequences: list[torch.Tensor]
    new_tokens: list[torch.Tensor]
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

    def trim(self, tokens: list[int], room: int) -> tuple[list[int], bool]:
        """A step's tokens cut to ``room`` (its budget and the target's context) and after its first stop id;
        returns (kept, stopped)."""
        tokens = tokens[:room]
        hit = next((j for j, t in enumerate(tokens) if t in self.eos), None)
        return (tokens[: hit + 1], True) if hit is not None else (tokens, False)

    def commit(self, tokens: list[int], gamma: int, num_accepted: int, draft_forwards: int, now: float) -> None:
        """Append a step's kept tokens and record the step in the request's stats (``gamma``: its γ_r,
        ``draft_forwards``: the draft forwards the step ran, ``now``: ``time.perf_counter()`` after it)."""
        if gamma > 0:
            self.stats.record_row_step(gamma, num_accepted, len(tokens))
        self.stats.num_target_forwards += 1
        self.stats.num_draft_forwards += min(gamma, draft_forwards)
        self.commit_prefill(tokens, now)

    def commit_prefill(self, tokens: list[int], now: float) -> None:
        """Append kept tokens that need no step: the token the target's prefill gives when the request joins
        (``now``: ``time.perf_counter()`` after it; the first tokens set the time to first token)."""
        if not self.new_tokens:
            self.stats.ttft_s = now - self.added_at
            self.stats.num_first_step_tokens = len(tokens)
        self.new_tokens.extend(tokens)

    def remaining(self, length: int, context_length: int | None) -> int:
        """Tokens it may still commit with ``length`` tokens (prompt + new) committed: its budget, and the target's
        context (None: no limit)."""
        left = self.max_new_tokens - len(self.new_tokens)
        return min(left, context_length - length) if context_length is not None else left

    def output(self, finish_reason: str) -> RequestOutput:
        self.stats.num_new_tokens = len(self.new_tokens)
        self.stats.total_s = time.perf_counter() - self.added_at
        return RequestOutput(self.request_id, list(self.prompt), list(self.new_tokens), finish_reason, self.stats)


class RequestIds:
    """Ids of the queued and active requests, and the counter behind the default ids ``"req-N"``."""

    def __init__(self) -> None:
        self.taken: set = set()
        self.next = 0

    def claim(self, request_id: Any) -> str | int:
        """``request_id`` (a str or int not in use), or the next free ``"req-N"`` for None, now in use; ValueError
        naming ``request_id`` otherwise."""
        if request_id is None:
            while f"req-{self.next}" in self.taken:
                self.next += 1
            request_id = f"req-{self.next}"
            self.next += 1
        elif isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            raise ValueError(f"request_id must be a str, an int or None, got {request_id!r}")
        elif request_id in self.taken:
            raise ValueError(f"request_id {request_id!r} is already queued or active")
        self.taken.add(request_id)
        return request_id

    def discard(self, request_id: Any) -> None:
        """``request_id`` is no longer queued or active."""
        self.taken.discard(request_id)


def row_gammas(gamma: int, rows: list[Request], committed: list[list[int]], context_length: int | None,
               draft_context_length: int | None) -> list[int]:
    """γ_r per row: ``gamma`` cut so that the row (``committed``: its prompt + new tokens) cannot overshoot its
    budget or either model's context."""
    out = []
    for row, seq in zip(rows, committed):
        g = min(gamma, row.remaining(len(seq), context_length) - 1)
        for ctx in (context_length, draft_context_length):
            if ctx is not None:  # the models see positions up to len - 1 + γ
                g = min(g, ctx - len(seq))
        out.append(max(g, 0))
    return out


def check_num_draft_tokens(gamma: Any, has_draft: bool) -> int | str:
    """γ: an int >= 0 (> 0 only with a draft model) or ``"auto"`` (with a draft model); ValueError otherwise."""
    if gamma == "auto":
        if not has_draft:
            raise ValueError("num_draft_tokens='auto' needs a draft model")
        return gamma
    if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 0:
        raise ValueError(f"num_draft_tokens must be an integer >= 0 or 'auto', got {gamma!r}")
    if gamma > 0 and not has_draft:
        raise ValueError(f"num_draft_tokens={gamma} needs a draft model; pass draft=... or use num_draft_tokens=0")
    return gamma


def generation_output(prompts: list[list[int]], outputs: list[RequestOutput], stats: DecodeStats) -> GenerationOutput:
    """``generate()``'s result from the finished requests, in input order."""
    new_tokens = [torch.tensor(o.new_tokens, dtype=torch.long) for o in outputs]
    sequences = [torch.tensor(p + o.new_tokens, dtype=torch.long) for p, o in zip(prompts, outputs)]
    return GenerationOutput(sequences=sequences, new_tokens=new_tokens, stats=stats)


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


def check_prompt(prompt_ids: Any, vocab_size: int, context_length: int | None, name: str = "prompt_ids") -> list[int]:
    """A prompt as a list of ints: 1-D, token ids in ``[0, vocab_size)``, at least one, and shorter than the
    target's ``context_length`` (None: no limit) so one new token fits. Raises ``ValueError`` naming ``name``."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    try:
        if isinstance(prompt_ids, (str, bytes)):
            raise TypeError
        prompt_ids = list(prompt_ids)
        if any(isinstance(t, bool) for t in prompt_ids):  # a mask passed as ids?
            raise TypeError
        prompt = [operator.index(t) for t in prompt_ids]  # ints only: a float or a string is not an id
    except TypeError:
        raise ValueError(f"{name} must be a sequence of integer token ids (tokenize text first), got "
                         f"{prompt_ids!r:.80}") from None
    if not prompt:
        raise ValueError(f"{name} has no tokens; give at least one (e.g. the tokenizer's bos token)")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if context_length is not None and len(prompt) >= context_length:
        raise ValueError(
            f"{name} has {len(prompt)} tokens but the target's context is {context_length}; "
            "truncate the prompt (keep its last tokens) so at least one new token fits"
        )
    return prompt


def pack_prompts(input_ids: Any, attention_mask: Any) -> list[Any]:
    """``generate()``'s prompts as one sequence of ids per row (not yet checked, :func:`check_prompt`): a
    ``(B, T)`` or ``(T,)`` tensor or array with an optional 0/1 ``attention_mask`` (padding on either side), a list
    of token-id lists, or one flat list of ids. Raises ``ValueError`` naming what is wrong."""
    if not isinstance(input_ids, torch.Tensor) and attention_mask is not None:
        try:  # a list with a mask: the mask must apply to it, so both become (B, T) tensors
            input_ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError("input_ids given with attention_mask must be a (B, T) or (T,) array of ids "
                             "(rows of equal length)") from None
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be (B, T) or (T,), got shape {tuple(input_ids.shape)}")
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
        prompts = ids.tolist() if attention_mask is None else _unpad(ids, attention_mask)
    elif isinstance(input_ids, (str, bytes)):
        raise ValueError("input_ids must be token ids, not text; tokenize it first (tokenizer(text)['input_ids'])")
    elif isinstance(input_ids, Mapping):
        raise ValueError("input_ids is a mapping (a tokenizer's BatchEncoding?); pass enc['input_ids'] and "
                         "attention_mask=enc['attention_mask']")
    else:
        try:
            rows = list(input_ids)
        except TypeError:
            raise ValueError(f"input_ids must be a (B, T) or (T,) tensor or a list of token-id lists, "
                             f"got {type(input_ids).__name__}") from None
        # A flat list of ids is one prompt, as a (T,) tensor is.
        prompts = [rows] if rows and all(isinstance(t, numbers.Integral) for t in rows) else rows
    if not prompts:
        raise ValueError("input_ids is empty: give at least one prompt")
    return prompts


def _unpad(ids: torch.Tensor, attention_mask: Any) -> list[list[int]]:
    """The rows of ``ids`` ``(B, T)`` where ``attention_mask`` is 1; each row's 1s must be one run."""
    m = torch.as_tensor(attention_mask)
    m = m if m.dim() == 2 else m.unsqueeze(0)
    if not ((m == 0) | (m == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (prompt token), got values "
                         f"{sorted(set(m[(m != 0) & (m != 1)].flatten().tolist()))[:5]}")
    if m.shape != ids.shape:
        raise ValueError(f"attention_mask shape {tuple(m.shape)} != input_ids shape {tuple(ids.shape)}")
    for i, mask in enumerate(m.cpu().bool()):
        kept = mask.nonzero().flatten()
        if len(kept) and int(kept[-1] - kept[0]) + 1 != len(kept):
            raise ValueError(f"attention_mask row {i} has padding between prompt tokens; a prompt is one "
                             "run of 1s (padding on the left or the right only)")
    return [row[mask.bool()].tolist() for row, mask in zip(ids.cpu(), m.cpu())]


def check_sampling_args(temperature: float, top_k: Any, top_p: Any, generator: Any, sampling: dict) -> None:
    """``generate()``'s sampling arguments checked before any work (ValueError naming the bad one)."""
    unknown = sorted(set(sampling) - PENALTY_ARGS)
    if unknown:
        raise ValueError(f"generate() got unknown argument(s) {', '.join(unknown)}; the sampling arguments are "
                         f"temperature (0 = greedy; there is no do_sample), top_k, top_p, "
                         f"{', '.join(sorted(PENALTY_ARGS))}")
    SamplingParams(temperature, top_k, top_p, **sampling)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def row_seeds(generator: torch.Generator | None, n: int) -> list[int | None]:
    """Seeds of ``n`` rows: n draws from ``generator``, or None each (the request draws one from torch's global
    generator)."""
    if generator is None:
        return [None] * n
    return torch.randint(0, MAX_SEED, (n,), generator=generator, device=generator.device).tolist()


def check_streamer(streamer: Any, batch_size: int) -> None:
    """A ``generate()`` streamer: None, or ``put(LongTensor)`` and ``end()`` at batch size 1 (else ValueError)."""
    if streamer is None:
        return
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise ValueError(f"streamer must have put(LongTensor) and end() (e.g. transformers.TextStreamer), got "
                         f"{type(streamer).__name__}")
    if batch_size != 1:
        raise ValueError("streamer needs batch size 1")
