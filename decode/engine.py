"""The speculative decoding engine: prefill -> draft γ -> verify -> commit, for batches with ragged acceptance.

Algorithm: Leviathan et al. (2023), Algorithm 1; Chen et al. (2023). The acceptance rule is
:func:`decode.verify.verify`; p and q come from :func:`decode.sampling.logits_to_probs`.

State between steps (per model, see :mod:`decode.cache` for the layout). Every committed token except the
last one is in both KV caches; the last committed token (``last``) is the next input of the target. The
draft may additionally lack the token before it: when all γ drafts were accepted, the γ-th draft was never fed
to the draft model (and after a step with γ = 0 it lacks that step's token too). Those pending tokens
(``draft_in``, usually 1 or 2) are fed in the first draft forward of the next step, so all-accepted steps bring
the draft's cache up to date without an extra forward.

Batching: each row accepts its own prefix. Rejected slots are masked out and then compacted away, positions
are per row (number of committed tokens before the slot), finished rows leave the batch. So every row's output
is what it would be decoded alone. The cost of raggedness is one cache compaction per step (a gather when rows
accepted different lengths) plus the shorter rows' padding in each forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from decode import cache as kv
from decode.compat import check_compatibility
from decode.metrics import DecodeStats, peak_memory_bytes
from decode.sampling import logits_to_probs, validate_sampling_args
from decode.speedup import AdaptiveGamma
from decode.verify import verify


@dataclass
class GenerationOutput:
    """Result of :meth:`SpeculativeDecoder.generate`.

    ``sequences`` and ``new_tokens`` are lists (one per input row, in input order) of 1-D int64 CPU tensors:
    the prompt without padding followed by the new tokens, and the new tokens alone.
    """

    sequences: list[torch.Tensor]
    new_tokens: list[torch.Tensor]
    stats: DecodeStats


@dataclass
class DecodeState:
    """Device-side decoding state of the active rows (exposed for tests and tools)."""

    rows: list[int]                      # original batch index of each active row
    target_cache: Any
    target_mask: torch.Tensor            # (B, W_t) int64
    draft_cache: Any
    draft_mask: torch.Tensor             # (B, W_d) int64
    last: torch.Tensor                   # (B,) last committed token, not yet in either cache
    draft_in: torch.Tensor               # (B, k) tokens to feed the draft before drafting; last column == last
    draft_in_mask: torch.Tensor          # (B, k) which of draft_in are real
    committed: list[list[int]] = field(default_factory=list)  # per active row: prompt + new tokens
    num_new: list[int] = field(default_factory=list)
    # Host-side bookkeeping, so cache maintenance needs no device-to-host sync:
    target_len: list[int] = field(default_factory=list)     # valid target-cache slots per row
    draft_len: list[int] = field(default_factory=list)      # valid draft-cache slots per row
    draft_pending: list[int] = field(default_factory=list)  # real tokens in draft_in per row (right-aligned)


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


def context_length(model: Any) -> int | None:
    """Max positions of a causal LM from its (text) config; None when the architecture states no limit."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class SpeculativeDecoder:
    """Lossless speculative decoding of ``target`` with proposals from ``draft``.

    Args:
        target: a Hugging Face causal LM (``PreTrainedModel``), used frozen.
        draft: a causal LM sharing the target's tokenizer, or ``None`` for plain decoding only.
        num_draft_tokens: γ, tokens drafted per verify step (0 = plain decoding; ``"auto"`` = adaptive γ
            chosen each step by :class:`decode.speedup.AdaptiveGamma`).
        tokenizer, draft_tokenizer: if given, checked for compatibility and used to set the shared vocabulary
            (see :func:`decode.compat.check_compatibility`); ids beyond it never appear in the output.
        max_auto_draft_tokens: upper bound on γ in ``"auto"`` mode.

    Raises:
        decode.compat.IncompatibleModelsError: the pair cannot share a vocabulary.
        ValueError: a bad ``num_draft_tokens``.
    """

    def __init__(self, target: Any, draft: Any = None, num_draft_tokens: int | str = 4, tokenizer: Any = None,
                 draft_tokenizer: Any = None, max_auto_draft_tokens: int = 8):
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.vocab_size = check_compatibility(target, draft, tokenizer, draft_tokenizer or tokenizer)
        self.max_auto_draft_tokens = max_auto_draft_tokens
        self.num_draft_tokens = self._check_gamma(num_draft_tokens)
        self.context_length = context_length(target)
        self.draft_context_length = context_length(draft) if draft is not None else None

    def _check_gamma(self, gamma: int | str) -> int | str:
        if gamma == "auto":
            if self.draft is None:
                raise ValueError("num_draft_tokens='auto' needs a draft model")
            return gamma
        if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 0:
            raise ValueError(f"num_draft_tokens must be an integer >= 0 or 'auto', got {gamma!r}")
        if gamma > 0 and self.draft is None:
            raise ValueError(f"num_draft_tokens={gamma} needs a draft model; pass draft=... or use num_draft_tokens=0")
        return gamma

    # ------------------------------------------------------------------ setup
    def _pack_prompts(self, input_ids: Any, attention_mask: torch.Tensor | None) -> list[list[int]]:
        if isinstance(input_ids, torch.Tensor):
            ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
            if attention_mask is None:
                prompts = ids.tolist()
            else:
                m = attention_mask if attention_mask.dim() == 2 else attention_mask.unsqueeze(0)
                if m.shape != ids.shape:
                    raise ValueError(f"attention_mask shape {tuple(m.shape)} != input_ids shape {tuple(ids.shape)}")
                prompts = [row[mask.bool()].tolist() for row, mask in zip(ids.cpu(), m.cpu())]
        else:
            prompts = [list(map(int, p)) for p in input_ids]
        if not prompts:
            raise ValueError("input_ids is empty: give at least one prompt")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} has no tokens; give at least one (e.g. the tokenizer's bos token)")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
            if self.context_length is not None and len(p) >= self.context_length:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens but the target's context is {self.context_length}; "
                    "truncate the prompt (keep its last tokens) so at least one new token fits"
                )
        return prompts

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], use_draft: bool = True) -> DecodeState:
        """Left-pad the prompts and run both models (the target only if ``use_draft`` is false) on all but each
        prompt's last token."""
        device = self.target.device
        B = len(prompts)
        ids, mask = left_pad(prompts, 0, device)
        T = ids.shape[1]
        # Everything but each prompt's last token (the longest prompt fills the width, so no column is all padding).
        pre_ids, pre_mask = ids[:, :-1], mask[:, :-1]
        keep = T - 1
        models = [(self.target, "target")] + ([(self.draft, "draft")] if self.draft is not None and use_draft else [])
        caches, masks = {}, {}
        for model, name in models:
            caches[name] = kv.new_cache(model)
            masks[name] = pre_mask[:, :0]
            if keep > 0:
                _, masks[name] = kv.forward(model, caches[name], masks[name], pre_ids, pre_mask, logits_to_keep=1)
        last = ids[:, -1]
        draft_in = torch.stack([torch.zeros_like(last), last], dim=-1)
        draft_in_mask = torch.tensor([[0, 1]], device=device).expand(B, 2).clone()
        return DecodeState(
            rows=list(range(B)), target_cache=caches["target"], target_mask=masks["target"],
            draft_cache=caches.get("draft"), draft_mask=masks.get("draft", pre_mask[:, :0]), last=last,
            draft_in=draft_in, draft_in_mask=draft_in_mask, committed=[list(p) for p in prompts], num_new=[0] * B,
            target_len=[len(p) - 1 for p in prompts], draft_len=[len(p) - 1 for p in prompts], draft_pending=[1] * B,
        )

    # ------------------------------------------------------------------ one step
    def _draft(self, state: DecodeState, gamma: int, sampling: dict, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft γ tokens per row; returns tokens ``(B, γ)`` and the distributions they were drawn from ``(B, γ, V)``."""
        # Feed the pending tokens, skipping leading columns that no row needs (usually 1 or 2 columns).
        width = max(state.draft_pending)
        inp, inp_mask = state.draft_in[:, -width:], state.draft_in_mask[:, -width:]
        tokens, probs = [], []
        for i in range(gamma):
            logits, state.draft_mask = kv.forward(self.draft, state.draft_cache, state.draft_mask, inp, inp_mask,
                                                  logits_to_keep=1)
            q = logits_to_probs(logits[:, -1], vocab_size=self.vocab_size, **sampling)
            tok = q.argmax(-1) if sampling["temperature"] == 0 else torch.multinomial(q, 1, generator=generator)[:, 0]
            tokens.append(tok)
            probs.append(q)
            inp, inp_mask = tok[:, None], torch.ones_like(tok)[:, None]
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)

    @torch.no_grad()
    def step(self, state: DecodeState, gamma: int, sampling: dict, generator=None,
             timings: dict | None = None) -> tuple[list[int], list[list[int]]]:
        """One verify step for every active row.

        Returns ``(n_accepted per row, committed new tokens per row)``. After it, each cache holds exactly the
        row's committed tokens except the new ``last``; the draft may also lack the last accepted draft.
        """
        B = len(state.rows)
        device = state.last.device
        t0 = time.perf_counter()
        if gamma > 0:
            drafts, q = self._draft(state, gamma, sampling, generator)
        else:
            drafts = state.last.new_zeros(B, 0)
            q = torch.zeros(B, 0, self.vocab_size, device=device)
        t1 = time.perf_counter()
        target_in = torch.cat([state.last[:, None], drafts], dim=1)  # (B, γ+1)
        logits, state.target_mask = kv.forward(self.target, state.target_cache, state.target_mask, target_in,
                                               torch.ones_like(target_in))
        p = logits_to_probs(logits, vocab_size=self.vocab_size, **sampling)  # (B, γ+1, V)
        n_acc, nxt = verify(q, p, drafts, generator)
        host = torch.cat([drafts, n_acc[:, None], nxt[:, None]], dim=1).tolist()  # the step's one host sync
        if timings is not None:
            timings["draft_s"], timings["target_s"] = t1 - t0, time.perf_counter() - t1

        # Roll back: rejected slots leave the mask; both caches then drop them.
        n_list = [row[gamma] for row in host]
        pos = torch.arange(gamma, device=device)
        if gamma > 0:
            state.target_mask[:, state.target_mask.shape[1] - gamma:] = (pos < n_acc[:, None]).long()
            fed = gamma - 1  # drafts d1..d_{γ-1} went into the draft cache
            if fed > 0:
                state.draft_mask[:, state.draft_mask.shape[1] - fed:] = (pos[:fed] < n_acc[:, None]).long()
            all_acc = n_acc == gamma
            state.draft_in = torch.stack([torch.where(all_acc, drafts[:, -1], 0), nxt], dim=-1)
            state.draft_in_mask = torch.stack([all_acc.long(), torch.ones_like(n_acc)], dim=-1)
            fed_pending = state.draft_pending
            state.target_len = [t + 1 + n for t, n in zip(state.target_len, n_list)]
            state.draft_len = [d + p + min(n, fed) for d, p, n in zip(state.draft_len, fed_pending, n_list)]
            state.draft_pending = [2 if n == gamma else 1 for n in n_list]
            same = len(set(n_list)) == 1
            t_holes = gamma - n_list[0] if same else None
            d_holes = fed - min(n_list[0], fed) if same and len(set(fed_pending)) == 1 else None
            state.target_mask = kv.compact(state.target_cache, state.target_mask, state.target_len, t_holes)
            state.draft_mask = kv.compact(state.draft_cache, state.draft_mask, state.draft_len, d_holes)
        else:
            # Plain step: the draft did not see this token either; it catches up in its next forward.
            state.draft_in = torch.cat([state.draft_in, nxt[:, None]], dim=-1)
            state.draft_in_mask = torch.cat([state.draft_in_mask, torch.ones_like(nxt)[:, None]], dim=-1)
            state.draft_pending = [p + 1 for p in state.draft_pending]
            state.target_len = [t + 1 for t in state.target_len]
        state.last = nxt
        new = [row[:n] + [row[gamma + 1]] for row, n in zip(host, n_list)]
        return n_list, new

    def _drop_rows(self, state: DecodeState, keep: list[int]) -> None:
        idx = torch.tensor(keep, device=state.last.device)
        for name in ("target_mask", "draft_mask", "last", "draft_in", "draft_in_mask"):
            setattr(state, name, getattr(state, name).index_select(0, idx))
        kv.select_rows(state.target_cache, idx)
        if state.draft_cache is not None:
            kv.select_rows(state.draft_cache, idx)
        state.rows = [state.rows[i] for i in keep]
        for name in ("committed", "num_new", "target_len", "draft_len", "draft_pending"):
            setattr(state, name, [getattr(state, name)[i] for i in keep])
        # Drop the leading columns that only the removed rows used.
        if max(state.target_len) < state.target_mask.shape[1]:
            state.target_mask = kv.compact(state.target_cache, state.target_mask, state.target_len)
        if state.draft_cache is not None and max(state.draft_len) < state.draft_mask.shape[1]:
            state.draft_mask = kv.compact(state.draft_cache, state.draft_mask, state.draft_len)

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        num_draft_tokens: int | str | None = None,
        streamer: Any = None,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens per row; output follows the target's distribution exactly.

        Args:
            input_ids: ``(B, T)`` or ``(T,)`` int64 prompts (any padding side, given ``attention_mask``), or a list
                of token-id lists.
            attention_mask: ``(B, T)`` 1 for prompt tokens, 0 for padding; None means no padding.
            temperature, top_k, top_p: sampling parameters shared by target and draft; temperature 0 is greedy
                and gives exactly the target's plain greedy output.
            eos_token_id: id or ids that end a row (kept in the output; nothing follows it).
            generator: the ``torch.Generator`` of every random draw (on the models' device).
            num_draft_tokens: override γ for this call (0 = plain target decoding through the same engine).
            streamer: optional object with ``put(LongTensor)`` / ``end()`` (e.g. ``transformers.TextStreamer``);
                batch size 1 only. Receives the prompt first, then each step's committed tokens.

        Returns:
            :class:`GenerationOutput` with per-row sequences and pooled :class:`DecodeStats`.

        Raises:
            ValueError: bad sampling values, an empty prompt, ids outside the vocabulary, a prompt that does not
                fit in the target's context, or ``max_new_tokens < 1``.
        """
        validate_sampling_args(temperature, top_k, top_p)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        gamma_cfg = self._check_gamma(self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens)
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        sampling = {"temperature": float(temperature), "top_k": top_k, "top_p": top_p}
        prompts = self._pack_prompts(input_ids, attention_mask)
        if streamer is not None and len(prompts) != 1:
            raise ValueError("streamer needs batch size 1")
        adaptive = AdaptiveGamma(self.max_auto_draft_tokens) if gamma_cfg == "auto" else None

        stats = DecodeStats(num_sequences=len(prompts))
        start = time.perf_counter()
        state = self.prefill(prompts, use_draft=gamma_cfg != 0)
        if streamer is not None:
            streamer.put(torch.tensor(prompts[0]))
        outputs: dict[int, list[int]] = {}
        timings: dict = {}
        while state.rows:
            lengths = [len(c) for c in state.committed]
            # A row ends at max_new_tokens, at eos, or when it fills the target's context.
            remaining = [min(max_new_tokens - n, (self.context_length or 1 << 62) - n_len)
                         for n, n_len in zip(state.num_new, lengths)]
            gamma = adaptive.gamma if adaptive is not None else gamma_cfg
            gamma = min(gamma, max(remaining) - 1)
            for ctx in (self.context_length, self.draft_context_length):
                if ctx is not None:  # the models see positions up to len - 1 + γ
                    gamma = min(gamma, ctx - max(lengths))
            gamma = max(gamma, 0)
            n_acc, new = self.step(state, gamma, sampling, generator, timings)
            stats.num_target_forwards += 1
            stats.num_draft_forwards += gamma
            stats.record_step(gamma, n_acc)
            if adaptive is not None and gamma > 0:
                if state.last.device.type == "cuda":
                    torch.cuda.synchronize()
                adaptive.update(gamma * len(n_acc), sum(n_acc), timings["draft_s"] / gamma, timings["target_s"])
            keep = []
            for i, tokens in enumerate(new):
                tokens = tokens[: remaining[i]]
                hit = next((j for j, t in enumerate(tokens) if t in eos), None)
                if hit is not None:
                    tokens = tokens[: hit + 1]
                state.committed[i].extend(tokens)
                state.num_new[i] += len(tokens)
                if streamer is not None:
                    streamer.put(torch.tensor(tokens))
                if hit is not None or len(tokens) >= remaining[i]:
                    outputs[state.rows[i]] = state.committed[i]
                else:
                    keep.append(i)
            if stats.ttft_s == 0.0:
                stats.ttft_s = time.perf_counter() - start
            if len(keep) < len(state.rows):
                if keep:
                    self._drop_rows(state, keep)
                else:
                    state.rows = []
        stats.total_s = time.perf_counter() - start
        if streamer is not None:
            streamer.end()
        sequences = [torch.tensor(outputs[b], dtype=torch.long) for b in range(len(prompts))]
        new_tokens = [seq[len(p):] for seq, p in zip(sequences, prompts)]
        stats.num_new_tokens = sum(len(t) for t in new_tokens)
        stats.peak_memory_bytes = peak_memory_bytes(state.last.device)
        return GenerationOutput(sequences=sequences, new_tokens=new_tokens, stats=stats)
