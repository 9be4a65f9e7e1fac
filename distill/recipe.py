"""The distillation recipe: setup, train loop, acceptance evaluation, checkpoints, cleanup. Read it top to bottom.

A frozen target teaches a draft to match its next-token distribution on completions, so that speculative
decoding accepts more of the draft's tokens (DistillSpec, Zhou et al. ICLR 2024). Per optimizer step:

1. take ``train.grad_accum`` micro-batches of (prompt, completion) examples; each one, with probability
   λ = ``data.on_policy_fraction``, gets its completions replaced by fresh draft samples (on-policy data);
2. count the completion tokens of the whole window (over all processes), so the loss is exact under
   accumulation and DDP;
3. the target scores each sequence in one forward pass (no grad), the draft in one forward pass with grad,
   and the divergence of ``loss.name`` between them drives the update (AdamW, warmup + cosine, clipping).

Every ``eval.every`` steps the draft's α and mean accepted length τ are measured on held-out prompts: by default
teacher-forced on the target's greedy responses to them (generated once, kept in ``<output_dir>/eval_heldout.json``),
with ``eval.method=generate`` by speculative decoding with the bundled decoder; the best checkpoint by
``eval.select_by`` is kept in ``<output_dir>/best``. Each evaluation's wall time is logged (``eval_s``) and the
summary gives the evaluation's share of the run's wall time.
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

from decode import SpeculativeDecoder
from decode.cache import context_length
from decode.compat import input_vocab_size
from decode.loading import hub_revision, recorded_name
from decode.outputs import replace_text
from decode.vocab_map import draft_vocab_map
from distill import checkpoint as ckpt, runfolder
from distill.checks import check_inputs, check_output_dir, normalize_config
from distill.config import SetupError
from distill.cross_vocab import (check_cross_vocab_settings, check_resumed_pairing, draft_inputs, is_cross_vocab,
                                 pair_vocabularies, pairing_record, shared_columns)
from distill.data import collate_sequences, kept_positions, load_data, micro_batch_indices
from distill.evaluate import (HELDOUT_FILE, acceptance_eval, heldout_examples, resolve_costs, save_heldout,
                              teacher_forced_eval)
from distill.logging import MetricsLogger, Progress, StopFlag as _StopFlag, sigterm_raises
from distill.logit_cache import cached_training_data, open_for_training, peak_memory_mb
from distill.losses import cached_distill_loss, distill_loss, pruned_cached_distill_loss, pruned_distill_loss
from distill.models import (attach_lora, check_pair, is_local_path, load_draft, load_draft_tokenizer, load_target,
                            load_tokenizer)
from distill.precision import accelerator_precision, launcher_notes, plain_forward
from distill.rollout import accepts_logits_to_keep, forward_kept_logits, rollout
from distill.target_data import prepare_target_data
from distill.vocab import heldout_coverage, prune_for_training, selection_warnings

# ------------------------------------------------------------------------------------------------ setup

@dataclass
class Run:
    """Everything the loop needs, built once by :func:`setup` (models, data, optimizer and the measured c)."""

    cfg: DictConfig                 # the normalized config
    accelerator: Any                # accelerate.Accelerator
    tokenizer: Any                  # the target's tokenizer (the pair shares it, unless intersection is set)
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
    heldout: list[dict] | None = None  # held-out prompts + the target's greedy responses (teacher-forced eval, vocab)
    heldout_record: dict | None = None  # those responses to keep in <output_dir>/eval_heldout.json (made by this setup)
    vocab_report: dict | None = None   # a pruned draft's kept ids: selection data and held-out coverage
    eval_time: dict = field(default_factory=lambda: {"eval_s": 0.0, "heldout_s": 0.0, "costs_s": 0.0})
    draft_tokenizer: Any = None     # the draft's own tokenizer when it differs from the target's (saved with it)
    intersection: Any = None        # decode.cross_vocab.VocabIntersection the draft trains through, with its own


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


def setup(cfg: DictConfig, log: Any = print, cost_ratio: float | None = None,
          resume_from: str | Path | None = None, verify_costs: list[float] | None = None) -> Run:
    """Everything the loop needs, in order of cost: config checks, models + pair check, data, the pruned draft
    head (``draft.vocab.keep``), LoRA, optimizer.

    ``cost_ratio``, ``verify_costs``: c and v_γ to use instead of ``eval.cost_ratio`` / ``eval.verify_costs`` or a
    measurement (a resumed run keeps its own; :func:`distill.evaluate.resolve_costs`).
    ``resume_from``: the checkpoint a resumed run continues (a pruned draft takes its id map from there).
    """
    cfg = normalize_config(cfg)
    check_inputs(cfg)  # data files, output folder, precision vs device: before any model loads
    accelerator = make_accelerator(cfg, log)
    progress = Progress(str(cfg.train.progress), enabled=accelerator.is_main_process)
    output_dir = Path(cfg.train.output_dir)
    tokenizer = load_tokenizer(cfg.target.tokenizer or cfg.target.name_or_path,
                               trust_remote_code=bool(cfg.target.trust_remote_code))
    draft_tokenizer = load_draft_tokenizer(cfg.draft)
    cross = is_cross_vocab(tokenizer, draft_tokenizer)  # a draft of another vocabulary: decode.cross_vocab's view
    if cross:
        check_cross_vocab_settings(cfg)
    if resume_from is not None:  # a resumed draft keeps the tokenizer it was trained with
        check_resumed_pairing(ckpt.read_state(resume_from).get("tokenizer_pairing"),
                              draft_tokenizer if cross else None, resume_from)
    # data.target_logits=cached: the target's distribution comes from a logit cache; the target is loaded only to
    # evaluate (eval.with_cached_logits=true), never to train.
    cache = open_for_training(cfg, tokenizer, log) if target_logits_mode(cfg) == "cached" else None
    target = load_target(cfg.target) if cache is None or cfg.eval.get("with_cached_logits") else None
    draft = load_draft(cfg.draft, target)
    check_draft_weights(cfg, draft)
    if cache is None:
        vocab = check_pair(target, draft, tokenizer, draft_tokenizer, cross)
        ctx = [c for c in (context_length(target), context_length(draft)) if c]
        examples, eval_prompts = load_data(cfg, tokenizer, min(ctx) if ctx else None)
    else:
        vocab, examples, eval_prompts = cached_training_data(cache, draft, tokenizer, draft_tokenizer,
                                                             context_length(draft), cross)
    intersection = pair_vocabularies(draft, tokenizer, draft_tokenizer, vocab, log).to(accelerator.device) \
        if cross else None
    if intersection is None:
        check_draft_inputs(cfg, draft, vocab)
    if target is not None:
        target.to(accelerator.device)
    draft.to(accelerator.device)
    if cache is None:  # (the cache holds the scored sequences, target-generated ones included)
        examples = training_examples(cfg, target, None if cross else draft, tokenizer, examples, accelerator, log)
    if not examples:
        raise SetupError("no training examples after loading; check data.source")
    examples = trim_prompts(examples, cfg.data.get("train_prompt_tokens"))
    eval_time = {"eval_s": 0.0, "heldout_s": 0.0, "costs_s": 0.0}
    t0 = time.perf_counter()
    heldout, heldout_record = heldout_text(cfg, target, draft, tokenizer, eval_prompts, log)
    eval_time["heldout_s"] = time.perf_counter() - t0
    # draft.vocab.keep: the draft's lm_head keeps the N ids with the most target mass on these examples.
    pruned_here, selection = prune_for_training(cfg, draft, tokenizer, vocab, target, cache, examples, resume_from,
                                                log)
    vocab_report = pruned_vocab_report(cfg, target, draft, tokenizer, vocab, selection, heldout, log)
    draft, draft_base = with_lora(cfg, draft, draft_tokenizer if cross else tokenizer, output_dir, pruned_here,
                                  accelerator)
    t0 = time.perf_counter()
    cost_ratio, verify_costs = run_costs(cfg, target, draft, eval_prompts, cost_ratio, verify_costs, progress,
                                         accelerator, (tokenizer, draft_tokenizer) if cross else None)
    eval_time["costs_s"] = time.perf_counter() - t0
    clock = {"elapsed_s": 0.0, "max_time_s": float(cfg.train.get("max_time_s") or 0)}
    optimizer, scheduler = build_optimizer(draft, cfg, clock)
    draft, optimizer = accelerator.prepare(draft, optimizer)
    return Run(cfg=cfg, accelerator=accelerator, tokenizer=tokenizer, target=target, draft=draft, vocab=vocab,
               examples=examples, eval_prompts=eval_prompts, optimizer=optimizer, scheduler=scheduler,
               cost_ratio=float(cost_ratio), verify_costs=verify_costs, draft_base=draft_base, output_dir=output_dir,
               logit_cache=cache, clock=clock, progress=progress, heldout=heldout,
               heldout_record=heldout_record, vocab_report=vocab_report, eval_time=eval_time,
               draft_tokenizer=draft_tokenizer if cross else None, intersection=intersection)


def heldout_text(cfg: DictConfig, target: Any, draft: Any, tokenizer: Any, eval_prompts: list[list[int]],
                 log: Any) -> tuple[list[dict] | None, dict | None]:
    """The held-out prompts with the target's greedy responses (``eval.max_new_tokens`` tokens), which the
    teacher-forced evaluation scores and a pruned draft's coverage is measured on: read from
    ``<output_dir>/eval_heldout.json`` when the run made them before (a resumed run with other settings is refused),
    else generated (every process the same greedy text), with the record the run keeps at its first write
    (:func:`distill.evaluate.heldout_examples`). None when nothing needs them (``eval.method=generate`` with a
    full-vocabulary draft) or no target is loaded (cached mode)."""
    keep = (cfg.draft.get("vocab") or {}).get("keep")
    if target is None or (str(cfg.eval.method) == "generate" and keep is None and draft_vocab_map(draft) is None):
        return None, None
    return heldout_examples(Path(cfg.train.output_dir) / HELDOUT_FILE, target, str(cfg.target.name_or_path),
                            eval_prompts, int(cfg.eval.max_new_tokens), tokenizer.eos_token_id,
                            int(cfg.eval.batch_size), log=log)


def pruned_vocab_report(cfg: DictConfig, target: Any, draft: Any, tokenizer: Any, vocab: int,
                        selection: dict | None, heldout: list[dict] | None, log: Any) -> dict | None:
    """For a pruned draft: the kept ids' coverage of the target on the held-out responses
    (:func:`distill.vocab.heldout_coverage`, logged), with the selection's own numbers when the ids were chosen in
    this setup, and a warning per :func:`distill.vocab.selection_warnings`. None for a full-vocabulary draft."""
    ids = draft_vocab_map(draft)
    if ids is None:
        return None
    report = {"keep": int(ids.numel()), **(selection or {})}
    if heldout is not None:
        report.update(heldout_coverage(target, heldout, ids, vocab, tokenizer.pad_token_id))
        log(f"draft.vocab.keep={ids.numel()}: on {report['heldout_positions']} held-out target tokens the kept ids "
            f"carry {report['heldout_mass']:.1%} of the target's probability mass (T = 1), and "
            f"{report['heldout_token_share']:.1%} of the target's greedy tokens are kept ids")
    for note in selection_warnings(int(ids.numel()), report.get("selection_positions"), report.get("heldout_mass")):
        log(f"warning: {note}")
    return report


def trim_prompts(examples: list[dict], keep: int | None) -> list[dict]:
    """``data.train_prompt_tokens``: each training sequence keeps only its prompt's last ``keep`` tokens (None: all).
    The loss positions (the completion) and the target's distributions there stay as they are (online: computed on
    the trimmed sequence; cached: the cache's rows, computed with the whole prompt, which the draft then predicts
    from less context). The draft's forward and backward over long prompts (summaries, retrieved passages) cost far
    more than its loss positions; the trimmed context is what it learns to predict from."""
    if keep is None:
        return examples
    return [{**e, "prompt_ids": list(e["prompt_ids"])[-int(keep):]} for e in examples]


def make_accelerator(cfg: DictConfig, log: Any) -> Any:
    """The run's ``accelerate.Accelerator`` at the resolved ``train.mixed_precision``, with the launcher's notes
    logged and the seed set; refuses DeepSpeed with ``train.grad_accum`` > 1."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, set_seed

    # On a machine without a GPU, cpu=True is what makes accelerate use gloo across launched processes.
    precision, cpu = accelerator_precision(cfg.train)
    if not torch.distributed.is_initialized():
        # accelerate keeps its state in a process-wide singleton; a second in-process run (tests, notebooks) with
        # another precision must start from a clean one.
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
    return accelerator


def check_draft_weights(cfg: DictConfig, draft: Any) -> None:
    """Refuse a draft holding a NaN or an infinity: it can be neither trained nor evaluated."""
    bad = nonfinite_weight(draft)
    if bad is not None:
        raise SetupError(f"draft.name_or_path={cfg.draft.name_or_path}: the draft's weight {bad} is not finite (NaN "
                         "or inf); it can be neither trained nor evaluated. Give a draft with finite weights (an "
                         "earlier checkpoint of its run, or the base draft)")


def check_draft_inputs(cfg: DictConfig, draft: Any, vocab: int) -> None:
    """Refuse a draft whose input embedding has fewer rows than the shared vocabulary: the decoder feeds such a
    draft a substitute id, but training reads every id of the data."""
    rows = input_vocab_size(draft)
    if rows is not None and rows < vocab:
        raise SetupError(f"draft.name_or_path={cfg.draft.name_or_path}: the draft's input embedding has {rows} rows "
                         f"but the shared vocabulary has {vocab} ids, which the training data uses: resize it first "
                         f"(draft.resize_token_embeddings({vocab}), then save_pretrained) or use a draft built for "
                         "this tokenizer")


def training_examples(cfg: DictConfig, target: Any, draft: Any, tokenizer: Any, examples: list[dict],
                      accelerator: Any, log: Any) -> list[dict]:
    """The examples the run trains on, by ``data.completions``: the data's own completions, the target's
    (sequence-level KD, :func:`prepare_target_data`) or both. Refuses data whose completions would train nothing."""
    if cfg.data.completions in ("target", "both"):
        if cfg.data.completions == "both" and all(not e["completion_ids"] for e in examples):
            raise SetupError("data.completions=both trains on the data's own completions and the target's, but the "
                             "data has none (data.source.completion_field is null or empty): half of the examples "
                             "would train nothing. Use data.completions=target, or set data.source.completion_field")
        generated = prepare_target_data(cfg, target, draft, tokenizer, examples, accelerator, log)
        return generated if cfg.data.completions == "target" else examples + generated
    if all(not e["completion_ids"] for e in examples) and float(cfg.data.on_policy_fraction) < 1.0:
        raise SetupError("the training data has no completions (data.source.completion_field is null), so only "
                         "on-policy batches could be trained: set data.on_policy_fraction=1.0, or "
                         "data.completions=target (sequence-level KD), or data.source.completion_field=FIELD")
    return examples


def with_lora(cfg: DictConfig, draft: Any, tokenizer: Any, output_dir: Path, pruned_here: bool,
              accelerator: Any) -> tuple[Any, str | None]:
    """The draft to train and what its adapter is applied to: with ``train.lora.enabled`` a LoRA-wrapped draft and
    its base (a path or hub id; ``<output_dir>/draft_base``, saved once, for a built or newly pruned draft), else
    the draft itself and None."""
    if not cfg.train.lora.enabled:
        return draft, None
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
    return draft, draft_base


def run_costs(cfg: DictConfig, target: Any, draft: Any, eval_prompts: list[list[int]], cost_ratio: float | None,
              verify_costs: list[float] | None, progress: Progress, accelerator: Any,
              tokenizers: tuple[Any, Any] | None = None) -> tuple[float, Any]:
    """c and v_γ of the run: ``eval.verify_costs`` when set (also over a resumed run's own), else the given ones,
    else ``eval.cost_ratio``, else measured (the same on every process); c is NaN in cached mode (no target).
    ``tokenizers``: (the target's, the draft's) for a draft with a tokenizer of its own, measured through the
    decoder's intersection."""
    if cfg.eval.get("verify_costs") is not None:
        verify_costs = [float(v) for v in cfg.eval.verify_costs]
    if cost_ratio is None:
        cost_ratio = cfg.eval.get("cost_ratio")
    if cost_ratio is None and target is None:
        return float("nan"), verify_costs  # no target to time; the recipe does not evaluate in cached mode
    if cost_ratio is None:
        with progress.reporting() as report:
            decoder = None if tokenizers is None else SpeculativeDecoder(target, draft, tokenizer=tokenizers[0],
                                                                         draft_tokenizer=tokenizers[1])
            cost_ratio, verify_costs = resolve_costs(target, draft, eval_prompts, None, verify_costs,
                                                     int(cfg.eval.max_gamma), report, decoder)
        if accelerator.num_processes > 1:  # timings differ per process; one cost model keeps selection in step
            from accelerate.utils import broadcast_object_list

            cost_ratio, verify_costs = broadcast_object_list([cost_ratio, verify_costs])
    return cost_ratio, verify_costs


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


def draft_side(run: Run, batch: dict[str, torch.Tensor], where: tuple) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(vocab_map, logits)`` of the draft at the kept positions: ``(N, V')`` logits and None for a draft of the
    target's vocabulary; for a vocabulary-pruned draft its ``(N, K)`` logits and its map ``(K,)`` of target ids;
    for a draft with a tokenizer of its own (``run.intersection``), which reads the target's tokens mapped into its
    ids, the ``(N, K)`` logits of the K shared tokens and their target ids: the same pruned form."""
    if run.intersection is None:
        return draft_vocab_map(run.draft), kept_logits(run, "draft", batch, where)
    logits, target_ids = shared_columns(kept_logits(run, "draft", draft_inputs(batch, run.intersection), where),
                                        run.intersection)
    return target_ids, logits


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
    vocab_map, draft_kept = draft_side(run, batch, where)  # vocab_map (N,): a pruned or cross-vocabulary draft
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
    vocab_map, draft_seq = draft_side(run, batch, where)
    draft_seq = draft_seq.view(shape)  # (B, C, V) or (B, C, N) when pruned or of another vocabulary
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
    """α, τ, histogram and predicted speedup of the current draft (every process runs it: same weights, same seed),
    by ``eval.method`` (:func:`distill.evaluate.teacher_forced_eval` or :func:`distill.evaluate.acceptance_eval`),
    with its wall time ``eval_s`` (also summed in ``run.eval_time``).

    None in cached mode (no target loaded): measure afterwards with ``python -m distill eval``.
    """
    cfg, acc = run.cfg, run.accelerator
    if run.target is None:
        return None
    t0 = time.perf_counter()
    # the draft as saved and exported (its own dtype), not under train.mixed_precision's autocast
    with run.progress.reporting() as report, plain_forward(acc.unwrap_model(run.draft)) as draft:
        if str(cfg.eval.method) == "teacher_forced":
            ev = teacher_forced_eval(run.target, draft, run.heldout, list(cfg.eval.temperatures), run.vocab,
                                     num_draft_tokens=int(cfg.eval.num_draft_tokens), cost_ratio=run.cost_ratio,
                                     verify_costs=run.verify_costs, max_gamma=int(cfg.eval.max_gamma),
                                     batch_size=int(cfg.eval.batch_size), pad_id=run.tokenizer.pad_token_id,
                                     progress=report, intersection=run.intersection)
        else:
            ev = acceptance_eval(run.target, draft, run.eval_prompts, run.tokenizer, list(cfg.eval.temperatures),
                                 num_draft_tokens=int(cfg.eval.num_draft_tokens),
                                 max_new_tokens=int(cfg.eval.max_new_tokens), batch_size=int(cfg.eval.batch_size),
                                 seed=int(cfg.eval.seed), cost_ratio=run.cost_ratio,
                                 max_gamma=int(cfg.eval.max_gamma), progress=report, verify_costs=run.verify_costs,
                                 draft_tokenizer=run.draft_tokenizer)
    ev["eval_s"] = time.perf_counter() - t0
    run.eval_time["eval_s"] += ev["eval_s"]
    return ev


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
    if any_process(run.accelerator, bad is not None):
        bad = bad or "(on another process)"
    if bad is not None:
        raise DivergedError(
            f"the training diverged: after step {step} the draft's weight {bad} is not finite (NaN or inf), so it was "
            f"not saved; the checkpoints in {out} before it are kept (metrics.jsonl shows where the loss went). "
            "Lower optim.lr, set optim.max_grad_norm, or use train.mixed_precision=bf16 rather than fp16, then "
            "resume from the last good checkpoint (train.resume=PATH) or start over")


def save(run: Run, state: dict, path: Path) -> Path:
    """A full checkpoint at ``path`` with the current trainer state."""
    return ckpt.save_checkpoint(run.accelerator, run.draft, run.draft_tokenizer or run.tokenizer, run.scheduler, run.optimizer, state,
                                OmegaConf.to_yaml(run.cfg), path)


# ------------------------------------------------------------------------------------------------ train

def train(cfg: DictConfig, log: Any = None) -> dict:
    """Run the recipe for a composed config (:func:`distill.compose`); returns the summary also written to
    ``<output_dir>/summary.json``. ``log`` takes each progress line (default: print, on the main process only).
    The config is checked as ``python -m distill train`` checks it (``distill.checks.validate`` and
    ``check_inputs``) before any model loads.

    Raises SetupError (a ValueError) for bad input before any training starts: missing target, incompatible
    tokenizer, empty data, prompts longer than the context, unknown loss, λ outside [0, 1], ...; CheckpointError
    when the run folder holds another run, or another ``distill train`` is running into it (the main process holds
    ``runfolder.RUN_LOCK`` there while it runs).
    """
    normalized = normalize_config(cfg)
    main = runfolder.is_main_process()  # setup's lines are the same on every process: print them once
    out, lock = Path(normalized.train.output_dir), None
    created = [d for d in (out, *out.parents) if not os.path.lexists(d)] if main else []  # the lock makes these
    if main:
        check_output_dir(out, "train.output_dir")  # not under a file, writable
        lock = runfolder.lock_run_folder(out)
    try:
        # SIGTERM while loading acts as Ctrl-C, so a run set aside by train.overwrite=true goes back (the training
        # loop's StopFlag takes both signals over and saves instead)
        with sigterm_raises(KeyboardInterrupt), contextlib.ExitStack() as closing:  # closing: the W&B run
            return _train(cfg, normalized, main, log, closing)
    except BaseException:
        if created and [p.name for p in out.iterdir()] == [runfolder.RUN_LOCK]:  # refused before any write
            (out / runfolder.RUN_LOCK).unlink()
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
    """:func:`train` once the run folder is locked: setup (and the resumed checkpoint), the first write, the loop,
    the summary. ``closing`` finishes the metrics logger (its W&B run) however the run ends, so a failed call leaves
    no W&B run open for the next one in the process."""
    started = time.perf_counter()
    run, state, resume_from, micro_position = start(cfg, normalized, main, log)
    cfg, acc, out = run.cfg, run.accelerator, run.output_dir
    log = log or acc.print
    max_steps, accum, world = int(cfg.train.max_steps), int(cfg.train.grad_accum), acc.num_processes
    logged_through = -1  # the last step an interrupted run logged (W&B holds it already)
    if acc.is_main_process:  # the new run starts writing: the run it replaces goes
        logged_through = runfolder.start_writing(out, OmegaConf.to_yaml(cfg), resume_from, int(state["step"]))
        if run.heldout_record is not None:
            save_heldout(out / HELDOUT_FILE, run.heldout_record)
    if resume_from is not None:
        for note in [*ckpt.resume_warnings(resume_from, cfg, state, world), *method_warning(cfg, state)]:
            log(f"warning: {note}")
    logger = closing.enter_context(MetricsLogger(cfg, out, acc.is_main_process, resumed=resume_from is not None,
                                                 resume_step=int(state["step"]), logged_through=logged_through,
                                                 log=log))
    state["num_processes"], state["batch_size"] = world, int(cfg.train.batch_size)
    stop_at = min(int(cfg.train.stop_at or max_steps), max_steps)
    announce(run, state, stop_at, log)
    if run.vocab_report is not None:  # saved with each checkpoint: the export's card states it
        state["vocab"] = run.vocab_report
        if resume_from is None:
            logger.log({f"vocab/{k}": v for k, v in run.vocab_report.items()}, 0)
    if resume_from is not None and state["step"] >= stop_at and (state["last_eval"] or {}).get("step") != stop_at:
        eval_and_save(run, state, logger, log, state["step"], force=True)  # killed between the save and its eval
    initial_eval(run, state, logger, log)

    run.draft.train()
    loss_value = float("nan")
    clock, max_time_s = run.clock, float(cfg.train.get("max_time_s") or 0)
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
            if max_time_s:  # every process must stop at the same step
                out_of_time = any_process(acc, out_of_time)
            log_now = step % int(cfg.train.log_every) == 0 or step == 1 or step == stop_at or out_of_time
            # a signal may reach one process only (kill -TERM of a rank) or the processes at different steps: all
            # stop at the same step, or the others wait in the next collective forever
            signalled = any_process(acc, flag.stop)
            if log_now or signalled:  # the loss is read (a host sync) only when it is shown
                loss_value = float(acc.reduce(out_step["loss_sum"], reduction="mean").item())
            tokens_per_s = out_step["tokens"] / max(time.perf_counter() - t0, 1e-9)
            bar.update(advance=1, info=f"loss {loss_value:.4f}  {tokens_per_s:,.0f} tok/s")
            if log_now:
                log_step(run, logger, state, out_step, {"train/loss": loss_value, "train/lr": lr,
                                                        "train/tokens_per_s": tokens_per_s})
            t1 = time.perf_counter()
            clock["elapsed_s"] += t1 - t0
            state["elapsed_s"] = clock["elapsed_s"]  # saved with the checkpoint: a resumed run keeps its schedule
            eval_and_save(run, state, logger, log, step, force=step == stop_at or out_of_time, signalled=signalled)
            clock["elapsed_s"] += time.perf_counter() - t1  # eval and checkpoint time count against the budget
            state["elapsed_s"] = clock["elapsed_s"]
            if signalled:
                log(f"stopped by signal at step {step}; resume with train.resume=true")
                break
            if out_of_time:
                log(f"train.max_time_s={max_time_s:.0f} reached at step {step} ({clock['elapsed_s']:.0f}s)")
                break
    logger.finish()
    return finish(run, state, loss_value, log, wall_s=time.perf_counter() - started)


def start(cfg: DictConfig, normalized: DictConfig, main: bool, log: Any) -> tuple[Run, dict, Path | None, int]:
    """:func:`setup`, and for a resumed run the checkpoint restored (:func:`distill.checkpoint.resume_state`).

    Returns the run, its trainer state, the checkpoint it resumed from (None: a fresh run) and the global
    micro-batches consumed so far. Until the run's first write, a stop (an error, Ctrl-C, a refused resume) puts
    back the run that ``train.overwrite=true`` set aside.
    """
    resume_from = runfolder.resolve_resume(normalized, log=log or print)
    try:
        saved = ckpt.read_state(resume_from) if resume_from is not None else {}
        ckpt.check_resume_settings(saved, cfg, resume_from)
        kept = ckpt.kept_costs(saved, cfg)
        run = setup(cfg, log=log or (print if main else lambda *_: None), cost_ratio=kept[0], resume_from=resume_from,
                    verify_costs=kept[1])
        log = log or run.accelerator.print
        state = fresh_state(run)
        if resume_from is not None:
            state = ckpt.resume_state(state, resume_from, run.cfg, run.accelerator, run.draft, run.optimizer,
                                      run.scheduler, kept, log)
        micro_position = ckpt.data_position(state, run.cfg, run.accelerator.num_processes, log)  # may refuse
    except BaseException:
        if main:
            runfolder.restore_set_aside(cfg.train.output_dir)
        raise
    return run, state, resume_from, micro_position


def method_warning(cfg: DictConfig, state: dict) -> list[str]:
    """A resumed run's ``eval.method`` against the one its evaluations so far used (a run without the record
    generated): best/ then compares numbers measured two ways."""
    last = state.get("last_eval") or state.get("initial_eval")
    used = (last or {}).get("method", "generate")
    if last is None or used == str(cfg.eval.method):
        return []
    return [f"eval.method={cfg.eval.method} but this run evaluated with {used} so far: best/ will compare numbers "
            f"measured both ways; resume with eval.method={used} to keep them comparable"]


def fresh_state(run: Run) -> dict:
    """The trainer state of a run at step 0 (saved as trainer_state.json with each checkpoint)."""
    cfg = run.cfg
    # cached logits: no target to time, so no c (null in trainer_state.json, not NaN, which is not JSON)
    recorded_c = run.cost_ratio if math.isfinite(run.cost_ratio) else None
    return {"step": 0, "tokens_seen": 0, "best": None, "last_eval": None, "draft_base": run.draft_base,
            "lora": bool(cfg.train.lora.enabled), "target": recorded_name(str(cfg.target.name_or_path)),
            "target_revision": hub_revision(str(cfg.target.name_or_path)), "vocab_size": run.vocab,
            "cost_ratio": recorded_c, "verify_costs": run.verify_costs, "batch_size": int(cfg.train.batch_size),
            "num_processes": run.accelerator.num_processes, "examples_consumed": 0,
            "tokenizer_pairing": None if run.intersection is None else
            pairing_record(run.tokenizer, run.draft_tokenizer, run.intersection)}


def announce(run: Run, state: dict, stop_at: int, log: Any) -> None:
    """The run's first line (data, loss, λ, processes, steps), after warnings about settings that do not do what
    they seem to: a ``train.stop_at`` past ``train.max_steps``, a batch larger than the data, a warmup longer than
    the run."""
    cfg, max_steps = run.cfg, int(run.cfg.train.max_steps)
    if cfg.train.stop_at is not None and int(cfg.train.stop_at) > max_steps:
        log(f"warning: train.stop_at={cfg.train.stop_at} is past train.max_steps={max_steps}; the run ends at step "
            f"{max_steps}")
    if int(cfg.train.batch_size) > len(run.examples):
        log(f"warning: train.batch_size={cfg.train.batch_size} > the {len(run.examples)} training examples: each batch "
            "holds some examples more than once (add data or lower train.batch_size)")
    if int(cfg.optim.warmup_steps) > max_steps:
        log(f"warning: optim.warmup_steps={cfg.optim.warmup_steps} > train.max_steps={max_steps}: the learning rate "
            f"never reaches optim.lr={cfg.optim.lr} (it peaks at {max_steps / int(cfg.optim.warmup_steps):.0%} of it)")
    evals = f"{len(run.eval_prompts)} eval prompts" if run.target is not None else "no eval (cached mode)"
    log(f"distill: {len(run.examples)} examples, {evals}, loss={cfg.loss.name}, "
        f"λ={cfg.data.on_policy_fraction}, {run.accelerator.num_processes} process(es), "
        f"steps {state['step']}->{stop_at}/{max_steps}")


def initial_eval(run: Run, state: dict, logger: MetricsLogger, log: Any) -> None:
    """The starting draft's α and τ (``eval.at_start``, step 0 only), kept as ``initial_eval``; in cached mode
    (no target loaded) a line saying how to measure the result instead."""
    if run.target is None:
        log("cached target logits: no acceptance evaluation during training (the target is not loaded; "
            "eval.with_cached_logits=true loads it to evaluate); measure the result with python -m distill eval "
            "+target.name_or_path=T draft.name_or_path=<output_dir>/step_N")
    elif state["step"] == 0 and run.cfg.eval.get("at_start", True):
        ev = evaluate(run)
        state["initial_eval"] = ev
        logger.log_eval(ev, 0)
        log(f"initial draft: acceptance rate={ev['acceptance_rate']:.3f} τ={ev['mean_accepted_length']:.2f} "
            f"({ev['method']}, {ev['eval_s']:.1f}s)")


def any_process(acc: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on any process (a sum over processes; one process: its own)."""
    if acc.num_processes == 1:
        return flag
    return bool(acc.reduce(torch.tensor(float(flag), device=acc.device), reduction="sum").item() > 0)


def log_step(run: Run, logger: MetricsLogger, state: dict, out_step: dict, row: dict) -> None:
    """Log a step's row (``row``: loss, lr and speed; the rest from ``out_step`` and ``state``); a loss that is not
    finite stops the run now if the weights diverged (the same on every process: the loss is reduced)."""
    step = state["step"]
    if not math.isfinite(row["train/loss"]):
        check_finite(run, step, run.output_dir)  # diverged weights stop the run now, not at the next save
    grad_norm = out_step["grad_norm"]
    grad_norm = float("nan") if grad_norm is None else float(grad_norm)  # None: DeepSpeed clips itself
    logger.log({**row, "train/grad_norm": grad_norm, "train/tokens_seen": state["tokens_seen"],
                "train/elapsed_s": run.clock["elapsed_s"],
                "train/on_policy_fraction_batch": out_step["on_policy_fraction"]}, step)


def eval_and_save(run: Run, state: dict, logger: MetricsLogger, log: Any, step: int, force: bool,
                  signalled: bool = False) -> None:
    """Save and evaluate at the scheduled steps, and both at the end (``force``). A signal saves but evaluates
    only on schedule: an extra eval would make a candidate for best/ that the same run uninterrupted never has."""
    cfg, acc, out = run.cfg, run.accelerator, run.output_dir
    every, save_every = int(cfg.eval.every), int(cfg.train.save_every)
    path = None
    saving = step > 0 and (force or signalled or bool(save_every and step % save_every == 0))
    evaluating = force or bool(every and step % every == 0)
    if saving or evaluating:  # a diverged draft is neither saved (it would prune good checkpoints) nor evaluated
        check_finite(run, step, out)
    if saving:  # saved first: an eval error loses no step
        path = save(run, state, ckpt.step_dir(out, step))
        if acc.is_main_process:
            ckpt.mark_latest(out, path)
            ckpt.prune(out, int(cfg.train.keep_last))
    ev = evaluate(run) if evaluating else None  # None in cached mode
    if ev is None:
        return
    state["last_eval"] = {"step": step, **ev}
    logger.log_eval(ev, step)
    log(f"step {step}: acceptance rate={ev['acceptance_rate']:.3f} τ={ev['mean_accepted_length']:.2f} "
        f"speedup≈{ev['predicted_speedup']:.2f} ({cfg.eval.select_by} selects; {ev['method']}, {ev['eval_s']:.1f}s)")
    value = ev[cfg.eval.select_by]
    if step > 0 and (state["best"] is None or value > state["best"]["value"]):
        state["best"] = {"metric": cfg.eval.select_by, "value": value, "step": step}
        save(run, state, out / "best")
    if path is not None and acc.is_main_process:
        ckpt.write_eval(path, state["last_eval"], state["best"])


def evaluation_share(run: Run, wall_s: float | None, log: Any) -> dict | None:
    """The seconds this call spent evaluating (``eval_s``: the evaluations; ``heldout_s``: generating the held-out
    responses; ``costs_s``: measuring c and v_γ) and their ``share`` of its wall time ``wall_s``, logged; None
    without a wall time."""
    if not wall_s:
        return None
    t = run.eval_time
    spent = t["eval_s"] + t["heldout_s"] + t["costs_s"]
    log(f"evaluation: {spent:.1f}s of {wall_s:.1f}s wall ({spent / wall_s:.1%}): evaluations {t['eval_s']:.1f}s, "
        f"held-out responses {t['heldout_s']:.1f}s, c/v_γ measurement {t['costs_s']:.1f}s "
        f"(eval.method={run.cfg.eval.method})")
    return {**t, "wall_s": wall_s, "share": spent / wall_s}


def finish(run: Run, state: dict, loss_value: float, log: Any, wall_s: float | None = None) -> dict:
    """The run's summary, written to ``<output_dir>/summary.json`` (whole or not at all) and returned; a warning
    when best/ scores below the starting draft. ``wall_s``: this call's wall time, of which the summary's
    ``evaluation`` gives the evaluation's share (:func:`evaluation_share`)."""
    cfg, acc, out = run.cfg, run.accelerator, run.output_dir
    # null, not NaN (invalid JSON), when this call trained no step (a finished run resumed) or the loss diverged
    final_loss = loss_value if math.isfinite(loss_value) else None
    summary = {"steps": state["step"], "max_steps": int(cfg.train.max_steps), "final_loss": final_loss,
               "tokens_seen": state["tokens_seen"], "best": state["best"], "last_eval": state["last_eval"],
               "initial_eval": state.get("initial_eval"), "num_processes": acc.num_processes, "output_dir": str(out),
               "elapsed_s": state.get("elapsed_s"), "target_logits": target_logits_mode(cfg),
               "peak_memory_mb": peak_memory_mb(acc.device), "vocab": run.vocab_report,
               "evaluation": evaluation_share(run, wall_s, log)}
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
            replace_text(out / "summary.json", json.dumps(summary, indent=2))
        except OSError as err:
            log(f"warning: could not write {out / 'summary.json'} ({err.strerror or err}); the checkpoints in {out} "
                f"are complete. The summary: {json.dumps(summary)}")
    acc.end_training()
    return summary
