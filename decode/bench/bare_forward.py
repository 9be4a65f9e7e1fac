"""The reference point for the engine's cost ratio: the two models' bare Hugging Face decode forwards (and, for
the end-to-end prediction, their bare prefills).

``decode.costs.measure_cost_ratio`` gives c as the engine pays it (its own forward path). Here each model is
called the plainest way HF allows, ``model(input_ids=(1, 1), cache=...)`` on its own prefilled
``DynamicCache`` with no mask and no positions, so ``c / bare_cost_ratio`` is the share of the draft's cost that the
engine adds on top of the models themselves (``cost_ratio_vs_bare`` of the highlights).
"""
from __future__ import annotations

import copy
import inspect
import statistics
import time
from typing import Any

import torch

from decode import kernels
from decode.bench.timing import sync
from decode.costs import check_repeats, check_timer_inputs


class BareTimer:
    """The timing behind :func:`measure_bare_forwards`, one round at a time (the benchmark spreads its rounds over
    its run, next to the engine's :class:`decode.costs.CostTimer`).

    Each :meth:`round` prefills the context's prefix with each model (timed), then feeds the last token on a copy
    of that prefill's cache (copied outside the timing), target and draft alternating; the first
    ``warmup_rounds`` are untimed. ``few_row_linear`` runs the rounds under :func:`decode.kernels.few_row_linear`
    (the engine's matmul kernels, so the engine's c and this ratio differ only in the work around the models).

    Raises:
        ValueError: as ``decode.costs.check_timer_inputs`` (no draft, a context that is not a (1, L >= 2)
            integer tensor of ids both models embed and whose positions they hold, a bad ``warmup_rounds`` or
            ``few_row_linear``); :meth:`result` before a timed round.
    """

    def __init__(self, target, draft, context_ids: torch.Tensor, few_row_linear: bool = False,
                 warmup_rounds: int = 2):
        check_timer_inputs(target, draft, context_ids, warmup_rounds=warmup_rounds, few_row_linear=few_row_linear)
        if context_ids.shape[0] != 1:
            raise ValueError(f"context_ids must have shape (1, L) with L >= 2, got {tuple(context_ids.shape)}")
        self._models = (("target", target), ("draft", draft))
        self._context, self.few_row_linear = context_ids, few_row_linear
        self.warmup_rounds, self.rounds = warmup_rounds, 0
        self._samples: dict[str, list[float]] = {k: [] for k in ("target", "draft", "target_prefill",
                                                                  "draft_prefill")}

    @torch.no_grad()
    def round(self) -> None:
        """One timed prefill and one timed cached decode forward of each model."""
        device, prefix, last = self._context.device, self._context[:, :-1], self._context[:, -1:]
        timed = self.rounds >= self.warmup_rounds  # the first calls pay for lazy initialisation
        with kernels.few_row_linear(self.few_row_linear):
            kernels.check_packed(*(model for _, model in self._models))  # as CostTimer.round: not in the timings
            caches = {}
            for name, model in self._models:
                sync(device)
                t0 = time.perf_counter()
                caches[name] = _cache_of(model(input_ids=prefix, use_cache=True))
                sync(device)
                if timed:
                    self._samples[f"{name}_prefill"].append(time.perf_counter() - t0)
            for name, model in self._models:
                cache = copy.deepcopy(caches[name])
                sync(device)
                t0 = time.perf_counter()
                model(input_ids=last, use_cache=True, **{_cache_kwarg(model): cache})
                sync(device)
                if timed:
                    self._samples[name].append(time.perf_counter() - t0)
        self.rounds += 1

    def result(self) -> dict[str, Any]:
        """The medians over the timed rounds, as :func:`measure_bare_forwards` returns them."""
        if not self._samples["target"]:
            raise ValueError(f"no timed round yet: call round() more than {self.warmup_rounds} times (the first are "
                             "untimed)")
        t, d, pt, pd = (statistics.median(self._samples[k]) for k in ("target", "draft", "target_prefill",
                                                                       "draft_prefill"))
        return {"context_tokens": int(self._context.shape[1]), "repeats": len(self._samples["target"]),
                "target_forward_s": t, "draft_forward_s": d, "cost_ratio": d / t, "target_prefill_s": pt,
                "draft_prefill_s": pd, "prefill_cost_ratio": pd / pt, "few_row_linear": self.few_row_linear}


def measure_bare_forwards(target, draft, context_ids: torch.Tensor, repeats: int = 21,
                          few_row_linear: bool = False) -> dict[str, Any]:
    """Median seconds of one cached single-token HF decode forward of each model, and their ratio; also of each
    model's prefill of the context's prefix, and their ratio.

    Args:
        target, draft: causal LMs on the device of ``context_ids``.
        context_ids: (1, L) LongTensor, L >= 2: each round prefills the prefix (all but the last token) with each
            model, then feeds the last token on a fresh copy of that prefill's cache (copied outside the timing),
            so every call sees the same context. Target and draft alternate so drift hits both.
        repeats: timed rounds after 2 untimed ones.
        few_row_linear: time under the engine's matmul kernels (:class:`BareTimer`).

    Returns:
        {"context_tokens", "repeats", "target_forward_s", "draft_forward_s" (medians, seconds), "cost_ratio"
        (draft / target), "target_prefill_s", "draft_prefill_s" (medians over L - 1 tokens, seconds),
        "prefill_cost_ratio" (draft / target: r of ``decode.speedup.end_to_end_speedup``), "few_row_linear"}.

    Raises:
        ValueError: as :class:`BareTimer`, or ``repeats`` not an integer >= 1.
    """
    check_repeats(repeats)
    timer = BareTimer(target, draft, context_ids, few_row_linear)
    for _ in range(repeats + 2):
        timer.round()
    return timer.result()


def _cache_of(output) -> Any:
    # transformers 5.x names the returned cache ``cache`` (formerly ``past_key_values``).
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
