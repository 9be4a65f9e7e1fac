"""A target/draft pair built from configs, with no checkpoint: for benchmarks on machines with no models.

The target is a randomly initialised Llama; the draft is the target's first ``draft_layers`` decoder layers with
the target's own embeddings, final norm and (tied) output head, the same module objects (no copy), so the draft is
what an early exit of the target would predict. Random layers move the hidden state a lot, so a draft that
skips most of them would rarely agree with the target; the target's later layers therefore have their residual
output projections (``o_proj``, ``down_proj``) scaled by ``late_layer_scale``, a depth-scaled initialisation in
the spirit of GPT-2's 1/√(2L) that lets the draft agree with the target often but not always. A random model's
next-token distribution is nearly uniform (greedy choices between near-ties); the shared final norm's gain is
multiplied by ``logit_scale`` so both models have a peaked distribution, as trained models do. With the defaults the
full pair's teacher-forced greedy agreement on random prompts was 0.73 and its T=1 acceptance Σmin(p, q) 0.75, with a
target entropy of about 1 nat (one CPU measurement on 64 positions); the benchmark measures α, never assumes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# ≈1.03B target (TinyLlama-1.1B's shape, 22 layers, tied embeddings) and a ≈110M draft (embeddings + 1 layer).
FULL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
            num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
# Seconds on a CPU: for checking the whole path end to end.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


@dataclass
class SyntheticPair:
    """The pair and what it is made of (parameter counts, the draft's layers, the scale of the later layers)."""

    target: torch.nn.Module
    draft: torch.nn.Module
    target_parameters: int
    draft_parameters: int
    draft_layers: int
    late_layer_scale: float
    logit_scale: float


def _num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@torch.no_grad()
def build_pair(size: str = "full", draft_layers: int = 1, late_layer_scale: float = 0.03, logit_scale: float = 10.0,
               seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> SyntheticPair:
    """Build the target (``FULL`` or ``TINY`` Llama config) and its early-exit draft on ``device``.

    Args:
        size: "full" (≈1.03B target, ≈110M draft) or "tiny" (a few hundred thousand parameters).
        draft_layers: how many of the target's first decoder layers the draft keeps (1 <= n < target layers).
        late_layer_scale: factor on ``o_proj`` and ``down_proj`` of the target's layers after the draft's.
        logit_scale: factor on the shared final norm's gain (logits of both models scale with it).
        seed: seeds the initialisation (the same pair on the same device type).
        device, dtype: where the weights are created (directly, no CPU copy) and their dtype.

    Returns:
        a ``SyntheticPair``; both models are in eval mode with gradients off, and share the draft's modules.

    Raises:
        ValueError: unknown size, or draft_layers outside [1, target layers).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in ("full", "tiny"):
        raise ValueError(f"size must be 'full' or 'tiny', got {size!r}")
    shape = FULL if size == "full" else TINY
    if not 1 <= draft_layers < shape["num_hidden_layers"]:
        raise ValueError(f"draft_layers must be in [1, {shape['num_hidden_layers']}), got {draft_layers}")
    config = LlamaConfig(**shape, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        target = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
        draft_config = LlamaConfig(**{**shape, "num_hidden_layers": draft_layers}, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
        draft = LlamaForCausalLM(draft_config).to(dtype).eval().requires_grad_(False)
    for layer in target.model.layers[draft_layers:]:
        layer.self_attn.o_proj.weight.mul_(late_layer_scale)
        layer.mlp.down_proj.weight.mul_(late_layer_scale)
    target.model.norm.weight.mul_(logit_scale)
    # The draft is the target's early exit: the same embedding, first layers, final norm and head objects.
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(target.model.layers[:draft_layers])
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    draft.model.rotary_emb = target.model.rotary_emb
    return SyntheticPair(target, draft, _num_parameters(target), _num_parameters(draft), draft_layers,
                         late_layer_scale, logit_scale)


@torch.no_grad()
def greedy_agreement(pair: SyntheticPair, input_ids: torch.Tensor) -> float:
    """Fraction of positions of ``input_ids`` (B, T) where the draft's and the target's argmax agree (teacher
    forced): a quick look at the greedy α the pair will show, before any decoding."""
    t = pair.target(input_ids=input_ids).logits.argmax(-1)
    d = pair.draft(input_ids=input_ids).logits.argmax(-1)
    return float((t == d).float().mean())
