"""``python -m distill bench-step``: the recipe's optimizer step against its hardware bound, on the same shapes.

The bound of one online KD step is the work no implementation can skip: the frozen target's forward (no grad,
autocast) plus the draft's forward, backward and AdamW update. The recipe's step (``distill.recipe.train_step``,
exactly what ``train`` runs: data draw, collation, target forward, draft forward, divergence, backward, clipping,
optimizer, scheduler) is timed against it, with the parts in between timed alone (collation; the divergence and
its backward on precomputed logits) so that the rest can be attributed. All parts run interleaved round by round
(one of each per round), so a busy machine slows all of them alike; medians are reported.

With ``data.target_logits=cached`` the target is not loaded and the bound is the draft's forward/backward/update
alone (the cache read is part of the recipe's step).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from functools import partial
from typing import Any, Callable

import torch

from distill.checks import normalize_config
from distill.data import collate_sequences
from distill.logit_cache import peak_memory_mb
from distill.losses import FUSED, cached_distill_loss, distill_loss
from distill.recipe import micro_batch, setup, target_distribution, train_step
from distill.runfolder import write_results
from distill.target_data import target_data_dir


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(prepare: Callable[[], Callable[[], Any]], device: torch.device) -> float:
    """Seconds of the callable that ``prepare()`` returns (the preparation itself is not timed)."""
    fn = prepare()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


BIG = 10**6  # bound parts draw micro-batches far from the recipe's steps


def _parts(run: Any) -> dict[str, Callable[[int], Callable[[], Any]]]:
    """name -> prepare(round) -> timed callable, for every part; the bound parts use micro-batches of the same
    shapes as the recipe's steps."""
    parts = {"recipe_step": _recipe_step, "recipe_step_full_logits": _recipe_step_full_logits,
             "recipe_step_other_loss_form": _recipe_step_other_loss_form, "collate": _collate,
             "draft_forward_backward_optimizer": _draft_update, "divergence_forward_backward": _divergence}
    if run.cfg.loss.name not in FUSED:  # loss.fused changes nothing there
        del parts["recipe_step_other_loss_form"]
    if run.target is not None:
        parts["target_forward"] = _target_forward
    return {name: partial(prepare, run) for name, prepare in parts.items()}


def _batch_of(run: Any, i: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The examples of bound round ``i`` and their collated batch on the accelerator's device."""
    examples, _ = micro_batch(run, BIG + i)
    pad = run.tokenizer.pad_token_id
    return examples, {k: v.to(run.accelerator.device) for k, v in collate_sequences(examples, pad).items()}


def _collate(run: Any, i: int) -> Callable[[], Any]:
    return lambda: collate_sequences(micro_batch(run, BIG + i)[0], run.tokenizer.pad_token_id)


def _target_forward(run: Any, i: int) -> Callable[[], Any]:
    _, batch = _batch_of(run, i)

    def fn():
        with torch.no_grad(), run.accelerator.autocast():
            run.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return fn


def _draft_update(run: Any, i: int) -> Callable[[], Any]:
    _, batch = _batch_of(run, i)
    acc, draft, optimizer = run.accelerator, run.draft, run.optimizer

    def fn():
        with acc.autocast():
            logits = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        acc.backward(logits.sum() * 0.0)  # every parameter gets a gradient; no loss work beyond the forward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return fn


def _divergence(run: Any, i: int) -> Callable[[], Any]:
    """The loss and its backward on precomputed kept logits, as the recipe computes it."""
    cfg, acc = run.cfg, run.accelerator
    examples, batch = _batch_of(run, i)
    keep = batch["loss_mask"].bool()
    n = int(keep.sum())
    with torch.no_grad(), acc.autocast():
        d = run.draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[keep]
    kind, t = target_distribution(run, batch, [e.get("cache_row") for e in examples])
    ones = torch.ones(1, n, device=acc.device)
    kw = dict(beta=float(cfg.loss.beta), temperature=float(cfg.loss.temperature))
    fused = bool(cfg.loss.get("fused", True))

    def fn():
        x = d[..., :run.vocab].unsqueeze(0).requires_grad_(True)
        if kind == "cached":
            loss = cached_distill_loss(cfg.loss.name, x, t[0].unsqueeze(0), t[1].unsqueeze(0), ones, n,
                                       fused=fused, tail_ids=None if t[2] is None else t[2].unsqueeze(0), **kw)
        else:
            loss = distill_loss(cfg.loss.name, x, t[..., :run.vocab].unsqueeze(0), ones, n, fused=fused, **kw)
        loss.backward()
    return fn


def _recipe_step(run: Any, i: int) -> Callable[[], Any]:
    def fn():
        out = train_step(run, i)
        float(out["loss_sum"])  # the recipe reads the loss at log steps; count one read per step (worst case)
    return fn


def _recipe_step_full_logits(run: Any, i: int) -> Callable[[], Any]:
    """The same step with the lm_heads run on every position (what logits_to_keep saves)."""
    def fn():
        saved = run.logits_to_keep
        run.logits_to_keep = {"target": False, "draft": False}
        try:
            float(train_step(run, i)["loss_sum"])
        finally:
            run.logits_to_keep = saved
    return fn


def _recipe_step_other_loss_form(run: Any, i: int) -> Callable[[], Any]:
    """The same step with the other loss.fused (fused vs autograd)."""
    def fn():
        fused = bool(run.cfg.loss.get("fused", True))
        run.cfg.loss.fused = not fused
        try:
            float(train_step(run, i)["loss_sum"])
        finally:
            run.cfg.loss.fused = fused
    return fn


def bench_step(cfg: Any, steps: int = 10, warmup: int = 2, out: str | None = None, log: Any = print,
               overwrite: bool = False) -> dict:
    """Time the recipe's step and its bound on the configured pair and data; print a table, return (and with
    ``out`` write) the JSON result. ``steps`` timed rounds after ``warmup`` untimed ones. An existing ``out`` is
    replaced only with ``overwrite`` (``--overwrite``).

    Raises SetupError as ``train`` does for a bad config (before any model loads).
    """
    # Nothing is written to train.output_dir (a run folder of the same overrides, or the next train's): setup's
    # own files (a LoRA draft's draft_base) go to a scratch folder; a target_data cache is still shared with train.
    cfg = normalize_config(cfg)
    cfg.data.target_generated.path = str(target_data_dir(cfg))
    with tempfile.TemporaryDirectory(prefix="draftkit-bench-step-") as scratch:
        cfg.train.output_dir = scratch
        return _bench(setup(cfg, log=lambda *_: None), steps, warmup, out, log, overwrite)


def _bench(run: Any, steps: int, warmup: int, out: str | None, log: Any, overwrite: bool) -> dict:
    acc = run.accelerator
    run.draft.train()
    parts = _parts(run)
    samples: dict[str, list[float]] = {name: [] for name in parts}
    for r in range(warmup + steps):
        for name, fn in parts.items():
            dt = _timed(lambda: fn(r), acc.device)
            if r >= warmup:
                samples[name].append(dt)
    med = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
    bound = med["draft_forward_backward_optimizer"] + med.get("target_forward", 0.0)
    c = run.cfg
    result = {"device": str(acc.device), "mixed_precision": str(acc.mixed_precision),
              "target_logits": str(c.data.get("target_logits") or "online"), "loss": str(c.loss.name),
              "batch_size": int(c.train.batch_size), "grad_accum": int(c.train.grad_accum),
              "threads": torch.get_num_threads(), "rounds": steps, "median_ms": med,
              "bound_ms": bound, "efficiency": bound / med["recipe_step"] if med["recipe_step"] else None,
              "loss_form": "fused" if c.loss.get("fused", True) else "autograd",
              "peak_memory_mb": peak_memory_mb(acc.device),
              "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()}}
    rows = [(f"recipe step ({result['loss_form']} loss)", med["recipe_step"]),
            ("recipe step, lm_heads on all positions", med["recipe_step_full_logits"])]
    other = med.get("recipe_step_other_loss_form")
    if other:  # the same step with the other loss.fused, for the bound / step of both forms from one run
        result["other_loss_form"] = "autograd" if result["loss_form"] == "fused" else "fused"
        result["efficiency_other_loss_form"] = bound / other
        rows.append((f"recipe step ({result['other_loss_form']} loss)", other))
    if "target_forward" in med:
        rows.append(("  target forward (no grad)", med["target_forward"]))
    rows += [("  draft forward+backward+AdamW", med["draft_forward_backward_optimizer"]),
             ("  = bound", bound), ("collation alone", med["collate"]),
             ("divergence forward+backward alone", med["divergence_forward_backward"])]
    log(f"bench-step: {result['target_logits']} target, loss={result['loss']}, batch {result['batch_size']}, "
        f"{result['mixed_precision']}, {result['threads']} thread(s), {steps} interleaved rounds (median ms)")
    width = max(len(name) for name, _ in rows)  # one column of numbers
    for name, ms in rows:
        log(f"  {name:<{width}} {ms:9.1f}")
    log(f"  bound / recipe step = {result['efficiency']:.2f}    peak memory {result['peak_memory_mb']:.0f} MiB")
    if other:
        log(f"  bound / recipe step with the {result['other_loss_form']} loss = "
            f"{result['efficiency_other_loss_form']:.2f}")
    if out:  # after the table above: a results file that cannot be written loses nothing
        write_results(json.dumps(result, indent=2), out, overwrite)
    return result
