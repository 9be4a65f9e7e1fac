"""Choose the ids a vocabulary-pruned draft keeps (``draft.vocab.keep=N``) and prune the draft for training.

The N ids are those that carry the most target probability on the training data: Σ over completion positions of
p_target(id) (from the logit cache: Σ exp(cached log-prob) per cached id; else one no-grad target pass over the
training sequences), plus the tokenizer's special ids so the draft can propose an end of sequence. EAGLE-3 (Li et
al. 2025) chooses its draft vocabulary by token frequency; the target's mass is the quantity acceptance depends on
(a kept id i lets the draft accept up to p(i) at a position). The model side is :mod:`decode.vocab_map`.

How well the N ids cover the target is measured on held-out target text, never on the data they were chosen from
(which flatters them: the ids were picked to cover exactly that data): :func:`heldout_coverage` gives the kept ids'
share of the target's probability mass at each held-out response position and the share of the target's own
response tokens that are kept ids (a greedy target token outside the set is a certain rejection).
:func:`selection_warnings` names ``draft.vocab.keep`` and the data size keys when the selection data is too small
to rank N ids or the held-out coverage is low.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from decode.compat import IncompatibleModelsError, check_draft_vocab_map, vocab_fingerprint
from decode.loading import run_draft_base
from decode.vocab_map import MAP_KEY, _read_tensors, draft_vocab_map, prune_draft_head, select_kept_ids
from distill.checkpoint import STATE_FILE, not_safetensors, read_json
from distill.config import SetupError
from distill.rollout import accepts_logits_to_keep, completion_logits


def special_ids(tokenizer: Any, vocab: int) -> list[int]:
    """bos/eos/pad/unk and every other special id of ``tokenizer`` (chat markers), those below ``vocab``."""
    ids = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    ids |= set(getattr(tokenizer, "all_special_ids", []) or [])
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < vocab)


def cache_id_mass(cache: Any, vocab: int, rows_per_read: int = 256) -> tuple[torch.Tensor, int]:
    """``((V,) float64 mass, positions)``: Σ over every cached position of exp(log-prob) per cached top-k id, plus,
    for a cache with sampled tail ids, each position's tail mass split evenly over its draws (an unbiased estimate
    of the tail ids' mass); a cache without them leaves its tail mass unassigned. ``positions`` is the number of
    cached positions, the total probability mass (1 per position).

    ``cache`` is a :class:`distill.logit_cache.LogitCache`.
    """
    mass = torch.zeros(vocab, dtype=torch.float64)
    n, positions = len(cache.ds), 0
    for start in range(0, n, rows_per_read):
        log_p, ids, tail_ids = cache.buckets(list(range(start, min(n, start + rows_per_read))))
        mass.index_add_(0, ids.flatten(), log_p[:, :-1].double().exp().flatten())
        if tail_ids is not None:
            share = log_p[:, -1:].double().exp() / tail_ids.shape[-1]
            mass.index_add_(0, tail_ids.flatten(), share.expand_as(tail_ids).flatten())
        positions += log_p.shape[0]
    return mass, positions


@torch.no_grad()
def target_id_mass(target: Any, examples: list[dict], pad_id: int, vocab: int, batch_size: int = 4,
                   temperature: float = 1.0) -> torch.Tensor:
    """``(V,)`` float64: Σ over the completion positions of ``examples`` of softmax(target logits / T) per id.

    One no-grad target forward per batch of ``batch_size`` sequences (prompt + completion); only the completion
    positions (the loss mask of :func:`distill.data.collate_sequences`) count.
    """
    to_keep = accepts_logits_to_keep(target)
    mass = torch.zeros(vocab, dtype=torch.float64, device=next(target.parameters()).device)
    for start in range(0, len(examples), batch_size):
        logits = completion_logits(target, examples[start:start + batch_size], pad_id, to_keep)  # (N, V')
        mass += (logits[:, :vocab].float() / temperature).softmax(-1).double().sum(0)
    return mass.cpu()


def checkpoint_vocab_map(checkpoint: str | Path) -> torch.Tensor | None:
    """The draft's id map stored in a training checkpoint (None when it has none).

    Read from ``model.safetensors``; a DeepSpeed/FSDP checkpoint has none (its weights are under ``accelerate/``),
    so then from ``draft/`` (the unwrapped draft's ``save_pretrained``) or, when that holds a LoRA adapter only,
    from the adapter's base named in ``trainer_state.json`` (``draft_base``, saved pruned by the run).
    """
    checkpoint = Path(checkpoint)
    path = checkpoint / "model.safetensors"
    if path.is_file():
        try:  # read before the checkpoint's own load, so a damaged file is named here, never unpickled
            with safe_open(str(path), framework="pt") as f:
                key = next((k for k in f.keys() if k == MAP_KEY or k.endswith("." + MAP_KEY)), None)
                return f.get_tensor(key).long() if key is not None else None
        except (SafetensorError, OSError, ValueError) as e:
            raise not_safetensors(path, e) from e
    folders = [checkpoint / "draft"]
    if (checkpoint / "draft" / "adapter_config.json").is_file() and (checkpoint / STATE_FILE).is_file():
        state = read_json(checkpoint / STATE_FILE)
        base = run_draft_base(checkpoint.resolve().parent, state.get("draft_base") if isinstance(state, dict) else None)
        folders = [Path(base)] if base else []
    for folder in folders:
        ids = _read_tensors(folder, [MAP_KEY]).get(MAP_KEY) if folder.is_dir() else None
        if ids is not None:
            return ids.long()
    return None


def _check_resumed_keep(keep: Any, ids: torch.Tensor | None, resume_from: str | Path | None) -> None:
    """Refuse a ``draft.vocab.keep`` that does not match the head of the checkpoint being resumed.

    ``ids``: the checkpoint's map (:func:`checkpoint_vocab_map`). A full head is recognised by a
    ``model.safetensors`` without a map; a DeepSpeed/FSDP checkpoint (none) with a full head passes here.

    Raises:
        SetupError: naming the ``draft.vocab.keep`` the checkpoint needs.
    """
    if resume_from is None:
        return
    if ids is not None and (keep is None or int(keep) != ids.numel()):
        raise SetupError(f"draft.vocab.keep={'null' if keep is None else keep} but the checkpoint {resume_from} "
                         f"was trained with a {ids.numel()}-id map (a map is never regenerated on resume); resume with "
                         f"draft.vocab.keep={ids.numel()}, or start a new run for another size")
    if ids is None and keep is not None and (Path(resume_from) / "model.safetensors").is_file():
        raise SetupError(f"draft.vocab.keep={keep} but the checkpoint {resume_from} has a full-vocabulary head (no "
                         "map); resume with draft.vocab.keep=null, or start a new run (train.resume=false) to prune")


def prune_for_training(cfg: Any, draft: Any, tokenizer: Any, vocab: int, target: Any = None, cache: Any = None,
                       examples: list[dict] | None = None, resume_from: str | Path | None = None,
                       log: Any = print) -> tuple[bool, dict | None]:
    """Apply ``draft.vocab.keep`` to the draft in place; returns whether it pruned the draft here and, when it chose
    the ids here, the selection: ``{"keep": N, "selection_positions": positions scored, "selection_mass": the kept
    ids' share of the target mass on that same data}``.

    - a draft that is already pruned (a pruned export, a run's checkpoint) keeps its own map; ``keep`` must be null
      or equal to its size (a map is never regenerated on a warm start);
    - resuming a run: the map stored in the checkpoint is used (no new selection); ``keep`` must equal its size,
      and be null for a checkpoint with a full-vocabulary head (:func:`_check_resumed_keep`);
    - else the N ids of :func:`decode.vocab_map.select_kept_ids` over :func:`cache_id_mass` (cached mode) or
      :func:`target_id_mass` (one target pass over ``examples``).

    Raises:
        SetupError: ``keep`` outside [number of special ids, V], a different ``keep`` than an already-pruned draft's
            or the resumed checkpoint's map size (null for a pruned checkpoint, set for a full one), or a map that
            does not fit the tokenizer/vocabulary.
    """
    keep = cfg.draft.get("vocab", {}).get("keep") if cfg.draft.get("vocab") is not None else None
    existing = draft_vocab_map(draft)
    if existing is not None:
        if keep is not None and int(keep) != existing.numel():
            raise SetupError(f"draft.vocab.keep={keep} but the draft {cfg.draft.name_or_path!r} is already pruned to "
                             f"{existing.numel()} ids; use draft.vocab.keep=null (keep its map) or start from its "
                             "full-vocabulary checkpoint")
        pruned_here, selection = False, None
    else:
        ids = checkpoint_vocab_map(resume_from) if resume_from is not None else None
        _check_resumed_keep(keep, ids, resume_from)
        if keep is None:
            return False, None
        selection = None
        if ids is not None:
            log(f"draft.vocab.keep={keep}: using the {ids.numel()}-id map of the checkpoint {resume_from}")
        else:
            if cache is not None:
                (mass, total), source = cache_id_mass(cache, vocab), "the logit cache"
                if not cache.tail_samples:
                    source += "; only its top-k mass is attributed to ids"
            else:
                mass = target_id_mass(target, examples, tokenizer.pad_token_id, vocab,
                                      temperature=float(cfg.loss.temperature))
                total, source = float(mass.sum()), f"one target pass over {len(examples)} training sequences"
            try:
                ids = select_kept_ids(mass, int(keep), special_ids(tokenizer, vocab))
            except ValueError as err:
                raise SetupError(str(err)) from None
            covered = float(mass[ids].sum()) / max(float(total), 1e-30)
            log(f"draft.vocab.keep={keep}: the kept ids carry {covered:.1%} of the target's probability mass on "
                f"the data they were chosen from ({source}; held-out coverage follows)")
            selection = {"keep": int(keep), "selection_positions": int(round(float(total))),
                         "selection_mass": covered}
        prune_draft_head(draft, ids, vocab_fingerprint(tokenizer))
        pruned_here = True
    try:
        check_draft_vocab_map(draft, vocab, tokenizer)
    except IncompatibleModelsError as err:
        raise SetupError(f"incompatible target/draft pair: {err}") from None
    return pruned_here, selection


# Below this many scored positions per kept id, the N-th id's rank is noise (most ids are seen a handful of times).
MIN_POSITIONS_PER_ID = 20
# Below this held-out share of the target's mass, the pruned head costs acceptance visibly.
MIN_HELDOUT_MASS = 0.97


def heldout_coverage(target: Any, examples: list[dict], ids: torch.Tensor, vocab: int, pad_id: int,
                     batch_size: int = 4) -> dict[str, float | int]:
    """How the kept ``ids`` cover the target on held-out ``examples`` (prompt + the target's response):
    ``heldout_mass``, the mean over response positions of the target's probability (T = 1) on the kept ids;
    ``heldout_token_share``, the share of the response tokens that are kept ids; ``heldout_positions``, the number
    of response positions."""
    kept = torch.zeros(vocab, dtype=torch.bool)
    kept[ids.cpu()] = True
    tokens = torch.tensor([t for e in examples for t in e["completion_ids"]], dtype=torch.long)
    if not len(tokens):
        raise ValueError("held-out coverage needs held-out responses; every example's completion is empty")
    rows, to_keep, kept_mass = [e for e in examples if e["completion_ids"]], accepts_logits_to_keep(target), 0.0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            logits = completion_logits(target, rows[start:start + batch_size], pad_id, to_keep)  # (N, V')
            p = logits[:, :vocab].float().softmax(-1)
            kept_mass += float(p[:, kept.to(p.device)].double().sum())
    share = float(kept[tokens[tokens < vocab]].sum()) / len(tokens)  # (an id past V is never a kept one)
    return {"heldout_mass": kept_mass / len(tokens), "heldout_token_share": share,
            "heldout_positions": int(len(tokens))}


def selection_warnings(keep: int, selection_positions: int | None = None,
                       heldout_mass: float | None = None) -> list[str]:
    """Warnings (without the ``warning:`` prefix) when the data the N kept ids were chosen from is too small to rank
    N ids (fewer than ``MIN_POSITIONS_PER_ID`` · N scored positions) or they cover less than ``MIN_HELDOUT_MASS`` of
    the target's mass on held-out text; each names ``draft.vocab.keep`` and the data size keys."""
    data = ("data.source.limit and data.max_new_tokens (with data.target_logits=cached, rebuild data.logit_cache "
            "from that data)")
    out = []
    if selection_positions is not None and selection_positions < MIN_POSITIONS_PER_ID * keep:
        out.append(f"draft.vocab.keep={keep} ids were chosen from {selection_positions} scored positions, fewer than "
                   f"{MIN_POSITIONS_PER_ID}·{keep} = {MIN_POSITIONS_PER_ID * keep}: too little data to rank {keep} ids "
                   f"(the last ones are picked by chance). Raise {data}, or lower draft.vocab.keep")
    if heldout_mass is not None and heldout_mass < MIN_HELDOUT_MASS:
        out.append(f"draft.vocab.keep={keep}: the kept ids carry only {heldout_mass:.1%} of the target's probability "
                   f"mass on held-out target text (below {MIN_HELDOUT_MASS:.0%}): every token outside them is a "
                   f"rejection. Choose them from more or broader data (raise {data}; data.source), or raise "
                   "draft.vocab.keep")
    return out
