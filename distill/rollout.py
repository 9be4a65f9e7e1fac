"""On-policy rollouts: the draft continues the training prompts, and the target then scores those sequences.

DistillSpec (Zhou et al. ICLR 2024, Sec. 4) and GKD (Agarwal et al. ICLR 2024): training on the draft's own
samples removes the train/inference mismatch, because at decode time the draft conditions on prefixes it wrote
itself. The draft samples with the decoder in plain mode (``num_draft_tokens=0``, i.e. the draft acting as its own
"target"), so rollouts use the same sampling code, the same ``torch.Generator`` discipline and the same stopping
rule as evaluation. Tokens after end-of-sequence are never produced (the decoder ends a row at eos), and the
prompt is masked in the loss by :func:`distill.data.collate_sequences`.
"""
from __future__ import annotations

from typing import Any

import torch

from distill.data import collate_prompts


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
    from decode import SpeculativeDecoder

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
