"""Predicted speedup of speculative decoding and the adaptive choice of γ.

Leviathan, Kalman, Matias (2023), Sec. 3.1–3.4: with i.i.d. acceptance α, γ drafted tokens and a draft/target
cost ratio c (time of one draft forward / time of one target forward), a verify step commits on average
``(1 − α^(γ+1)) / (1 − α)`` tokens and costs ``γc + 1`` target-forward units, so the expected wall-clock
improvement over plain target decoding is ``(1 − α^(γ+1)) / ((1 − α)(γc + 1))``.
"""
from __future__ import annotations

import math
import numbers
import random
from typing import Any, Callable, Sequence


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """Expected committed tokens per verify step, ``(1 − α^(γ+1)) / (1 − α)``; equals γ+1 at α = 1.

    Raises ValueError if α is outside [0, 1] or γ < 0.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def catchup_cost(alpha: float, gamma: int, cost_ratio: float, catchup_cost_ratio: float | None) -> float:
    """The expected extra cost per step, in target forwards, of the draft's catch-up input: after a step that accepted
    all γ drafts (probability α^γ under i.i.d. acceptance) the γ-th draft was never fed to the draft, so the next
    step's first draft forward reads two tokens, costing ``catchup_cost_ratio`` (c₂: a two-token draft forward / the
    target's one-token forward) instead of c. ``α^γ · max(c₂ − c, 0)``; 0 for γ = 0 or c₂ None (not measured). Where
    a two-token forward costs what a one-token one does (the few-row kernels, float32 on CPU) it is about 0; in
    bfloat16 on CPU a two-token draft forward costs about twice a one-token one."""
    if gamma <= 0 or catchup_cost_ratio is None:
        return 0.0
    return alpha ** gamma * max(float(catchup_cost_ratio) - cost_ratio, 0.0)


def predicted_speedup(alpha: float, gamma: int, cost_ratio: float, verify_cost: float = 1.0,
                      catchup_cost_ratio: float | None = None) -> float:
    """Predicted speedup over plain target decoding, ``(1 − α^(γ+1)) / ((1 − α)(γc + v_γ + e))``, e the draft's
    catch-up (:func:`catchup_cost`; 0 without ``catchup_cost_ratio``).

    Args:
        alpha: per-token acceptance α in [0, 1] (Leviathan et al.'s α, not Σaccepted / Σdrafted).
        gamma: drafted tokens per step (γ = 0 gives 1.0: plain decoding).
        cost_ratio: c >= 0, draft forward time / target forward time on the same hardware.
        verify_cost: v_γ, time of the target's forward over γ+1 tokens / its one-token forward (1.0 in Leviathan
            et al.'s model; larger where the verify is compute-bound: CPU, large batches). The step then costs
            ``γc + v_γ``.
        catchup_cost_ratio: c₂, a two-token draft forward / the target's one-token forward, or None (the step
            costs ``γc + v_γ`` alone); see :func:`catchup_cost`.

    Raises:
        ValueError: α outside [0, 1], γ < 0, c < 0 or NaN, or v_γ <= 0 or NaN.
    """
    if cost_ratio < 0 or math.isnan(cost_ratio):
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    if not verify_cost > 0:
        raise ValueError(f"verify_cost must be > 0, got {verify_cost}")
    step = gamma * cost_ratio + (verify_cost if gamma else 1.0) + catchup_cost(alpha, gamma, cost_ratio,
                                                                            catchup_cost_ratio)
    return expected_tokens_per_step(alpha, gamma) / step


def end_to_end_speedup(decode_speedup: float, prefill_share: float, prefill_cost_ratio: float) -> float:
    """A per-step speedup prediction extended to whole requests: ``1 / (f (1 + r) + (1 − f) / S)``.

    Leviathan et al.'s model (:func:`predicted_speedup`) is per decode step; a request also pays a prefill, which
    speculative decoding does not shorten and to which it adds the draft's own. With plain decoding spending a share
    f of its wall time on the prefill and the rest on the decode phase, a decoder whose decode phase runs S times
    faster and whose prefill costs 1 + r times plain decoding's takes ``f (1 + r) + (1 − f) / S`` of plain
    decoding's time. As f → 0 (long generations) this tends to S.

    Args:
        decode_speedup: S > 0, the per-step (decode-phase) speedup, e.g. :func:`predicted_speedup`.
        prefill_share: f in [0, 1], plain decoding's prefill seconds / its total seconds for the same requests.
        prefill_cost_ratio: r >= 0, the draft's prefill time / the target's over the same prompt (0: free).

    Returns:
        the predicted end-to-end speedup over plain decoding.

    Raises:
        ValueError: an argument that is not a finite real number (NaN, inf, a bool, a string), S <= 0, f outside
            [0, 1], r < 0, each naming the argument.
    """
    for name, x, ok, want in (("decode_speedup", decode_speedup, lambda v: v > 0, "> 0"),
                              ("prefill_share", prefill_share, lambda v: 0 <= v <= 1, "in [0, 1]"),
                              ("prefill_cost_ratio", prefill_cost_ratio, lambda v: v >= 0, ">= 0")):
        if not is_finite_number(x) or not ok(x):
            raise ValueError(f"{name} must be a finite number {want}, got {x!r}")
    return 1.0 / (prefill_share * (1.0 + prefill_cost_ratio) + (1.0 - prefill_share) / decode_speedup)


def verify_cost_at(verify_costs: Sequence[float] | None, gamma: int) -> float:
    """v_γ from a list indexed by γ: None is Leviathan et al.'s v = 1; γ beyond the list's end takes its last
    value (verify costs do not fall as γ grows, :func:`monotone_costs`), so a short list never makes a longer γ
    look cheaper than the longest one measured."""
    if gamma <= 0 or not verify_costs:
        return 1.0
    return float(verify_costs[min(gamma, len(verify_costs) - 1)])


def best_gamma(alpha: float, cost_ratio: float, max_gamma: int = 16, min_gamma: int = 0,
               verify_costs: Sequence[float] | None = None, catchup_cost_ratio: float | None = None) -> int:
    """The γ in ``[min_gamma, max_gamma]`` that maximizes :func:`predicted_speedup` (smallest on ties).

    Args:
        alpha: per-token acceptance α in [0, 1]; cost_ratio: c >= 0.
        max_gamma, min_gamma: the range searched (``max_gamma >= min_gamma >= 0``).
        verify_costs: v_γ indexed by γ (``verify_costs[γ]``, e.g. from :func:`measure_cost_ratio`'s ``verify``
            list), the verify-aware model; γ beyond its end takes its last value, None uses Leviathan et al.'s
            v = 1 (:func:`verify_cost_at`).
        catchup_cost_ratio: c₂ of the draft's catch-up forward, or None (:func:`catchup_cost`).

    Raises:
        ValueError: ``max_gamma < min_gamma``, or α / c out of range (:func:`predicted_speedup`).
    """
    if max_gamma < min_gamma:
        raise ValueError(f"max_gamma ({max_gamma}) must be >= min_gamma ({min_gamma})")
    v = list(verify_costs) if verify_costs is not None else None

    def speed(g: int) -> float:
        return predicted_speedup(alpha, g, cost_ratio, verify_cost_at(v, g), catchup_cost_ratio)

    return max(range(min_gamma, max_gamma + 1), key=lambda g: (speed(g), -g))


def is_count(x: Any) -> bool:
    """An integer (Python or NumPy, not bool): a number of tokens, drafts or runs."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_finite_number(x: Any) -> bool:
    """A finite real number (Python or NumPy, not bool): a time, a ratio, a probability."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def check_max_auto_draft_tokens(value: Any) -> int:
    """The largest γ of ``num_draft_tokens="auto"``: an integer >= 1, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_auto_draft_tokens must be an integer >= 1 (the largest γ of num_draft_tokens="
                         f"'auto'), got {value!r}")
    return value


def check_auto_costs(auto_costs: dict | None) -> dict[int, dict]:
    """``auto_costs`` as given (e.g. loaded from JSON, whose keys are strings) with int batch-size keys, checked:
    every entry needs a finite c >= 0, a non-empty ``verify`` list of finite, positive v_γ and, if it has one, a
    finite ``catchup_cost_ratio`` c₂ >= 0 (other keys, such as ``target_forward_s``, are kept as they are). The
    decoder's ``auto_costs=`` and :func:`simulate_batch_speedup` read the cost model through it. Raises ValueError
    naming the entry."""
    out: dict[int, dict] = {}
    for key, entry in (auto_costs or {}).items():
        try:
            batch = int(key)
            c, verify = float(entry["cost_ratio"]), [float(v) for v in entry["verify"]]
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"auto_costs[{key!r}] must be {{'cost_ratio': c, 'verify': [v_0, .., v_max]}} under a "
                             f"batch-size key (what decode.costs.calibrate returns): {err!r}") from None
        c2 = entry.get("catchup_cost_ratio")
        if (batch < 1 or not (math.isfinite(c) and c >= 0) or not verify
                or not all(math.isfinite(v) and v > 0 for v in verify)
                or (c2 is not None and not (is_finite_number(c2) and c2 >= 0))):
            raise ValueError(f"auto_costs[{key!r}] = {entry!r}: need a batch size >= 1, cost_ratio >= 0, a "
                             "non-empty verify list of positive costs and, if given, catchup_cost_ratio >= 0")
        out[batch] = {**entry, "cost_ratio": c, "verify": verify}
    return out


def cost_bucket(batch_size: int) -> int:
    """The batch size whose costs the decoder uses for ``batch_size`` active rows: the power of two >= it."""
    return 1 << (int(batch_size) - 1).bit_length()


def cost_buckets(max_batch_size: int) -> list[int]:
    """Every :func:`cost_bucket` a batch of up to ``max_batch_size`` rows passes through as its rows finish
    (1, 2, 4, .., ``cost_bucket(max_batch_size)``): the batch sizes to calibrate before timing a batched run."""
    return [1 << k for k in range(cost_bucket(max_batch_size).bit_length())]


def makespan_gamma(alphas: Sequence[float], remaining: Sequence[int], cost_ratio: float, max_gamma: int = 16,
                   min_gamma: int = 0, verify_costs: Sequence[float] | None = None) -> int:
    """The γ in ``[min_gamma, max_gamma]`` that minimizes the expected time until the *last* row of a static batch
    finishes, were γ kept for the rest of the batch (smallest on ties).

    In a batch whose rows all wait for the slowest (``generate()`` over several prompts), speculation pays only if
    the row that finishes last gets there sooner. Row r needs ``remaining[r]`` more tokens and commits
    E_r(γ) = ``expected_tokens_per_step(α_r, min(γ, R_r − 1))`` per step (a row never drafts past its budget); a step
    costs ``γc + v_γ`` batch forwards (1 at γ = 0). The objective is ``(γc + v_γ) · max_r R_r / E_r(γ)``. With
    equal α_r it picks the γ of :func:`best_gamma` (up to the budget cut); with a few slow rows it drafts less than
    pooled α would (a pooled α weights the rows that accept most, and their tokens do not end the batch sooner).
    The model is conservative: it ignores that the batch shrinks as rows finish, which makes later steps cheaper.

    Args:
        alphas: α_r per row, each in [0, 1]; remaining: R_r >= 1 per row (same length, at least one row).
        cost_ratio: c >= 0 at this batch size; verify_costs: v_γ indexed by γ at this batch size
            (:func:`verify_cost_at`).
        max_gamma, min_gamma: the range searched (``max_gamma >= min_gamma >= 0``).

    Raises:
        ValueError: empty or unequal ``alphas`` / ``remaining``, an R_r that is not an integer >= 1,
            ``max_gamma < min_gamma``, c < 0 or NaN, ``verify_costs`` empty or holding a value that is not finite and
            > 0, or an α outside [0, 1] (:func:`expected_tokens_per_step`).
    """
    if not alphas or len(alphas) != len(remaining):
        raise ValueError(f"alphas and remaining must be non-empty and of equal length, got {len(alphas)} and "
                         f"{len(remaining)}")
    if not all(is_count(r) and r >= 1 for r in remaining):
        raise ValueError(f"remaining must be integers >= 1 (tokens per row), got {list(remaining)}")
    if max_gamma < min_gamma:
        raise ValueError(f"max_gamma ({max_gamma}) must be >= min_gamma ({min_gamma})")
    if cost_ratio < 0 or math.isnan(cost_ratio):
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    v = list(verify_costs) if verify_costs is not None else None
    if v is not None and (not v or not all(math.isfinite(x) and x > 0 for x in v)):
        raise ValueError(f"verify_costs must be a non-empty list of finite values > 0 (or None), got {v}")

    def time_to_finish(g: int) -> float:
        step = g * cost_ratio + verify_cost_at(v, g)
        return step * max(r / expected_tokens_per_step(a, min(g, r - 1)) for a, r in zip(alphas, remaining))

    return min(range(min_gamma, max_gamma + 1), key=lambda g: (time_to_finish(g), g))


class AlphaEstimate:
    """One row's acceptance counts for :meth:`AdaptiveGamma.plan_batch`: accepted drafts and trials (accepted +
    rejections, as :class:`AdaptiveGamma` counts them for the pool), each decayed by ``decay`` per update. The
    decoder keeps one per request. They start empty: :meth:`alpha` shrinks them toward a prior (the pooled α)."""

    __slots__ = ("accepted", "trials", "decay")

    def __init__(self, decay: float = 0.9):
        if not 0 < decay <= 1:  # also refuses NaN
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.accepted, self.trials, self.decay = 0.0, 0.0, float(decay)

    def alpha(self, prior_alpha: float, prior_weight: float) -> float:
        """``(accepted + w·prior) / (trials + w)`` in [0, 1]: the row's α, shrunk toward ``prior_alpha`` with the
        weight of ``prior_weight`` trials (the prior alone before any trial). Raises ValueError for a prior outside
        [0, 1] or a weight that is negative or not finite (NaN included)."""
        if not 0 <= prior_alpha <= 1 or not (math.isfinite(prior_weight) and prior_weight >= 0):
            raise ValueError(f"need prior_alpha in [0, 1] and a finite prior_weight >= 0, got {prior_alpha} and "
                             f"{prior_weight}")
        total = self.trials + prior_weight
        value = (self.accepted + prior_weight * prior_alpha) / total if total > 0 else prior_alpha
        return min(max(value, 0.0), 1.0)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Fold in one step: ``num_accepted`` of ``num_drafted`` drafts kept (a rejection ended the run if fewer;
        nothing is learnt from a step that drafted nothing). Raises ValueError unless
        ``0 <= num_accepted <= num_drafted`` (integers)."""
        if not (is_count(num_drafted) and is_count(num_accepted) and 0 <= num_accepted <= num_drafted):
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted} and {num_drafted}")
        if num_drafted == 0:
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.trials = self.decay * self.trials + num_accepted + (num_accepted < num_drafted)


class AdaptiveGamma:
    """Chooses γ for each step from the acceptance seen so far and a fixed cost model, deterministically.

    α is estimated from pooled counts with exponential forgetting (``decay`` per update) and a weak prior
    (``prior_alpha`` = 0.8 worth ``prior_weight`` = 4 trials), so it follows drift in the text. The costs (c and
    the verify costs v_γ, see :func:`predicted_speedup`) are set from outside (:meth:`set_costs`, measured once per
    batch size by the decoder) and never from clocks during decoding: the γ schedule, and so the number and use of
    random draws, depends only on the accepted counts, which makes a seeded run repeatable. γ ranges over
    ``[min_gamma, max_gamma]``; when the best is 0 (plain decoding pays more), one token is drafted at the first such
    step and every ``probe_every``-th one after, so that α keeps being measured.

    α is Leviathan et al.'s per-token acceptance, estimated as accepted / (accepted + rejections): each row's step
    is a run of Bernoulli(α) trials that stops at the first rejection, so the drafts after a rejection are not
    trials (Σaccepted / Σdrafted, the acceptance rate, would underestimate α and pick too small a γ). For the first
    ``warmup_steps`` verify steps γ is at least 1 (``initial_gamma``, or by default the model's choice at the current
    estimate): α can only be learnt by drafting, and where the prior is below the break-even α (a compute-bound
    batch) the controller would otherwise stay at γ = 0 with rare 1-token probes.

    With prompt lookup (:mod:`decode.lookup`) a step's leading drafts can come from the text itself and run no
    draft forward, so a step at γ costs ``f·γ·c + v_γ``: ``f`` (:attr:`draft_forward_share`) is the share of drafted
    positions that ran a draft forward, estimated from the forward counts the decoder passes to :meth:`update` with
    the same forgetting (prior 1, the same weight as α's: every position a forward). It only moves where a lookup
    covers positions (without one every position is a forward and the choices are the same as before), and it is a
    count, not a clock, so the schedule stays repeatable. Linear in γ, it overstates a longer γ where the lookup
    covers whole steps (one forward then feeds them all), so it errs toward the shorter γ.

    The prior matters on short generations: the decoder starts a fresh controller whenever it goes idle (each
    ``generate()`` call; requests that join a running batch share its estimate), and 64 new tokens are only about
    8-15 steps.
    The defaults come from simulating i.i.d. acceptance (:func:`simulate_speedup`): with prior 0.8 and warm-up at the
    model's choice the controller reaches 0.95 to 0.98 of the best fixed γ on 64 tokens for α in 0.7..1 (a prior of
    0.5 with 2 warm-up steps at γ = 4 reaches 0.92 to 0.95). Where drafting does not pay, the warm-up and the probes
    cost: 0.90 / 0.92 / 0.955 of plain decoding at α = 0 / 0.3 / 0.5 on 64 tokens (0.92 / 0.95 / 0.97 on 256).

    Args:
        max_gamma, min_gamma: the range γ is chosen from (``0 <= min_gamma <= max_gamma``, ``max_gamma >= 1``).
        initial_gamma: γ of the warm-up steps (clipped to [1, max_gamma]); None: the model's choice, at least 1.
        decay: forgetting factor per update, in (0, 1] (1: plain pooled counts).
        prior_alpha, prior_weight: the prior α in [0, 1] and its weight in trials (>= 0).
        initial_cost_ratio: c until :meth:`set_costs` (or timings given to :meth:`update`).
        probe_every: at γ = 0, one token is drafted every this many steps (>= 1).
        warmup_steps: steps that draft at least one token before the model may choose γ = 0 (>= 0).

    Raises:
        ValueError: any of the ranges above, naming the argument.
    """

    ROW_PRIOR_WEIGHT = 8.0  # trials of pooled α each row's estimate starts from in plan_batch (simulated: 2-8 alike)

    def __init__(self, max_gamma: int = 8, initial_gamma: int | None = None, decay: float = 0.9,
                 prior_alpha: float = 0.8, prior_weight: float = 4.0, initial_cost_ratio: float = 0.1,
                 min_gamma: int = 0, probe_every: int = 8, warmup_steps: int = 2):
        checks = {"max_gamma": (max_gamma, max_gamma >= 1, ">= 1"),
                  "min_gamma": (min_gamma, 0 <= min_gamma <= max_gamma, "in [0, max_gamma]"),
                  "decay": (decay, 0 < decay <= 1, "in (0, 1]"),
                  "prior_alpha": (prior_alpha, 0 <= prior_alpha <= 1, "in [0, 1]"),
                  "prior_weight": (prior_weight, prior_weight >= 0, ">= 0"),
                  "initial_cost_ratio": (initial_cost_ratio, initial_cost_ratio >= 0, ">= 0"),
                  "probe_every": (probe_every, probe_every >= 1, ">= 1"),
                  "warmup_steps": (warmup_steps, warmup_steps >= 0, ">= 0")}
        for name, (value, ok, want) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {want}, got {value}")
        self.max_gamma = max_gamma
        self.min_gamma = min_gamma
        self.initial_gamma = None if initial_gamma is None else max(1, min(initial_gamma, max_gamma))
        self.warmup_steps = warmup_steps
        self._steps_seen = 0
        self.decay = decay
        self.probe_every = probe_every
        self.prior_alpha = prior_alpha
        self._accepted = prior_alpha * prior_weight
        self._drafted = prior_weight
        self._forwards = self._positions = prior_weight  # draft forwards / drafted positions (prompt lookup)
        self._draft_s = initial_cost_ratio
        self._target_s = 1.0
        self._timed = False
        self._verify: list[float] | None = None
        self._catchup: float | None = None  # c₂ − c: the draft's two-token catch-up forward over a one-token one
        self._idle = probe_every - 1  # the first step at γ = 0 probes
        self._choose()  # the choice at the prior and the guessed c, until set_costs

    @property
    def alpha(self) -> float:
        """Current per-token acceptance estimate (the prior before any trial)."""
        return self._accepted / self._drafted if self._drafted > 0 else self.prior_alpha

    @property
    def cost_ratio(self) -> float:
        """Current c = draft forward time / target forward time."""
        return self._draft_s / self._target_s

    @property
    def draft_forward_share(self) -> float:
        """f = draft forwards per drafted position (1 without prompt lookup; lower where it covers positions)."""
        return self._forwards / self._positions if self._positions > 0 else 1.0

    @property
    def drafting_cost_ratio(self) -> float:
        """c·f: what one drafted position costs in target forwards, as the γ choice counts it."""
        return self.cost_ratio * self.draft_forward_share

    def set_costs(self, cost_ratio: float, verify_costs: Sequence[float] | None = None,
                  catchup_cost_ratio: float | None = None) -> None:
        """Fix the cost model: c >= 0, ``verify_costs[γ]`` = v_γ for γ = 0..max_gamma (None: all 1.0; a shorter
        list extends with its last value, :func:`verify_cost_at`) and c₂, the draft's two-token catch-up forward
        (None: as a one-token one, :func:`catchup_cost`). Raises ValueError for c < 0, a v_γ <= 0 or c₂ < 0."""
        if not cost_ratio >= 0:
            raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
        if catchup_cost_ratio is not None and not catchup_cost_ratio >= 0:
            raise ValueError(f"catchup_cost_ratio must be >= 0 or None, got {catchup_cost_ratio}")
        self._catchup = None if catchup_cost_ratio is None else float(catchup_cost_ratio) - float(cost_ratio)
        if verify_costs is not None and not all(v > 0 for v in verify_costs):
            raise ValueError(f"verify_costs must all be > 0, got {list(verify_costs)}")
        self._draft_s, self._target_s, self._timed = float(cost_ratio), 1.0, True
        self._verify = list(verify_costs) if verify_costs is not None else None
        self._choose()

    def _choose(self) -> None:
        a = min(max(self.alpha, 0.0), 1.0)
        c = self.drafting_cost_ratio
        self.gamma = best_gamma(a, c, self.max_gamma, self.min_gamma, verify_costs=self._verify,
                                catchup_cost_ratio=None if self._catchup is None else c + self._catchup)

    def plan_batch(self, rows: Sequence[AlphaEstimate], remaining: Sequence[int]) -> int:
        """Replace the pooled choice by :func:`makespan_gamma` for a static batch (all rows wait for the last):
        row r's α is its own counts shrunk toward the pooled estimate with the weight of :attr:`ROW_PRIOR_WEIGHT`
        trials (:meth:`AlphaEstimate.alpha`), and ``remaining[r]`` its tokens still to make. :meth:`next_gamma`
        then applies the warm-up and the probes to it as usual; the next :meth:`update` returns to the pooled
        choice. Returns the planned γ. Raises ValueError as :func:`makespan_gamma`."""
        pooled = min(max(self.alpha, 0.0), 1.0)
        alphas = [row.alpha(pooled, self.ROW_PRIOR_WEIGHT) for row in rows]
        self.gamma = makespan_gamma(alphas, remaining, self.drafting_cost_ratio, self.max_gamma, self.min_gamma,
                                    verify_costs=self._verify)
        return self.gamma

    def next_gamma(self) -> int:
        """γ for the next step: during the warm-up ``initial_gamma`` (default: the current choice, at least 1), then
        the current choice, or a 1-token probe every ``probe_every`` steps at γ = 0."""
        if self._steps_seen < self.warmup_steps:
            return self.initial_gamma if self.initial_gamma is not None else max(1, self.gamma)
        if self.gamma > 0:
            return self.gamma
        self._idle += 1
        if self._idle >= self.probe_every:
            self._idle = 0
            return 1
        return 0

    def update(self, num_drafted: int, num_accepted: int, draft_s_per_forward: float | None = None,
               target_s_per_forward: float | None = None, num_rejected: int | None = None,
               num_draft_forwards: int | None = None, step_gamma: int | None = None) -> int:
        """Fold in one verify step (pooled over rows) and return the γ to use next.

        Args:
            num_drafted: Σγ_r; num_accepted: Σ accepted drafts.
            num_rejected: rows whose run ended in a rejection (n_r < γ_r); with it α is estimated from
                num_accepted + num_rejected trials (see the class docstring); None: from num_drafted (a run
                with no information about where rejections fell).
            draft_s_per_forward, target_s_per_forward: timings, if given, update c (for callers that want a
                clock-driven estimate; the decoder passes none).
            num_draft_forwards, step_gamma: the draft forwards the step ran and its γ (the positions they could
                have drafted; the largest row's γ), both or neither: they update :attr:`draft_forward_share`.

        Raises:
            ValueError: negative counts, more accepted than drafted, more rejections than accepted could leave,
                or only one of num_draft_forwards / step_gamma, or they are not integers with
                0 <= num_draft_forwards <= step_gamma and 1 <= step_gamma <= num_drafted (checked before any state
                changes).
        """
        if not 0 <= num_accepted <= num_drafted or (num_rejected is not None
                                                    and not 0 <= num_rejected <= num_drafted - num_accepted):
            raise ValueError(f"need 0 <= num_accepted <= num_drafted and 0 <= num_rejected <= num_drafted - "
                             f"num_accepted, got drafted={num_drafted}, accepted={num_accepted}, "
                             f"rejected={num_rejected}")
        if (num_draft_forwards is None) != (step_gamma is None) or (step_gamma is not None and not (
                is_count(num_draft_forwards) and is_count(step_gamma)
                and 0 <= num_draft_forwards <= step_gamma and 1 <= step_gamma <= num_drafted)):
            raise ValueError(f"give both num_draft_forwards and step_gamma (integers, 0 <= forwards <= γ and 1 <= γ "
                             f"<= num_drafted) or neither, got num_draft_forwards={num_draft_forwards!r}, "
                             f"step_gamma={step_gamma!r}, num_drafted={num_drafted}")
        trials = num_drafted if num_rejected is None else num_accepted + num_rejected
        self._steps_seen += 1
        self._accepted = self.decay * self._accepted + num_accepted
        self._drafted = self.decay * self._drafted + trials
        if step_gamma is not None:
            self._forwards = self.decay * self._forwards + num_draft_forwards
            self._positions = self.decay * self._positions + step_gamma
        if draft_s_per_forward is not None and target_s_per_forward is not None and target_s_per_forward > 0:
            if not self._timed:  # replace the guess on the first measurement
                self._draft_s, self._target_s, self._timed = draft_s_per_forward, target_s_per_forward, True
            else:
                self._draft_s = self.decay * self._draft_s + (1 - self.decay) * draft_s_per_forward
                self._target_s = self.decay * self._target_s + (1 - self.decay) * target_s_per_forward
        self._choose()
        return self.gamma


def simulate_batch_speedup(gamma: int | Callable[[], AdaptiveGamma], alphas: Sequence[float],
                           auto_costs: dict[int, dict], max_new_tokens: int = 64, runs: int = 200, seed: int = 0,
                           plan: bool = True) -> float:
    """Speedup of one static batch (every row makes ``max_new_tokens`` tokens, the batch ends with its last row)
    over plain decoding of the same batch, simulated with i.i.d. acceptance per row.

    As the decoder does: rows that finish leave, and a step over B active rows is timed with the costs of the
    power of two >= B, ``t_B · (γc_B + v_B(γ))`` (``t_B`` = the target's one-token forward at that batch size), plus
    ``t_B · (c₂_B − c_B)`` where a row's previous step accepted all its drafts and the entry has
    ``catchup_cost_ratio`` c₂ (the draft's first forward then reads two tokens, :func:`catchup_cost`);
    each row drafts ``min(γ, R_r − 1)``, accepts a run of Bernoulli(α_r) drafts that stops at the first rejection
    and commits accepted + 1 tokens. A controller gets ``set_costs`` at each batch-size change, per-row
    :class:`AlphaEstimate` counts and, with ``plan``, :meth:`AdaptiveGamma.plan_batch` before each step while more
    than one row is active (the decoder's ``generate()``); without ``plan`` it keeps the pooled choice. Plain
    decoding: ``max_new_tokens − 1`` steps at the full batch's ``t``.

    Args:
        gamma: a fixed γ >= 0 or a controller factory (see :func:`simulate_speedup`).
        alphas: α_r per row, each in [0, 1].
        auto_costs: ``{batch_size: {"cost_ratio", "verify", "target_forward_s"}}`` for every power of two up to
            ``len(alphas)`` (what :func:`decode.costs.calibrate` returns; its keys may be strings, as in JSON).
        max_new_tokens: tokens per row (>= 2); runs, seed: simulated batches and their random seed.

    Returns:
        (Σ plain time) / (Σ speculative time) over the runs.

    Raises:
        ValueError: empty ``alphas`` or one outside [0, 1], a missing batch size or key in ``auto_costs`` or a
            value out of range there (c < 0, t <= 0, an empty or non-positive verify list), ``max_new_tokens < 2``
            or ``runs < 1``.
    """
    if not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
        raise ValueError(f"alphas must be a non-empty list of values in [0, 1], got {list(alphas)}")
    if max_new_tokens < 2 or runs < 1:
        raise ValueError(f"need max_new_tokens >= 2 and runs >= 1, got {max_new_tokens} and {runs}")
    costs = _check_batch_costs(auto_costs, len(alphas))
    rng = random.Random(seed)
    plain = spec = 0.0
    for _ in range(runs):
        spec += _simulate_batch_run(gamma, alphas, costs, max_new_tokens, plan, rng)
        plain += (max_new_tokens - 1) * costs[cost_bucket(len(alphas))]["target_forward_s"]
    return plain / spec


def _check_batch_costs(auto_costs: dict[int, dict], batch_size: int) -> dict[int, dict]:
    """:func:`simulate_batch_speedup`'s ``auto_costs`` checked: an entry with ``target_forward_s`` > 0 for every
    power of two a batch of ``batch_size`` rows passes through. Returns them with int keys."""
    costs = check_auto_costs(auto_costs)
    buckets = cost_buckets(batch_size)
    for b in buckets:
        if b not in costs:
            raise ValueError(f"auto_costs needs batch size {b} (decode.costs.calibrate(decoder, ..., batch_sizes="
                             f"{buckets})), got batch sizes {sorted(costs)}")
        if "target_forward_s" not in costs[b]:
            raise ValueError(f"auto_costs[{b}] lacks target_forward_s (calibrate() of this version records it)")
        t = costs[b]["target_forward_s"]
        if not (is_finite_number(t) and t > 0):
            raise ValueError(f"auto_costs[{b}] needs target_forward_s > 0 (seconds), got {t!r}")
    return costs


def _simulate_batch_run(gamma: int | Callable[[], AdaptiveGamma], alphas: Sequence[float], costs: dict[int, dict],
                        max_new_tokens: int, plan: bool, rng: random.Random) -> float:
    """One simulated static batch of :func:`simulate_batch_speedup`; returns its speculative time (seconds)."""
    ctl = gamma() if callable(gamma) else None
    rows = [AlphaEstimate() for _ in alphas]
    made = [1] * len(alphas)
    active, bucket = list(range(len(alphas))), None
    caught_up = [True] * len(alphas)  # False: the row's last step accepted all its drafts (two tokens pending)
    spec = 0.0
    while active:
        b = cost_bucket(len(active))
        entry = costs[b]
        c2 = entry.get("catchup_cost_ratio")
        if ctl is not None and b != bucket:
            ctl.set_costs(entry["cost_ratio"], entry["verify"], c2)
            bucket = b
        if ctl is None:
            g = int(gamma)
        else:
            if plan and len(active) > 1:
                ctl.plan_batch([rows[i] for i in active], [max_new_tokens - made[i] for i in active])
            g = ctl.next_gamma()
        gs = [min(g, max_new_tokens - made[i] - 1) for i in active]
        step_gamma = max(gs)
        catchup = (max(c2 - entry["cost_ratio"], 0.0) if c2 is not None and step_gamma > 0
                   and not all(caught_up[i] for i in active) else 0.0)  # the first draft forward reads two tokens
        spec += entry["target_forward_s"] * (step_gamma * entry["cost_ratio"]
                                             + verify_cost_at(entry["verify"], step_gamma) + catchup)
        accepted_total = rejected = 0
        for i, gi in zip(active, gs):
            accepted = 0
            while accepted < gi and rng.random() < alphas[i]:
                accepted += 1
            caught_up[i] = step_gamma > 0 and not (gi > 0 and accepted == gi)  # else tokens pending
            made[i] += accepted + 1
            rows[i].update(gi, accepted)
            accepted_total += accepted
            rejected += int(accepted < gi)
        if ctl is not None and step_gamma > 0:
            ctl.update(sum(gs), accepted_total, num_rejected=rejected)
        active = [i for i in active if made[i] < max_new_tokens]
    return spec


def monotone_costs(costs: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``costs`` in least squares (pool-adjacent-violators).

    Verify costs v_γ (time of a γ+1-token forward over a 1-token one) are assumed not to fall as γ grows; medians of a
    few timed forwards sometimes do (noise, e.g. v_3 < v_2), and an auto-γ controller would then favour the γ that
    happened to time fast. The assumption is a smoothing choice, not a law: some CPU kernels are slower at 3 rows
    than at 5 (measured on the quickstart pair: v_2 ≈ 1.6, v_4 ≈ 1.2, see
    docs/results/2026-11-29-bench-highlights-quickstart-pair.md), and pooling then errs toward the larger γ. Returns
    a list of the same length; each value is the mean of its pooled block.
    """
    blocks: list[list[float]] = []  # [sum, count]
    for x in costs:
        blocks.append([float(x), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    out: list[float] = []
    for total, n in blocks:
        out += [total / n] * int(n)
    return out


def smooth_verify_costs(measured: Sequence[float]) -> list[float]:
    """``[v_0 = 1, v_1, .., v_n]`` from n measured ratios v_1..v_n: made non-decreasing (:func:`monotone_costs`),
    then each at least 1 (a verify over more tokens never costs less than one token). The one smoothing used by the
    decoder's ``calibrate``, the recipe's evaluation and the quickstart."""
    return [1.0] + [max(1.0, float(v)) for v in monotone_costs([float(v) for v in measured])]


def simulate_speedup(gamma: int | Callable[[], AdaptiveGamma], alpha: float, cost_ratio: float,
                     verify_costs: Sequence[float] | None = None, max_new_tokens: int = 64, runs: int = 200,
                     seed: int = 0) -> float:
    """Speedup over plain decoding of a fixed γ or a γ controller, simulated with i.i.d. acceptance.

    Each run generates ``max_new_tokens`` tokens as the decoder does: the prefill gives the first; each step drafts
    γ (cut so the step cannot overshoot the budget), accepts a run of Bernoulli(α) drafts that stops at the first
    rejection, commits accepted + 1 tokens and costs ``γc + v_γ`` target-forward units (1 for γ = 0). Plain decoding
    costs 1 unit per token after the first. No clock and no model is involved, so a controller's defaults can be
    judged against the best fixed γ for given costs. As in the benchmark's
    tokens/s, the speedup pools the runs: Σ plain cost / Σ speculative cost.

    Args:
        gamma: a fixed γ >= 0, or a factory returning a fresh controller (``next_gamma()`` / ``update(...)``) per
            run, as the decoder makes one per ``generate()`` call. Give the controller the same costs, e.g.
            ``def factory(): ctl = AdaptiveGamma(8); ctl.set_costs(c, v); return ctl`` (a bare
            ``AdaptiveGamma(8)`` chooses with its guessed c = 0.1 and v = 1).
        alpha: per-token acceptance in [0, 1]; cost_ratio: c >= 0.
        verify_costs: v_γ indexed by γ (None: 1.0; beyond its end: its last value, :func:`verify_cost_at`).
        max_new_tokens: tokens per run (>= 2); runs: simulated runs; seed: the runs' random seed.

    Returns:
        (Σ over runs of plain cost) / (Σ of speculative cost).

    Raises:
        ValueError: γ not an integer >= 0 nor a callable, α outside [0, 1], c < 0 or NaN, a v_γ <= 0,
            ``max_new_tokens < 2`` or ``runs < 1``, each naming the argument.
    """
    if not callable(gamma) and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0):
        raise ValueError(f"gamma must be an integer >= 0 or a controller factory, got {gamma!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not cost_ratio >= 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    if verify_costs is not None and not all(x > 0 for x in verify_costs):
        raise ValueError(f"verify_costs must all be > 0, got {list(verify_costs)}")
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2, got {max_new_tokens}")
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    v = list(verify_costs) if verify_costs is not None else None
    rng = random.Random(seed)
    plain, spec = 0.0, 0.0
    for _ in range(runs):
        ctl = gamma() if callable(gamma) else None
        made, cost = 1, 0.0
        while made < max_new_tokens:
            g = min(ctl.next_gamma() if ctl is not None else int(gamma), max_new_tokens - made - 1)
            accepted = 0
            while accepted < g and rng.random() < alpha:
                accepted += 1
            made += accepted + 1
            cost += g * cost_ratio + verify_cost_at(v, g)
            if ctl is not None and g > 0:
                ctl.update(g, accepted, num_rejected=int(accepted < g))
        plain += made - 1
        spec += cost
    return plain / spec
