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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from distill import checkpoint as ckpt
from distill.config import check_inputs, normalize_config
from distill.data import (as_examples, build_examples, cache_key, check_lengths, collate_sequences,
                          generate_target_data, micro_batch_indices)
from distill.evaluate import acceptance_eval, measure_cost_ratio
from distill.logging import MetricsLogger, Progress, StopFlag as _StopFlag
from distill.losses import distill_loss
from distill.models import (SetupError, attach_lora, check_pair, context_length, is_local_path, load_draft,
                            load_draft_tokenizer, load_target, load_tokenizer)
from distill.rollout import rollout

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
    draft_base: str | None          # what a LoRA adapter is applied to (a path/hub id), None for a full fine-tune
    output_dir: Path                # train.output_dir


def lr_lambda(step: int, warmup: int, total: int, kind: str, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over ``warmup`` steps, then cosine/linear decay to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def build_optimizer(draft: Any, cfg: DictConfig) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (no weight decay on biases and norms) and a LambdaLR warmup + decay schedule."""
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
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup, total, kind, min_ratio))
    return opt, sched


def target_data_dir(cfg: DictConfig) -> Path:
    """Folder of the sequence-level KD cache (``data.target_generated.path`` or ``<output_dir>/target_data``)."""
    return Path(cfg.data.target_generated.get("path") or Path(cfg.train.output_dir) / "target_data")


def prepare_target_data(cfg: DictConfig, target: Any, draft: Any, tokenizer: Any, examples: list[dict],
                        accelerator: Any = None, log: Any = print) -> list[dict]:
    """Target-generated completions for ``examples`` (cached, resumable; generated on the main process)."""
    tg = cfg.data.target_generated
    gen = {"temperature": float(tg.temperature), "max_new_tokens": int(cfg.data.max_new_tokens),
           "seed": int(cfg.train.seed)}
    key = cache_key(str(cfg.target.name_or_path), examples, gen)
    out_dir = target_data_dir(cfg)
    is_main = accelerator is None or accelerator.is_main_process
    if is_main:
        log(f"target-generated data: {len(examples)} prompts -> {out_dir} (resumable)")
        generate_target_data(target, tokenizer, examples, out_dir, key, temperature=gen["temperature"],
                             max_new_tokens=gen["max_new_tokens"], batch_size=int(tg.batch_size),
                             shard_size=int(tg.shard_size), seed=gen["seed"],
                             draft=draft if tg.get("use_draft", True) else None,
                             progress=lambda i, n: log(f"  shard {i}/{n} done"))
    if accelerator is not None:
        accelerator.wait_for_everyone()
    import datasets

    return as_examples(datasets.load_from_disk(str(out_dir / "dataset")))


def load_data(cfg: DictConfig, tokenizer: Any, context: int | None) -> tuple[list[dict], list[list[int]]]:
    """Training examples and eval prompts (held out of training when ``eval.prompts`` is null), length-checked."""
    examples = build_examples(cfg.data.source, tokenizer, cfg.data)
    if cfg.eval.get("prompts"):
        ev_src = OmegaConf.merge({"kind": "auto", "completion_field": None}, cfg.eval.prompts)
        eval_examples = build_examples(ev_src, tokenizer, cfg.data)
    else:
        n_hold = int(cfg.data.holdout)
        if n_hold < 1:
            raise SetupError("eval.prompts is null and data.holdout < 1: nothing to evaluate on; set "
                             "data.holdout=N or eval.prompts.path=FILE")
        if len(examples) <= n_hold:
            raise SetupError(f"the data has {len(examples)} examples, not more than data.holdout={n_hold} held out "
                             "for evaluation; lower data.holdout or give eval.prompts.path=FILE")
        examples, eval_examples = examples[:-n_hold], examples[-n_hold:]
    examples = check_lengths(examples, context, cfg.data)
    eval_cfg = OmegaConf.merge(cfg.data, {"max_new_tokens": int(cfg.eval.max_new_tokens)})
    eval_examples = check_lengths(eval_examples[: int(cfg.eval.num_prompts)], context, eval_cfg, "eval prompts")
    return examples, [e["prompt_ids"] for e in eval_examples]


def setup(cfg: DictConfig, log: Any = print, cost_ratio: float | None = None) -> Run:
    """Everything the loop needs, in order of cost: config checks, models + pair check, data, optimizer.

    ``cost_ratio``: c to use instead of ``eval.cost_ratio`` or a measurement (a resumed run keeps its own).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed

    cfg = normalize_config(cfg)
    check_inputs(cfg)  # data files, output folder, precision vs device: before any model loads
    # On a machine without a GPU, cpu=True is what makes accelerate use gloo across launched processes.
    cpu = bool(cfg.train.get("cpu", False)) or not torch.cuda.is_available()
    if not torch.distributed.is_initialized():
        # accelerate keeps its state in a process-wide singleton; a second in-process run (tests, notebooks) with
        # another precision must start from a clean one.
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision=str(cfg.train.mixed_precision), cpu=cpu)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and int(cfg.train.grad_accum) != 1:
        raise SetupError("DeepSpeed owns gradient accumulation: set train.grad_accum=1 and raise train.batch_size "
                         "(the recipe's exact token-count division needs one micro-batch per step)")
    set_seed(int(cfg.train.seed))
    output_dir = Path(cfg.train.output_dir)
    tokenizer = load_tokenizer(cfg.target.tokenizer or cfg.target.name_or_path,
                               trust_remote_code=bool(cfg.target.trust_remote_code))
    target = load_target(cfg.target)
    draft = load_draft(cfg.draft, target)
    vocab = check_pair(target, draft, tokenizer, load_draft_tokenizer(cfg.draft))
    ctx = [c for c in (context_length(target), context_length(draft)) if c]
    examples, eval_prompts = load_data(cfg, tokenizer, min(ctx) if ctx else None)

    lora = bool(cfg.train.lora.enabled)
    draft_base = None
    if lora:
        draft_base = str(Path(cfg.draft.name_or_path).resolve()) if cfg.draft.get("name_or_path") and \
            is_local_path(str(cfg.draft.name_or_path)) else cfg.draft.get("name_or_path")
        if not draft_base:  # a built draft has no checkpoint to put the adapter on: save its initial weights once
            draft_base = str((output_dir / "draft_base").resolve())
            if accelerator.is_main_process and not (output_dir / "draft_base" / "config.json").exists():
                draft.save_pretrained(draft_base)
                tokenizer.save_pretrained(draft_base)
        draft = attach_lora(draft, cfg.train.lora)
    target.to(accelerator.device)
    draft.to(accelerator.device)

    if cfg.data.completions in ("target", "both"):
        generated = prepare_target_data(cfg, target, draft, tokenizer, examples, accelerator, log)
        examples = generated if cfg.data.completions == "target" else examples + generated
    elif all(not e["completion_ids"] for e in examples) and float(cfg.data.on_policy_fraction) < 1.0:
        raise SetupError("the training data has no completions (data.source.completion_field is null), so only "
                         "on-policy batches could be trained: set data.on_policy_fraction=1.0, or "
                         "data.completions=target (sequence-level KD), or data.source.completion_field=FIELD")
    if not examples:
        raise SetupError("no training examples after loading; check data.source")
    cost_ratio = cfg.eval.get("cost_ratio") if cost_ratio is None else cost_ratio
    if cost_ratio is None:
        cost_ratio = measure_cost_ratio(target, draft, eval_prompts)
        if accelerator.num_processes > 1:  # timings differ per process; one c keeps checkpoint selection in step
            from accelerate.utils import broadcast_object_list

            cost_ratio = broadcast_object_list([cost_ratio])[0]
    optimizer, scheduler = build_optimizer(draft, cfg)
    draft, optimizer = accelerator.prepare(draft, optimizer)
    return Run(cfg=cfg, accelerator=accelerator, tokenizer=tokenizer, target=target, draft=draft, vocab=vocab,
               examples=examples, eval_prompts=eval_prompts, optimizer=optimizer, scheduler=scheduler,
               cost_ratio=float(cost_ratio), draft_base=draft_base, output_dir=output_dir)


# ------------------------------------------------------------------------------------------------ micro-batch

def micro_batch(run: Run, micro_id: int) -> tuple[list[dict], bool]:
    """The examples of global micro-batch ``micro_id``; with probability λ their completions are draft rollouts."""
    cfg, acc = run.cfg, run.accelerator
    idx = micro_batch_indices(len(run.examples), micro_id, int(cfg.train.batch_size), int(cfg.train.seed),
                              bool(cfg.data.shuffle))
    batch = [run.examples[i] for i in idx]
    rng = random.Random(f"{cfg.train.seed}/{micro_id}")
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


def loss_on_batch(run: Run, batch: dict[str, torch.Tensor], n_tokens: torch.Tensor) -> torch.Tensor:
    """Target scores the sequences (no grad), the draft too (grad); the divergence over completion tokens."""
    cfg, acc = run.cfg, run.accelerator
    batch = {k: v.to(acc.device) for k, v in batch.items()}
    with torch.no_grad(), acc.autocast():
        target_logits = run.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    draft_logits = run.draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # Only completion positions enter the loss: select them first, so the float32 softmax work is (1, N, V)
    # instead of (B, T, V) with the prompt and padding share wasted.
    keep = batch["loss_mask"].bool()
    n_keep = int(keep.sum())
    loss = distill_loss(cfg.loss.name, _vocab_slice(draft_logits[keep], run.vocab).unsqueeze(0),
                        _vocab_slice(target_logits[keep], run.vocab).unsqueeze(0),
                        torch.ones(1, n_keep, device=keep.device), n_tokens, labels=batch["labels"][keep].unsqueeze(0),
                        beta=float(cfg.loss.beta), temperature=float(cfg.loss.temperature),
                        ce_weight=float(cfg.loss.ce_weight))
    del target_logits  # (B, T, V) is the largest activation here; free it before the draft's backward
    return loss


# ------------------------------------------------------------------------------------------------ evaluate

def evaluate(run: Run) -> dict:
    """α, τ, histogram and predicted speedup of the current draft (every process runs it: same weights, same seed)."""
    cfg, acc = run.cfg, run.accelerator
    return acceptance_eval(run.target, acc.unwrap_model(run.draft), run.eval_prompts, run.tokenizer,
                           list(cfg.eval.temperatures), num_draft_tokens=int(cfg.eval.num_draft_tokens),
                           max_new_tokens=int(cfg.eval.max_new_tokens), batch_size=int(cfg.eval.batch_size),
                           seed=int(cfg.eval.seed), cost_ratio=run.cost_ratio, max_gamma=int(cfg.eval.max_gamma))


def save(run: Run, state: dict, path: Path) -> Path:
    """A full checkpoint at ``path`` with the current trainer state."""
    return ckpt.save_checkpoint(run.accelerator, run.draft, run.tokenizer, run.scheduler, run.optimizer, state,
                                OmegaConf.to_yaml(run.cfg), path)


# ------------------------------------------------------------------------------------------------ checkpoints

def resolve_resume(cfg: DictConfig) -> Path | None:
    """The checkpoint to resume from (``train.resume`` true: the newest complete one in output_dir; a path: that
    one), after checking that the run folder may be written (see ``checkpoint.prepare_run_folder``)."""
    return ckpt.prepare_run_folder(cfg.train.output_dir, cfg.train.get("resume"),
                                   bool(cfg.train.get("overwrite", False)), main=int(os.environ.get("RANK", "0")) == 0)


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
    keys = ["train.seed", "train.batch_size", "train.grad_accum", "train.max_steps", "data.source",
            "data.on_policy_fraction", "loss", "optim", "target.name_or_path"]
    return [k for k in keys if OmegaConf.select(saved, k) != OmegaConf.select(cfg, k)]


# ------------------------------------------------------------------------------------------------ train

def train(cfg: DictConfig, log: Any = None) -> dict:
    """Run the recipe for a composed config; returns the summary also written to ``<output_dir>/summary.json``.

    Raises SetupError (a ValueError) for bad input before any training starts: missing target, incompatible
    tokenizer, empty data, prompts longer than the context, unknown loss, λ outside [0, 1], ...
    """
    resume_from = resolve_resume(normalize_config(cfg))
    saved = ckpt.read_state(resume_from) if resume_from is not None else {}
    kept_c = saved.get("cost_ratio") if cfg.eval.get("cost_ratio") is None else None
    run = setup(cfg, log=log or print, cost_ratio=kept_c)
    cfg, acc = run.cfg, run.accelerator
    log = log or acc.print
    out = run.output_dir
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    state = {"step": 0, "tokens_seen": 0, "best": None, "last_eval": None, "draft_base": run.draft_base,
             "lora": bool(cfg.train.lora.enabled), "target": str(cfg.target.name_or_path), "vocab_size": run.vocab,
             "cost_ratio": run.cost_ratio, "batch_size": int(cfg.train.batch_size),
             "num_processes": acc.num_processes, "examples_consumed": 0}
    if resume_from is not None:
        state.update(ckpt.load_checkpoint(acc, run.draft, run.optimizer, run.scheduler, resume_from, log))
        log(f"resumed from {resume_from} at step {state['step']}")
        if kept_c is not None:
            log(f"resume: keeping the checkpoint's cost ratio c={kept_c:.3f} (measured when the run started; "
                "set eval.cost_ratio to use another)")
        if acc.is_main_process:
            ckpt.truncate_metrics(out, int(state["step"]))
            if Path(resume_from).resolve().parent == out.resolve():  # a kill may have come before the pointer update
                ckpt.mark_latest(out, resume_from)
        for key in _changed_keys(resume_from, cfg):
            log(f"warning: {key} differs from the checkpoint's config; the resumed run is not the same experiment")
    logger = MetricsLogger(cfg, out, acc.is_main_process, resumed=resume_from is not None)
    max_steps, accum, world = int(cfg.train.max_steps), int(cfg.train.grad_accum), acc.num_processes
    micro_position = _data_position(state, cfg, world, log)
    state["num_processes"], state["batch_size"] = world, int(cfg.train.batch_size)
    stop_at = min(int(cfg.train.stop_at or max_steps), max_steps)
    log(f"distill: {len(run.examples)} examples, {len(run.eval_prompts)} eval prompts, loss={cfg.loss.name}, "
        f"λ={cfg.data.on_policy_fraction}, {world} process(es), steps {state['step']}->{stop_at}/{max_steps}")

    def maybe_eval_and_save(step: int, force: bool) -> None:
        every, save_every = int(cfg.eval.every), int(cfg.train.save_every)
        path = None
        if step > 0 and (force or (save_every and step % save_every == 0)):  # saved first: an eval error loses no step
            path = save(run, state, ckpt.step_dir(out, step))
            ckpt.fault_point("pointer", step)
            if acc.is_main_process:
                ckpt.mark_latest(out, path)
                ckpt.prune(out, int(cfg.train.keep_last))
        if force or (every and step % every == 0):
            ev = evaluate(run)
            state["last_eval"] = {"step": step, **ev}
            logger.log_eval(ev, step)
            log(f"step {step}: α={ev['acceptance_rate']:.3f} τ={ev['mean_accepted_length']:.2f} "
                f"speedup≈{ev['predicted_speedup']:.2f} ({cfg.eval.select_by} selects)")
            value = ev[cfg.eval.select_by]
            if step > 0 and (state["best"] is None or value > state["best"]["value"]):
                state["best"] = {"metric": cfg.eval.select_by, "value": value, "step": step}
                save(run, state, out / "best")
            if path is not None and acc.is_main_process:
                ckpt.write_eval(path, state["last_eval"], state["best"])

    if resume_from is not None and state["step"] >= stop_at and (state["last_eval"] or {}).get("step") != stop_at:
        maybe_eval_and_save(state["step"], force=True)  # killed between the final save and its evaluation
    if state["step"] == 0 and cfg.eval.get("at_start", True):
        ev = evaluate(run)
        state["initial_eval"] = ev
        logger.log_eval(ev, 0)
        log(f"initial draft: α={ev['acceptance_rate']:.3f} τ={ev['mean_accepted_length']:.2f}")

    draft, optimizer, scheduler = run.draft, run.optimizer, run.scheduler
    progress = Progress(str(cfg.train.progress), stop_at, state["step"], acc.is_main_process)
    draft.train()
    loss_value = float("nan")
    with _StopFlag() as flag:
        while state["step"] < stop_at:
            step = state["step"]
            t0 = time.perf_counter()
            micro_ids = [micro_position + j * world + acc.process_index for j in range(accum)]
            drawn = [micro_batch(run, m) for m in micro_ids]
            batches = [collate_sequences(b, run.tokenizer.pad_token_id) for b, _ in drawn]
            # Divide by the window's tokens over all processes (mean over processes: DDP averages gradients).
            n_local = torch.tensor(float(sum(int(b["loss_mask"].sum()) for b in batches)), device=acc.device)
            n_global = acc.reduce(n_local, reduction="sum")
            n_tokens = n_global / world
            loss_sum = torch.zeros((), device=acc.device)
            for j, batch in enumerate(batches):
                sync = j == accum - 1
                with acc.no_sync(draft) if not sync else contextlib.nullcontext():
                    loss = loss_on_batch(run, batch, n_tokens)
                    acc.backward(loss)
                loss_sum += loss.detach()
            ckpt.fault_point("step", step + 1)
            max_norm = float(cfg.optim.max_grad_norm or 0) or float("inf")
            grad_norm = acc.clip_grad_norm_(draft.parameters(), max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] = step = step + 1
            state["tokens_seen"] += int(n_global.item())
            micro_position += accum * world
            state["examples_consumed"] = micro_position * int(cfg.train.batch_size)  # the data position
            loss_value = float(acc.reduce(loss_sum, reduction="mean").item())
            dt = time.perf_counter() - t0
            tokens_per_s = float(n_global.item()) / max(dt, 1e-9)
            progress.update(loss_value, tokens_per_s)
            if step % int(cfg.train.log_every) == 0 or step == 1:
                grad_norm = float("nan") if grad_norm is None else float(grad_norm)  # None: DeepSpeed clips itself
                logger.log({"train/loss": loss_value, "train/lr": scheduler.get_last_lr()[0],
                            "train/grad_norm": grad_norm, "train/tokens_per_s": tokens_per_s,
                            "train/tokens_seen": state["tokens_seen"],
                            "train/on_policy_fraction_batch": sum(p for _, p in drawn) / accum}, step)
            stop_now = flag.stop or step == stop_at
            maybe_eval_and_save(step, force=stop_now)
            if flag.stop:
                log(f"stopped by signal at step {step}; resume with train.resume=true")
                break
    progress.close()
    logger.finish()
    summary = {"steps": state["step"], "max_steps": max_steps, "final_loss": loss_value,
               "tokens_seen": state["tokens_seen"], "best": state["best"], "last_eval": state["last_eval"],
               "initial_eval": state.get("initial_eval"), "num_processes": world, "output_dir": str(out)}
    if acc.is_main_process:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    acc.end_training()
    return summary
