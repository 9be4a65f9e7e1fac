"""``python -m decode certify``: a statistical certificate that a target/draft pair decodes losslessly.

At M prefixes the speculative decoder draws the next two tokens K times (K copies of the prefix, in batches of at
most ``batch_size`` rows; the first comes from the target's prefill, the second from the first speculative step,
whose acceptance rule it passes or whose residual draws it), and the draws are compared
with the target's exact distribution after the same temperature/top-k/top-p processing
(:func:`decode.sampling.logits_to_probs`):

- ``token1``: the first token against the target's p(x1 | prefix).
- ``token2``: the second token against its exact marginal sum_x p(x) p(y | prefix, x). The first token's support
  is enumerated over S, its most likely ids up to ``max_enumerate`` (all of it under top-k/top-p); when S misses
  part of the support, the event "x1 outside S" is one cell whose probability 1 - p(S) is still exact, so the
  test stays exact without enumerating 8k or 150k continuations (cheaper and exact, unlike a two-sample test
  against the target's own sampling, which would also double the sampling cost and the noise).
- ``joint``: the pair (x1, x2) against p(x1) p(x2 | x1) on the same cells; it also catches a decoder whose
  marginals are right but whose second token ignores the first (e.g. a cache rollback bug).

Each test is Pearson's chi-square on cells of expected count >= 5 (Cochran 1954); rarer outcomes are pooled into
one cell (merged into the smallest cell while the pool is still below 5). A sample on an outcome the target gives
probability 0 (outside top-k/top-p, or a greedy mismatch at T=0) makes the test's p-value 0. Per setting the
prefixes' statistics are also summed (independent draws: chi-square with the summed degrees of freedom), which
detects a bias shared by all prefixes sqrt(M) times more finely. All p-values of the run form one family under
Holm's step-down correction (Holm 1979); the pair fails when a hypothesis is rejected at family-wise level alpha.

A test with a single cell (df = 0) has power only when the target gives one outcome probability 1 (T=0, or top-k/
top-p keeping one id): it is then exact, since any other draw fails it. Otherwise its draws all fell into one pooled
cell (every outcome's expected count K p below 5) and it can detect nothing. A setting none of whose tests has power
is not certified: the verdict is INCONCLUSIVE (raise K), not PASS.

Upper confidence bound on the total-variation distance TV(P, p) between the decoder's distribution P and the
target's p, per prefix and test: TV(P, p) <= TV_cells(P_hat, p) + eps + p(pooled cells), where eps =
sqrt((k ln 2 + ln(1/delta)) / (2K)) bounds TV_cells(P_hat, P) on k cells with probability 1 - delta
(Bretagnolle-Huber-Carol inequality, van der Vaart & Wellner 1996, Prop. A.6.6; Weissman et al. 2003), and a
pooled cell adds at most min(P(c), p(c)) <= p(c) of TV inside it. delta = alpha / (number of bounds), so the bounds
hold simultaneously with confidence 1 - alpha. For the token2 cells the bound is on the second-token marginal.

Smallest detectable TV: Cauchy-Schwarz gives chi2-divergence >= 4 TV^2, so any P whose TV on the test's cells is
at least d gives the statistic a noncentrality K * chi2-div >= 4 K d^2 (Cohen 1988, ch. 7: lambda = N w^2). The
reported d is the smallest TV detected with power 0.8 at the Bonferroni level alpha / (number of tests), which
Holm's first step uses, for every such P. For an exact test it is the d with 1 - (1 - d)^K = 0.8: the chance that
one of the K draws falls outside the target's only outcome when P puts mass d there.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2

from decode.cache import context_length
from decode.cli_args import add_draft_tokenizer_arg, check_draft_tokenizer_arg
from decode.compat import check_argument_types, check_compatibility, shares_vocabulary
from decode.engine import SpeculativeDecoder
from decode.loading import (check_cached, check_device, hub_revision, load_causal_lm, load_draft_tokenizer,
                            load_target_tokenizer)
from decode.outputs import check_output_file, write_new_file
from decode.prompts import encode_prompts, load_prompts
from decode.requests import check_seed
from decode.sampling import logits_to_probs, validate_sampling_args

MIN_EXPECTED = 5.0  # Cochran's rule for the chi-square approximation
POWER = 0.8  # power at which the smallest detectable TV is reported
TESTS = ("token1", "token2", "joint")
DEFAULT_SETTINGS = "T=1; T=0.7,top_p=0.9; T=0.7,top_k=20"
DRAW_BATCH = 1024  # most copies of a prefix per generate call: memory grows with it, the draws' distribution does not
EXIT_CODES = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}  # 2: bad input; 4: --out appeared during the run
EXIT_NO_VERDICT = 5  # the run stopped with an unexpected error before a verdict (never the FAIL code)


# ---------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Setting:
    """One sampling configuration to certify."""

    temperature: float
    top_k: int | None = None
    top_p: float | None = None

    @property
    def label(self) -> str:
        parts = [f"T={self.temperature:g}"]
        if self.top_k is not None:
            parts.append(f"top_k={self.top_k}")
        if self.top_p is not None:
            parts.append(f"top_p={self.top_p:g}")
        return ",".join(parts)

    def sampling(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


_KEYS = {"t": "temperature", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p"}


def parse_settings(text: str) -> list[Setting]:
    """Parse ``"T=1; T=0.7,top_p=0.9; T=0.7,top_k=20"``: settings separated by ``;``, each ``key=value`` pairs
    separated by ``,`` with keys ``T`` (or ``temperature``, required), ``top_k``, ``top_p``.

    Raises:
        ValueError: naming the part (1-based) and the problem: empty part, unknown or repeated key, a value that
            is not a number, a missing T, a value outside its range (see ``validate_sampling_args``), or a setting
            given twice (``T=1; temperature=1.0``).
    """
    parts = text.split(";")
    settings = []
    for i, raw in enumerate(parts, 1):
        part = raw.strip()
        where = f"--settings part {i} ({part!r})"
        if not part:
            raise ValueError(f"--settings part {i} is empty; separate settings with ';' as in {DEFAULT_SETTINGS!r}")
        values: dict[str, Any] = {}
        for item in part.split(","):
            key, eq, value = (s.strip() for s in item.partition("="))
            if not eq or not key or not value:
                raise ValueError(f"{where}: {item.strip()!r} is not key=value; use T=..., top_k=..., top_p=...")
            name = _KEYS.get(key.lower())
            if name is None:
                raise ValueError(f"{where}: unknown key {key!r}; use T, top_k or top_p")
            if name in values:
                raise ValueError(f"{where}: {key!r} given twice")
            try:
                values[name] = int(value) if name == "top_k" else float(value)
            except ValueError:
                kind = "an integer" if name == "top_k" else "a number"
                raise ValueError(f"{where}: {key}={value!r} is not {kind}") from None
        if "temperature" not in values:
            raise ValueError(f"{where}: no temperature; add T=... (T=0 is greedy)")
        try:
            validate_sampling_args(values["temperature"], values.get("top_k"), values.get("top_p"))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        setting = Setting(**values)
        for j, earlier in enumerate(settings, 1):
            if earlier.label == setting.label:  # the results are grouped by label: the two would be mixed
                raise ValueError(f"{where} repeats part {j} ({parts[j - 1].strip()!r}): both are {setting.label}; "
                                 "give each setting once")
            if _distribution(earlier) == _distribution(setting):
                raise ValueError(f"{where} samples the same distribution as part {j} ({parts[j - 1].strip()!r}): "
                                 "top_p=1 keeps every id, and T=0 is greedy whatever top_k/top_p; give each "
                                 "setting once")
        settings.append(setting)
    return settings


def _distribution(setting: Setting) -> tuple:
    """What decides a setting's sampling distribution: T = 0 is greedy whatever top_k/top_p say, top_p = 1 is off."""
    if setting.temperature == 0:
        return (0.0,)
    return setting.temperature, setting.top_k, setting.top_p if setting.top_p != 1 else None


# ---------------------------------------------------------------------------------------------------- statistics
@dataclass
class TestResult:
    """One chi-square goodness-of-fit test on a partition of the outcomes into cells."""

    setting: str
    prefix: int | None  # None for the test combined over prefixes
    test: str  # token1 | token2 | joint
    samples: int
    cells: int
    df: int
    statistic: float
    p_value: float
    impossible: int = 0  # samples on outcomes of target probability 0
    tv_observed: float | None = None  # TV_cells(P_hat, p)
    tv_upper: float | None = None  # upper confidence bound on the TV (see module docstring)
    pooled_mass: float | None = None  # target probability of the pooled cells (unresolved by the test)
    detectable_tv: float | None = None  # smallest TV on the cells detected with power 0.8 (None: no power)
    exact: bool = False  # the target gives one outcome probability 1: any other draw fails the test
    p_holm: float | None = None
    rejected: bool = False


def pooled_cells(probs: np.ndarray, observed: np.ndarray, samples: int,
                 min_expected: float = MIN_EXPECTED) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Partition outcomes into cells for a chi-square test.

    Args:
        probs: ``(n,)`` float64 exact probabilities of the enumerated outcomes; the outcomes not enumerated have
            probability ``1 - probs.sum()`` together.
        observed: ``(samples,)`` int64 outcome index of each draw, ``-1`` for a draw outside the enumeration.
        samples: K, the number of draws.
        min_expected: outcomes with expected count ``K * p`` below it are pooled.

    Returns:
        ``(cell_probs (k,), cell_counts (k,), resolved (k,) bool, impossible)``: resolved cells are single
        outcomes, likeliest first; the last cell pools the rest when there is any; ``impossible`` counts draws on
        outcomes of probability 0.
    """
    counts = np.bincount(observed[observed >= 0], minlength=len(probs)).astype(np.float64)
    impossible = int(counts[probs <= 0].sum())
    order = np.argsort(-probs, kind="stable")
    heavy = order[samples * probs[order] >= min_expected - 1e-9]
    cell_p, cell_n = list(probs[heavy]), list(counts[heavy])
    rest_p = max(0.0, 1.0 - float(np.sum(cell_p)))  # light outcomes and the non-enumerated ones
    rest_n = samples - float(np.sum(cell_n))
    # float32 probabilities sum to 1 only up to ~1e-6: an empty pool that small is round-off, not a cell.
    while cell_p and samples * rest_p < min_expected - 1e-9 and not (rest_n == 0 and rest_p < 1e-5):
        rest_p += cell_p.pop()  # merge the pool into the smallest cell until its expected count is large enough
        rest_n += cell_n.pop()
    resolved = [True] * len(cell_p)
    if rest_n > 0 or rest_p >= 1e-5 or not cell_p:
        cell_p.append(rest_p)
        cell_n.append(rest_n)
        resolved.append(False)
    return np.array(cell_p), np.array(cell_n), np.array(resolved), impossible


def chi_square_test(cell_p: np.ndarray, cell_n: np.ndarray, impossible: int) -> tuple[float, int, float]:
    """Pearson's statistic, degrees of freedom and p-value; p-value 0 if a draw hit a probability-0 outcome."""
    m = cell_p > 0
    expected = cell_p[m] * cell_n.sum()
    stat = float(((cell_n[m] - expected) ** 2 / expected).sum())
    df = int(m.sum()) - 1
    if impossible > 0 or cell_n[~m].sum() > 0:
        return stat, df, 0.0
    return stat, df, float(chi2.sf(stat, df)) if df > 0 else 1.0


def bhc_radius(cells: int, samples: int, delta: float) -> float:
    """eps with P(TV(P_hat, P) >= eps) <= delta on ``cells`` cells from ``samples`` draws (Bretagnolle-Huber-Carol:
    P(||P_hat - P||_1 >= 2 eps) <= 2^k exp(-2 K eps^2))."""
    return math.sqrt((cells * math.log(2) + math.log(1 / delta)) / (2 * samples))


def detectable_tv(df: int, samples: int, level: float, power: float = POWER, exact: bool = False) -> float | None:
    """Smallest TV on the cells that a chi-square test with ``df`` degrees of freedom at ``level`` detects with
    ``power``: sqrt(lambda* / (4 K)) where ncx2(df, lambda*) exceeds the critical value with probability ``power``
    (Cohen 1988, ch. 7; chi2-divergence >= 4 TV^2). ``exact`` (the target gives one outcome probability 1): the d
    with 1 - (1 - d)^K = ``power``, the chance that a draw misses that outcome. None when df = 0 and not exact:
    every draw fell into one pooled cell, and the test has no power."""
    if exact:
        return 1.0 - (1.0 - power) ** (1.0 / samples)
    if df < 1:
        return None
    crit = chi2.isf(level, df)
    lam = brentq(lambda x: ncx2.sf(crit, df, x) - power, 1e-9, 1e7)
    return math.sqrt(lam / (4 * samples))


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm (1979) step-down adjusted p-values, in input order."""
    p = np.asarray(p_values, dtype=np.float64)
    n = len(p)
    order = np.argsort(p, kind="stable")
    adj = np.minimum(1.0, np.maximum.accumulate((n - np.arange(n)) * p[order]))
    out = np.empty(n)
    out[order] = adj
    return out


# ---------------------------------------------------------------------------------------------------- sampling
@torch.no_grad()
def exact_distributions(target: Any, prefix: Sequence[int], setting: Setting, vocab_size: int,
                        max_enumerate: int, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's processed first-token distribution and the next-token distributions after its likeliest ids.

    Returns:
        ``(p1 (V,), support (S,), p2 (S, V))`` float64 on CPU: ``p1`` after ``logits_to_probs``, ``support`` the ids
        of p1's S most likely ids with p > 0 (S <= ``max_enumerate``), and ``p2[i]`` = p(. | prefix, support[i]).
    """
    device = next(target.parameters()).device
    ids = torch.tensor([list(prefix)], device=device)
    p1 = logits_to_probs(target(ids).logits[0, -1], vocab_size=vocab_size, **setting.sampling()).double().cpu()
    nonzero = int((p1 > 0).sum())
    support = torch.argsort(p1, descending=True, stable=True)[: min(nonzero, max_enumerate)]
    rows = []
    for chunk in support.split(batch_size):
        seqs = torch.cat([ids.expand(len(chunk), -1), chunk[:, None].to(device)], dim=1)
        logits = target(seqs, logits_to_keep=1).logits[:, -1]
        rows.append(logits_to_probs(logits, vocab_size=vocab_size, **setting.sampling()).double().cpu())
    return p1, support, torch.cat(rows)


def draw_two_tokens(decoder: Any, prefix: Sequence[int], samples: int, setting: Setting, num_draft_tokens: int,
                    generator: torch.Generator, device: Any, batch_size: int = DRAW_BATCH) -> np.ndarray:
    """K independent draws of the next two tokens through ``decoder.generate``: ``(K, 2)`` int64.

    K copies of the prefix go in batches of at most ``batch_size`` rows (rows are decoded independently, so the
    batching changes which draws come out, not their distribution). The first token comes from the target's
    prefill; ``max_new_tokens = γ + 2`` so the first step after it drafts the full γ tokens and the second token is
    a verified draft or a residual draw; no eos is passed, so every row yields its tokens. Only the first two are
    kept.
    """
    rows = []
    for start in range(0, samples, batch_size):
        ids = torch.tensor([list(prefix)] * min(batch_size, samples - start), device=device)
        out = decoder.generate(ids, max_new_tokens=num_draft_tokens + 2, generator=generator,
                               num_draft_tokens=num_draft_tokens, **setting.sampling())
        rows += [t[:2].tolist() for t in out.new_tokens]
    if any(len(r) < 2 for r in rows):
        raise RuntimeError("the decoder returned fewer than two new tokens for a row; the prefix may fill the "
                           "target's context")
    return np.array(rows, dtype=np.int64)


def _point_mass(probs: np.ndarray) -> bool:
    """The outcomes' probabilities put all the mass on one outcome (the rest, not enumerated, has none)."""
    return int((probs > 0).sum()) == 1 and float(probs.sum()) >= 1 - 1e-5


def _tests_at_prefix(draws: np.ndarray, p1: torch.Tensor, support: torch.Tensor, p2: torch.Tensor,
                     samples: int) -> dict[str, tuple]:
    """Cells (:func:`pooled_cells`) and exactness (:func:`_point_mass`) of token1, token2 and joint at one prefix
    (see the module docstring)."""
    V = p1.shape[0]
    p1n, sup, p2n = p1.numpy(), support.numpy(), p2.numpy()
    x1, x2 = draws[:, 0], draws[:, 1]
    pos = np.full(V, -1, dtype=np.int64)
    pos[sup] = np.arange(len(sup))
    s_idx = pos[x1]  # index of x1 in the enumerated support, -1 outside it
    inside = s_idx >= 0
    joint = p1n[sup][:, None] * p2n  # (S, V)
    outcomes = {"token1": (p1n, x1), "token2": (joint.sum(0), np.where(inside, x2, -1)),
                "joint": (joint.reshape(-1), np.where(inside, s_idx * V + x2, -1))}
    return {name: (pooled_cells(p, obs, samples), _point_mass(p)) for name, (p, obs) in outcomes.items()}


def max_prefix_length(target: Any, draft: Any, num_draft_tokens: int) -> tuple[int | None, str]:
    """The longest prefix whose first step still drafts all γ tokens, and why: the prefill gives one token, and the
    engine cuts γ so that the prefix, that token and γ + 1 more fit the target's context and the prefix, that token
    and γ drafted tokens the draft's.

    Returns:
        ``(limit, reason)``; ``limit`` is None when neither model states a context length.
    """
    g, ctx_t, ctx_d = num_draft_tokens, context_length(target), context_length(draft)
    limits = [c for c in (ctx_t - g - 2 if ctx_t else None, ctx_d - g - 1 if ctx_d else None) if c is not None]
    reason = (f"the prefix and its γ + 2 = {g + 2} new tokens must fit the target's context ({ctx_t}) and the prefix, "
              f"its first new token and γ = {g} drafted tokens the draft's ({ctx_d})")
    return (min(limits) if limits else None), reason


def certify(target: Any, draft: Any, prefixes: Sequence[Sequence[int]], settings: Sequence[Setting], *,
            samples: int = 1000, num_draft_tokens: int = 2, alpha: float = 0.01, seed: int = 0,
            tokenizer: Any = None, draft_tokenizer: Any = None, max_enumerate: int = 128,
            decoder: Any = None, log: Any = None, batch_size: int = DRAW_BATCH) -> dict:
    """Test that speculative decoding of ``target`` with ``draft`` samples the target's distribution.

    Args:
        target, draft: Hugging Face causal LMs (frozen, on one device).
        prefixes: M token-id lists; each is continued K = ``samples`` times per setting.
        settings: sampling configurations (see :func:`parse_settings`).
        samples: K draws of two tokens per prefix and setting.
        num_draft_tokens: γ >= 2.
        alpha: family-wise error rate of the whole certificate (Holm) and 1 - confidence of the TV bounds.
        seed: seeds the one ``torch.Generator`` of every draw.
        tokenizer, draft_tokenizer: passed to the decoder to fix the shared vocabulary (as in generate/serve).
        max_enumerate: at most this many first tokens are enumerated for the exact second-token distribution.
        decoder: an object with ``generate(input_ids (K, T), max_new_tokens, temperature, top_k, top_p, generator,
            num_draft_tokens) -> .new_tokens``; default ``SpeculativeDecoder(target, draft, γ, ...)``.
        log: optional callable taking one progress line.
        batch_size: at most this many copies of a prefix per ``generate`` call.

    Returns:
        the certificate as a JSON-ready dict: ``verdict`` (``PASS``; ``FAIL``: a test rejected; ``INCONCLUSIVE``: no
        rejection, but a setting none of whose tests has power), ``passed`` (verdict is PASS), per-test results
        (:class:`TestResult`), per-setting summaries (verdict, sample sizes, smallest adjusted p-value, largest TV
        bound, median smallest detectable TV, prefixes whose test has no power) and the method.

    Raises:
        ValueError: γ < 2, K < 1, alpha outside (0, 1), batch_size < 1, no prefixes or no settings, two settings
            with the same label, or a prefix too long for the models' contexts (:func:`max_prefix_length`).
    """
    prefixes = _check_arguments(target, draft, prefixes, settings, samples, num_draft_tokens, alpha, batch_size,
                                tokenizer, draft_tokenizer)
    if decoder is None:
        decoder = SpeculativeDecoder(target, draft, num_draft_tokens, tokenizer=tokenizer,
                                     draft_tokenizer=draft_tokenizer)
    vocab_size = check_compatibility(target, draft, tokenizer, draft_tokenizer or tokenizer,
                                     cross_vocab=not shares_vocabulary(tokenizer, draft_tokenizer))
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    start = time.perf_counter()
    per_prefix: list[tuple[TestResult, np.ndarray, np.ndarray, np.ndarray]] = []
    for setting in settings:
        for m, prefix in enumerate(prefixes):
            draws = draw_two_tokens(decoder, prefix, samples, setting, num_draft_tokens, generator, device,
                                    batch_size)
            p1, support, p2 = exact_distributions(target, prefix, setting, vocab_size, max_enumerate)
            tests = _tests_at_prefix(draws, p1, support, p2, samples)
            for name, ((cp, cn, resolved, impossible), exact) in tests.items():
                stat, df, pv = chi_square_test(cp, cn, impossible)
                res = TestResult(setting.label, m, name, samples, len(cp), df, stat, pv, impossible, exact=exact)
                per_prefix.append((res, cp, cn, resolved))
            if log is not None:
                log(f"{setting.label}  prefix {m + 1}/{len(prefixes)}  ({time.perf_counter() - start:.0f} s)")
    results = [r for r, *_ in per_prefix] + _combined_tests([r for r, *_ in per_prefix], settings, samples)
    _add_tv_bounds(results, per_prefix, samples, alpha)
    for res, adj in zip(results, holm([r.p_value for r in results])):
        res.p_holm = float(adj)
        res.rejected = bool(adj <= alpha)
    return _summarise(results, settings, prefixes, samples, num_draft_tokens, alpha, seed, max_enumerate,
                      time.perf_counter() - start)


def _check_arguments(target: Any, draft: Any, prefixes: Any, settings: Any, samples: Any, num_draft_tokens: Any,
                     alpha: Any, batch_size: Any, tokenizer: Any, draft_tokenizer: Any) -> Sequence[Sequence[int]]:
    """:func:`certify`'s argument checks, before any draw; returns the prefixes as lists (a 2-D tensor is split)."""
    if draft is None:
        raise ValueError("certify needs a draft: it tests the speculative decoder of the target/draft pair")
    check_argument_types(target, draft, tokenizer, draft_tokenizer)
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 2:
        raise ValueError(f"num_draft_tokens must be an integer >= 2 so the second token passes a draft, "
                         f"got {num_draft_tokens!r}")
    for name, value in (("samples", samples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if isinstance(prefixes, torch.Tensor) and prefixes.dim() == 2:
        prefixes = prefixes.tolist()
    if not isinstance(settings, (list, tuple)) or not all(isinstance(s, Setting) for s in settings):
        raise ValueError(f"settings must be a list of Setting (e.g. parse_settings('T=1; T=0.7,top_p=0.9')), got "
                         f"{settings!r}"[:200])
    if not isinstance(prefixes, (list, tuple)) or not all(isinstance(p, (list, tuple, torch.Tensor)) for p in prefixes):
        raise ValueError("prefixes must be a list of token-id lists (one per prefix, e.g. [[5, 6, 7]]), got "
                         f"{prefixes!r}"[:200])
    if not prefixes or not settings:
        raise ValueError("certify needs at least one prefix and one setting")
    labels = [s.label for s in settings]
    if len(set(labels)) < len(labels):
        raise ValueError(f"settings repeat {next(x for x in labels if labels.count(x) > 1)}; give each setting once")
    limit, reason = max_prefix_length(target, draft, num_draft_tokens)
    for m, prefix in enumerate(prefixes):
        if limit is not None and len(prefix) > limit:
            raise ValueError(f"prefix {m} has {len(prefix)} tokens, more than {limit}: {reason}")
    return prefixes


def _combined_tests(per_prefix: list[TestResult], settings: Sequence[Setting], samples: int) -> list[TestResult]:
    """One combined test per setting and kind: the sum of the prefixes' independent chi-square statistics."""
    combined = []
    for setting in settings:
        for name in TESTS:
            group = [r for r in per_prefix if r.setting == setting.label and r.test == name]
            stat, df = sum(r.statistic for r in group), sum(r.df for r in group)
            bad = any(r.p_value == 0.0 and r.impossible > 0 for r in group)
            pv = 0.0 if bad else (float(chi2.sf(stat, df)) if df > 0 else 1.0)
            combined.append(TestResult(setting.label, None, name, samples * len(group), sum(r.cells for r in group),
                                       df, stat, pv, sum(r.impossible for r in group),
                                       exact=all(r.exact for r in group)))
    return combined


def _add_tv_bounds(results: list[TestResult], per_prefix: list, samples: int, alpha: float) -> None:
    """Fill each test's observed TV, its upper confidence bound (simultaneous over the per-prefix tests) and the
    smallest TV it could detect at Holm's first-step level."""
    level = alpha / len(results)  # Bonferroni level of Holm's first step
    delta = alpha / len(per_prefix)  # simultaneous confidence of the TV bounds
    for res, cp, cn, resolved in per_prefix:
        res.tv_observed = 0.5 * float(np.abs(cn / samples - cp).sum())
        res.pooled_mass = max(0.0, 1.0 - float(cp[resolved].sum()))
        res.tv_upper = min(1.0, res.tv_observed + bhc_radius(len(cp), samples, delta) + res.pooled_mass)
        res.detectable_tv = detectable_tv(res.df, samples, level, exact=res.exact)
    for comb in results:
        if comb.prefix is None:  # a bias shared by the prefixes whose tests have power (RMS of their TVs)
            group = [r for r in results if r.prefix is not None and r.setting == comb.setting and r.test == comb.test]
            chi2_part, exact_part = [r for r in group if r.df > 0], [r for r in group if r.exact]
            if chi2_part:
                comb.detectable_tv = detectable_tv(comb.df, samples * len(chi2_part), level)
            elif exact_part:
                comb.detectable_tv = detectable_tv(0, samples * len(exact_part), level, exact=True)


def _summarise(results: list[TestResult], settings, prefixes, samples, gamma, alpha, seed, max_enumerate,
               elapsed) -> dict:
    summary = []
    for s in settings:
        mine = [r for r in results if r.setting == s.label]
        each = [r for r in mine if r.prefix is not None]
        powered = any(r.detectable_tv is not None for r in mine)
        verdict = "FAIL" if any(r.rejected for r in mine) else "pass" if powered else "no power"
        row = {"setting": s.label, **s.sampling(), "prefixes": len(prefixes), "samples_per_prefix": samples,
               "draws": samples * len(prefixes), "verdict": verdict, "passed": verdict == "pass",
               "min_p_holm": min(r.p_holm for r in mine)}
        for name in TESTS:
            part = [r for r in each if r.test == name]
            comb = next(r for r in mine if r.prefix is None and r.test == name)
            # A prefix whose test has no power counts as undetectable (inf), so the median does not overstate power.
            median = float(np.median([math.inf if r.detectable_tv is None else r.detectable_tv for r in part]))
            row[name] = {"max_tv_upper": max(r.tv_upper for r in part),
                         "max_tv_observed": max(r.tv_observed for r in part),
                         "max_pooled_mass": max(r.pooled_mass for r in part),
                         "median_detectable_tv": median if math.isfinite(median) else None,
                         "no_power_prefixes": sum(r.detectable_tv is None for r in part),
                         "exact_prefixes": sum(r.exact for r in part),
                         "combined_detectable_tv": comb.detectable_tv, "combined_p_value": comb.p_value}
        summary.append(row)
    verdicts = {row["verdict"] for row in summary}
    verdict = "FAIL" if "FAIL" in verdicts else "INCONCLUSIVE" if "no power" in verdicts else "PASS"
    return {
        "verdict": verdict, "passed": verdict == "PASS",
        "alpha": alpha, "num_draft_tokens": gamma, "num_prefixes": len(prefixes), "samples_per_prefix": samples,
        "num_tests": len(results), "seed": seed, "max_enumerate": max_enumerate, "elapsed_s": elapsed,
        "prefix_lengths": [len(p) for p in prefixes],
        "settings": summary,
        "tests": [asdict(r) for r in results],
        "method": {
            "test": "Pearson chi-square per prefix (token1, token2 marginal, joint) and summed over prefixes; "
                    f"cells with expected count >= {MIN_EXPECTED:g} (Cochran 1954), the rest pooled",
            "correction": "Holm (1979) step-down over all tests; family-wise error rate alpha",
            "tv_upper": "TV_cells(P_hat, p) + sqrt((k ln2 + ln(1/delta)) / 2K) + p(pooled cells), "
                        "delta = alpha / #bounds (Bretagnolle-Huber-Carol; van der Vaart & Wellner 1996 A.6.6)",
            "detectable_tv": f"power {POWER} at level alpha/#tests, any alternative with that TV on the cells "
                             "(noncentral chi-square, Cohen 1988 ch. 7; chi2-divergence >= 4 TV^2); exact tests "
                             f"(target mass 1 on one outcome): 1 - (1 - d)^K = {POWER}; null: no power (df = 0)",
        },
    }


# ---------------------------------------------------------------------------------------------------- report
def format_certificate(cert: dict) -> str:
    """A plain-text certificate: verdict, sample sizes, per-setting smallest adjusted p-value, largest TV bound,
    smallest detectable TV, prefixes whose test has no power (and what to raise when a setting has none)."""
    lines = [f"speculative decoding certificate: {cert['verdict']}",
             f"  γ={cert['num_draft_tokens']}  {cert['num_prefixes']} prefixes x {cert['samples_per_prefix']} "
             f"draws of two tokens per setting; {cert['num_tests']} chi-square tests, Holm family-wise "
             f"alpha={cert['alpha']:g}; TV bounds hold together with confidence {1 - cert['alpha']:g}",
             f"  {'setting':24s} {'result':8s} {'min p_holm':>10s} {'test':>7s} {'TV<= (max)':>10s} "
             f"{'pooled':>7s} {'detect TV':>9s} {'combined':>9s} {'no power':>8s}"]
    for s in cert["settings"]:
        for i, name in enumerate(TESTS):
            t = s[name]
            det, comb = ("no power" if d is None else f"{d:.3f}"
                         for d in (t["median_detectable_tv"], t["combined_detectable_tv"]))
            head = (f"  {s['setting']:24s} {s['verdict']:8s} {s['min_p_holm']:10.2e}" if i == 0
                    else f"  {'':24s} {'':8s} {'':10s}")
            lines.append(f"{head} {name:>7s} {t['max_tv_upper']:10.3f} {t['max_pooled_mass']:7.3f} {det:>9s} "
                         f"{comb:>9s} {t['no_power_prefixes']:>4d}/{s['prefixes']:<3d}")
    lines.append("  TV<=: largest upper bound over prefixes (pooled mass included); detect TV: median over prefixes "
                 "of the smallest TV on the cells found with power 0.8 (a prefix whose test has no power counts as "
                 "undetectable); combined: the same for a bias shared by all prefixes (RMS); no power: prefixes "
                 "whose draws all fell into one pooled cell (every outcome's expected count K·p below "
                 f"{MIN_EXPECTED:g}). A test where the target gives one outcome probability 1 (T=0) is exact: any "
                 "other draw fails it")
    weak = [s["setting"] for s in cert["settings"] if s["verdict"] == "no power"]
    if weak and cert["verdict"] == "INCONCLUSIVE":
        lines.append(f"  INCONCLUSIVE: no test of {'; '.join(weak)} has any power at K = {cert['samples_per_prefix']} "
                     "draws per prefix; raise --samples/-K (a test needs two cells of expected count K·p >= "
                     f"{MIN_EXPECTED:g}; more prefixes, -M, do not help)")
    lines.append(f"  {cert['elapsed_s']:.0f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode certify",
                                description="Check statistically that a target/draft pair decodes losslessly.",
                                epilog="exit status: 0 PASS; 1 FAIL (a test rejected); 2 bad input, checked before "
                                       "any sampling; 3 INCONCLUSIVE (no rejection, but a setting none of whose tests "
                                       "has power: raise -K); 4 --out appeared during the run and was kept, the "
                                       "certificate was written next to it under a new name (printed); 5 the run "
                                       "stopped with an unexpected error before a verdict")
    p.add_argument("--target", required=True, help="target checkpoint: local path or hub id")
    p.add_argument("--draft", required=True, help="draft checkpoint: local path or hub id")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target's)")
    add_draft_tokenizer_arg(p)
    p.add_argument("--prompts", default="humaneval", help="prompt set name or .jsonl path the prefixes come from")
    p.add_argument("--prompt-field", default=None, help="text field of a local jsonl, or another field of a named set")
    p.add_argument("--settings", default=DEFAULT_SETTINGS,
                   help=f"';'-separated sampling settings (default {DEFAULT_SETTINGS!r})")
    p.add_argument("--num-prefixes", "-M", type=int, default=4, help="M prefixes (one per prompt; default 4)")
    p.add_argument("--samples", "-K", type=int, default=1000, help="K draws of two tokens per prefix (default 1000)")
    p.add_argument("--prefix-tokens", type=int, default=8,
                   help="each prefix is the last this many tokens of its prompt (default 8: every one of the K "
                        "copies is prefilled, so the cost grows with it)")
    p.add_argument("--num-draft-tokens", "-g", type=int, default=2, help="γ >= 2 (default 2)")
    p.add_argument("--alpha", type=float, default=0.01, help="family-wise error rate (default 0.01)")
    p.add_argument("--max-enumerate", type=int, default=128,
                   help="first tokens enumerated for the exact second-token distribution (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--out", default=None, help="write the certificate as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return p


def _check_args(args: argparse.Namespace) -> list[Setting]:
    """Every check that needs no model; raises ValueError (FileNotFoundError for a model path) naming the option."""
    settings = parse_settings(args.settings)
    for name in ("num_prefixes", "samples", "prefix_tokens", "max_enumerate"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_draft_tokens < 2:
        raise ValueError(f"--num-draft-tokens must be >= 2 so the second token goes through a draft, "
                         f"got {args.num_draft_tokens}")
    if not 0 < args.alpha < 1:
        raise ValueError(f"--alpha must be in (0, 1), got {args.alpha}")
    if args.out is not None:
        check_output_file(args.out, "--out", args.overwrite)
    elif args.overwrite:
        raise ValueError("--overwrite replaces an existing --out file, and no --out was given (nothing is written "
                         "without one); add --out FILE or drop --overwrite")
    check_draft_tokenizer_arg(args.draft, args.draft_tokenizer)
    for option in ("target", "draft", "tokenizer"):
        if getattr(args, option) is not None:
            check_cached(getattr(args, option), f"--{option}")
    return settings


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m decode certify``; returns 0 on PASS, 1 on FAIL, 2 on bad input, 3 when
    INCONCLUSIVE, 4 when ``--out`` appeared during the run (the certificate is then in a new file beside it), 5
    when an unexpected error stopped the run before a verdict (with its traceback: a bug to report; an uncaught
    exception would exit 1, the FAIL code, and a script would read it as "not lossless")."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as err:  # e.g. decode.compat.IncompatibleModelsError, a bad --dtype
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # not a verdict: keep exit 1 for FAIL only
        traceback.print_exc()
        print(f"error: certify stopped before a verdict ({type(err).__name__}: {err}); exit "
              f"{EXIT_NO_VERDICT}, no certificate", file=sys.stderr)
        return EXIT_NO_VERDICT


def _run(args: argparse.Namespace) -> int:
    """:func:`main` after argument parsing."""
    try:  # every check that needs no model: bad input exits 2 before anything loads
        settings = _check_args(args)
        check_seed(args.seed, "--seed", none_ok=False)
        device = check_device(args.device)
        prompts = load_prompts(args.prompts, limit=args.num_prefixes, field=args.prompt_field)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if len(prompts) < args.num_prefixes:  # said before the run, not only in the certificate's num_prefixes
        print(f"note: --prompts {args.prompts} has {len(prompts)} prompt(s), fewer than --num-prefixes "
              f"{args.num_prefixes}; certifying {len(prompts)} prefix(es)", file=sys.stderr)
    tok = load_target_tokenizer(args.tokenizer, args.target)
    prefixes = encode_prompts(prompts, tok, chat_template=False, max_prompt_tokens=args.prefix_tokens)
    target = load_causal_lm(args.target, "target", args.dtype, device)
    draft = load_causal_lm(args.draft, "draft", args.dtype, device)
    draft_tok = load_draft_tokenizer(args.draft, tok, tokenizer_path=args.draft_tokenizer)
    limit, reason = max_prefix_length(target, draft, args.num_draft_tokens)
    if limit is not None and limit < 1:  # no prefix fits: γ itself is too large for the models' context
        print(f"error: --num-draft-tokens {args.num_draft_tokens} leaves no room for a prefix: {reason}; lower "
              "--num-draft-tokens", file=sys.stderr)
        return 2
    if limit is not None and args.prefix_tokens > limit:
        print(f"error: --prefix-tokens {args.prefix_tokens} is more than {limit}: {reason}; use --prefix-tokens "
              f"<= {limit}", file=sys.stderr)
        return 2
    cert = certify(target, draft, prefixes, settings, samples=args.samples, num_draft_tokens=args.num_draft_tokens,
                   alpha=args.alpha, seed=args.seed, tokenizer=tok, draft_tokenizer=draft_tok,
                   max_enumerate=args.max_enumerate, log=lambda line: print(line, file=sys.stderr, flush=True))
    cert.update(target=args.target, target_revision=hub_revision(args.target), draft=args.draft,
                draft_revision=hub_revision(args.draft), draft_tokenizer=args.draft_tokenizer, prompts=args.prompts,
                prompt_ids=[p.id for p in prompts])
    print(format_certificate(cert))
    if args.out is not None:
        out = Path(args.out).expanduser()
        written = write_new_file(json.dumps(cert, indent=1), out, args.overwrite)
        if written != out:
            print(f"error: --out {str(out)!r} appeared during the run and was kept; the certificate "
                  f"({cert['verdict']}) is in {str(written)!r}", file=sys.stderr)
            return 4
        print(f"wrote {out}", file=sys.stderr)
    return EXIT_CODES[cert["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
