"""Cost measurement on this hardware: c (draft forward / target forward) and the verify costs v_γ, timed through the
decoder's own forward path (``decode.cache.forward``, the static cache, compiled calls, few-row kernels), and the
one-time work a decoder does before serving (:func:`warm_up`).

Imports run one way: :mod:`decode.speedup` (the pure formulas these numbers feed) <- this module <-
:mod:`decode.engine` (whose auto γ calls :func:`calibrate` at first use inside a step) <- the bench and the server.
So the functions that take a decoder (:func:`calibrate`, :func:`measure_costs`, :func:`cost_timer`,
:func:`warm_up`) read it through its attributes and never import the engine.
"""
from __future__ import annotations

import copy
import itertools
import statistics
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from decode import cache as kv
from decode import kernels
from decode.cache import context_length
from decode.requests import check_prompt
from decode.speedup import cost_bucket, cost_buckets, is_count, smooth_verify_costs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_context_ids(context_ids: Any, models: Mapping[str, Any], hint: str = "") -> None:
    """A cost measurement's context checked: a ``(B, L)`` integer tensor with B >= 1, L >= 2 (a prefix to prefill
    and one token to decode) whose ids every model in ``models`` (role -> model) can embed; ``hint`` ends the
    message of a wrong shape or type.

    Raises:
        ValueError: naming what is wrong (shape, dtype, or the ids and the embedding they fall outside of)."""
    if not (isinstance(context_ids, torch.Tensor) and context_ids.dim() == 2 and context_ids.dtype in
            (torch.int64, torch.int32) and context_ids.shape[0] >= 1 and context_ids.shape[1] >= 2):
        got = (f"a {context_ids.dtype} tensor of shape {tuple(context_ids.shape)}"
               if isinstance(context_ids, torch.Tensor) else type(context_ids).__name__)
        raise ValueError(f"context_ids must be a (B, L) integer tensor with B >= 1 and L >= 2 (a prefix to prefill "
                         f"and one token to decode), got {got}{hint}")
    lo, hi = int(context_ids.min()), int(context_ids.max())
    for role, model in models.items():
        rows = model.get_input_embeddings().num_embeddings
        if lo < 0 or hi >= rows:
            raise ValueError(f"context_ids holds ids {lo}..{hi}, outside the {role}'s embedding of {rows} rows")


def check_timer_inputs(target, draft, context_ids: Any, verify_gammas: Sequence[int] = (), static_cache: Any = False,
                       calls: Mapping[str, Any] | None = None, warmup_rounds: Any = 2,
                       few_row_linear: Any = False) -> list[int]:
    """The arguments of a cost timer (:class:`CostTimer`, ``decode.bench.bare_forward.BareTimer``) checked before
    any forward: both models given, ``context_ids`` a (B, L >= 2) integer tensor of ids both embed, fitting both
    models' positions with the largest verify γ; γ values integers >= 1; ``warmup_rounds`` an integer >= 0;
    ``few_row_linear`` a bool. Returns the sorted γ values.

    Raises:
        ValueError: naming the first argument that fails.
    """
    if draft is None or target is None:
        raise ValueError("a cost measurement times a draft against a target: both are needed (got None)")
    check_context_ids(context_ids, {"target": target, "draft": draft})
    if not is_count(warmup_rounds) or warmup_rounds < 0:
        raise ValueError(f"warmup_rounds must be an integer >= 0 (untimed first rounds), got {warmup_rounds!r}")
    if not isinstance(few_row_linear, bool):
        raise ValueError(f"few_row_linear must be True or False, got {few_row_linear!r}")
    if isinstance(verify_gammas, (str, bytes)) or not isinstance(verify_gammas, Iterable):
        raise ValueError(f"verify_gammas must be a sequence of integers >= 1 (e.g. [2, 4] or []), got "
                         f"{verify_gammas!r}")
    gammas = list(verify_gammas)
    if any(not is_count(g) or g < 1 for g in gammas):
        raise ValueError(f"verify_gammas must be integers >= 1 (γ of each verify forward timed), got {gammas!r}")
    gammas = sorted({int(g) for g in gammas})  # numpy integers too (the static cache's sizes need ints)
    if isinstance(static_cache, Mapping) and not set(static_cache) <= {"target", "draft"}:
        raise ValueError(f"static_cache keys must be 'target' and/or 'draft', got {sorted(static_cache)!r}")
    for name, call in (calls or {}).items():
        if call is not None and not callable(call):
            raise ValueError(f"{name}_call must be callable (a model's forward, e.g. compiled) or None, got "
                             f"{type(call).__name__}")
    need = context_ids.shape[1] + max(max(gammas, default=0), 1)  # the draft's catch-up writes two tokens
    for role, model in (("target", target), ("draft", draft)):
        limit = context_length(model)
        if limit is not None and need > limit:
            plus = f" plus the largest verify γ {max(gammas)}" if gammas else ""
            raise ValueError(f"context_ids of {context_ids.shape[1]} tokens{plus} need {need} positions, more than the "
                             f"{role}'s {limit}")
    return gammas


def check_repeats(repeats: Any) -> None:
    """``repeats`` of a cost measurement: an integer >= 1 (timed rounds), else ValueError naming it."""
    if not is_count(repeats) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1 (timed forwards per measurement), got {repeats!r}")


class CostTimer:
    """The timing behind :func:`measure_cost_ratio`, one round at a time, so a caller can spread its rounds over a
    longer run (the benchmark times rounds between its prompts, so the machine's drift hits the costs as it hits
    the runs they predict).

    Construction checks the arguments and prefills both models once (no timing); each :meth:`round` times one
    forward of every kind (target, draft, each verify γ), the first ``warmup_rounds`` untimed; :meth:`result` gives
    the medians. Arguments as in :func:`measure_cost_ratio`; ``few_row_linear`` runs each round under
    :func:`decode.kernels.few_row_linear` (the engine's kernels for its steps).

    Raises:
        ValueError: as :func:`measure_cost_ratio` (``repeats`` aside); :meth:`result` before a timed round.
    """

    @torch.no_grad()
    def __init__(self, target, draft, context_ids: torch.Tensor, verify_gammas: Sequence[int] = (),
                 static_cache: bool | Mapping[str, bool] = False, target_call: Callable | None = None,
                 draft_call: Callable | None = None, few_row_linear: bool = False, warmup_rounds: int = 2):

        self._calls = {"target": target_call, "draft": draft_call}
        self.verify_gammas = check_timer_inputs(target, draft, context_ids, verify_gammas, static_cache, self._calls,
                                                warmup_rounds, few_row_linear)
        self.context_tokens, self.few_row_linear = int(context_ids.shape[1]), few_row_linear
        self._device, self.warmup_rounds, self.rounds = context_ids.device, warmup_rounds, 0
        prefix, self._last = context_ids[:, :-1], context_ids[:, -1:]
        B, self._width = prefix.shape
        # (label, model, cache name, tokens fed, logits kept): the draft keeps one position, the verify keeps all;
        # draft2 is the draft's catch-up forward after a step that accepted all its drafts (two tokens pending).
        self._jobs = [("target", target, "target", 1, None), ("draft", draft, "draft", 1, 1),
                      ("draft2", draft, "draft", 2, 1)]
        self._jobs += [(f"verify{g}", target, "target", g + 1, None) for g in self.verify_gammas]
        self._base = {}
        with kernels.few_row_linear(few_row_linear):  # every forward of a decoder's measurement on its kernels
            for name, model in (("target", target), ("draft", draft)):
                cache = kv.new_cache(model)
                _, mask = kv.forward(model, cache, prefix[:, :0], prefix, torch.ones_like(prefix), logits_to_keep=1)
                static = static_cache.get(name, False) if isinstance(static_cache, Mapping) else bool(static_cache)
                if static and kv.StaticKV.supported(model) is None:
                    skv = kv.StaticKV(model, self._device)
                    skv.merge(cache, mask, [self._width] * B,
                              room=max(k for _, _, n, k, _ in self._jobs if n == name) + 1)
                    cache, mask = skv, None
                self._base[name] = (cache, mask)
        self._samples: dict[str, list[float]] = {label: [] for label, *_ in self._jobs}

    @torch.no_grad()
    def round(self) -> None:
        """One forward of each kind on the prefilled context, target and draft alternating; timed after the
        warm-up rounds (the first calls pay for lazy initialisation and compilation)."""

        B = self._last.shape[0]
        with kernels.few_row_linear(self.few_row_linear):
            # a decoder's steps run inside one block, its copies checked once: the timed forwards must not pay it
            kernels.check_packed(*{id(m): m for _, m, *_ in self._jobs}.values())
            for label, model, name, k, keep in self._jobs:
                cache, mask = self._base[name]
                ids = self._last.expand(B, k).contiguous()
                static = isinstance(cache, kv.StaticKV)
                cache = cache if static else copy.deepcopy(cache)
                _sync(self._device)
                t0 = time.perf_counter()
                if static:
                    cache.forward(model, ids, None, logits_to_keep=keep, call=self._calls[name])
                else:
                    kv.forward(model, cache, mask, ids, torch.ones_like(ids), logits_to_keep=keep,
                               call=self._calls[name])
                _sync(self._device)
                elapsed = time.perf_counter() - t0
                if static:  # the write column goes back: the next call sees the same context
                    cache.roll_back(ids.new_zeros(B, k, dtype=torch.bool), [0] * B, [self._width] * B)
                if self.rounds >= self.warmup_rounds:
                    self._samples[label].append(elapsed)
        self.rounds += 1

    def result(self) -> dict[str, Any]:
        """The medians over the timed rounds, as :func:`measure_cost_ratio` returns them (``repeats``: timed
        rounds)."""
        if not self._samples["target"]:
            raise ValueError(f"no timed round yet: call round() more than {self.warmup_rounds} times (the first are "
                             "untimed)")
        s = self._samples
        t, d = statistics.median(s["target"]), statistics.median(s["draft"])
        verify = [{"gamma": g, "tokens": g + 1, "forward_s": statistics.median(s[f"verify{g}"]),
                   "relative_cost": statistics.median(s[f"verify{g}"]) / t} for g in self.verify_gammas]
        d2 = statistics.median(s["draft2"])
        return {"context_tokens": self.context_tokens, "repeats": len(s["target"]), "target_forward_s": t,
                "draft_forward_s": d, "cost_ratio": d / t, "draft_catchup_forward_s": d2, "catchup_cost_ratio": d2 / t,
                "target_forward_samples_s": list(s["target"]),
                "draft_forward_samples_s": list(s["draft"]), "verify": verify}


def measure_cost_ratio(target, draft, context_ids: torch.Tensor, repeats: int = 21,
                       verify_gammas: Sequence[int] = (),
                       progress: Callable[[int, int], None] | None = None,
                       static_cache: bool | Mapping[str, bool] = False, target_call: Callable | None = None,
                       draft_call: Callable | None = None, few_row_linear: bool = False) -> dict[str, Any]:
    """Measure c = draft forward time / target forward time on this hardware, and the cost of verify forwards.

    Both models are prefilled with all but the last token of ``context_ids``; each timed call is then one decode
    forward on that context through the engine's own forward path: on a fresh copy of the ``DynamicCache``
    (``decode.cache.forward``: explicit positions and mask), or, for a model on the static path, on a
    :class:`decode.cache.StaticKV` whose write column is moved back after each call (the engine's rollback). Target
    and draft alternate so drift hits both.

    Leviathan et al. (2023) assume a verify forward of γ+1 tokens costs one single-token target forward. On
    compute-bound hardware (CPU, large batches) it does not; ``verify_gammas`` also times target forwards of γ+1
    tokens, giving v_γ = t(γ+1 tokens) / t(1 token) for the verify-aware prediction.

    Args:
        target, draft: causal LMs on the same device.
        context_ids: (B, L) LongTensor, a realistic context (real prompt tokens, repeated if needed); B rows
            measure the costs at batch size B.
        repeats: timed forwards per measurement (after 2 untimed ones); the median is used.
        verify_gammas: γ values whose verify forward (γ+1 tokens) is timed on the target.
        progress: called as ``progress(done, total)`` after each round of timed forwards (``total`` =
            ``repeats`` + 2 untimed ones), e.g. to drive a progress bar.
        static_cache: time on the static cache: True for both models, or ``{"target": bool, "draft": bool}`` (the
            decoder's own choice per model); a model whose architecture cannot use it
            (``StaticKV.supported``) keeps the ``DynamicCache``.
        target_call, draft_call: what runs each model's forward (default: the model itself), e.g. the
            ``torch.compile``-d forwards of a ``SpeculativeDecoder(compile=...)``, so c is the compiled one. A
            compiled call compiles in the untimed first calls.
        few_row_linear: time the forwards under :func:`decode.kernels.few_row_linear` (the decoder's steps do
            when its ``few_row_linear`` is on).

    Returns:
        dict with context_tokens, repeats, target_forward_s, draft_forward_s (medians, seconds), cost_ratio,
        draft_catchup_forward_s and catchup_cost_ratio (the draft's forward over two tokens, the catch-up after a
        step that accepted all its drafts), the raw samples, and ``verify``: [{gamma, tokens, forward_s,
        relative_cost v_γ}].

    Raises:
        ValueError: no draft; ``context_ids`` not a (B, L >= 2) integer tensor, or with ids outside either model's
            embedding, or too long for either model's positions with the largest γ; ``repeats`` < 1; a γ < 1; a
            ``static_cache`` key other than target/draft; a call that is not callable.
    """
    check_repeats(repeats)
    timer = CostTimer(target, draft, context_ids, verify_gammas, static_cache, target_call, draft_call, few_row_linear)
    for i in range(repeats + 2):
        timer.round()
        if progress is not None:
            progress(i + 1, repeats + 2)
    return timer.result()


# ---------------------------------------------------------------------------------- on a decoder's forward path
@torch.no_grad()
def calibrate(decoder: Any, context_ids: Sequence[int], batch_sizes: Sequence[int] = (1, 2, 4, 8),
              repeats: int = 5) -> dict[int, dict]:
    """Measure a :class:`decode.engine.SpeculativeDecoder`'s ``"auto"`` cost model now (else it is measured at first
    use, inside a step), and keep it in ``decoder.auto_costs``.

    Args:
        decoder: the decoder (with a draft).
        context_ids: a real token sequence (repeated or cut to at most 64 tokens); only its length matters.
        batch_sizes: batch sizes to measure; each is rounded up to a power of two.
        repeats: timed forwards per measurement (median).

    The forwards are timed as the steps run them: on each model's cache kind (static or dynamic) and, with
    ``compile``, through the compiled forwards (so a compiled draft's lower c reaches the γ choice; the first
    calibration compiles the one-token shapes, tens of seconds on CPU).

    Returns:
        ``decoder.auto_costs``, ``{batch_size: {"cost_ratio": c, "verify": [v_0 = 1, v_1, .., v_max],
        "catchup_cost_ratio": c₂, "target_forward_s": t}}`` (c₂: the draft's two-token catch-up forward after a step
        that accepted all its drafts, at least c; :func:`decode.speedup.catchup_cost`); the measured v_γ are made
        non-decreasing in γ and >= 1
        (:func:`decode.speedup.smooth_verify_costs`); t (the target's one-token forward, seconds) is kept for
        :func:`decode.speedup.simulate_batch_speedup` and not used by the controller.

    Raises:
        ValueError: no draft, ids of ``context_ids`` outside the vocabulary, or a batch size < 1.
    """
    if decoder.draft is None:
        raise ValueError("calibrate() measures the draft/target cost model; this decoder has no draft")
    if any(not is_count(b) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be integers >= 1, got {list(batch_sizes)!r}")
    width = max(2, min(64, shared_context(decoder) - decoder.max_auto_draft_tokens - 2))
    seq = list(context_ids)[-width:]
    seq = check_prompt(seq, decoder.vocab_size, decoder.context_length, "context_ids") if seq else [0]
    seq = (seq * (width // len(seq) + 1))[-width:]
    for b in sorted({cost_bucket(b) for b in batch_sizes}):
        context = torch.tensor([seq] * b, device=decoder.target.device)
        m = measure_costs(decoder, context, repeats=repeats,
                          verify_gammas=range(1, decoder.max_auto_draft_tokens + 1))
        decoder.auto_costs[b] = {"cost_ratio": m["cost_ratio"],
                                 "verify": smooth_verify_costs([v["relative_cost"] for v in m["verify"]]),
                                 "catchup_cost_ratio": max(m["catchup_cost_ratio"], m["cost_ratio"]),
                                 "target_forward_s": m["target_forward_s"]}  # for simulate_batch_speedup
    return decoder.auto_costs


@torch.no_grad()
def measure_costs(decoder: Any, context_ids: torch.Tensor, repeats: int = 21, verify_gammas: Sequence[int] = (),
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """:func:`measure_cost_ratio` on a decoder's own forward path: its few-row kernels setting, each model's cache
    kind (static or dynamic) and, with ``compile``, the compiled forwards; ids the draft cannot embed are replaced by
    its substitute id in both models' input (only the shapes matter).

    Args:
        decoder: a :class:`decode.engine.SpeculativeDecoder` with a draft.
        context_ids: ``(B, L)`` LongTensor of target ids on the models' device (B rows: costs at batch size B).
        repeats, verify_gammas, progress: as in :func:`measure_cost_ratio`.

    Returns:
        the dict of :func:`measure_cost_ratio` (seconds; ``cost_ratio`` = c).

    Raises:
        ValueError: the decoder has no draft, or a bad argument (as :func:`measure_cost_ratio` raises; ids are
            checked against the target before the draft's substitution).
    """
    return measure_cost_ratio(decoder.target, decoder.draft, _cost_context(decoder, context_ids, "measure_costs"),
                              repeats=repeats, verify_gammas=verify_gammas, progress=progress,
                              static_cache=decoder.static_cache, target_call=decoder.target_call,
                              draft_call=decoder.draft_call, few_row_linear=decoder.few_row_linear)


def cost_timer(decoder: Any, context_ids: torch.Tensor, verify_gammas: Sequence[int] = ()) -> CostTimer:
    """:func:`measure_costs` one round at a time: a :class:`CostTimer` on the decoder's forward path (call
    ``round()`` as often as wanted, then ``result()``), e.g. to spread the timing over a benchmark's run. Arguments
    and errors as :func:`measure_costs`."""
    return CostTimer(decoder.target, decoder.draft, _cost_context(decoder, context_ids, "cost_timer"), verify_gammas,
                     static_cache=decoder.static_cache, target_call=decoder.target_call,
                     draft_call=decoder.draft_call, few_row_linear=decoder.few_row_linear)


def _cost_context(decoder: Any, context_ids: torch.Tensor, caller: str) -> torch.Tensor:
    """The cost measurement's context as the models read it, checked against the target first (the draft's
    substitution would hide an id too large for it)."""
    if decoder.draft is None:
        raise ValueError(f"{caller}() times the draft against the target; this decoder has no draft")
    check_context_ids(context_ids, {"target": decoder.target}, hint=" (calibrate() takes a list of ids)")
    return decoder.draft_input_ids(context_ids)


def shared_context(decoder: Any) -> int:
    """The shorter of a decoder's two models' contexts (2**30 when neither states one)."""
    return min(c for c in (decoder.context_length, decoder.draft_context_length, 1 << 30) if c)


@torch.no_grad()
def warm_up(decoder: Any, max_batch_size: int = 16) -> float:
    """Do, before the first request, the one-time work that steps would otherwise do in the middle of serving,
    stalling every running request: compile the compiled forwards' graphs (with ``compile``) and, with
    ``num_draft_tokens="auto"``, measure the cost model of every batch size up to ``max_batch_size``. Returns
    the seconds it took (0 when there is nothing to do).

    A compiled forward (``torch.compile(..., dynamic=True)``) specialises on sizes 0 and 1, on whether an
    attention mask is passed and, through the few-row kernels, on whether rows × new tokens is at most 2. So a
    step's forward falls into one of 12 shape classes per compiled model: 1, 2 or more rows; 1, 2 or more new
    tokens (the draft's pending input is usually 1 or 2 tokens, more after auto γ chose 0; the verify window is
    γ + 1; with prompt lookup the draft's input is 3 or more tokens wherever a step's leading drafts came from
    it); without or with a mask (rows of unequal length). Each class compiles the first time a step meets
    it (seconds to tens of seconds on CPU). This runs each class once (:func:`run_shape_classes`): for 1, 2 and 3
    rows, a prefill of equal-length dummy prompts, then the forward helpers the steps use with 1, 2 and 3 new
    tokens (3 stands for more), first without and then with a mask, on a scratch state (the decoder's requests are
    untouched); with ``max_batch_size=1`` the mask classes are left out (one row has no holes: 3 classes per
    compiled model). Dynamo also keeps a static buffer's length static until it sees it change, so one class runs
    first on a 64-column buffer and then every class on a 128-column one (72-token prompts; a model whose context
    is too short for that stays at 64). Auto γ measures its cost model once per power-of-two batch size
    (:func:`decode.speedup.cost_bucket`), here for all of them at once (:func:`calibrate` on a dummy 64-token
    context) unless ``auto_costs`` were given. ``python -m decode serve`` calls it before it listens.

    Args:
        decoder: a :class:`decode.engine.SpeculativeDecoder`, idle.
        max_batch_size: the most requests that will run together (the server's ``--max-batch-size``).

    Raises:
        ValueError: ``max_batch_size`` < 1.
    """
    if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
        raise ValueError(f"warm_up(max_batch_size=...) takes an integer >= 1, got {max_batch_size!r}")
    auto = decoder.draft is not None and decoder.num_draft_tokens == "auto"
    if not decoder.compile and not auto:
        return 0.0
    start = time.perf_counter()
    if decoder.compile:
        # A single row never has holes (they come from rows of unequal length): no mask class at batch 1.
        masks = (False, True) if max_batch_size > 1 else (False,)
        every = list(itertools.product([b for b in (1, 2, 3) if b <= max_batch_size], masks, (1, 2, 3)))
        with kernels.few_row_linear(decoder.few_row_linear):
            # A static cache's buffer length is a size dynamo keeps static until it sees it change: one class
            # runs first on a 64-column buffer (a short prompt), then every class on a 128-column one.
            if shared_context(decoder) >= 72 + decoder.room() + 4:
                run_shape_classes(decoder, 4, [(1, False, 1)])
                run_shape_classes(decoder, 72, every)
            else:
                run_shape_classes(decoder, 4, every)
    missing = [b for b in cost_buckets(max_batch_size) if b not in decoder.auto_costs] if auto else []
    if missing:
        calibrate(decoder, [i % decoder.vocab_size for i in range(1, 65)], missing)
    return time.perf_counter() - start


def run_shape_classes(decoder: Any, prompt_length: int, classes: list[tuple[int, bool, int]]) -> None:
    """For :func:`warm_up`: each ``(rows, holes, k)`` runs the decoder's compiled forwards once on a scratch state of
    ``rows`` dummy prompts of ``prompt_length`` ids, with k new tokens and a mask if ``holes``."""
    prompt = [i % decoder.vocab_size for i in range(1, prompt_length + 1)]
    for batch in sorted({c[0] for c in classes}):
        state = decoder.prefill([prompt] * batch, use_draft=decoder.draft_call is not None)
        for _, holes, k in [c for c in classes if c[0] == batch]:
            ids = state.last[:, None].repeat(1, k)
            if decoder.draft_call is not None:
                decoder.draft_forward(state, ids, torch.ones_like(ids), holes)
            if decoder.target_call is not None:
                if holes and isinstance(state.target_cache, kv.StaticKV):
                    state.target_cache.holey = True  # what a ragged batch's roll-back leaves
                decoder.verify_forward(state, ids)
