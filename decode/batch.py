"""The running batch (:class:`RunningBatch`: its requests, device state, sampling tensors and penalty counts) and its
bookkeeping: prefill new prompts, merge them into the batch, commit a step's tokens, drop the rows that leave.

State between steps (per model, see :mod:`decode.cache` for the layout). Every committed token except the last one
is in both KV caches; the last committed token (``last``) is the next input of the target. The draft may
additionally lack the token before it: when all γ drafts were accepted, the γ-th draft was never fed to the draft
model (and after a step with γ = 0 it lacks that step's token too). Those pending tokens (``draft_in``, usually 1
or 2) are fed in the first draft forward of the next step, so all-accepted steps bring the draft's cache up to date
without an extra forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from decode import cache as kv
from decode.sampling import BatchSampling, next_token


@dataclass
class DecodeState:
    """Device-side decoding state of the active rows (exposed for tests and tools)."""

    target_cache: Any                    # decode.cache.StaticKV or DynamicKV (its mask and valid slots per row)
    draft_cache: Any                     # the same for the draft; None when the batch decodes without the draft
    last: torch.Tensor                   # (B,) last committed token, not yet in either cache
    draft_in: torch.Tensor               # (B, k) tokens to feed the draft before drafting; last column == last
    draft_in_mask: torch.Tensor          # (B, k) which of draft_in are real
    committed: list[list[int]] = field(default_factory=list)  # per active row: prompt + new tokens
    # Host-side, so cache maintenance needs no device-to-host sync:
    draft_pending: list[int] = field(default_factory=list)  # real tokens in draft_in per row (right-aligned)

    def caches(self) -> list[Any]:
        """The caches in use (the target's, and the draft's when the batch drafts)."""
        return [c for c in (self.target_cache, self.draft_cache) if c is not None]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(B, T)`` int64 ``input_ids`` and ``attention_mask`` for token-id lists (T = longest row),
    the layout the decoder, rollouts and the benchmark use."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def prefill_cache(model: Any, ids: torch.Tensor, mask: torch.Tensor, lens: list[int],
                  context: int | None) -> tuple[kv.DynamicKV, torch.Tensor | None]:
    """``model`` run on left-padded ``ids`` / ``mask`` ``(B, T)`` (T may be 0), as a :class:`decode.cache.DynamicKV`
    (``lens``: each row's real tokens, known on the host), and the logits ``(B, 1, V)`` after each row's last token
    (None when T = 0). Prefill runs eager: its shapes vary with every admission (compiling it only adds
    recompiles)."""
    # The longest row fills the width, so no column is all padding.
    cache, out_mask, logits = kv.new_cache(model), mask[:, :0], None
    if ids.shape[1] > 0:
        logits, out_mask = kv.forward(model, cache, out_mask, ids, mask, logits_to_keep=1,
                                      max_position=context - 1 if context else None)
    return kv.DynamicKV(cache, out_mask, lens), logits


def new_state(target_cache: Any, draft_cache: Any, committed: list[list[int]], draft_in: torch.Tensor) -> DecodeState:
    """The state after a prefill: ``committed`` (per row: prompt and any new tokens), whose last token is the target's
    next input; ``draft_in`` ``(B, k)``: each row's last k committed tokens, the draft's pending input (the target's
    cache holds all but the last committed token, the draft's all but the last k)."""
    B, k = draft_in.shape
    draft_in_mask = torch.ones(B, k, dtype=torch.long, device=draft_in.device)
    if k < 2:  # the first draft forward reads at least two columns (a hole, then the pending token)
        draft_in = torch.cat([torch.zeros_like(draft_in[:, :1]), draft_in], dim=1)
        draft_in_mask = torch.cat([torch.zeros_like(draft_in_mask[:, :1]), draft_in_mask], dim=1)
    return DecodeState(target_cache=target_cache, draft_cache=draft_cache, last=draft_in[:, -1],
                       draft_in=draft_in, draft_in_mask=draft_in_mask, committed=[list(c) for c in committed],
                       draft_pending=[k] * B)


def first_tokens(logits: torch.Tensor, rows: Sequence[Any], vocab_size: int) -> list[int]:
    """Each joining row's next token from the target's prefill logits ``(B, 1, V)`` after its context, drawn as a
    plain decoding step draws it: its sampling settings and penalties (``rows``: :class:`decode.requests.Request`),
    one uniform from its own generator for a sampled row, none for a greedy one (the argmax). An id >= ``vocab_size``
    (inverse-CDF sampling of NaN probabilities) is returned as is, for the caller's check."""
    sampling = BatchSampling([r.params for r in rows], logits.device)
    counts, seen = penalty_counts(rows, vocab_size, logits.device) if sampling.penalized else (None, None)
    u = None if sampling.all_greedy else torch.stack(
        [torch.rand((), generator=r.generator) if not r.params.greedy else torch.zeros(()) for r in rows]
    ).to(logits.device)
    return next_token(logits, sampling, vocab_size, counts, seen, u)[0].tolist()


def to_static(cache: kv.DynamicKV, model: Any, device: Any, room: int) -> kv.StaticKV:
    """A fresh prefill's cache moved into a new static cache with ``room`` free columns."""
    skv = kv.StaticKV(model, device)
    skv.merge(cache.cache, cache.mask, cache.lens, room)
    return skv


def merge(state: DecodeState, other: DecodeState, room: int) -> None:
    """Append the rows of ``other`` (a fresh prefill) to ``state``; a failure in the draft's merge (out of memory,
    Ctrl-C) gives the target's new rows back, so both caches stay as they were."""
    rows, merged = len(state.committed), []
    try:
        for mine, theirs in ((state.target_cache, other.target_cache), (state.draft_cache, other.draft_cache)):
            if mine is not None:
                mine.merge(theirs.cache, theirs.mask, theirs.lens, room)
                merged.append(mine)
    except BaseException:
        for cache in merged:
            cache.select_rows(list(range(rows)))
        raise
    state.last = torch.cat([state.last, other.last])
    width = max(state.draft_in.shape[1], other.draft_in.shape[1])
    pad = lambda x: torch.cat([x.new_zeros(x.shape[0], width - x.shape[1]), x], dim=1)  # noqa: E731
    state.draft_in = torch.cat([pad(state.draft_in), pad(other.draft_in)])
    state.draft_in_mask = torch.cat([pad(state.draft_in_mask), pad(other.draft_in_mask)])
    state.committed.extend(other.committed)
    state.draft_pending.extend(other.draft_pending)


def keep_rows(state: DecodeState, keep: list[int]) -> None:
    """Keep only rows ``keep`` (increasing indices into the batch); the rest leave the caches."""
    idx = torch.tensor(keep, device=state.last.device)
    for name in ("last", "draft_in", "draft_in_mask"):
        setattr(state, name, getattr(state, name).index_select(0, idx))
    for cache in state.caches():
        cache.select_rows(keep)
    state.committed = [state.committed[i] for i in keep]
    state.draft_pending = [state.draft_pending[i] for i in keep]


def penalty_counts(rows: Sequence[Any], vocab_size: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, V)`` counts of each row's generated tokens and ``(B, V)`` bools of the ids in its prompt or output,
    for the presence/frequency/repetition penalties (``rows``: :class:`decode.requests.Request`)."""
    counts, seen = torch.zeros(len(rows), vocab_size), torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r.new_tokens:
            counts[i].index_put_((torch.tensor(r.new_tokens),), torch.ones(len(r.new_tokens)), accumulate=True)
        seen[i, torch.tensor(r.prompt + r.new_tokens)] = True
    return counts.to(device), seen.to(device)


def roll_back(state: DecodeState, gamma: int, drafts: torch.Tensor, n_acc: torch.Tensor, nxt: torch.Tensor,
              n_list: list[int]) -> None:
    """After a step's verify: rejected slots leave both caches (each rolls back its own way, :mod:`decode.cache`),
    the draft's pending input becomes what it has not yet seen, and ``nxt`` ``(B,)`` is the new last token.
    ``drafts`` ``(B, γ)``; ``n_acc`` ``(B,)`` and ``n_list`` (on the host): accepted drafts per row."""
    kept = torch.arange(gamma, device=drafts.device) < n_acc[:, None]  # (B, γ): the accepted drafts
    # The target wrote last, d1..dγ: last and the accepted drafts stay.
    t_cache = state.target_cache
    t_cache.roll_back(kept, n_list, [t + 1 + n for t, n in zip(t_cache.lens, n_list)])
    if gamma == 0:  # plain step: the draft did not see this token either; it catches up in its next forward
        state.draft_in = torch.cat([state.draft_in, nxt[:, None]], dim=-1)
        state.draft_in_mask = torch.cat([state.draft_in_mask, torch.ones_like(nxt)[:, None]], dim=-1)
        state.draft_pending = [p + 1 for p in state.draft_pending]
    else:
        fed = gamma - 1  # the draft wrote its pending input, then d1..d_{γ-1}
        d_kept = [min(n, fed) for n in n_list]
        d_cache = state.draft_cache
        d_cache.roll_back(kept[:, :fed], d_kept,
                          [d + p + k for d, p, k in zip(d_cache.lens, state.draft_pending, d_kept)])
        all_acc = n_acc == gamma
        state.draft_in = torch.stack([torch.where(all_acc, drafts[:, -1], 0), nxt], dim=-1)
        state.draft_in_mask = torch.stack([all_acc.long(), torch.ones_like(n_acc)], dim=-1)
        state.draft_pending = [2 if n == gamma else 1 for n in n_list]
    state.last = nxt


def count_tokens(counts: torch.Tensor | None, seen: torch.Tensor | None, rows: list[int], ids: list[int]) -> None:
    """Add committed tokens to the penalty counts: ``ids[j]`` was committed by row ``rows[j]`` (no-op without
    penalties)."""
    if counts is None or not ids:
        return
    idx = (torch.tensor(rows, device=counts.device), torch.tensor(ids, device=counts.device))
    counts.index_put_(idx, torch.ones(len(ids), device=counts.device), accumulate=True)
    seen[idx] = True


class RunningBatch:
    """The active requests (:class:`decode.requests.Request`) in row order, their :class:`DecodeState` (None when
    empty), per-row sampling tensors and, when a row has penalties, ``(B, V)`` penalty counts."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.clear()

    def clear(self) -> None:
        """No rows."""
        self.rows: list[Any] = []
        self.state: DecodeState | None = None
        self.sampling: BatchSampling | None = None
        self.counts: torch.Tensor | None = None  # (B, V) generated-token counts, when a row has penalties
        self.seen: torch.Tensor | None = None    # (B, V) ids in prompt or generated

    def add(self, rows: list[Any], state: DecodeState, room: int) -> None:
        """``rows`` join with ``state``, their prefill (the batch's state when it was empty, else merged into it
        with ``room`` free cache columns, :func:`merge`)."""
        if self.state is None:
            self.state = state
        else:
            merge(self.state, state, room)
        self.rows += rows
        self._resample()

    def keep(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (increasing indices into the batch); the rest leave the caches."""
        if not keep:
            self.clear()
            return
        keep_rows(self.state, keep)
        self.rows = [self.rows[i] for i in keep]
        self._resample()

    def _resample(self) -> None:
        """Per-row sampling tensors (and penalty counts) for the current rows, on the state's device."""
        device = self.state.last.device
        self.sampling = BatchSampling([r.params for r in self.rows], device)
        self.counts, self.seen = (penalty_counts(self.rows, self.vocab_size, device) if self.sampling.penalized
                                  else (None, None))

    def commit(self, gammas: list[int], n_acc: list[int], new: list[list[int]], draft_forwards: int,
               context_length: int | None) -> tuple[list[Any], list[tuple[Any, list[int]]]]:
        """Append each row's new tokens (cut after a stop id and to its budget and the target's ``context_length``),
        record its step (γ_r ``gammas``, accepted drafts ``n_acc``, the step's ``draft_forwards``), and drop the rows
        that finished. Returns their :class:`decode.requests.RequestOutput` and ``(request, kept tokens)`` per row,
        both in batch order."""
        now = time.perf_counter()
        finished, keep, calls, count_rows, count_ids = [], [], [], [], []
        for i, (row, g, n, tokens) in enumerate(zip(self.rows, gammas, n_acc, new)):
            committed = self.state.committed[i]
            tokens, stopped = row.trim(tokens, row.remaining(len(committed), context_length))
            row.commit(tokens, g, n, draft_forwards, now)
            committed.extend(tokens)
            calls.append((row, tokens))
            if stopped or row.remaining(len(committed), context_length) <= 0:
                finished.append(row.output("stop" if stopped else "length"))
            else:
                keep.append(i)
                count_rows += [len(keep) - 1] * len(tokens)
                count_ids += tokens
        if len(keep) < len(self.rows):
            self.keep(keep)
        else:
            count_tokens(self.counts, self.seen, count_rows, count_ids)
        return finished, calls
