"""The running batch's device state and its bookkeeping: prefill new prompts, merge them into the batch, drop the
rows that leave, and the penalty counts of its rows.

State between steps (per model, see :mod:`decode.cache` for the layout). Every committed token except the last one
is in both KV caches; the last committed token (``last``) is the next input of the target. The draft may
additionally lack the token before it: when all γ drafts were accepted, the γ-th draft was never fed to the draft
model (and after a step with γ = 0 it lacks that step's token too). Those pending tokens (``draft_in``, usually 1
or 2) are fed in the first draft forward of the next step, so all-accepted steps bring the draft's cache up to date
without an extra forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from decode import cache as kv


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
                  context: int | None) -> kv.DynamicKV:
    """``model`` run on all but each row's last token of left-padded ``ids`` / ``mask`` ``(B, T)``, as a
    :class:`decode.cache.DynamicKV` (``lens``: each row's prompt length - 1, known on the host). Prefill runs eager:
    its shapes vary with every admission (compiling it only adds recompiles)."""
    # The longest prompt fills the width, so no column of the prefix is all padding.
    pre_ids, pre_mask = ids[:, :-1], mask[:, :-1]
    cache, out_mask = kv.new_cache(model), pre_mask[:, :0]
    if ids.shape[1] > 1:
        _, out_mask = kv.forward(model, cache, out_mask, pre_ids, pre_mask, logits_to_keep=1,
                                 max_position=context - 1 if context else None)
    return kv.DynamicKV(cache, out_mask, lens)


def new_state(target_cache: Any, draft_cache: Any, prompts: list[list[int]], last: torch.Tensor) -> DecodeState:
    """The state after a prefill: the last prompt token is the target's next input and the draft's pending one."""
    B = len(prompts)
    draft_in = torch.stack([torch.zeros_like(last), last], dim=-1)
    draft_in_mask = torch.tensor([[0, 1]], device=last.device).expand(B, 2).clone()
    return DecodeState(target_cache=target_cache, draft_cache=draft_cache, last=last, draft_in=draft_in,
                       draft_in_mask=draft_in_mask, committed=[list(p) for p in prompts], draft_pending=[1] * B)


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
