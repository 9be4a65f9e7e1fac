"""Prompt lookup: propose the tokens that followed the last n tokens the most recent time they occurred before.

Prompt lookup decoding (Saxena, 2023, github.com/apoorvumang/prompt-lookup-decoding; in transformers as
``prompt_lookup_num_tokens``, in vLLM as the ``ngram`` proposer) drafts without a model: when the last n tokens of
a sequence occurred earlier in it, the tokens that followed that occurrence are a free guess for what comes next.
The decoder uses it for greedy requests (``SpeculativeDecoder(prompt_lookup_ngram=n)``): beside the draft model,
while the lookup has a match, a step's drafts are its tokens instead of the draft's argmaxes (docs/decode.md,
"Prompt lookup"); alone (``SpeculativeDecoder(target, None, prompt_lookup_ngram=n)``), a row drafts its lookup
chain where it has one and nothing otherwise (a plain step), and a sampled row always takes plain steps. It pays where the target repeats what is already in its context (loops, repeated code, quoted
text), which a small draft often fails to copy.

Losslessness does not depend on it: a proposal is a function of the prefix only, and a greedy request keeps a
proposal exactly when it equals the target's argmax.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch


class NgramLookup:
    """An index of one growing token sequence: for every n-gram, where the token after its most recent occurrence
    (that has a next token) is.

    :meth:`update` reads the tokens appended since the last call (the sequence only grows: a request's prompt and
    committed tokens), :meth:`propose` chains lookups: each proposed token extends the sequence for the next lookup,
    as if it had been accepted. Host-side Python, O(1) per token.

    Args:
        n: the n-gram length, >= 1.

    Raises:
        ValueError: ``n`` is not an integer >= 1.
    """

    def __init__(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"prompt_lookup_ngram must be an integer >= 1 (0 turns prompt lookup off), got {n!r}")
        self.n = n
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self._seen = 0  # tokens of the sequence read so far

    def update(self, tokens: Sequence[int]) -> None:
        """Index ``tokens[self._seen:]``; ``tokens`` is the whole sequence so far (the same list, grown)."""
        n = self.n
        for j in range(max(self._seen, n), len(tokens)):
            self._next[tuple(tokens[j - n:j])] = j
        self._seen = len(tokens)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens of ``tokens`` (read into the index first): the token after the most
        recent earlier occurrence of the last n tokens, then the same for the sequence with that token appended,
        and so on until an n-gram has no earlier occurrence. Returns ``[]`` when the first has none."""
        self.update(tokens)
        n, base = self.n, len(tokens)
        if base < n or k < 1:
            return []
        chain: list[int] = []
        pending: dict[tuple[int, ...], int] = {}  # occurrences that end inside the chain: newer than the index's
        at = lambda j: tokens[j] if j < base else chain[j - base]  # noqa: E731
        for _ in range(k):
            end = base + len(chain)
            key = tuple(at(j) for j in range(end - n, end))
            j = pending.get(key, self._next.get(key))
            if j is None:
                break
            pending[key] = end  # the suffix is now followed by the token proposed below
            chain.append(at(j))
        return chain


class LookupDrafts(NamedTuple):
    """One step's prompt-lookup proposals for the batch (:func:`lookup_drafts`): a drafting source beside the draft
    model. Its first ``covered`` positions need no guess from the draft model; past them, a row's proposal
    replaces the draft model's guess where ``use`` marks it."""

    ids: torch.Tensor  # (B, γ) int64: the proposals (0 where unused)
    use: torch.Tensor  # (B, γ) bool: the draft at this position is the proposal (a prefix of a greedy row's γ_r)
    covered: int       # leading positions where no row needs the draft's guess (a proposal, or past the row's γ_r)

    def proposal(self, i: int, vocab_size: int, with_q: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Position ``i`` < ``covered``: the tokens ``(B,)`` and, if ``with_q``, their one-hot q ``(B, V)`` (as
        :func:`decode.sampling.probs_from_logits` gives a greedy row)."""
        tok = self.ids[:, i]
        return tok, (torch.nn.functional.one_hot(tok, vocab_size).float() if with_q else None)

    def overlay(self, i: int, tok: torch.Tensor, q: torch.Tensor | None,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft model's tokens ``(B,)`` and q ``(B, V)`` at position ``i`` with the proposals put in where
        marked (greedy rows only, so q is one-hot wherever their draft comes from)."""
        tok = torch.where(self.use[:, i], self.ids[:, i], tok)
        if q is not None:
            q = torch.where(self.use[:, i, None], torch.nn.functional.one_hot(tok, vocab_size).float(), q)
        return tok, q


def lookup_chains(rows: Sequence[Any], committed: Sequence[list[int]], gammas: Sequence[int],
                  n: int) -> list[list[int]]:
    """Each row's prompt-lookup proposal of up to γ_r tokens (``gammas``), host-side: a greedy row's chain
    (``rows``: :class:`decode.requests.Request`, each keeping its :class:`NgramLookup` of ``committed``), ``[]``
    for a sampled row or one without a match."""
    chains = []
    for row, seq, g in zip(rows, committed, gammas):
        if row.params.greedy and g > 0:
            if row.lookup is None:
                row.lookup = NgramLookup(n)
            chains.append(row.lookup.propose(seq, g))
        else:
            chains.append([])
    return chains


def chain_tokens(chains: Sequence[list[int]], vocab_size: int, with_q: bool,
                 device: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt lookup alone (no draft model): the step's drafts ``(B, γ)`` are the rows' chains (γ the longest, a
    shorter chain padded with id 0 past its row's γ_r) and, if ``with_q``, their one-hot q ``(B, γ, V)``."""
    gamma = max(len(c) for c in chains)
    ids = torch.tensor([list(c) + [0] * (gamma - len(c)) for c in chains], dtype=torch.long).to(device)
    return ids, (torch.nn.functional.one_hot(ids, vocab_size).float() if with_q else None)


def lookup_drafts(rows: Sequence[Any], committed: Sequence[list[int]], gammas: Sequence[int], gamma: int, n: int,
                  device: Any) -> LookupDrafts | None:
    """Prompt-lookup proposals of the greedy rows beside the draft model (:func:`lookup_chains`); None when no row
    has a match. ``gammas``: γ_r per row, ``gamma`` their max."""
    chains = lookup_chains(rows, committed, gammas, n)
    if not any(chains):
        return None
    covered = min(gamma if len(chain) >= g else len(chain) for chain, g in zip(chains, gammas))
    ids = torch.zeros(len(chains), gamma, dtype=torch.long)
    use = torch.zeros(len(chains), gamma, dtype=torch.bool)
    for i, chain in enumerate(chains):
        ids[i, :len(chain)] = torch.tensor(chain, dtype=torch.long)
        use[i, :len(chain)] = True
    return LookupDrafts(ids.to(device, non_blocking=True), use.to(device, non_blocking=True), covered)


def check_prompt_lookup(value: object, has_draft: bool = True, name: str = "prompt_lookup_ngram") -> int:
    """``prompt_lookup_ngram`` checked: an integer >= 0 (0: off). Raises ``ValueError`` naming ``name`` (the
    argument, or a CLI's option) for anything else, and, with ``has_draft=False``, for n > 0 (for a caller that
    uses prompt lookup only beside a draft model; the decoder itself also drafts by lookup alone)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (the n-gram length of prompt lookup; 0: off), got {value!r}")
    if value and not has_draft:
        raise ValueError(f"{name}={value} needs a draft model here (prompt lookup drafts beside it); pass a draft "
                         "or 0")
    return value
