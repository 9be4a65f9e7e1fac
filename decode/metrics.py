"""Decoding metrics, pooled over tokens (never averaged per request).

Definitions (Leviathan et al. 2023; Spec-Bench, Xia et al. 2024):
- acceptance rate α = Σ accepted draft tokens / Σ drafted tokens;
- per-token acceptance α_tok = Σ accepted / (Σ accepted + rejections): the maximum-likelihood estimate of the
  i.i.d. per-token acceptance probability of Leviathan et al.'s speedup formula. Each verify step is a run of
  Bernoulli trials that stops at the first rejection, so drafts after a rejection are not trials; α above
  counts them as failures and falls as γ grows even when α_tok does not;
- mean accepted length τ = Σ (accepted + 1) / number of verify steps (tokens per target forward, counting
  the correction or bonus token; 1.0 for plain decoding);
- characters per verify step = (Σ characters of the generated text / Σ new tokens) × τ: the text one target forward
  commits, with the text decoded by the target's tokenizer (special tokens skipped). α and τ count target tokens;
  this counts text, so drafts of different tokenizers (:mod:`decode.cross_vocab`) and targets of different
  vocabularies compare. It needs the decoded text, so the benchmark computes it (:func:`chars_per_verify_step`),
  not the decoder's step loop;
- acceptance by draft position i = number of verify steps whose draft token i was accepted;
- time to first token (TTFT): seconds from the call until the first new token is committed (prefill + first step);
- per-token latency: seconds per new token after the first; throughput: new tokens / total seconds;
- peak memory: process RSS high-water mark on CPU, ``torch.cuda.max_memory_allocated`` on GPU (bytes).
"""
from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class DecodeStats:
    """Counters and timings of one ``generate`` call (all rows of the batch pooled).

    ``num_verify_steps`` counts (row, target forward) pairs in which that row drafted at least one token;
    ``num_rejections`` those of them that rejected a draft (accepted fewer than drafted);
    ``num_target_forwards`` counts batched target forwards after prefill (the prefill gives each row its first
    token); ``ttft_s`` is the time to the first token, ``draft_prefill_s`` the time the draft's prefill took after
    it (0 without a draft).
    """

    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    num_rejections: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_length_histogram: list[int] = field(default_factory=list)
    num_new_tokens: int = 0
    num_sequences: int = 0
    num_target_forwards: int = 0
    num_draft_forwards: int = 0
    ttft_s: float = 0.0
    draft_prefill_s: float = 0.0
    num_first_step_tokens: int = 0
    total_s: float = 0.0
    peak_memory_bytes: int = 0

    def record_step(self, num_drafted: int, num_accepted: list[int]) -> None:
        """Add one verify step: every row in ``num_accepted`` drafted ``num_drafted`` tokens and accepted a prefix.

        A plain step (``num_drafted == 0``) is not a verify step and changes nothing here."""
        if num_drafted == 0:
            return
        for n in num_accepted:  # every draft of an untrimmed step was used: num_kept = n + 1
            self.record_row_step(num_drafted, n, n + 1)

    def record_row_step(self, num_drafted: int, num_accepted: int, num_kept: int) -> None:
        """Add one row's verify step, counting only the tokens the row kept (after the eos/length trim).

        Args:
            num_drafted: γ_r, tokens the row drafted (>= 1).
            num_accepted: n, drafts the target accepted.
            num_kept: tokens committed after the trim (1 <= num_kept <= n + 1).

        A step cut inside its accepted drafts (an eos among them, or the length budget) is recorded as a step
        that drafted ``num_kept - 1`` tokens and accepted them all: drafts after the cut were never used, so they
        are neither accepted tokens nor rejections (τ then equals the tokens committed by the step).
        """
        if num_kept <= num_accepted:
            num_drafted = num_accepted = num_kept - 1
        n = num_drafted
        for lst, size in ((self.accepted_per_position, n), (self.drafted_per_position, n),
                          (self.accepted_length_histogram, n + 1)):
            lst.extend([0] * (size - len(lst)))
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_verify_steps += 1
        self.num_rejections += int(num_accepted < num_drafted)
        self.accepted_length_histogram[num_accepted] += 1
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    @property
    def acceptance_rate(self) -> float:
        """The acceptance rate Σaccepted / Σdrafted (0.0 when nothing was drafted). Not α: drafts after a
        rejection count as drafted but were never tried."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def alpha(self) -> float:
        """α = Σaccepted / (Σaccepted + rejections), Leviathan et al.'s per-token acceptance, the α of their
        speedup formulas (:mod:`decode.speedup`); 0.0 with no trials."""
        trials = self.num_accepted + self.num_rejections
        return self.num_accepted / trials if trials else 0.0

    @property
    def mean_num_draft_tokens(self) -> float:
        """Mean γ over verify steps (differs from the configured γ with ``"auto"`` and at the token budget's end)."""
        return self.num_drafted / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ = Σ(accepted + 1) / verify steps: tokens committed per target forward. Plain decoding (target
        forwards but no verify step) gives 1.0; nothing at all gives 0.0."""
        if not self.num_verify_steps:
            return 1.0 if self.num_target_forwards else 0.0
        return (self.num_accepted + self.num_verify_steps) / self.num_verify_steps

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of verify steps whose i-th draft token was accepted, for each drafted position i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def per_token_latency_s(self) -> float:
        """Seconds per new token of the decode phase: the time after the first tokens, less the draft's prefill that
        runs right after them (``total_s - ttft_s - draft_prefill_s``), over the tokens committed after them
        (``num_new_tokens - num_first_step_tokens``: the decoder's prefill gives one token per sequence; callers
        that do not record it count one per sequence). 0.0 when no token came after the first."""
        first = self.num_first_step_tokens or self.num_sequences
        n = self.num_new_tokens - first
        return (self.total_s - self.ttft_s - self.draft_prefill_s) / n if n > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens (all rows) per second of wall time."""
        return self.num_new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        """Counters plus the derived metrics, JSON-serialisable."""
        d = asdict(self)
        for name in ("acceptance_rate", "alpha", "mean_num_draft_tokens", "mean_accepted_length",
                     "acceptance_by_position", "per_token_latency_s", "tokens_per_s"):
            d[name] = getattr(self, name)
        return d

    @classmethod
    def merge(cls, stats: list["DecodeStats"]) -> "DecodeStats":
        """Pool several calls: counters and times add, peak memory is the max, TTFT is summed (divide by
        ``num_sequences`` calls yourself for a mean over batch-1 calls)."""
        out = cls()
        for s in stats:
            for name in ("num_drafted", "num_accepted", "num_verify_steps", "num_rejections", "num_new_tokens", "num_sequences",
                         "num_target_forwards", "num_draft_forwards", "ttft_s", "draft_prefill_s",
                         "num_first_step_tokens", "total_s"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
            out.peak_memory_bytes = max(out.peak_memory_bytes, s.peak_memory_bytes)
            for name in ("accepted_per_position", "drafted_per_position", "accepted_length_histogram"):
                a, b = getattr(out, name), getattr(s, name)
                a.extend([0] * (len(b) - len(a)))
                for i, v in enumerate(b):
                    a[i] += v
        return out


def chars_per_verify_step(num_chars: int, num_new_tokens: int, mean_accepted_length: float | None) -> float | None:
    """Characters of generated text per verify step: ``num_chars / num_new_tokens × τ``, with ``num_chars`` the
    length of the new tokens' text decoded by the target's tokenizer and τ the mean accepted length
    (:attr:`DecodeStats.mean_accepted_length`). None with no token or no τ."""
    if not num_new_tokens or mean_accepted_length is None:
        return None
    return num_chars / num_new_tokens * mean_accepted_length


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """Peak memory in bytes: ``torch.cuda.max_memory_allocated`` on a CUDA device, else the process's peak RSS."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
