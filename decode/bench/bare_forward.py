"""The reference point for the engine's cost ratio: the two models' bare Hugging Face decode forwards (and, for
the end-to-end prediction, their bare prefills).

``decode.speedup.measure_cost_ratio`` gives c as the engine pays it (its own forward path). Here each model is
called the plainest way HF allows, ``model(input_ids=(1, 1), cache=...)`` on its own prefilled
``DynamicCache`` with no mask and no positions, so ``c / bare_cost_ratio`` is the share of the draft's cost that the
engine adds on top of the models themselves (issue #8 asks for at most 1.25).
"""
from __future__ import annotations

import copy
import inspect
import statistics
import time
from typing import Any

import torch

from decode.bench.timing import sync


@torch.no_grad()
def measure_bare_forwards(target, draft, context_ids: torch.Tensor, repeats: int = 21) -> dict[str, Any]:
    """Median seconds of one cached single-token HF decode forward of each model, and their ratio; also of each
    model's prefill of the context's prefix, and their ratio.

    Args:
        target, draft: causal LMs on the device of ``context_ids``.
        context_ids: (1, L) LongTensor, L >= 2: the prefix (all but the last token) is prefilled per model, timed
            ``repeats`` times; each timed decode call then feeds the last token on a fresh copy of that prefill's
            cache (copied outside the timing), so every call sees the same context. Target and draft alternate so
            drift hits both.
        repeats: timed calls per model and kind after 2 untimed ones.

    Returns:
        {"context_tokens", "repeats", "target_forward_s", "draft_forward_s" (medians, seconds), "cost_ratio"
        (draft / target), "target_prefill_s", "draft_prefill_s" (medians over L - 1 tokens, seconds),
        "prefill_cost_ratio" (draft / target: r of ``decode.speedup.end_to_end_speedup``)}.

    Raises:
        ValueError: fewer than 2 context tokens or repeats < 1.
    """
    if context_ids.dim() != 2 or context_ids.shape[0] != 1 or context_ids.shape[1] < 2:
        raise ValueError(f"context_ids must have shape (1, L) with L >= 2, got {tuple(context_ids.shape)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = context_ids.device
    prefix, last = context_ids[:, :-1], context_ids[:, -1:]
    models = (("target", target), ("draft", draft))
    prefills: dict[str, list[float]] = {"target": [], "draft": []}
    caches = {}
    for i in range(repeats + 2):
        for name, model in models:
            sync(device)
            t0 = time.perf_counter()
            caches[name] = _cache_of(model(input_ids=prefix, use_cache=True))
            sync(device)
            if i >= 2:
                prefills[name].append(time.perf_counter() - t0)
    samples: dict[str, list[float]] = {"target": [], "draft": []}
    for i in range(repeats + 2):
        for name, model in models:
            cache = copy.deepcopy(caches[name])
            sync(device)
            t0 = time.perf_counter()
            model(input_ids=last, use_cache=True, **{_cache_kwarg(model): cache})
            sync(device)
            if i >= 2:  # the first calls pay for lazy initialisation
                samples[name].append(time.perf_counter() - t0)
    t, d = statistics.median(samples["target"]), statistics.median(samples["draft"])
    pt, pd = statistics.median(prefills["target"]), statistics.median(prefills["draft"])
    return {"context_tokens": int(context_ids.shape[1]), "repeats": repeats, "target_forward_s": t,
            "draft_forward_s": d, "cost_ratio": d / t, "target_prefill_s": pt, "draft_prefill_s": pd,
            "prefill_cost_ratio": pd / pt}


def _cache_of(output) -> Any:
    # transformers 5.x names the returned cache ``cache`` (formerly ``past_key_values``).
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
