"""The distillation recipe: setup, train loop, acceptance evaluation, checkpoints, cleanup. Read it top to bottom.

A frozen target teaches a draft to match its next-token distribution on completions, so that speculative
decoding accepts more of the draft's tokens (DistillSpec, Zhou et al. ICLR 2024). Per optimizer step:

1. take ``train.grad_accum`` micro-batches of (prompt, completion) examples; each one, with probability
   λ = ``data.on_policy_fraction``, gets its completions replaced by fresh draft samples (on-policy data);
2. count the completion tokens of the whole window (over all processes), so the loss is exact under
   accumulation and DDP;
3. the target scores each sequence in one forward pass (no grad), the draft in one forward pass with grad,
   and the divergence of ``loss.name`` between them drives the update (AdamW, warmup + cosine, clipping).

Every ``eval.every`` steps the draft's acceptance rate α and mean accepted length τ are measured with the bundled
decoder on held-out prompts; the best checkpoint by ``eval.select_by`` is kept in ``<output_dir>/best``.
All randomness of step k (data order, the λ coin, rollout sampling) is a function of (seed, k): with the
optimizer, scheduler and RNG states in the checkpoint, a resumed run continues exactly.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from decode.cache import context_length
from decode.loading import hub_revision, recorded_name
from decode.vocab_map import draft_vocab_map
from distill import checkpoint as ckpt
from distill.checks import check_inputs, normalize_config
from distill.config import SetupError
from distill.data import collate_sequences, kept_positions, load_data, micro_batch_indices
from distill.evaluate import acceptance_eval, resolve_costs
from distill.logging import MetricsLogger, Progress, StopFlag as _StopFlag, sigterm_raises
from distill.logit_cache import cached_training_data, open_for_training, peak_memory_mb
from distill.losses import cached_distill_loss, distill_loss, pruned_cached_distill_loss, pruned_distill_loss
from distill.models import (attach_lora, check_pair, is_local_path, load_draft, load_draft_tokenizer, load_target,
                            load_tokenizer)
from distill.precision import accelerator_precision, launcher_notes, plain_forward
from distill.rollout import accepts_logits_to_keep, forward_kept_logits, rollout
from distill.target_data import prepare_target_data
from distill.vocab import prune_for_training

# ------------------------------------------------------------------------------------------------ setup

@dataclass
class Run:
    """Everything the loop needs, built once by :func:`setup` (models, data, optimizer and the measured c)."""

    cfg: DictConfig                 # the normalized config
    accelerator: Any                # accelerate.Accelerator
    tokenizer: Any                  # the target's tokenizer (the pair shares it)
    target: Any                     # frozen target, on the accelerator's device
    draft: Any                      # the trainable draft (LoRA-wrapped when train.lora.enabled), prepared
    vocab: int                      # shared vocabulary size V (logits are sliced to it)
    examples: list[dict]            # training examples {"prompt_ids", "completion_ids"}
    eval_prompts: list[list[int]]   # held-out prompt token ids for the α/τ evaluation
    optimizer: Any                  # AdamW, prepared
    scheduler: Any                  # LambdaLR warmup + decay
    cost_ratio: float               # c = draft forward time / target forward time
    verify_costs: list[float] | None  # v_γ = verify forward of γ+1 tokens / one-token forward; None: v = 1
    draft_base: str | None          # what a LoRA adapter is applied to (a path/hub id), None for a full fine-tune
    output_dir: Path                # train.output_dir
    logit_cache: Any = None         # distill.logit_cache reader when data.target_logits=cached (then target is None)
    clock: dict = field(default_factory=lambda: {"elapsed_s": 0.0, "max_time_s": 0.0})  # for train.max_time_s
    logits_to_keep: dict = field(default_factory=dict)  # "target"/"draft" -> forward takes logits_to_keep
    progress: Progress = field(default_factory=lambda: Progress("none"))  # bars: steps, c measurement, α/τ eval


def lr_lambda(step: int, warmup: int, total: int, kind: str, min_ratio: float, time_progress: float = 0.0) -> float:
    """LR multiplier: linear warmup to 1 over ``warmup`` steps, then cosine/linear decay to ``min_ratio``.

    ``time_progress`` (elapsed / ``train.max_time_s``, 0 without a budget) drives the decay when it is ahead of
    the step count, so a run cut by its wall-clock budget still ends at ``min_ratio`` (as quickstart/pretrain.py does).
    """
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_progress))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def build_optimizer(draft: Any, cfg: DictConfig, clock: dict | None = None) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (no weight decay on biases and norms) and a LambdaLR warmup + decay schedule.

    ``clock`` (``{"elapsed_s", "max_time_s"}``, updated by the loop) makes the decay follow elapsed time too.
    """
    clock = clock if clock is not None else {"elapsed_s": 0.0, "max_time_s": 0.0}
    params = [p for p in draft.parameters() if p.requires_grad]
    if not params:
        raise SetupError("the draft has no trainable parameters (check train.lora.target_modules)")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": float(cfg.optim.weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=float(cfg.optim.lr),
                            betas=tuple(cfg.optim.betas), eps=float(cfg.optim.eps))
    kind = cfg.optim.scheduler
    if kind not in ("cosine", "linear", "constant"):
        raise SetupError(f"optim.scheduler={kind!r}; choose cosine|linear|constant")
    total, warmup, min_ratio = int(cfg.train.max_steps), int(cfg.optim.warmup_steps), float(cfg.optim.min_lr_ratio)
    def time_progress() -> float:
        return clock["elapsed_s"] / clock["max_time_s"] if clock["max_time_s"] else 0.0

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, warmup, total, kind, min_ratio, time_progress()))
    return opt, sched


def apply_optim_settings(optimizer: Any, scheduler: Any, cfg: DictConfig) -> list[str]:
    """Set ``optim.lr``, ``optim.weight_decay``, ``optim.betas`` and ``optim.eps`` of ``cfg`` on an optimizer and
    LambdaLR schedule that a resume loaded from a checkpoint (their state dicts carry the values the run started
    with, which a changed config would otherwise leave in force while config.yaml recorded the new ones). The
    schedule keeps its step: the learning rate becomes ``optim.lr`` × the schedule's factor there. Returns one line
    per value that changed."""
    lr, betas, eps = float(cfg.optim.lr), tuple(float(b) for b in cfg.optim.betas), float(cfg.optim.eps)
    notes = []
    for i, group in enumerate(optimizer.param_groups):
        decay = any(p.ndim >= 2 for p in group["params"])  # build_optimizer's groups: weights, then biases/norms
        want = {"initial_lr": lr, "betas": betas, "eps": eps, "weight_decay": float(cfg.optim.weight_decay) if decay
                else 0.0}
        for key, value in want.items():
            old = group.get(key)
            if old is not None and (tuple(old) if key == "betas" else old) != value:
                name = "lr" if key == "initial_lr" else key
                shown = list(value) if key == "betas" else value
                note = f"optim.{name}={shown} (the checkpoint's {old}) applies from here"
                if note not in notes:
                    notes.append(note)
            group[key] = value
        scheduler.base_lrs[i] = lr
        group["lr"] = lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() and its state say
    return notes


def setup(cfg: DictConfig, log: Any = print, cost_ratio: float | None = None,
          resume_from: str | Path | None = None, verify_costs: list[float] | None = None) -> Run:
    """Everything the loop needs, in order of cost: config checks, models + pair check, data, the pruned draft
    head (``draft.vocab.keep``), LoRA, optimizer.

    ``cost_ratio``, ``verify_costs``: c and v_γ to use instead of ``eval.cost_ratio`` / ``eval.verify_costs`` or a
    measurement (a resumed run keeps its own; :func:`distill.evaluate.resolve_costs`).
    ``resume_from``: the checkpoint a resumed run continues (a pruned draft takes its id map from there).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed

    cfg = normalize_config(cfg)
    check_inputs(cfg)  # data files, output folder, precision vs device: before any model loads
    # On a machine without a GPU, cpu=True is what makes accelerate use gloo across launched processes.
    precision, cpu = accelerator_precision(cfg.train)
    if not torch.distributed.is_initialized():
        # accelerate keeps its state in a process-wide singleton; a second in-process run (tests, notebooks) with
        # another precision must start from a clean one.
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision=precision, cpu=cpu)
    if str(cfg.train.mixed_precision) == "auto":
        log(f"train.mixed_precision=auto -> {precision} (distill/precision.py: bf16 only where the hardware has it)")
    if accelerator.is_main_process:
        for note in launcher_notes(precision, str(cfg.train.mixed_precision), accelerator.distributed_type.value):
            log(f"warning: {note}")
    if accelerator.distributed_type == DistributedType.DEEPSPEED and int(cfg.train.grad_accum) != 1:
        raise SetupError("DeepSpeed owns gradient accumulation: set train.grad_accum=1 and raise train.batch_size "
                         "(the recipe's exact token-count division needs one micro-batch per step)")
    set_seed(int(cfg.train.seed))
    progress = Progress(str(cfg.train.progress), enabled=accelerator.is_main_process)
    output_dir = Path(cfg.train.output_dir)
    tokenizer = load_tokenizer(cfg.target.tokenizer or cfg.target.name_or_path,
                               trust_remote_code=bool(cfg.target.trust_remote_code))
    # data.target_logits=cached: the target's distribution comes from a logit cache and the target is never loaded.
    cache = open_for_training(cfg, tokenizer, log) if target_logits_mode(cfg) == "cached" else None
    target = load_target(cfg.target) if cache is None else None
    draft = load_draft(cfg.draft, target)
    bad = nonfinite_weight(draft)
    if bad is not None:
        raise SetupError(f"draft.name_or_path={cfg.draft.name_or_path}: the draft's weight {bad} is not finite (NaN "
                         "or inf); it can be neither trained nor evaluated. Give a draft with finite weights (an "
                         "earlier checkpoint of its run, or the base draft)")
    if cache is None:
        vocab = check_pair(target, draft, tokenizer, load_draft_tokenizer(cfg.draft))
        ctx = [c for c in (context_length(target), context_length(draft)) if c]
        examples, eval_prompts = load_data(cfg, tokenizer, min(ctx) if ctx else None)
    else:
        vocab, examples, eval_prompts = cached_training_data(cache, draft, tokenizer, load_draft_tokenizer(cfg.draft),
                                                             context_length(draft))
    from decode.compat import input_vocab_size

    rows = input_vocab_size(draft)
    if rows is not None and rows < vocab:  # the decoder feeds such a draft a substitute id; training reads every id
        raise SetupError(f"draft.name_or_path={cfg.draft.name_or_path}: the draft's input embedding has {rows} rows "
                         f"but the shared vocabulary has {vocab} ids, which the training data uses: resize it first "
                         f"(draft.resize_token_embeddings({vocab}), then save_pretrained) or use a draft built for "
                         "this tokenizer")

    if target is not None:
        target.to(accelerator.device)
    draft.to(accelerator.device)

    if cache is not None:
        pass  # the cache holds the scored sequences (target-generated ones included)
    elif cfg.data.completions in ("target", "both"):
        if cfg.data.completions == "both" and all(not e["completion_ids"] for e in examples):
            raise SetupError("data.completions=both trains on the data's own completions and the target's, but the "
                             "data has none (data.source.completion_field is null or empty): half of the examples "
                             "would train nothing. Use data.completions=target, or set data.source.completion_field")
        generated = prepare_target_data(cfg, target, draft, tokenizer, examples, accelerator, log)
        examples = generated if cfg.data.completions == "target" else examples + generated
    elif all(not e["completion_ids"] for e in examples) and float(cfg.data.on_policy_fraction) < 1.0:
        raise SetupError("the training data has no completions (data.source.completion_field is null), so only "
                         "on-policy batches could be trained: set data.on_policy_fraction=1.0, or "
                         "data.completions=target (sequence-level KD), or data.source.completion_field=FIELD")
    if not examples:
        raise SetupError("no training examples after loading; check data.source")
    # draft.vocab.keep: the draft's lm_head keeps the N ids with the most target mass on these examples.
    pruned_here = prune_for_training(cfg, draft, tokenizer, vocab, target, cache, examples, resume_from, log)

    lora = bool(cfg.train.lora.enabled)
    draft_base = None
    if lora:
        draft_base = str(Path(cfg.draft.name_or_path).resolve()) if cfg.draft.get("name_or_path") and \
            is_local_path(str(cfg.draft.name_or_path)) else cfg.draft.get("name_or_path")
        if not draft_base or pruned_here:  # a built or newly pruned draft: save the adapter's base weights once
            draft_base = str((output_dir / "draft_base").resolve())
            if accelerator.is_main_process and not (output_dir / "draft_base" / "config.json").exists():
                draft.save_pretrained(draft_base)
                tokenizer.save_pretrained(draft_base)
        draft = attach_lora(draft, cfg.train.lora)
        for adapter in draft.peft_config.values():  # the adapter names its real base (a pruned one is draft_base)
            adapter.base_model_name_or_path = draft_base
    if cfg.eval.get("verify_costs") is not None:  # an explicit setting wins, also over a resumed run's own
        verify_costs = [float(v) for v in cfg.eval.verify_costs]
    if cost_ratio is None:
        cost_ratio = cfg.eval.get("cost_ratio")
    if cost_ratio is None and target is None:
        cost_ratio = float("nan")  # no target to time; the recipe does not evaluate in cached mode
    elif cost_ratio is None:
        with progress.reporting() as report:
            cost_ratio, verify_costs = resolve_costs(target, draft, eval_prompts, None, verify_costs,
                                                     int(cfg.eval.max_gamma), report)
        if accelerator.num_processes > 1:  # timings differ per process; one cost model keeps selection in step
            from accelerate.utils import broadcast_object_list

            cost_ratio, verify_costs = broadcast_object_list([cost_ratio, verify_costs])
    clock = {"elapsed_s": 0.0, "max_time_s": float(cfg.train.get("max_time_s") or 0)}
    optimizer, scheduler = build_optimizer(draft, cfg, clock)
    draft, optimizer = accelerator.prepare(draft, optimizer)
    return Run(cfg=cfg, accelerator=accelerator, tokenizer=tokenizer, target=target, draft=draft, vocab=vocab,
               examples=examples, eval_prompts=eval_prompts, optimizer=optimizer, scheduler=scheduler,
               cost_ratio=float(cost_ratio), verify_costs=verify_costs, draft_base=draft_base, output_dir=output_dir,
               logit_cache=cache,
               clock=clock, progress=progress)


# ------------------------------------------------------------------------------------------------ micro-batch

def micro_rng(cfg: DictConfig, micro_id: int) -> random.Random:
    """The generator of global micro-batch ``micro_id``: its λ coin, then its rollout seed (same on every process)."""
    return random.Random(f"{cfg.train.seed}/{micro_id}")


def micro_batch(run: Run, micro_id: int) -> tuple[list[dict], bool]:
    """The examples of global micro-batch ``micro_id``; with probability λ their completions are draft rollouts."""
    cfg, acc = run.cfg, run.accelerator
    idx = micro_batch_indices(len(run.examples), micro_id, int(cfg.train.batch_size), int(cfg.train.seed),
                              bool(cfg.data.shuffle))
    batch = [run.examples[i] for i in idx]
    rng = micro_rng(cfg, micro_id)
    on_policy = rng.random() < float(cfg.data.on_policy_fraction)
    if on_policy:
        gen = torch.Generator(device=acc.device).manual_seed(rng.randrange(2**63))
        batch = rollout(acc.unwrap_model(run.draft), batch, run.tokenizer.pad_token_id,
                        run.tokenizer.eos_token_id, int(cfg.data.max_new_tokens),
                        float(cfg.data.rollout_temperature), gen)
    return batch, on_policy


# ------------------------------------------------------------------------------------------------ loss

def _vocab_slice(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, T, V') -> (B, T, vocab): drop lm_head padding rows; a smaller lm_head is padded with -inf (q = 0)."""
    if logits.shape[-1] >= vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def target_logits_mode(cfg: DictConfig) -> str:
    """``data.target_logits``: ``online`` (the target scores every batch) or ``cached`` (``data.logit_cache``)."""
    mode = str(cfg.data.get("target_logits") or "online")
    if mode not in ("online", "cached"):
        raise SetupError(f"data.target_logits={mode!r}; choose online or cached (with data.logit_cache=PATH)")
    return mode


def kept_logits(run: Run, who: str, batch: dict[str, torch.Tensor], where: tuple) -> torch.Tensor:
    """(N, V') logits of ``run.<who>`` at the kept positions (:func:`distill.rollout.forward_kept_logits`); whether the
    model takes ``logits_to_keep`` is looked up once per run."""
    model, support = getattr(run, who), run.logits_to_keep
    if who not in support:
        support[who] = accepts_logits_to_keep(model)
    return forward_kept_logits(model, batch, where, support[who])


def target_distribution(run: Run, batch: dict[str, torch.Tensor], rows: list[int] | None = None,
                        where: tuple | None = None) -> tuple[str, Any]:
    """The target's side of the loss at the N completion positions of ``batch`` (row by row, as the loss mask).

    Returns ``("logits", (N, V') logits)`` from a no-grad target forward, or ``("cached", ((N, k+1) bucket
    log-probs, (N, k) ids, (N, s) sampled tail ids or None))`` read from the logit cache (``data.target_logits=cached``). ``where`` is
    :func:`kept_positions` of the batch's loss mask (computed here when None); ``rows`` are the cache rows of the
    batch's examples (cached mode only).
    """
    where = where if where is not None else kept_positions(batch["loss_mask"].cpu())
    cache = run.logit_cache
    if cache is not None:
        log_p, ids, tail_ids = cache.buckets(rows)
        if log_p.shape[0] != len(where[1]):
            raise RuntimeError(f"logit cache rows give {log_p.shape[0]} positions, the batch has {len(where[1])}")
        device = run.accelerator.device
        return "cached", tuple(None if t is None else t.to(device, non_blocking=True) for t in (log_p, ids, tail_ids))
    with torch.no_grad(), run.accelerator.autocast():
        return "logits", kept_logits(run, "target", batch, where)


def ce_weight(cfg: DictConfig, on_policy: bool) -> float:
    """``loss.ce_weight`` of a micro-batch: 0 on on-policy batches with ``loss.ce_labels=data``, whose labels are
    the draft's own samples (cross-entropy on them would train the draft toward what it already says; GKD's
    on-policy term is the divergence alone, Agarwal et al. 2024). With ``ce_labels=target`` the labels are the
    target's choices, which on the draft's own states are what GKD trains toward: the weight applies."""
    if on_policy and _ce_labels(cfg) != "target":
        return 0.0
    return float(cfg.loss.ce_weight)


def _ce_labels(cfg: Any) -> str:
    return getattr(cfg.loss, "ce_labels", None) or "data"  # (a config of an earlier version has no such key)


def target_top1(kind: str, target_side: Any, vocab: int) -> torch.Tensor:
    """The target's greedy choice at each kept position, the labels of ``loss.ce_labels=target`` (a top-1
    agreement term: the token a greedy verify compares the draft's argmax with).

    Args:
        kind, target_side: as :func:`target_distribution` returns them: ``"logits"`` with (..., V') logits (ids
            past the shared vocabulary ``vocab`` are ignored), or ``"cached"`` with ((N, k+1) bucket log-probs,
            (N, k) ids, tail ids): the top cached id, which is the target's argmax (the cache keeps its top k).
    Returns: (...,) or (N,) int64 target ids.
    """
    if kind == "cached":
        log_p, ids, _ = target_side
        return ids.gather(-1, log_p[..., :ids.shape[-1]].argmax(-1, keepdim=True)).squeeze(-1)
    return _vocab_slice(target_side, vocab).argmax(-1)


def loss_on_batch(run: Run, batch: dict[str, torch.Tensor], n_tokens: torch.Tensor,
                  on_policy: bool = False) -> torch.Tensor:
    """Target side (online forward or cache), the draft forward (grad); the divergence over completion tokens
    (plus ``loss.ce_weight`` of cross-entropy, on batches that are not on-policy: :func:`ce_weight`).

    In cached mode ``batch["cache_rows"]`` (B,) locates the examples' cached target distributions.
    Only completion positions reach the lm_heads and the loss, so the float32 softmax work is (N, V), not
    (B, L, V) with the prompt and padding share wasted; positions are found on the host (no device sync).
    ``loss=acceptance`` keeps the sequence layout instead (its windows of γ consecutive positions must not cross
    sequences): both lm_heads run on the contiguous column span holding every completion token, (B, C, V).
    """
    cfg, acc = run.cfg, run.accelerator
    if cfg.loss.name == "acceptance":
        return _acceptance_loss_on_batch(run, batch, n_tokens, on_policy)
    where = kept_positions(batch["loss_mask"])
    n_keep = len(where[1])
    labels = batch["labels"].flatten()[batch["loss_mask"].bool().flatten()]
    rows = batch["cache_rows"].tolist() if "cache_rows" in batch else None
    batch = {k: v.to(acc.device, non_blocking=True) for k, v in batch.items() if k != "cache_rows"}
    kind, target_side = target_distribution(run, batch, rows, where)
    if _ce_labels(cfg) == "target":
        labels = target_top1(kind, target_side, run.vocab)
    vocab_map = draft_vocab_map(run.draft)  # (N,) for a pruned draft (its logits are N wide)
    draft_kept = kept_logits(run, "draft", batch, where)
    draft_kept = (draft_kept if vocab_map is not None else _vocab_slice(draft_kept, run.vocab)).unsqueeze(0)
    kw = dict(labels=labels.to(acc.device).unsqueeze(0), beta=float(cfg.loss.beta),
              temperature=float(cfg.loss.temperature), ce_weight=ce_weight(cfg, on_policy),
              fused=bool(cfg.loss.get("fused", True)))
    ones = torch.ones(1, n_keep, device=acc.device)
    # The pruned-support losses run through autograd (no fused form): loss.fused does not apply to them.
    pruned_kw = {k: v for k, v in kw.items() if k != "fused"}
    if kind == "cached":
        log_p, ids, tail_ids = target_side
        if vocab_map is not None:
            return pruned_cached_distill_loss(cfg.loss.name, draft_kept, log_p.unsqueeze(0), ids.unsqueeze(0),
                                              vocab_map, run.vocab, ones, n_tokens, **pruned_kw,
                                              tail_ids=None if tail_ids is None else tail_ids.unsqueeze(0))
        return cached_distill_loss(cfg.loss.name, draft_kept, log_p.unsqueeze(0), ids.unsqueeze(0), ones, n_tokens,
                                   tail_ids=None if tail_ids is None else tail_ids.unsqueeze(0), **kw)
    if vocab_map is not None:
        loss = pruned_distill_loss(cfg.loss.name, draft_kept, _vocab_slice(target_side, run.vocab).unsqueeze(0),
                                   vocab_map, ones, n_tokens, **pruned_kw)
    else:
        loss = distill_loss(cfg.loss.name, draft_kept, _vocab_slice(target_side, run.vocab).unsqueeze(0), ones,
                            n_tokens, **kw)
    del target_side  # (N, V) is the largest activation here; free it before the draft's backward
    return loss


def _acceptance_loss_on_batch(run: Run, batch: dict[str, torch.Tensor], n_tokens: torch.Tensor,
                              on_policy: bool = False) -> torch.Tensor:
    """``loss=acceptance`` on (B, C, V) logits: C is the contiguous column span from the first to the last column
    holding a completion token (all L columns when that is every one), so consecutive positions stay consecutive."""
    cfg, acc = run.cfg, run.accelerator
    mask = batch["loss_mask"]
    cols = mask.bool().any(0).nonzero().squeeze(1)
    span = None if len(cols) in (0, mask.shape[1]) else torch.arange(int(cols[0]), int(cols[-1]) + 1)
    if span is not None and len(span) == mask.shape[1]:
        span = None
    width = mask.shape[1] if span is None else len(span)
    where = (span, torch.arange(mask.shape[0] * width))  # every (row, column) of the span, row by row
    mask_seq = mask if span is None else mask[:, span]
    labels = batch["labels"] if span is None else batch["labels"][:, span]
    batch = {k: v.to(acc.device, non_blocking=True) for k, v in batch.items() if k != "cache_rows"}
    kind, target_side = target_distribution(run, batch, None, where)
    if kind != "logits":  # config validation refuses loss=acceptance with data.target_logits=cached
        raise SetupError("loss=acceptance needs the target's full logits; use data.target_logits=online")
    shape = (mask.shape[0], width, -1)
    if _ce_labels(cfg) == "target":
        labels = target_top1(kind, target_side.view(shape), run.vocab)
    vocab_map = draft_vocab_map(run.draft)
    draft_seq = kept_logits(run, "draft", batch, where).view(shape)  # (B, C, V) or (B, C, N) when pruned
    kw = dict(labels=labels.to(acc.device), beta=float(cfg.loss.beta), temperature=float(cfg.loss.temperature),
              ce_weight=ce_weight(cfg, on_policy), gamma=int(cfg.loss.gamma))
    target_seq = _vocab_slice(target_side.view(shape), run.vocab)
    if vocab_map is not None:
        loss = pruned_distill_loss(cfg.loss.name, draft_seq, target_seq, vocab_map, mask_seq.to(acc.device),
                                   n_tokens, **kw)
    else:
        loss = distill_loss(cfg.loss.name, _vocab_slice(draft_seq, run.vocab), target_seq, mask_seq.to(acc.device),
                            n_tokens, **kw)
    del target_side  # (B, C, V) is the largest activation here; free it before the draft's backward
    return loss


def train_step(run: Run, step: int, micro_position: int | None = None) -> dict:
    """One optimizer step of the recipe (``train.grad_accum`` micro-batches), with no host sync on a GPU.

    ``step`` is the 0-based step being made; ``micro_position`` the global micro-batches consumed before it
    (``step · grad_accum · processes`` when None; a run resumed on another world size passes its own).

    Returns ``loss_sum`` (a device scalar: the step's loss on this process), ``tokens`` (completion tokens of the
    window over all processes), ``grad_norm`` (device scalar, None under DeepSpeed) and ``on_policy_fraction``
    (of the window's micro-batches over all processes).
    """
    cfg, acc = run.cfg, run.accelerator
    draft, optimizer, scheduler = run.draft, run.optimizer, run.scheduler
    accum, world = int(cfg.train.grad_accum), acc.num_processes
    micro_position = step * accum * world if micro_position is None else micro_position
    micro_ids = [micro_position + j * world + acc.process_index for j in range(accum)]
    drawn = [micro_batch(run, m) for m in micro_ids]
    batches = [collate_sequences(b, run.tokenizer.pad_token_id) for b, _ in drawn]
    if run.logit_cache is not None:  # where each example's target distribution sits in the cache
        for batch, (examples, _) in zip(batches, drawn):
            batch["cache_rows"] = torch.tensor([e["cache_row"] for e in examples])
    # Divide by the window's tokens over all processes (mean over processes: DDP averages gradients). The count is
    # known on the host; only a multi-process run needs a collective for it.
    n_local = float(sum(int(b["loss_mask"].sum()) for b in batches))
    n_global = n_local
    if world > 1:
        n_global = float(acc.reduce(torch.tensor(n_local, device=acc.device), reduction="sum").item())
    n_tokens = n_global / world
    loss_sum = torch.zeros((), device=acc.device)
    for j, (batch, (_, on_policy)) in enumerate(zip(batches, drawn)):
        sync = j == accum - 1
        with acc.no_sync(draft) if not sync else contextlib.nullcontext():
            loss = loss_on_batch(run, batch, n_tokens, on_policy)
            acc.backward(loss)
        loss_sum += loss.detach()
    ckpt.fault_point("step", step + 1)
    max_norm = float(cfg.optim.max_grad_norm or 0) or float("inf")
    grad_norm = acc.clip_grad_norm_(draft.parameters(), max_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # The fraction of the step's micro-batches on every process that were on-policy: each coin is a function of
    # (seed, micro-batch id), so it is counted here without a collective.
    window = range(micro_position, micro_position + accum * world)
    lam = float(cfg.data.on_policy_fraction)
    fraction = sum(micro_rng(cfg, m).random() < lam for m in window) / len(window)
    return {"loss_sum": loss_sum, "tokens": int(n_global), "grad_norm": grad_norm, "on_policy_fraction": fraction}


# ------------------------------------------------------------------------------------------------ evaluate

def evaluate(run: Run) -> dict | None:
    """α, τ, histogram and predicted speedup of the current draft (every process runs it: same weights, same seed).

    None in cached mode (no target loaded): measure afterwards with ``python -m distill eval``.
    """
    cfg, acc = run.cfg, run.accelerator
    if run.target is None:
        return None
    # the draft as saved and exported (its own dtype), not under train.mixed_precision's autocast
    with run.progress.reporting() as report, plain_forward(acc.unwrap_model(run.draft)) as draft:
        return acceptance_eval(run.target, draft, run.eval_prompts, run.tokenizer, list(cfg.eval.temperatures),
                               num_draft_tokens=int(cfg.eval.num_draft_tokens),
                               max_new_tokens=int(cfg.eval.max_new_tokens), batch_size=int(cfg.eval.batch_size),
                               seed=int(cfg.eval.seed), cost_ratio=run.cost_ratio, max_gamma=int(cfg.eval.max_gamma),
                               progress=report, verify_costs=run.verify_costs)


class DivergedError(SetupError):
    """The draft's weights are no longer finite (the training diverged); nothing of that state is saved."""


def nonfinite_weight(model: Any) -> str | None:
    """The name of the first parameter of ``model`` holding a NaN or an infinity (this process's shard), else None."""
    return next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)


def check_finite(run: Run, step: int, out: Path) -> None:
    """Raise :class:`DivergedError` on every process when a weight of the draft is NaN or infinite after ``step``
    (one pass over the weights, at checkpoint and evaluation steps only): a diverged draft is neither saved nor
    evaluated. Under several processes the verdict is reduced, so all stop together (FSDP shards differ)."""
    bad = nonfinite_weight(run.draft)
    acc = run.accelerator
    if acc.num_processes > 1:
        flag = acc.reduce(torch.tensor(float(bad is not None), device=acc.device), reduction="sum")
        bad = bad or ("(on another process)" if float(flag) > 0 else None)
    if bad is not None:
        raise DivergedError(
            f"the training diverged: after step {step} the draft's weight {bad} is not finite (NaN or inf), so it was "
            f"not saved; the checkpoints in {out} before it are kept (metrics.jsonl shows where the loss went). "
            "Lower optim.lr, set optim.max_grad_norm, or use train.mixed_precision=bf16 rather than fp16, then "
            "resume from the last good checkpoint (train.resume=PATH) or start over")


def save(run: Run, state: dict, path: Path) -> Path:
    """A full checkpoint at ``path`` with the current trainer state."""
    return ckpt.save_checkpoint(run.accelerator, run.draft, run.tokenizer, run.scheduler, run.optimizer, state,
                                OmegaConf.to_yaml(run.cfg), path)


# ------------------------------------------------------------------------------------------------ checkpoints

def resolve_resume(cfg: DictConfig, log: Any = None) -> Path | None:
    """The checkpoint to resume from (``train.resume`` true: the newest complete one in output_dir; a path: that
    one), after checking that the run folder may be written (see ``checkpoint.prepare_run_folder``)."""
    inputs = {key: OmegaConf.select(cfg, key) for key in ("draft.name_or_path", "target.name_or_path",
                                                          "target.tokenizer", "draft.tokenizer", "data.logit_cache",
                                                          "data.source.path")}
    return ckpt.prepare_run_folder(cfg.train.output_dir, cfg.train.get("resume"),
                                   bool(cfg.train.get("overwrite", False)), main=ckpt.is_main_process(),
                                   inputs=inputs, log=log)


def _data_position(state: dict, cfg: DictConfig, world: int, log: Any) -> int:
    """Micro-batches consumed by the checkpoint's steps; another world size continues at the same example."""
    batch = int(cfg.train.batch_size)
    consumed = int(state.get("examples_consumed", 0))
    if consumed % batch:
        raise SetupError(f"the checkpoint stopped at example {consumed}, which is not a multiple of "
                         f"train.batch_size={batch} (it was trained with batch_size={state.get('batch_size')}); "
                         f"resume with train.batch_size={state.get('batch_size')}")
    saved_world = state.get("num_processes")
    if saved_world is not None and saved_world != world:
        log(f"resume: the checkpoint was trained by {saved_world} process(es), this run has {world}; continuing at "
            f"example {consumed} ({world * int(cfg.train.grad_accum) * batch} examples per step from here)")
    return consumed // batch


def _changed_keys(checkpoint: Path, cfg: DictConfig) -> list[str]:
    """Config keys that decide the data stream and the update, whose values differ from the checkpoint's."""
    saved = ckpt.read_config(checkpoint)
    if saved is None:
        return []
    saved = OmegaConf.create(saved)
    if OmegaConf.select(saved, "loss.ce_labels") is None:  # a config from before loss.ce_labels: data labels
        OmegaConf.update(saved, "loss.ce_labels", "data", force_add=True)
    keys = ["train.seed", "train.batch_size", "train.grad_accum", "train.max_steps", "data.source", "data.holdout",
            "data.completions", "data.target_logits", "data.logit_cache", "data.logit_cache_k",
            "data.logit_cache_tail_samples", "data.on_policy_fraction", "data.rollout_temperature", "loss.name",
            "loss.beta", "loss.temperature", "loss.ce_weight", "loss.ce_labels", "loss.gamma", "optim",
            "target.name_or_path", "train.lora.dropout"]  # not loss.fused: same update
    absent = object()  # a key the checkpoint's config predates is not a change
    return [k for k in keys if OmegaConf.select(saved, k, default=absent) not in (absent, OmegaConf.select(cfg, k))]


def _resume_warnings(checkpoint: Path, cfg: DictConfig, state: dict, world: int) -> list[str]:
    """What a resume changes: each key of :func:`_changed_keys`, except ``train.batch_size`` where only the split
    of the same global micro-batch over processes changed and λ = 0 (the data stream and the update are the same);
    with λ > 0 a changed split is named: the λ coin is tossed per process micro-batch, so which rows are on-policy
    changes from there on."""
    split, now = (state.get("num_processes"), state.get("batch_size")), (world, int(cfg.train.batch_size))
    same_global = None not in split and split[0] * split[1] == now[0] * now[1]
    on_policy = float(cfg.data.on_policy_fraction) > 0
    notes = [f"{key} differs from the checkpoint's config; the resumed run is not the same experiment"
             for key in _changed_keys(checkpoint, cfg) if not (key == "train.batch_size" and same_global and
                                                               not on_policy)]
    saved = ckpt.read_config(checkpoint) or {}
    was = (saved.get("logger") or {}).get("project") or "draftkit"
    project = cfg.logger.get("project") or "draftkit"
    if cfg.logger.name == "wandb" and (saved.get("logger") or {}).get("name") == "wandb" and was != project:
        notes.append(f"logger.project={project} differs from the checkpoint's {was}: W&B keeps run ids per project, "
                     f"so the metrics go to a new W&B run in {project}, not on with the one in {was}")
    if on_policy and None not in split and split != now:
        notes.append(f"data.on_policy_fraction={cfg.data.on_policy_fraction}: the checkpoint's micro-batches were "
                     f"{split[0]} process(es) x {split[1]} rows, this run's are {now[0]} x {now[1]}; the λ coin is "
                     "tossed per micro-batch, so which rows are on-policy differs from a run that kept the split "
                     "(the data order does not)")
    return notes


def _check_resume_settings(saved: dict, cfg: DictConfig, resume_from: Path | None) -> None:
    """Settings a resume cannot honour, checked against the checkpoint's trainer_state.json (``saved``; empty for
    a fresh run) before any model loads. Raises SetupError naming the setting and the fix."""
    asked_stop, at = cfg.train.get("stop_at"), int(saved.get("step", 0))
    if asked_stop is not None and asked_stop < at:
        raise SetupError(f"train.stop_at={asked_stop} is before step {at}, where the checkpoint it resumes stops "
                         f"({resume_from}); a run cannot go back: set train.stop_at above {at} (or drop it to go on "
                         "to train.max_steps), or resume an earlier checkpoint with train.resume=<its step_N folder>")
    best_by = (saved.get("best") or {}).get("metric")
    same_folder = resume_from is not None and Path(resume_from).resolve().parent == Path(
        cfg.train.output_dir).resolve()  # (a fork into another folder starts its best/ over)
    if same_folder and best_by is not None and best_by != cfg.eval.select_by:
        raise SetupError(f"eval.select_by={cfg.eval.select_by} differs from the run's {best_by}, by which its best/ "
                         f"(step {saved['best'].get('step')}) was chosen: the two values are not comparable. Resume "
                         f"with eval.select_by={best_by}, or fork into a new folder with train.resume={resume_from} "
                         "train.output_dir=NEW (its best/ starts over)")
    if "lora" in saved and bool(saved["lora"]) != bool(cfg.train.lora.enabled):
        lora = bool(saved["lora"])
        raise SetupError(f"the checkpoint {resume_from} was trained {'with' if lora else 'without'} LoRA; resume it "
                         f"with train.lora.enabled={str(lora).lower()}"
                         + (" and the run's other train.lora settings" if lora else ""))
    if saved.get("lora") and cfg.train.lora.enabled:  # these shape the adapter the checkpoint's weights belong to
        old_lora = ((resume_from and ckpt.read_config(resume_from)) or {}).get("train", {}).get("lora") or {}
        lora = OmegaConf.to_container(cfg.train.lora)
        for key in ("r", "alpha", "target_modules", "modules_to_save"):
            if key in old_lora and _lora_value(old_lora[key]) != _lora_value(lora[key]):
                was, now = _override_form(old_lora[key]), _override_form(lora[key])
                raise SetupError(
                    f"train.lora.{key}={now} differs from the checkpoint's {was} ({resume_from}): its adapter weights "
                    f"were trained {'at the scale alpha / r' if key in ('r', 'alpha') else 'on those modules'} and "
                    f"would be restored into another adapter. Resume with train.lora.{key}={was}, or start a new run "
                    "from an export of this one")


def _override_form(value: Any) -> str:
    """A config value as a Hydra override writes it: 32.0 -> 32, ['q_proj', 'v_proj'] -> [q_proj,v_proj],
    None -> null."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _lora_value(value: Any) -> Any:
    """A train.lora value in a comparable form: module lists as sets (null as none), numbers as floats (alpha 32 ==
    32.0)."""
    if value is None or isinstance(value, (list, tuple)):  # modules_to_save: null and [] both save none
        return frozenset(value or ())
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


# ------------------------------------------------------------------------------------------------ train

def train(cfg: DictConfig, log: Any = None) -> dict:
    """Run the recipe for a composed config (:func:`distill.compose`); returns the summary also written to
    ``<output_dir>/summary.json``. ``log`` takes each progress line (default: print, on the main process only).
    The config is checked as ``python -m distill train`` checks it (``distill.checks.validate`` and
    ``check_inputs``) before any model loads.

    Raises SetupError (a ValueError) for bad input before any training starts: missing target, incompatible
    tokenizer, empty data, prompts longer than the context, unknown loss, λ outside [0, 1], ...; CheckpointError
    when the run folder holds another run, or another ``distill train`` is running into it (the main process holds
    ``checkpoint.RUN_LOCK`` there while it runs).
    """
    normalized = normalize_config(cfg)
    main = ckpt.is_main_process()  # setup's lines are the same on every process: print them once
    out, lock = Path(normalized.train.output_dir), None
    created = [d for d in (out, *out.parents) if not os.path.lexists(d)] if main else []  # the lock makes these
    if main:
        from distill.checks import check_output_dir

        check_output_dir(out, "train.output_dir")  # not under a file, writable
        lock = ckpt.lock_run_folder(out)
    try:
        # SIGTERM while loading acts as Ctrl-C, so a run set aside by train.overwrite=true goes back (the training
        # loop's StopFlag takes both signals over and saves instead)
        with sigterm_raises(KeyboardInterrupt), contextlib.ExitStack() as closing:  # closing: the W&B run
            return _train(cfg, normalized, main, log, closing)
    except BaseException:
        if created and [p.name for p in out.iterdir()] == [ckpt.RUN_LOCK]:  # refused before any write: as it was
            (out / ckpt.RUN_LOCK).unlink()
            for folder in created:  # innermost first; one the run did not make stops it
                try:
                    folder.rmdir()
                except OSError:
                    break
        raise
    finally:
        if lock is not None:
            lock.close()


def _train(cfg: DictConfig, normalized: DictConfig, main: bool, log: Any, closing: contextlib.ExitStack) -> dict:
    """:func:`train` once the run folder is locked; ``closing`` finishes the metrics logger (its W&B run) however
    the run ends, so a failed call leaves no W&B run open for the next one in the process."""
    resume_from = resolve_resume(normalized, log=log or print)
    try:  # until the first write, a stop puts back the run that train.overwrite=true set aside
        saved = ckpt.read_state(resume_from) if resume_from is not None else {}
        _check_resume_settings(saved, cfg, resume_from)
        kept_c = saved.get("cost_ratio") if cfg.eval.get("cost_ratio") is None else None
        # a checkpoint from before verify costs were kept has none: it goes on with v = 1, as it started
        kept_v = saved.get("verify_costs") if kept_c is not None else None
        run = setup(cfg, log=log or (print if main else lambda *_: None), cost_ratio=kept_c, resume_from=resume_from,
                    verify_costs=kept_v)
        cfg, acc = run.cfg, run.accelerator
        log = log or acc.print
        out = run.output_dir
        revision = hub_revision(str(cfg.target.name_or_path))
        # cached logits: no target to time, so no c (null in trainer_state.json, not NaN, which is not JSON)
        recorded_c = run.cost_ratio if math.isfinite(run.cost_ratio) else None
        state = {"step": 0, "tokens_seen": 0, "best": None, "last_eval": None, "draft_base": run.draft_base,
                 "lora": bool(cfg.train.lora.enabled), "target": recorded_name(str(cfg.target.name_or_path)),
                 "target_revision": revision, "vocab_size": run.vocab, "cost_ratio": recorded_c,
                 "verify_costs": run.verify_costs, "batch_size": int(cfg.train.batch_size),
                 "num_processes": acc.num_processes, "examples_consumed": 0}
        if resume_from is not None:
            state.update(ckpt.load_checkpoint(acc, run.draft, run.optimizer, run.scheduler, resume_from, log))
            for note in apply_optim_settings(run.optimizer, run.scheduler, cfg):  # the checkpoint's were loaded
                log(f"resume: {note}")
            state["cost_ratio"], state["verify_costs"] = recorded_c, run.verify_costs  # the ones this run uses
            state["draft_base"] = run.draft_base  # in a moved run folder, its own draft_base (not the old path)
            if state.get("target_revision") != revision:
                log(f"warning: target {cfg.target.name_or_path} is at revision {revision} (the cache's refs/main); "
                    f"the checkpoint was trained against {state.get('target_revision')}: the run goes on against "
                    f"{revision} (trainer_state.json and the export card list both)")
                earlier = list(state.get("earlier_target_revisions") or [])
                state["earlier_target_revisions"] = [*earlier, {"target_revision": state.get("target_revision"),
                                                                "through_step": int(state["step"])}]
            state["target_revision"] = revision
            log(f"resumed from {resume_from} at step {state['step']}")
            if state.get("best") and Path(resume_from).resolve().parent != out.resolve():
                # a fork into a new run folder: its best/ would be missing though the state names one
                old = state["best"]
                log(f"resume into another run folder: its best checkpoint starts over (the earlier run's best, "
                    f"{old['metric']} {old['value']:.4f} at step {old['step']}, stays in "
                    f"{Path(resume_from).parent / 'best'})")
                state["best"] = None
            if kept_c is not None:
                verify = ("set by eval.verify_costs" if cfg.eval.get("verify_costs") is not None else
                          "kept" if kept_v is not None else "none recorded, so v = 1 as the run started")
                log(f"resume: keeping the checkpoint's cost ratio c={kept_c:.3f} (measured when the run started; "
                    f"set eval.cost_ratio to use another); verify costs: {verify}")
        max_steps, accum, world = int(cfg.train.max_steps), int(cfg.train.grad_accum), acc.num_processes
        micro_position = _data_position(state, cfg, world, log)  # a refused resume raises here, before any write
    except BaseException:
        if main:
            ckpt.restore_set_aside(cfg.train.output_dir)
        raise
    if acc.is_main_process:  # the new run starts writing: the run it replaces goes
        ckpt.discard_set_aside(out)
        out.mkdir(parents=True, exist_ok=True)
        ckpt.replace_text(out / "config.yaml", OmegaConf.to_yaml(cfg))  # whole or not at all: it marks the run
    logged_through = -1  # the last step the interrupted run logged (W&B holds it already)
    if resume_from is not None:
        if acc.is_main_process:
            logged_through = ckpt.truncate_metrics(out, int(state["step"]))
            if Path(resume_from).resolve().parent == out.resolve():  # a kill may have come before the pointer update
                ckpt.mark_latest(out, resume_from)
        for note in _resume_warnings(resume_from, cfg, state, world):
            log(f"warning: {note}")
    logger = closing.enter_context(MetricsLogger(cfg, out, acc.is_main_process, resumed=resume_from is not None,
                                                 resume_step=int(state["step"]), logged_through=logged_through,
                                                 log=log))
    state["num_processes"], state["batch_size"] = world, int(cfg.train.batch_size)
    stop_at = min(int(cfg.train.stop_at or max_steps), max_steps)
    if cfg.train.stop_at is not None and int(cfg.train.stop_at) > max_steps:
        log(f"warning: train.stop_at={cfg.train.stop_at} is past train.max_steps={max_steps}; the run ends at step "
            f"{max_steps}")
    if int(cfg.train.batch_size) > len(run.examples):
        log(f"warning: train.batch_size={cfg.train.batch_size} > the {len(run.examples)} training examples: each batch "
            "holds some examples more than once (add data or lower train.batch_size)")
    if int(cfg.optim.warmup_steps) > max_steps:
        log(f"warning: optim.warmup_steps={cfg.optim.warmup_steps} > train.max_steps={max_steps}: the learning rate "
            f"never reaches optim.lr={cfg.optim.lr} (it peaks at {max_steps / int(cfg.optim.warmup_steps):.0%} of it)")
    evals = (f"{len(run.eval_prompts)} eval prompts" if run.target is not None
             else "no eval (cached mode)")
    log(f"distill: {len(run.examples)} examples, {evals}, loss={cfg.loss.name}, "
        f"λ={cfg.data.on_policy_fraction}, {world} process(es), steps {state['step']}->{stop_at}/{max_steps}")

    def maybe_eval_and_save(step: int, force: bool, signalled: bool = False) -> None:
        """Save and evaluate at the scheduled steps, and both at the end (``force``). A signal saves but evaluates
        only on schedule: an extra eval would make a candidate for best/ that the same run uninterrupted never has."""
        every, save_every = int(cfg.eval.every), int(cfg.train.save_every)
        path = None
        saving = step > 0 and (force or signalled or bool(save_every and step % save_every == 0))
        evaluating = force or bool(every and step % every == 0)
        if saving or evaluating:  # a diverged draft is neither saved (it would prune good checkpoints) nor evaluated
            check_finite(run, step, out)
        if saving:  # saved first: an eval error loses no step
            path = save(run, state, ckpt.step_dir(out, step))
            ckpt.fault_point("pointer", step)
            if acc.is_main_process:
                ckpt.mark_latest(out, path)
                ckpt.prune(out, int(cfg.train.keep_last))
        ev = evaluate(run) if evaluating else None  # None in cached mode
        if ev is not None:
            state["last_eval"] = {"step": step, **ev}
            logger.log_eval(ev, step)
            log(f"step {step}: acceptance rate={ev['acceptance_rate']:.3f} τ={ev['mean_accepted_length']:.2f} "
                f"speedup≈{ev['predicted_speedup']:.2f} ({cfg.eval.select_by} selects)")
            value = ev[cfg.eval.select_by]
            if step > 0 and (state["best"] is None or value > state["best"]["value"]):
                state["best"] = {"metric": cfg.eval.select_by, "value": value, "step": step}
                save(run, state, out / "best")
            if path is not None and acc.is_main_process:
                ckpt.write_eval(path, state["last_eval"], state["best"])

    if resume_from is not None and state["step"] >= stop_at and (state["last_eval"] or {}).get("step") != stop_at:
        maybe_eval_and_save(state["step"], force=True)  # killed between the final save and its evaluation
    if run.target is None:
        log("cached target logits: no acceptance evaluation during training (the target is not loaded); measure the "
            "result with python -m distill eval +target.name_or_path=T draft.name_or_path=<output_dir>/step_N")
    elif state["step"] == 0 and cfg.eval.get("at_start", True):
        ev = evaluate(run)
        state["initial_eval"] = ev
        logger.log_eval(ev, 0)
        log(f"initial draft: acceptance rate={ev['acceptance_rate']:.3f} τ={ev['mean_accepted_length']:.2f}")

    draft = run.draft
    draft.train()
    loss_value = float("nan")
    max_time_s = float(cfg.train.get("max_time_s") or 0)
    clock = run.clock
    clock.update(elapsed_s=float(state.get("elapsed_s", 0.0)), max_time_s=max_time_s)
    if max_time_s:
        log(f"wall-clock budget: {max_time_s:.0f}s (the LR schedule follows elapsed time; {clock['elapsed_s']:.0f}s "
            "spent)")
    with _StopFlag() as flag, run.progress.bar("distill", stop_at, state["step"], unit="steps") as bar:
        while state["step"] < stop_at:
            t0 = time.perf_counter()
            lr = run.optimizer.param_groups[0]["lr"]  # the rate this step applies (train_step advances the schedule)
            out_step = train_step(run, state["step"], micro_position)
            state["step"] = step = state["step"] + 1
            state["tokens_seen"] += out_step["tokens"]
            micro_position += accum * world
            state["examples_consumed"] = micro_position * int(cfg.train.batch_size)  # the data position
            out_of_time = bool(max_time_s) and clock["elapsed_s"] + (time.perf_counter() - t0) >= max_time_s
            if max_time_s and acc.num_processes > 1:  # every process must stop at the same step
                flag_t = torch.tensor(float(out_of_time), device=acc.device)
                out_of_time = bool(acc.reduce(flag_t, reduction="sum").item() > 0)
            log_now = step % int(cfg.train.log_every) == 0 or step == 1 or step == stop_at or out_of_time
            signalled = flag.stop
            if acc.num_processes > 1:  # a signal may reach one process only (kill -TERM of a rank) or the processes
                # at different steps: all stop at the same step, or the others wait in the next collective forever
                signalled = bool(acc.reduce(torch.tensor(float(signalled), device=acc.device), reduction="sum").item())
            if log_now or signalled:  # the loss is read (a host sync) only when it is shown
                loss_value = float(acc.reduce(out_step["loss_sum"], reduction="mean").item())
            dt = time.perf_counter() - t0
            tokens_per_s = out_step["tokens"] / max(dt, 1e-9)
            bar.update(advance=1, info=f"loss {loss_value:.4f}  {tokens_per_s:,.0f} tok/s")
            if log_now and not math.isfinite(loss_value):  # (the same on every process: it is reduced)
                check_finite(run, step, out)  # diverged weights stop the run now, not at the next save
            if log_now:
                grad_norm = out_step["grad_norm"]
                grad_norm = float("nan") if grad_norm is None else float(grad_norm)  # None: DeepSpeed clips itself
                logger.log({"train/loss": loss_value, "train/lr": lr,
                            "train/grad_norm": grad_norm, "train/tokens_per_s": tokens_per_s,
                            "train/tokens_seen": state["tokens_seen"], "train/elapsed_s": clock["elapsed_s"],
                            "train/on_policy_fraction_batch": out_step["on_policy_fraction"]}, step)
            t1 = time.perf_counter()
            clock["elapsed_s"] += t1 - t0
            state["elapsed_s"] = clock["elapsed_s"]  # saved with the checkpoint: a resumed run keeps its schedule
            maybe_eval_and_save(step, force=step == stop_at or out_of_time, signalled=signalled)
            clock["elapsed_s"] += time.perf_counter() - t1  # eval and checkpoint time count against the budget
            state["elapsed_s"] = clock["elapsed_s"]
            if signalled:
                log(f"stopped by signal at step {step}; resume with train.resume=true")
                break
            if out_of_time:
                log(f"train.max_time_s={max_time_s:.0f} reached at step {step} ({clock['elapsed_s']:.0f}s)")
                break
    logger.finish()
    # null, not NaN (invalid JSON), when this call trained no step (a finished run resumed) or the loss diverged
    final_loss = loss_value if math.isfinite(loss_value) else None
    summary = {"steps": state["step"], "max_steps": max_steps, "final_loss": final_loss,
               "tokens_seen": state["tokens_seen"], "best": state["best"], "last_eval": state["last_eval"],
               "initial_eval": state.get("initial_eval"), "num_processes": world, "output_dir": str(out),
               "elapsed_s": state.get("elapsed_s"), "target_logits": target_logits_mode(cfg),
               "peak_memory_mb": peak_memory_mb(acc.device)}
    log(f"peak memory {summary['peak_memory_mb']:.0f} MiB ({'CUDA allocated' if acc.device.type == 'cuda' else 'RSS'}"
        f", target logits {summary['target_logits']})")
    initial, best = state.get("initial_eval") or {}, state["best"]
    if best and initial.get(best["metric"]) is not None and best["value"] < initial[best["metric"]]:
        # the starting draft is never a candidate for best/ (it is not a checkpoint of this run)
        log(f"warning: best/ (step {best['step']}, {best['metric']} {best['value']:.4f}) scores below the starting "
            f"draft ({initial[best['metric']]:.4f}): training has not improved on it yet, so keep the starting draft "
            f"or train longer before exporting best/")
    if acc.is_main_process:
        try:  # whole or not at all; a full disk here costs the summary only: every checkpoint is already saved
            ckpt.replace_text(out / "summary.json", json.dumps(summary, indent=2))
        except OSError as err:
            log(f"warning: could not write {out / 'summary.json'} ({err.strerror or err}); the checkpoints in {out} "
                f"are complete. The summary: {json.dumps(summary)}")
    acc.end_training()
    return summary
