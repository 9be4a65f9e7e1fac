"""Drafting: γ proposals per row from two sources side by side, prompt lookup (:mod:`decode.lookup`: greedy rows,
no model) and the draft model.

q is exactly the distribution a draft was drawn from after all processing: one-hot for a greedy row (its argmax,
or the lookup's proposal), the processed draft distribution for a sampled row (:func:`decode.sampling.probs_from_logits`
on the draft's logits mapped to target ids, with the penalty counts of the prefix including the earlier drafts).

Positions where every row takes the lookup's proposal (or drafts nothing) run no draft forward: their tokens join the
next forward's input (one forward of several tokens costs about one of a single token here), and when every position
is covered one forward feeds them at the end, so the draft's cache holds the same tokens as after γ one-token
forwards and the roll-back does not depend on where the drafts came from.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from decode.batch import DecodeState
from decode.lookup import LookupDrafts
from decode.sampling import BatchSampling, next_token
from decode.vocab_map import scatter_to_vocab

# forward(state, inp (B, k), inp_mask (B, k), holes) -> the draft's logits (B, 1, N) after inp
DraftForward = Callable[[DecodeState, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def draft_logits(logits: torch.Tensor, draft_map: torch.Tensor | None, vocab_size: int,
                 columns: torch.Tensor | None = None) -> torch.Tensor:
    """The draft's ``(B, 1, N)`` logits as a row over the target's ids: a pruned draft's N logits go to the ids of its
    map (``draft_map``, None for a full-vocabulary draft) and every other id gets -inf, so q = 0 there and the
    residual max(p − q, 0) gives those ids exactly their target probability. A draft of another vocabulary
    (:mod:`decode.cross_vocab`) gives ``columns``, its logit columns of the shared tokens, and ``draft_map``,
    their target ids."""
    if draft_map is None:
        return logits
    return scatter_to_vocab(logits, draft_map.to(logits.device), vocab_size,
                            None if columns is None else columns.to(logits.device))


def draft_tokens(state: DecodeState, gamma: int, lookup: LookupDrafts | None, forward: DraftForward,
                 sampling: BatchSampling, vocab_size: int, draft_map: torch.Tensor | None, counts: Any, seen: Any,
                 draft_u: torch.Tensor, draft_columns: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Draft γ >= 1 tokens per row: the lookup's proposal where it has one, else the draft model's guess.

    Args:
        state: the running batch; the draft's pending input (``draft_in``) is fed first.
        lookup: this step's prompt-lookup proposals, or None.
        forward: one draft forward on the draft's cache (the engine's ``draft_forward``).
        counts, seen: ``(B, V)`` penalty counts of the rows, or None.
        draft_u: ``(B, γ)`` the rows' uniforms for sampled drafts.
        draft_map, draft_columns: where the draft's logits go among the target's ids (:func:`draft_logits`).

    Returns:
        tokens ``(B, γ)``, q ``(B, γ, V)`` (None when every row is greedy) and the number of draft forwards run.
    """
    covered = lookup.covered if lookup is not None else 0
    # Feed the pending tokens, skipping leading columns that no row needs (usually 1 or 2 columns).
    width = max(state.draft_pending)
    inp, inp_mask = state.draft_in[:, -width:], state.draft_in_mask[:, -width:]
    state.draft_cache.ensure_room(width + gamma)  # so no compaction runs between this step's writes
    holes = min(state.draft_pending) < width
    tokens, probs = [], []
    for i in range(gamma):
        if i < covered:  # every row's draft here is its proposal (or unused): it joins the next forward's input
            tok, q = lookup.proposal(i, vocab_size, with_q=not sampling.all_greedy)
            inp = torch.cat([inp, tok[:, None]], dim=1)
            inp_mask = torch.cat([inp_mask, torch.ones_like(inp_mask[:, :1])], dim=1)
        else:
            logits = draft_logits(forward(state, inp, inp_mask, holes), draft_map, vocab_size, draft_columns)
            tok, q = next_token(logits, sampling, vocab_size, counts, seen, draft_u[:, i])
            if lookup is not None:
                tok, q = lookup.overlay(i, tok, q, vocab_size)
            inp, inp_mask, holes = tok[:, None], torch.ones_like(tok)[:, None], False
        if q is not None:
            probs.append(q)
        tokens.append(tok)
        if counts is not None and i + 1 < gamma:  # the next position's prefix includes this draft
            counts = counts.scatter_add(-1, tok[:, None], torch.ones_like(counts[:, :1]))
            seen = seen.scatter(-1, tok[:, None], True)
    if covered == gamma:  # no forward ran: feed what the γ forwards would have (all but the γ-th draft)
        forward(state, inp[:, :-1], inp_mask[:, :-1], holes)
    forwards = 1 if covered == gamma else gamma - covered
    return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None), forwards
