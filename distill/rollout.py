"""The models' passes over a batch: on-policy rollouts (the draft continues the training prompts) and the
forwards that score a batch of sequences at its completion positions only (:func:`forward_kept_logits`).

DistillSpec (Zhou et al. ICLR 2024, Sec. 4) and GKD (Agarwal et al. ICLR 2024): training on the draft's own
samples removes the train/inference mismatch, because at decode time the draft conditions on prefixes it wrote
itself. The draft samples with the decoder in plain mode (``num_draft_tokens=0``, i.e. the draft acting as its own
"target"), so rollouts use the same sampling code, the same ``torch.Generator`` discipline and the same stopping
rule as evaluation. Tokens after end-of-sequence are never produced (the decoder ends a row at eos), and the
prompt is masked in the loss by :func:`distill.data.collate_sequences`.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from decode import SpeculativeDecoder
from distill.data import collate_prompts, collate_sequences, kept_positions


@torch.no_grad()
def rollout(draft: Any, examples: list[dict], pad_id: int, eos_id: int | None, max_new_tokens: int,
            temperature: float, generator: torch.Generator, top_k: int | None = None,
            top_p: float | None = None) -> list[dict]:
    """Replace each example's completion by a draft sample of at most ``max_new_tokens`` tokens.

    Args:
        draft: the (unwrapped) draft model; switched to ``eval()`` for sampling (no dropout) and restored after.
        examples: dicts with ``prompt_ids`` (list[int]); their ``completion_ids`` are ignored.
        pad_id: left-padding id for the batched prompts.
        eos_id: end-of-sequence id (kept as the last completion token; nothing is sampled after it).
        temperature, top_k, top_p: the draft's sampling; temperature 0 is greedy.
        generator: the ``torch.Generator`` of every draw, on the draft's device.

    Returns:
        new example dicts ``{"prompt_ids", "completion_ids"}``; completions are 1..max_new_tokens tokens long.
    """
    was_training = draft.training
    draft.eval()
    try:
        device = next(draft.parameters()).device
        ids, att = collate_prompts([e["prompt_ids"] for e in examples], pad_id)
        dec = SpeculativeDecoder(draft, None, num_draft_tokens=0)
        out = dec.generate(ids.to(device), attention_mask=att.to(device), max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_id,
                           generator=generator)
    finally:
        draft.train(was_training)
    return [{"prompt_ids": list(e["prompt_ids"]), "completion_ids": t.tolist()}
            for e, t in zip(examples, out.new_tokens)]


def accepts_logits_to_keep(model: Any) -> bool:
    """True when the (unwrapped: DDP/FSDP/DeepSpeed ``.module``, peft base) model's forward takes logits_to_keep."""
    for _ in range(4):
        model = getattr(model, "module", model)
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def forward_kept_logits(model: Any, batch: dict[str, torch.Tensor], where: tuple | None = None,
                        logits_to_keep: bool | None = None) -> torch.Tensor:
    """``(N, V')`` logits of ``model`` at the N kept positions of ``batch`` (:func:`distill.data.collate_sequences`),
    row by row.

    ``where`` is :func:`distill.data.kept_positions` of ``batch["loss_mask"]`` (computed when None). The lm_head runs
    on the C columns holding a completion token instead of all L (``logits_to_keep``, which Hugging Face causal LMs
    take; ``logits_to_keep=None`` checks the model's signature), which also shrinks the (B, L, V) logits: for a
    target whose lm_head is a large share of its weights (a 150k vocabulary), that is most of a prompt position's
    work.
    """
    cols, flat = where if where is not None else kept_positions(batch["loss_mask"])
    device = batch["input_ids"].device
    if logits_to_keep is None:
        logits_to_keep = accepts_logits_to_keep(model)
    kw = {"logits_to_keep": cols.to(device)} if cols is not None and logits_to_keep else {}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kw).logits
    if not kw and cols is not None:
        logits = logits[:, cols.to(logits.device)]
    return logits.flatten(0, 1).index_select(0, flat.to(logits.device))


def completion_logits(model: Any, examples: list[dict], pad_id: int, logits_to_keep: bool | None = None
                      ) -> torch.Tensor:
    """``(N, V')`` logits of ``model`` at the N completion positions of ``examples``
    (:func:`distill.data.collate_sequences`), row by row: the positions are found on the host (no device sync) and
    only ids and attention mask move to the model's device; :func:`forward_kept_logits` does the rest
    (``logits_to_keep`` as there)."""
    host = collate_sequences(examples, pad_id)
    device = next(model.parameters()).device
    batch = {key: host[key].to(device) for key in ("input_ids", "attention_mask")}
    return forward_kept_logits(model, batch, kept_positions(host["loss_mask"]), logits_to_keep)
